"""`onespark serve`: launch the v2 (or v2-tq) container, wait until it answers, prove it with one request.

    onespark serve --model /data/qwen35-hybrid                  # onespark/v2 on 127.0.0.1:8000
    onespark serve --model DIR --tq --api-key "$KEY" --port 8080
    onespark serve --demo --model DIR                           # CPU stand-in image, tiny model
    onespark serve --model DIR -- --max-model-len 65536         # anything after -- goes to vLLM

The container uses the host network and vLLM binds only --host (127.0.0.1 unless you say otherwise).
While it starts, one progress line names the stage read from the server log (loading weights, compiling,
capturing CUDA graphs, ...): the 122B model's cold start takes minutes and should never look hung.
If the container dies, the log tail and the likely cause are printed. Once /health answers, one chat
request is sent and its answer and rate (completion tokens from the server's `usage` / wall time) shown.
Before `docker run`, a memory plan (onespark.serving.memory) shows weights, vLLM's share, KV pool and host
reserve, and refuses a configuration that leaves the host too little; beside the container a memory
guard runs (its own process, gone with the container) that stops it before the host swaps itself to a
standstill (--no-memory-guard turns it off).
The API key travels as the environment variable VLLM_API_KEY, never on a command line or in output; so does
any --env whose name says it is a secret (TOKEN, KEY, SECRET, PASSWORD in it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from onespark import __version__, options
from onespark.errors import UserError, read_secret
from onespark.serving import launch, memory
from onespark.serving.vllm_log import likely_cause

V2_IMAGE = f"onespark/v2:{__version__}"
V2_TQ_IMAGE = f"onespark/v2-tq:{__version__}"
DEMO_IMAGE = f"onespark-demo/v2:{__version__}"

# Defaults of docker/entrypoint.sh that make no sense on the CPU stand-in (GPU kernels, the MTP head of
# the real checkpoint, fastsafetensors' GPU loader, Qwen3 parsers the tiny model's tokenizer lacks).
DEMO_DROP = (
    "--attention-backend --speculative-config --load-format --gpu-memory-utilization "
    "--max-model-len --reasoning-parser --enable-auto-tool-choice --tool-call-parser"
)
# vLLM on CPU, as tests/vllm_server.py runs it: eager mode, a 1 GiB KV cache, nothing from the network.
DEMO_ENV = {"TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
DEMO_ARGS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "1024", "--served-model-name", "onespark-tiny"]

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory on the host (mounted read-only at /model)")
    # --model is the checkpoint directory here (as in vLLM), so the spec has its own flag.
    p.add_argument("--spec", metavar="NAME", help="model spec (onespark specs): its serving defaults (served name, "
                                                  "--gpu-memory-utilization, --max-model-len, drafter) replace the "
                                                  "image's, which are qwen3.5-122b-a10b's; flags after -- still win")
    p.add_argument("--drafter", choices=("mtp", "dflash"), default="mtp",
                   help="speculative decoding: mtp (default: the checkpoint's own MTP layer) or dflash (the spec's "
                        "DFlash drafter from --drafter-dir; vLLM 0.32.0 track images only)")
    p.add_argument("--drafter-dir", help="--drafter dflash: the drafter's directory on the host (onespark download "
                                         "--drafter dflash writes WORK/dflash), mounted read-only at /drafter")
    p.add_argument("--num-draft-tokens", type=options.COUNT, metavar="N",
                   help="--drafter dflash: tokens drafted per step (default: the spec's, the record's 12; others "
                        "reported 12 unstable and use 10)")
    p.add_argument("--image", help=f"image to run (default: {V2_IMAGE}; --tq: {V2_TQ_IMAGE}; --demo: {DEMO_IMAGE})")
    p.add_argument("--tq", action="store_true", help="run the TurboQuant image (v2-tq)")
    p.add_argument("--demo", action="store_true", help="CPU stand-in: no GPU, tiny model, GPU-only defaults dropped")
    p.add_argument("--name", default="onespark", help="container name (default: onespark)")
    p.add_argument("--host", default="127.0.0.1", help="address vLLM binds (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=options.PORT, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=os.environ.get("ONESPARK_API_KEY"),
                   help="require this key on /v1 (default: $ONESPARK_API_KEY; none); visible in `ps`: prefer "
                        "--api-key-file or the variable")
    p.add_argument("--api-key-file", help="read the key from this file (first line)")
    p.add_argument("--timeout", type=options.SECONDS, help="seconds to wait for /health (default: 1800; --demo: 600)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra container environment, repeatable (e.g. ONESPARK_INT8_LM_HEAD=0 for an A/B run); a name "
                        "with TOKEN, KEY, SECRET or PASSWORD in it is passed by name, its value never shown")
    p.add_argument("--replace", action="store_true", help="remove an existing container of the same name first")
    p.add_argument("--prompt", default="In one sentence: what is a DGX Spark?", help="the smoke-test question")
    p.add_argument("--max-tokens", type=options.COUNT, default=64, help="smoke-test answer length (default: 64)")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke request")
    p.add_argument("--dry-run", action="store_true", help="print the docker command, run nothing")
    memory.add_plan_arguments(p)
    p.add_argument("--no-memory-guard", action="store_true",
                   help="do not start the memory guard (it stops the container before the host runs out of memory)")
    p.add_argument("--meminfo", default="/proc/meminfo", help=argparse.SUPPRESS)  # tests point these at files
    p.add_argument("--vmstat", default="/proc/vmstat", help=argparse.SUPPRESS)
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: extra vLLM flags (they replace defaults)")


@dataclass(frozen=True)
class Launch:
    """What one `onespark serve` starts, read once from its arguments (run() and docker_run_command build it;
    nothing below them reads the Namespace)."""
    model: str  # the checkpoint directory as given
    image: str
    name: str
    host: str
    port: int
    api_key: str | None = field(repr=False)  # --api-key, its file's first line, or $ONESPARK_API_KEY
    env: dict[str, str]  # --env NAME=VALUE, checked
    vllm_args: tuple[str, ...]  # the spec's flags the user does not set, the drafter's, then the user's after --
    drafter_dir: str | None  # --drafter dflash only: mounted at /drafter
    demo: bool
    replace: bool
    dry_run: bool
    smoke: bool
    prompt: str
    max_tokens: int
    timeout: float
    guard: bool
    guard_floor_gib: float
    host_reserve_gib: float
    meminfo: str
    vmstat: str

    @classmethod
    def from_args(cls, args: argparse.Namespace, image: str | None = None) -> Launch:
        api_key = read_secret(args.api_key_file, "--api-key-file") if args.api_key_file else args.api_key
        user = _after_dashes(args.vllm_args)
        options.reject_secret_flags(user, "serve")
        image = image or args.image or (DEMO_IMAGE if args.demo else V2_TQ_IMAGE if args.tq else V2_IMAGE)
        vllm_args = _with_spec(args.spec, _with_drafter(args, image, user))
        floor = args.guard_floor_gib
        if floor is None:
            floor = memory.DEMO_GUARD_FLOOR_GIB if args.demo else memory.GUARD_FLOOR_GIB
        return cls(model=args.model, image=image, name=args.name, host=args.host, port=args.port, api_key=api_key,
                   env=_env(args.env), vllm_args=tuple(vllm_args),
                   drafter_dir=os.path.abspath(args.drafter_dir) if args.drafter == "dflash" else None,
                   demo=args.demo, replace=args.replace, dry_run=args.dry_run, smoke=not args.no_smoke,
                   prompt=args.prompt, max_tokens=args.max_tokens,
                   timeout=args.timeout or (600 if args.demo else 1800), guard=not args.no_memory_guard,
                   guard_floor_gib=floor, host_reserve_gib=args.host_reserve_gib, meminfo=args.meminfo,
                   vmstat=args.vmstat)


def _after_dashes(vllm_args: list[str] | None) -> list[str]:
    extra = list(vllm_args or [])
    return extra[1:] if extra and extra[0] == "--" else extra


def _env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            # the name only: the value may be the secret
            raise UserError(f"--env {key + '=...' if sep else item!r}: expected NAME=VALUE, NAME of letters, digits "
                            "and _, e.g. --env ONESPARK_INT8_LM_HEAD=0")
        if key == "VLLM_API_KEY":
            raise UserError("--env VLLM_API_KEY=...: use --api-key (or $ONESPARK_API_KEY) so the key stays off argv")
        env[key] = value
    return env


def _with_drafter(args: argparse.Namespace, image: str, user: list[str]) -> list[str]:
    """--drafter dflash: its --speculative-config goes among the user's vLLM flags (so it replaces the spec's
    and the image's MTP default), unless the user gave one after --, which wins."""
    if args.drafter != "dflash":
        if args.drafter_dir or args.num_draft_tokens:
            raise UserError("--drafter-dir/--num-draft-tokens are for --drafter dflash")
        return user
    from onespark.model import specs
    if args.demo:
        raise UserError("--drafter dflash: not on the CPU demo (its tiny model has no DFlash drafter); drop --demo "
                        "or use --drafter mtp")
    if image in (V2_IMAGE, V2_TQ_IMAGE):
        raise UserError(f"--drafter dflash needs the vLLM 0.32.0 track's image, not {image} (vLLM 0.19.1): "
                        "./install.sh --vllm 0.32.0 builds it; pass --image onespark/v2:"
                        f"{__version__}-vllm0.32.0")
    spec = specs.get(args.spec, flag="--spec")
    if not spec.dflash:
        raise UserError(f"--drafter dflash: spec {spec.name} has no DFlash drafter; use --drafter mtp")
    if not args.drafter_dir:
        raise UserError("--drafter dflash needs --drafter-dir DIR (onespark download --drafter dflash fetches it "
                        "to WORK/dflash)")
    if not args.dry_run and not os.path.isfile(os.path.join(args.drafter_dir, "config.json")):
        raise UserError(f"--drafter-dir {args.drafter_dir}: no config.json: fetch the drafter with onespark "
                        "download --drafter dflash (onespark verify --drafter DIR checks it)")
    if any(a == "--speculative-config" or a.startswith("--speculative-config=") for a in user):
        return user
    cfg = specs.dflash_config(spec, tokens=args.num_draft_tokens)
    return ["--speculative-config", json.dumps(cfg, separators=(",", ":")), *user]


