"""`onespark serve`: launch the v2 (or v2-tq) container, wait until it answers, prove it with one request.

    onespark serve --checkpoint /data/qwen35-hybrid             # onespark/v2 on 127.0.0.1:8000
    onespark serve --checkpoint DIR --model qwen3.5-35b-a3b     # that spec's serving defaults
    onespark serve --checkpoint DIR --tq --api-key "$KEY" --port 8080
    onespark serve --demo --checkpoint DIR                      # CPU stand-in image, tiny model
    onespark serve --checkpoint DIR -- --max-model-len 65536    # anything after -- goes to vLLM

The container uses the host network and vLLM binds only --host (127.0.0.1 unless you say otherwise).
While it starts, one progress line names the stage read from the server log (loading weights, compiling,
capturing CUDA graphs, ...): the 122B model's cold start takes minutes and should never look hung.
If the container dies, the log tail and the likely cause are printed. Once /health answers, one chat
request is sent and its answer and rate (completion tokens from the server's `usage` / wall time) shown.
Before `docker run`, a memory plan (onespark.serving.memory) shows weights, vLLM's share, KV pool and host
reserve, and refuses a configuration that leaves the host too little; beside the container a memory
guard runs (its own process, gone with the container) that stops it before the host swaps itself to a
standstill (--no-memory-guard turns it off).
What starts is described once (serve_launch.Launch); the container is watched through container.py.
The API key travels as the environment variable VLLM_API_KEY, never on a command line or in output; so does
any --env whose name says it is a secret (TOKEN, KEY, SECRET, PASSWORD in it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from onespark import options
from onespark.errors import UserError
from onespark.serving import container, launch, memory
from onespark.serving.serve_launch import DEMO_IMAGE, V2_IMAGE, V2_TQ_IMAGE, Launch, container_command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, type=options.directory, metavar="DIR",
                   help="checkpoint directory on the host (mounted read-only at /model)")
    p.add_argument("--model", type=options.spec_name, metavar="NAME",
                   help="model spec (onespark specs): its serving defaults (served name, --gpu-memory-utilization, "
                        "--max-model-len, drafter) replace the image's, which are qwen3.5-122b-a10b's; flags after "
                        "-- still win (default: the spec the checkpoint's manifest records, else the image's)")
    p.add_argument("--spec", type=options.spec_name, dest="model", help=argparse.SUPPRESS)  # --model's old name
    p.add_argument("--drafter", choices=("mtp", "dflash"), default="mtp",
                   help="speculative decoding: mtp (default: the checkpoint's own MTP layer) or dflash (the spec's "
                        "DFlash drafter from --drafter-dir; vLLM 0.32.0 track images only)")
    p.add_argument("--drafter-dir", type=options.directory, help="--drafter dflash: the drafter's directory on the host (onespark download "
                                         "--drafter dflash writes WORK/dflash), mounted read-only at /drafter")
    p.add_argument("--num-draft-tokens", type=options.COUNT, metavar="N",
                   help="--drafter dflash: tokens drafted per step (default: the spec's, the record's 12; others "
                        "reported 12 unstable and use 10)")
    p.add_argument("--image", type=options.image_ref, help=f"image to run (default: {V2_IMAGE}; --tq: {V2_TQ_IMAGE}; --demo: {DEMO_IMAGE})")
    p.add_argument("--tq", action="store_true", help="run the TurboQuant image (v2-tq): 3.9x the KV tokens per GB; a decode "
                   "step ~v2's at 1K, faster at long context (H200, 122B and 35B shapes: docs/concepts/turboquant.md)")
    p.add_argument("--demo", action="store_true", help="CPU stand-in: no GPU, tiny model, GPU-only defaults dropped")
    p.add_argument("--name", type=options.container_name, default="onespark", help="container name (default: onespark)")
    p.add_argument("--host", type=options.bind_host, default="127.0.0.1", help="address vLLM binds (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=options.PORT, default=8000, help="port (default: 8000)")
    launch.add_key_arguments(p)
    p.add_argument("--timeout", type=options.SECONDS, help="seconds to wait for /health (default: 1800; --demo: 600)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra container environment, repeatable (e.g. ONESPARK_INT8_LM_HEAD=0 for an A/B run); a name "
                        "with TOKEN, KEY, SECRET or PASSWORD in it is passed by name, its value never shown")
    p.add_argument("--replace", action="store_true", help="remove an existing container of the same name first")
    p.add_argument("--cache-volume", type=options.cache_volume, default=launch.CACHE_VOLUME, metavar="NAME",
                   help=f"Docker volume kept at the container's {launch.CACHE_DIR} for vLLM's, Triton's and "
                        f"FlashInfer's compile caches, so a restart does not compile again (default: "
                        f"{launch.CACHE_VOLUME}; none: no volume)")
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


def docker_run_command(args: argparse.Namespace, image: str) -> tuple[list[str], dict[str, str]]:
    """The `docker run` argv of these arguments and `image` (tests and --dry-run read it)."""
    return container_command(Launch.from_args(args, image))


def memory_plan(la: Launch) -> None:
    """Print the plan and the other consumers; raise UserError when the plan must not start (a dry run only
    says so). The CPU demo has no plan: vLLM on CPU takes a fixed 1 GiB KV cache, no share of the pool."""
    if la.demo:
        print("onespark serve: memory plan: none for --demo (vLLM on CPU, 1 GiB KV cache)")
        return
    try:
        plan = memory.make_plan(la.checkpoint, list(la.vllm_args), meminfo=la.meminfo, floor_gib=la.host_reserve_gib,
                                guard_floor_gib=la.guard_floor_gib, compressor_dir=la.compressor_dir)
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
    if container.docker("image", "inspect", la.image, check=False).returncode != 0:
        raise UserError(f"image {la.image} not found: build it with steps/4-images.sh{' --demo' if la.demo else ''}")
    if container.docker("inspect", "--type", "container", la.name, check=False).returncode == 0:  # not an image's
        if not la.replace:
            raise UserError(f"a container named {la.name} exists: pass --replace, or --name another")
        container.docker("rm", "-f", la.name)
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
    if not la.dry_run and not os.path.isfile(os.path.join(la.checkpoint, "config.json")):
        raise UserError(f"{la.checkpoint} has no config.json: --checkpoint must be a checkpoint directory "
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
    base_url = launch.base_url(la.host, la.port)
    container.wait_healthy(la.name, base_url, la.timeout, tty=sys.stdout.isatty(), guard_report=guard_report if la.guard else None)
    if la.smoke:
        try:
            launch.print_smoke("onespark serve", base_url, la.prompt, la.max_tokens, la.api_key,
                               "end to end, prefill included, one request")
        except UserError as e:  # a server that answers wrongly is not left serving; stopped, it keeps its log
            container.docker("stop", la.name, check=False)
            raise UserError(f"{e}; stopped container {la.name} (its log: docker logs {la.name}; then "
                            f"docker rm {la.name}, or serve again with --replace)") from None
    print(f"onespark serve: serving on {base_url}/v1 (stop: docker rm -f {la.name})")
    return 0
