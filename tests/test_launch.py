"""One launch path (onespark/serving/launch.py): serve and cluster compose their containers with one function, and
cluster gains what serve had (the OOM adjustment, the key from a file, the memory guard on each node).

1. cluster's --dry-run plan: every `docker run` carries --oom-score-adj, the key (from --api-key-file or
   $ONESPARK_API_KEY) is in no printed line and reaches docker by name only, the guard is planned on each node.
2. cluster's run against fake nodes: the guard starts on both nodes, no command any node ran holds the key,
   and a vLLM the guard stopped is reported with the guard's report.
3. The planned guard command, run in bash against a stub docker: it starts the real guard, which watches the
   container, writes its log where serve's is, and prints its pid and log path.
(No import circle, no private imports: tests/test_wings.py, for the whole distribution.)
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onespark.errors import UserError
from onespark.serving import cluster, launch, memory, serve
from tests import test_cluster
from tests.test_cluster import HEAD, WORKER, FakeCluster, cluster_args

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-launch-7f3a9c"  # a value no command, path or log line would hold by chance
nodes, fake_vllm = test_cluster.nodes, test_cluster.fake_vllm  # its fixtures: RoCE nodes, a vLLM stand-in


def _cluster_dry_run(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onespark", "cluster", "--nodes", "spark1,spark2", "--work", "/data/w",
                           "--dry-run", "--sync", *extra], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("how", ["file", "env"])
def test_cluster_plan_has_the_oom_adjustment_the_guard_and_no_key(tmp_path, how):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    p = (_cluster_dry_run("--api-key-file", str(key_file)) if how == "file"
         else _cluster_dry_run(env={"ONESPARK_API_KEY": KEY}))
    assert p.returncode == 0, p.stderr
    assert KEY not in p.stdout + p.stderr
    plan = [ln for ln in p.stdout.splitlines() if ln.startswith(("[head spark1] + ", "[worker spark2] + "))]
    runs = [ln for ln in plan if " docker run " in ln]
    assert [ln.split("]")[0] for ln in runs] == ["[head spark1", "[worker spark2"]
    for ln in runs:
        assert "--oom-score-adj 1000" in ln, ln
    guards = [ln.split("]")[0] for ln in plan if "-m onespark.serving.memory guard --container onespark-ray" in ln]
    assert guards == ["[head spark1", "[worker spark2"]
    # The guard starts after both Ray containers exist (it refuses a missing one) and before vLLM does.
    order = [("ray" if " docker run " in ln else "guard" if "onespark.serving.memory guard" in ln
              else "vllm" if "entrypoint.sh" in ln else "") for ln in plan]
    order = [o for o in order if o]
    assert order == ["ray", "ray", "guard", "guard", "vllm"]
    vllm = next(ln for ln in plan if "entrypoint.sh" in ln)
    assert "docker exec -d -e VLLM_API_KEY onespark-ray" in vllm  # by name: the value comes from the environment


def test_cluster_plan_without_the_guard():
    p = _cluster_dry_run("--no-memory-guard")
    assert p.returncode == 0, p.stderr
    assert "onespark.serving.memory guard" not in p.stdout and "--oom-score-adj 1000" in p.stdout


def test_cluster_keeps_the_compile_caches_on_each_node_as_serve_does():
    """Both Ray containers mount the compile caches' volume (serve's default), another name, or none; a path is
    refused in one line before any plan."""
    for extra, want in (((), "-v onespark-cache:/root/.cache "), (("--cache-volume", "c2"), "-v c2:/root/.cache ")):
        p = _cluster_dry_run(*extra)
        assert p.returncode == 0, p.stderr
        runs = [ln for ln in p.stdout.splitlines() if " docker run " in ln and "] + " in ln]
        assert len(runs) == 2 and all(want in ln for ln in runs), runs
    p = _cluster_dry_run("--cache-volume", "none")
    assert p.returncode == 0 and ":/root/.cache" not in p.stdout, p.stdout
    p = _cluster_dry_run("--cache-volume=/:/host")
    assert p.returncode == 2 and "docker run" not in p.stdout
    assert p.stderr.count("\n") == 1 and "--cache-volume" in p.stderr and "Docker volume name" in p.stderr, p.stderr


def test_cluster_bad_key_file_is_one_line(tmp_path):
    p = _cluster_dry_run("--api-key-file", str(tmp_path / "missing"))
    assert p.returncode == 1
    assert p.stderr.strip() == (f"onespark cluster: error: cannot read --api-key-file {tmp_path / 'missing'}: "
                                "No such file or directory")


def test_serve_and_cluster_share_the_container_flags(tmp_path):
    """One function composes both containers: serve's docker run starts with it, cluster's Ray container too."""
    p = subprocess.run([sys.executable, "-m", "onespark", "serve", "--checkpoint", str(tmp_path), "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("onespark serve: + docker run "))
    assert shlex.split(line.split(" + ", 1)[1])[:len(launch.container_flags("onespark", str(tmp_path)))] == \
        launch.container_flags("onespark", str(tmp_path))
    ray = cluster.ray_container_cmd("img", "/data/w/hybrid", {}, ["--head"])
    assert shlex.split(ray)[:len(launch.container_flags(cluster.RAY_CONTAINER, "/data/w/hybrid"))] == \
        launch.container_flags(cluster.RAY_CONTAINER, "/data/w/hybrid")


class GuardedCluster(FakeCluster):
    """FakeCluster whose nodes answer the guard's start with a pid and log path, and (stopped=True) whose vLLM
    exits with the worker's guard report on disk."""

    def __init__(self, dirs, stopped=False, **overrides):
        super().__init__(dirs, **overrides)
        self.stopped = stopped

    def __call__(self, node, cmd, timeout):
        if "onespark.serving.memory guard" in cmd:
            self.calls.append((node.name, cmd))
            return 0, f"{4000 + len(self.calls)} /home/u/.local/state/onespark/guard-onespark-ray.log"
        if self.stopped and "kill -0" in cmd:
            self.calls.append((node.name, cmd))
            return 1, ""
        if self.stopped and cmd.startswith("cat ") and cluster.GUARD_REPORT in cmd:
            self.calls.append((node.name, cmd))
            if node.name != "spark2":
                return 1, ""
            return 0, "onespark memory guard stopped container onespark-ray: MemAvailable 3.1 GiB < 5 GiB"
        return super().__call__(node, cmd, timeout)


