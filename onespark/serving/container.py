"""The serving container on this machine's Docker engine, as `onespark serve` watches it: docker calls that
fail in one line, its state and log, and the wait for /health (launch.wait_healthy, cluster's too) told what
a stopped container means here: the memory guard's report, or the log's tail and the likely cause."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from onespark.errors import UserError
from onespark.serving import launch
from onespark.serving.vllm_log import likely_cause


def docker(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["docker", *argv], capture_output=True, text=True, check=check)
    except FileNotFoundError:
        raise UserError("docker not found: install Docker (onespark doctor)") from None
    except subprocess.CalledProcessError as e:
        raise UserError(f"docker {argv[0]} failed: {e.stderr.strip() or e.stdout.strip()}") from None


def state(name: str) -> tuple[bool, int | None, bool]:
    # --type container: a bare `docker inspect NAME` also answers for an image, volume or network of that name
    out = docker("inspect", "--type", "container", "--format", "{{.State.Running}} {{.State.ExitCode}} {{.State.OOMKilled}}",
                  name, check=False)
    if out.returncode != 0:
        return False, None, False
    running, code, oom = out.stdout.split()
    return running == "true", int(code), oom == "true"


def logs(name: str, tail: int = 400) -> str:
    out = docker("logs", "--tail", str(tail), name, check=False)
    return out.stdout + out.stderr


def wait_healthy(name: str, base_url: str, timeout: float, tty: bool, guard_report: Path | None = None) -> None:
    """launch.wait_healthy on container `name`: when it stops, the memory guard's report or its log's tail."""
    def poll(elapsed: float) -> tuple[str, str | None]:
        running, code, oom = state(name)
        log = logs(name)
        if running:
            return log, None
        if guard_report is not None and code in (137, 143):
            # docker stop's SIGTERM (143) or SIGKILL (137): the guard writes its report just after the stop
            for _ in range(50):
                if guard_report.is_file():
                    break
                time.sleep(0.2)
        if guard_report is not None and guard_report.is_file():
            return log, (f"container {name} was stopped by the memory guard after {elapsed:.0f} s:\n"
                         + guard_report.read_text(errors="replace").rstrip())
        tail = "\n".join(log.splitlines()[-40:])
        return log, (f"container {name} exited (code {code}) after {elapsed:.0f} s.\n--- last 40 log lines ---\n"
                     f"{tail}\n--- likely cause: {likely_cause(log, code, oom)}\n(full log: docker logs {name})")

    def after_timeout(log: str) -> str:
        tail = "\n".join(log.splitlines()[-40:])
        return (f"the container is left running for you to inspect.\n--- last 40 log lines ---\n{tail}\n"
                f"--- if it is still progressing, wait (the first start compiles and captures graphs) or pass "
                f"--timeout; otherwise: docker logs {name}")

    launch.wait_healthy(base_url, timeout, prog="onespark serve", poll=poll, after_timeout=after_timeout, tty=tty,
                        first="starting container")