def _with_spec(spec_name: str | None, user: list[str]) -> list[str]:
    """The spec's serving flags before the user's vLLM flags, leaving out any flag the user sets."""
    if not spec_name:
        return user
    from onespark.model import specs
    spec_args, i = specs.get(spec_name, flag="--spec").vllm_args(), 0
    keep = []
    while i < len(spec_args):  # flag value pairs
        flag = spec_args[i]
        if not any(a == flag or a.startswith(flag + "=") for a in user):
            keep += spec_args[i:i + 2]
        i += 2
    return [*keep, *user]


def docker_run_command(args: argparse.Namespace, image: str) -> tuple[list[str], dict[str, str]]:
    """The `docker run` argv of these arguments and `image` (tests and --dry-run read it)."""
    return container_command(Launch.from_args(args, image))


def container_command(la: Launch) -> tuple[list[str], dict[str, str]]:
    """The `docker run` argv and the environment variables it forwards (by name, values not on argv)."""
    env = {"ONESPARK_HEALTH_URL": f"http://{launch.probe_host(la.host)}:{la.port}/health"}
    drafter = ("-v", f"{la.drafter_dir}:/drafter:ro") if la.drafter_dir else ()
    cmd = launch.container_flags(la.name, os.path.abspath(la.model), mounts=drafter, gpu=not la.demo)
    if la.demo:
        env.update(DEMO_ENV)
        env["ONESPARK_DROP_DEFAULTS"] = DEMO_DROP
        # vLLM 0.32.0 on CPU asks 160 MiB of /dev/shm at engine start (tiny Qwen3.5-MoE + MTP-2, measured
        # 2026-12-01); Docker gives a container 64 MiB.
        cmd += ["--shm-size", "1g"]
    env.update(la.env)
    if la.api_key:
        env["VLLM_API_KEY"] = la.api_key
    cmd += launch.env_flags(env)  # run() passes env to docker, so the secrets it names by name arrive
    cmd += [la.image, "--host", la.host, "--port", str(la.port)]
    if la.demo:
        cmd += DEMO_ARGS
    cmd += la.vllm_args
    return cmd, env