def test_cluster_run_starts_the_guard_on_each_node_and_never_passes_the_key(nodes, fake_vllm, tmp_path, capsys,
                                                                            monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    monkeypatch.setenv("VLLM_API_KEY", "")  # run() sets it; monkeypatch then restores this process's
    keys = []  # the key each request of the smoke test carried
    http = launch.http
    monkeypatch.setattr(launch, "http", lambda url, *a, api_key=None, **k: keys.append((url.split("/", 3)[3], api_key))
                        or http(url, *a, api_key=api_key, **k))
    fake = GuardedCluster(nodes)
    fake.args = cluster_args("--port", str(fake_vllm), "--api-key-file", str(key_file))
    assert cluster.run(fake.args, runner=fake, nodes=(HEAD, WORKER)) == 0
    out, err = capsys.readouterr()
    assert KEY not in out + err
    assert not [c for _, c in fake.calls if KEY in c]
    assert os.environ["VLLM_API_KEY"] == KEY  # where `docker exec -e VLLM_API_KEY` reads it
    assert ("v1/models", KEY) in keys and ("v1/chat/completions", KEY) in keys
    assert [n for n, c in fake.calls if "onespark.serving.memory guard" in c] == ["spark1", "spark2"]
    for name in ("spark1", "spark2"):
        assert re.search(rf"onespark cluster: memory guard pid \d+ on {name}: stops onespark-ray if MemAvailable "
                         r"stays below 5 GiB", out), out
    assert "(log: /home/u/.local/state/onespark/guard-onespark-ray.log there)" in out
    guard_at = next(i for i, (_, c) in enumerate(fake.calls) if "onespark.serving.memory guard" in c)
    assert guard_at < next(i for i, (_, c) in enumerate(fake.calls) if "docker exec -d" in c)


def test_a_vllm_the_guard_stopped_is_named_with_the_report(nodes, monkeypatch):
    monkeypatch.setattr(launch, "http", lambda *a, **k: (0, b""))
    fake = GuardedCluster(nodes, stopped=True)
    fake.args = cluster_args()
    with pytest.raises(UserError) as e:
        cluster.run(fake.args, runner=fake, nodes=(HEAD, WORKER))
    assert str(e.value).startswith("vLLM on spark1 exited after 0 s: the memory guard stopped it:\non spark2: "
                                   "onespark memory guard stopped container onespark-ray: MemAvailable 3.1 GiB")


def test_the_planned_guard_command_starts_the_real_guard(tmp_path):
    """The head's guard line in bash, docker a stub whose `wait` ends after 1 s: the guard watches, then ends
    with the container; its log is in XDG_STATE_HOME/onespark, as serve's is (memory.guard_files)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").write_text('#!/bin/sh\ncase "$1" in inspect) echo sha256:1;; wait) sleep 1;; esac\n')
    (bindir / "docker").chmod(0o755)
    args = cluster_args()
    cmd = cluster.guard_cmd(cluster.Cluster.from_args(args))
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "XDG_STATE_HOME": str(tmp_path / "state")}
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode == 0, p.stderr
    pid, log = p.stdout.split()
    assert pid.isdigit()
    env_log, _ = memory.guard_files(cluster.RAY_CONTAINER)  # this process's idea of the path ...
    assert Path(log).name == env_log.name and Path(log).parent == tmp_path / "state" / "onespark"  # ... the node's
    deadline = time.monotonic() + 20
    while "ended" not in Path(log).read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    text = Path(log).read_text()
    assert "onespark memory guard: watching container onespark-ray" in text and "ended" in text, text


def test_serve_launch_holds_no_key_in_its_repr(tmp_path):
    p = serve.argparse.ArgumentParser()
    serve.add_arguments(p)
    la = serve.Launch.from_args(p.parse_args(["--checkpoint", str(tmp_path), "--api-key", KEY]))
    assert la.api_key == KEY and KEY not in repr(la)
    c = cluster.Cluster.from_args(cluster_args("--api-key", KEY))
    assert c.api_key == KEY and KEY not in repr(c)