def _docker(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["docker", *argv], capture_output=True, text=True, check=check)
    except FileNotFoundError:
        raise UserError("docker not found: install Docker (onespark doctor)") from None
    except subprocess.CalledProcessError as e:
        raise UserError(f"docker {argv[0]} failed: {e.stderr.strip() or e.stdout.strip()}") from None


def _container_state(name: str) -> tuple[bool, int | None, bool]:
    out = _docker("inspect", "--format", "{{.State.Running}} {{.State.ExitCode}} {{.State.OOMKilled}}",
                  name, check=False)
    if out.returncode != 0:
        return False, None, False
    running, code, oom = out.stdout.split()
    return running == "true", int(code), oom == "true"


def _logs(name: str, tail: int = 400) -> str:
    out = _docker("logs", "--tail", str(tail), name, check=False)
    return out.stdout + out.stderr


def wait_healthy(name: str, base_url: str, timeout: float, tty: bool, guard_report: Path | None = None) -> None:
    """launch.wait_healthy on container `name`: when it stops, the memory guard's report or its log's tail."""
    def poll(elapsed: float) -> tuple[str, str | None]:
        running, code, oom = _container_state(name)
        log = _logs(name)
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


def memory_plan(la: Launch) -> None:
    """Print the plan and the other consumers; raise UserError when the plan must not start (a dry run only
    says so). The CPU demo has no plan: vLLM on CPU takes a fixed 1 GiB KV cache, no share of the pool."""
    if la.demo:
        print("onespark serve: memory plan: none for --demo (vLLM on CPU, 1 GiB KV cache)")
        return
    try:
        plan = memory.make_plan(la.model, list(la.vllm_args), meminfo=la.meminfo, floor_gib=la.host_reserve_gib,
                                guard_floor_gib=la.guard_floor_gib)
    except memory.PlanError as e:
        if la.dry_run:
            print(f"onespark serve: memory plan: not made yet ({e}); serve makes it before launch")
            return
        raise UserError(str(e)) from None
    print("onespark serve: memory plan (unified memory: vLLM's share and the host's reserve are one pool):")
    for line in plan.lines():
        print("  " + line)
    mem = memory.read_meminfo(la.meminfo)
    for c in memory.consumers(mem):
        print(f"onespark serve: also using memory: {c.what}: {c.detail}\n  frees it: {c.fix}")
    problems = plan.problems()
    if problems and la.dry_run:
        print("onespark serve: the plan would refuse: " + " | ".join(problems))
    elif problems:
        raise UserError("memory plan refused: " + "\n".join(problems))


def _guard_plan(la: Launch) -> tuple[Path, Path, list[str]]:
    """The memory guard's log, report and command line for this container."""
    util = memory.vllm_flag(list(la.vllm_args), "--gpu-memory-utilization") or (
        None if la.demo else f"{memory.DEFAULT_GPU_UTIL:g}")
    guard_log, guard_report = memory.guard_files(la.name)
    guard_cmd = memory.guard_command(la.name, floor_gib=la.guard_floor_gib, report=guard_report, util=util,
                                     meminfo=la.meminfo, vmstat=la.vmstat)
    return guard_log, guard_report, guard_cmd


def _clear_the_way(la: Launch, guard_report: Path) -> None:
    """Before the plan: the image exists, a container of this name is gone (--replace), and the last guard
    report of this name is shown once."""
    if _docker("image", "inspect", la.image, check=False).returncode != 0:
        raise UserError(f"image {la.image} not found: build it with steps/4-images.sh{' --demo' if la.demo else ''}")
    if _docker("inspect", la.name, check=False).returncode == 0:
        if not la.replace:
            raise UserError(f"a container named {la.name} exists: pass --replace, or --name another")
        _docker("rm", "-f", la.name)
        # The plan below must see the memory the old server gave back (the driver frees it as it exits).
        memory.wait_until_settled(la.meminfo)
    if guard_report.is_file():  # what the guard of this name's last run saw, shown once, then not this run's
        print("onespark serve: the previous run's memory guard stopped it:\n" + guard_report.read_text().rstrip())
        guard_report.unlink()


def _check_guard_log(guard_log: Path) -> None:
    try:  # before anything starts: a guard that cannot write its log must not be found out later
        guard_log.parent.mkdir(parents=True, exist_ok=True)
        open(guard_log, "ab").close()
    except OSError as e:
        raise UserError(f"{guard_log}: cannot write the memory guard's log ({e.strerror or e}): set "
                        "XDG_STATE_HOME to a writable directory, or pass --no-memory-guard") from None


def _start_guard(la: Launch, guard_cmd: list[str], guard_log: Path) -> None:
    """Started right after the container, so it watches start-up profiling too; it ends when `docker wait`
    returns, i.e. with the container (stopped, removed or replaced)."""
    print("onespark serve: + " + shlex.join(guard_cmd) + f" >> {guard_log}")
    try:
        guard = memory.start_guard(guard_cmd, guard_log)
        print(f"onespark serve: memory guard pid {guard.pid}: stops {la.name} if MemAvailable stays below "
              f"{la.guard_floor_gib:g} GiB or the host keeps swapping (log: {guard_log})")
    except OSError as e:  # the server is up: say so loudly, do not take it down
        print(f"onespark serve: warning: the memory guard did not start ({e}); {la.name} runs unguarded "
              f"(stop it with docker rm -f {la.name})", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    la = Launch.from_args(args)
    if not la.dry_run and not os.path.isfile(os.path.join(la.model, "config.json")):
        raise UserError(f"{la.model} has no config.json: --model must be a checkpoint directory "
                        "(steps 1-2 write it; onespark verify checks it)")
    cmd, env = container_command(la)
    guard_log, guard_report, guard_cmd = _guard_plan(la)
    if la.dry_run:
        memory_plan(la)
        print("onespark serve: + " + shlex.join(cmd))
        if la.guard:
            print("onespark serve: + " + shlex.join(guard_cmd) + f" >> {guard_log}   (memory guard)")
        return 0
    launch.warn_if_exposed("onespark serve", la.host, la.api_key)
    _clear_the_way(la, guard_report)
    # After removing a replaced container, so that its memory counts as free; before anything is started.
    memory_plan(la)
    print("onespark serve: + " + shlex.join(cmd))
    probe = launch.probe_host(la.host)
    if launch.port_open(probe, la.port):
        raise UserError(f"something already listens on {probe}:{la.port}: stop it or pass --port")
    if la.guard:
        _check_guard_log(guard_log)
    try:
        subprocess.run(cmd, env={**os.environ, **env}, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise UserError(f"docker run failed: {e.stderr.strip()}") from None
    if la.guard:
        _start_guard(la, guard_cmd, guard_log)
    base_url = f"http://{probe}:{la.port}"
    wait_healthy(la.name, base_url, la.timeout, tty=sys.stdout.isatty(), guard_report=guard_report if la.guard else None)
    if la.smoke:
        try:
            launch.print_smoke("onespark serve", base_url, la.prompt, la.max_tokens, la.api_key,
                               "end to end, prefill included, one request")
        except UserError as e:  # a server that answers wrongly is not left serving; stopped, it keeps its log
            _docker("stop", la.name, check=False)
            raise UserError(f"{e}; stopped container {la.name} (its log: docker logs {la.name}; then "
                            f"docker rm {la.name}, or serve again with --replace)") from None
    print(f"onespark serve: serving on {base_url}/v1 (stop: docker rm -f {la.name})")
    return 0
