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
Before `docker run`, a memory plan (onespark.memory) shows weights, vLLM's share, KV pool and host
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
import socket
import subprocess
import sys
import time
from pathlib import Path

from onespark import __version__, memory, options
from onespark.errors import UserError

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

# Server-log line -> start-up stage. Patterns are vLLM 0.19.1's own log messages; the last line that
# matches any of them is the current stage.
# A table on purpose (`duplicates` pairs its same-shape rows, D8): one row a stage, read top to bottom.
STAGES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"vLLM API server version|Automatically detected platform"), "starting vLLM"),
    (re.compile(r"Resolved architecture"), "reading the model config"),
    (re.compile(r"Initializing a V1 LLM engine"), "starting the engine"),
    (re.compile(r"Starting to load model"), "loading weights"),
    (re.compile(r"Loading safetensors[^|]*?(\d+)% Completed \| (\d+)/(\d+)"), "loading weights ({2}/{3} shards)"),
    (re.compile(r"Loading weights took|Model loading took"), "weights loaded"),
    (re.compile(r"Dynamo bytecode transform|Compiling a graph"), "compiling (torch.compile)"),
    (re.compile(r"torch\.compile took"), "compiled"),
    (re.compile(r"Memory profiling takes|Available KV cache memory"), "sizing the KV cache"),
    (re.compile(r"Capturing CUDA graphs[^|]*?(\d+)%"), "capturing CUDA graphs ({1}%)"),
    (re.compile(r"Graph capturing finished"), "CUDA graphs captured"),
    (re.compile(r"init engine \(profile, create kv cache, warmup model\) took"), "engine ready"),
    (re.compile(r"Starting vLLM server on|Application startup complete"), "API server up"),
]

# (pattern in the log, likely cause and fix). First match wins; the order puts specific causes first.
CAUSES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"undefined symbol"),
     "torch ABI mismatch: vLLM's compiled ops were built against a different torch than the one installed. "
     "Rebuild the base image: steps/3-base-image.sh --no-cache (both stages then share one torch)."),
    (re.compile(r"sm_121a.*not defined|not defined.*sm_121a"),
     "Triton's bundled ptxas does not know sm_121a: TRITON_PTXAS_PATH must point at CUDA 13's ptxas "
     "(Dockerfile.base sets it; an image built elsewhere may not)."),
    (re.compile(r"CUDA out of memory|OutOfMemoryError|Cannot allocate memory"),
     "out of memory: lower --gpu-memory-utilization (default 0.82) or --max-model-len, and close other "
     "programs using the GPU (nvidia-smi)."),
    (re.compile(r"than the derived max_model_len"),
     "--max-model-len is longer than the model's config allows (max_position_embeddings): lower it."),
    (re.compile(r"larger than the available KV cache"),
     "the KV cache cannot hold --max-model-len tokens: lower --max-model-len, or raise "
     "--gpu-memory-utilization a little (0.82 is the stable default on a 128 GB Spark)."),
    (re.compile(r"No CUDA GPUs are available|could not select device driver|Found no NVIDIA driver|"
                r"no CUDA-capable device"),
     "the container sees no GPU: install and configure the NVIDIA container toolkit (onespark doctor prints "
     "the commands), then restart Docker."),
    (re.compile(r"Address already in use"), "the port is taken: stop the other server or pass --port."),
    (re.compile(r"No space left on device"), "the disk is full: free space (onespark doctor shows how much)."),
    (re.compile(r"KeyError: '?[\w.]*mtp|mtp\.[\w.]+ (is )?(missing|not found)|[Ss]peculative\w*Error|"
                r"speculative.*(not supported|invalid|missing)", re.IGNORECASE),
     "the MTP draft model did not load: run `onespark verify` on the checkpoint (every mtp.* tensor must be "
     "present), or start without MTP: onespark serve ... -- --speculative-config '{}'"),
    (re.compile(r"config\.json|Invalid repository ID or local directory|is not a local folder"),
     "no model at /model: --model must be the checkpoint directory (the one with config.json)."),
    (re.compile(r"onespark"), "the onespark plugin failed: see its error above (set VLLM_PLUGINS= to run "
                               "without it and confirm)."),
]


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


def docker_run_command(args: argparse.Namespace, image: str) -> tuple[list[str], dict[str, str]]:
    """The `docker run` argv and the environment variables it forwards (by name, values not on argv)."""
    model = os.path.abspath(args.model)
    health_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    env = {"ONESPARK_HEALTH_URL": f"http://{health_host}:{args.port}/health"}
    cmd = ["docker", "run", "-d", "--name", args.name, "--network", "host",
           "-v", f"{model}:/model:ro",
           *(["-v", f"{os.path.abspath(args.drafter_dir)}:/drafter:ro"]
             if getattr(args, "drafter", "mtp") == "dflash" else []),
           # Out of memory, the kernel kills the container first, not sshd; and why there is no --memory limit:
           # memory.OOM_SCORE_ADJ's comment.
           "--oom-score-adj", str(memory.OOM_SCORE_ADJ)]
    if args.demo:
        env.update(DEMO_ENV)
        env["ONESPARK_DROP_DEFAULTS"] = DEMO_DROP
        # vLLM 0.32.0 on CPU asks 160 MiB of /dev/shm at engine start (tiny Qwen3.5-MoE + MTP-2, measured
        # 2026-12-01); Docker gives a container 64 MiB.
        cmd += ["--shm-size", "1g"]
    else:
        # Unified memory: --ipc host for PyTorch's shared memory; unlimited locked memory for NCCL/UCX.
        cmd += ["--gpus", "all", "--ipc", "host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]
    for item in getattr(args, "env", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            # the name only: the value may be the secret
            raise UserError(f"--env {key + '=...' if sep else item!r}: expected NAME=VALUE, NAME of letters, digits "
                            "and _, e.g. --env ONESPARK_INT8_LM_HEAD=0")
        if key == "VLLM_API_KEY":
            raise UserError("--env VLLM_API_KEY=...: use --api-key (or $ONESPARK_API_KEY) so the key stays off argv")
        env[key] = value
    if args.api_key:
        env["VLLM_API_KEY"] = args.api_key
    for k, v in env.items():
        # A secret (the key, --env HF_TOKEN=...) goes by name: docker copies its value from our environment
        # (run() passes env to the child), so it is never printed and never on an argv `ps` shows.
        cmd += ["-e", k if options.is_secret_name(k) else f"{k}={v}"]
    cmd += [image, "--host", args.host, "--port", str(args.port)]
    if args.demo:
        cmd += DEMO_ARGS
    cmd += _vllm_extra(args)
    return cmd, env


def detect_stage(log: str) -> str | None:
    """The start-up stage named by the last log line that matches one of STAGES."""
    stage = None
    for line in log.replace("\r", "\n").splitlines():
        for pattern, label in STAGES:
            m = pattern.search(line)
            if m:
                stage = label.format(*([m.group(0)] + list(m.groups())))
    return stage


def likely_cause(log: str, exit_code: int | None = None, oom_killed: bool = False) -> str:
    if oom_killed:
        return ("the container was killed for memory (OOM): lower --gpu-memory-utilization (default 0.82) or "
                "--max-model-len; on a Spark, CPU and GPU share the 128 GB, so close other programs too.")
    if exit_code == 137:
        # Docker sets OOMKilled only for its own memory limit; the host's OOM killer (no limit set, the
        # usual case on a Spark) and a `docker kill` / `docker rm -f` both show up as a bare SIGKILL.
        return ("the container was killed (SIGKILL): if `dmesg | grep -i oom` shows it, host memory ran out (OOM): "
                "lower --gpu-memory-utilization (default 0.82) or --max-model-len and close other programs; "
                "otherwise something stopped it (docker kill / rm -f, another `onespark serve --replace`).")
    # Only error lines: the config dump at start-up mentions mtp, speculative, memory... harmlessly.
    errors = [ln for ln in log.splitlines() if re.search(r"Error|error|Exception|fatal|Killed", ln)]
    text = "\n".join(errors[-30:])
    for pattern, cause in CAUSES:
        if pattern.search(text):
            return cause
    return "not recognised: read the log above (the first Traceback is usually the cause)."


def _docker(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["docker", *argv], capture_output=True, text=True, check=check)
    except FileNotFoundError:
        raise UserError("docker not found: install Docker (onespark doctor)") from None
    except subprocess.CalledProcessError as e:
        raise UserError(f"docker {argv[0]} failed: {e.stderr.strip() or e.stdout.strip()}") from None


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _http(url: str, body: dict | None = None, api_key: str | None = None, timeout: float = 10) -> tuple[int, bytes]:
    # Imported here, not at the top: install.sh --dry-run runs `python3 -m onespark serve --dry-run` with the
    # system Python before the venv (and httpx) exists, and a dry run sends no request.
    import httpx

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        if body is None:
            r = httpx.get(url, headers=headers, timeout=timeout)
        else:
            r = httpx.post(url, content=json.dumps(body).encode(), headers=headers, timeout=timeout)
        return r.status_code, r.content
    except (httpx.HTTPError, OSError):  # not up yet, refused, timed out: the callers poll or say what they asked
        return 0, b""


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


def wait_healthy(name: str, base_url: str, timeout: float, tty: bool, guard_report=None) -> None:
    t0 = time.monotonic()
    last_line = ""
    while True:
        elapsed = time.monotonic() - t0
        status, _ = _http(f"{base_url}/health", timeout=5)
        if status == 200:
            if tty:
                print(flush=True)
            print(f"onespark serve: healthy after {elapsed:.0f} s")
            return
        running, code, oom = _container_state(name)
        log = _logs(name)
        if not running:
            if tty:
                print(flush=True)
            if guard_report is not None and code in (137, 143):
                # docker stop's SIGTERM (143) or SIGKILL (137): the guard writes its report just after the stop
                for _ in range(50):
                    if guard_report.is_file():
                        break
                    time.sleep(0.2)
            if guard_report is not None and guard_report.is_file():
                raise UserError(f"container {name} was stopped by the memory guard after {elapsed:.0f} s:\n"
                                + guard_report.read_text(errors="replace").rstrip())
            tail = "\n".join(log.splitlines()[-40:])
            raise UserError(
                f"container {name} exited (code {code}) after {elapsed:.0f} s.\n--- last 40 log lines ---\n{tail}\n"
                f"--- likely cause: {likely_cause(log, code, oom)}\n(full log: docker logs {name})"
            )
        if elapsed > timeout:
            if tty:
                print(flush=True)
            tail = "\n".join(log.splitlines()[-40:])
            raise UserError(
                f"/health not green after {timeout:.0f} s (stage: {detect_stage(log) or 'unknown'}); the container "
                f"is left running for you to inspect.\n--- last 40 log lines ---\n{tail}\n"
                f"--- if it is still progressing, wait (the first start compiles and captures graphs) or pass "
                f"--timeout; otherwise: docker logs {name}"
            )
        line = f"[{elapsed:5.0f} s] {detect_stage(log) or 'starting container'}"
        if tty:
            print(f"\r{line:<70}", end="", flush=True)
        elif line.split("] ", 1)[1] != last_line.split("] ", 1)[-1]:
            print(line, flush=True)  # in a log file: one line per stage, not one per poll
        last_line = line
        time.sleep(2)


def _json_answer(body: bytes, what: str):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{what} is not JSON (it starts {body[:80]!r}): {NOT_VLLM}") from None


NOT_VLLM = "not what vLLM answers: is another server on that port? The server's log says more"


def smoke(base_url: str, prompt: str, max_tokens: int, api_key: str | None) -> dict:
    """One chat request to the first model /v1/models lists; every answer checked for the fields read."""
    status, body = _http(f"{base_url}/v1/models", api_key=api_key)
    if status != 200:
        raise UserError(f"GET /v1/models answered HTTP {status}: {body[:300]!r}")
    doc = _json_answer(body, "GET /v1/models")
    cards = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(cards, list) or not cards:
        raise UserError(f"GET /v1/models lists no model (it answered {body[:120]!r}): {NOT_VLLM}")
    model = cards[0].get("id") if isinstance(cards[0], dict) else None
    if not isinstance(model, str) or not model:
        raise UserError(f"GET /v1/models: the first model card has no id ({str(cards[0])[:120]!r}): {NOT_VLLM}")
    request = {"model": model, "messages": [{"role": "user", "content": prompt}],
               "max_tokens": max_tokens, "temperature": 0}
    t0 = time.monotonic()
    status, body = _http(f"{base_url}/v1/chat/completions", request, api_key=api_key, timeout=600)
    elapsed = time.monotonic() - t0
    if status != 200:
        raise UserError(f"the chat request answered HTTP {status}: {body[:500]!r}")
    reply = _json_answer(body, "the chat answer")
    try:
        message = reply["choices"][0]["message"]
        answer = message.get("content") or message.get("reasoning_content") or ""
        tokens = reply["usage"]["completion_tokens"]
    except (KeyError, IndexError, TypeError, AttributeError):
        answer, tokens = None, None
    if not isinstance(answer, str) or type(tokens) is not int or tokens < 0:
        raise UserError(f"the chat answer has no choices[0].message text or usage.completion_tokens (it answered "
                        f"{body[:120]!r}): {NOT_VLLM}")
    return {
        "model": model,
        "answer": answer,
        "completion_tokens": tokens,
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed if elapsed > 0 else 0.0,
    }


def _vllm_extra(args: argparse.Namespace) -> list[str]:
    extra = list(args.vllm_args or [])
    return extra[1:] if extra and extra[0] == "--" else extra


def guard_floor_gib(args: argparse.Namespace) -> float:
    if args.guard_floor_gib is not None:
        return args.guard_floor_gib
    return memory.DEMO_GUARD_FLOOR_GIB if args.demo else memory.GUARD_FLOOR_GIB


def memory_plan(args: argparse.Namespace) -> None:
    """Print the plan and the other consumers; raise UserError when the plan must not start (a dry run only
    says so). The CPU demo has no plan: vLLM on CPU takes a fixed 1 GiB KV cache, no share of the pool."""
    if args.demo:
        print("onespark serve: memory plan: none for --demo (vLLM on CPU, 1 GiB KV cache)")
        return
    try:
        plan = memory.make_plan(args.model, _vllm_extra(args), meminfo=args.meminfo, floor_gib=args.host_reserve_gib,
                                guard_floor_gib=guard_floor_gib(args))
    except memory.PlanError as e:
        if args.dry_run:
            print(f"onespark serve: memory plan: not made yet ({e}); serve makes it before launch")
            return
        raise UserError(str(e)) from None
    print("onespark serve: memory plan (unified memory: vLLM's share and the host's reserve are one pool):")
    for line in plan.lines():
        print("  " + line)
    mem = memory.read_meminfo(args.meminfo)
    for c in memory.consumers(mem):
        print(f"onespark serve: also using memory: {c.what}: {c.detail}\n  frees it: {c.fix}")
    problems = plan.problems()
    if problems and args.dry_run:
        print("onespark serve: the plan would refuse: " + " | ".join(problems))
    elif problems:
        raise UserError("memory plan refused: " + "\n".join(problems))


def _with_drafter(args: argparse.Namespace, image: str) -> None:
    """--drafter dflash: its --speculative-config goes among the user's vLLM flags (so it replaces the spec's
    and the image's MTP default), unless the user gave one after --, which wins."""
    if getattr(args, "drafter", "mtp") != "dflash":
        if getattr(args, "drafter_dir", None) or getattr(args, "num_draft_tokens", None):
            raise UserError("--drafter-dir/--num-draft-tokens are for --drafter dflash")
        return
    from onespark import specs
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
    user = _vllm_extra(args)
    if any(a == "--speculative-config" or a.startswith("--speculative-config=") for a in user):
        return
    cfg = specs.dflash_config(spec, tokens=args.num_draft_tokens)
    args.vllm_args = ["--", "--speculative-config", json.dumps(cfg, separators=(",", ":")), *user]


def _with_spec(args: argparse.Namespace) -> None:
    """Put the spec's serving flags before the user's vLLM flags, leaving out any flag the user sets."""
    if not getattr(args, "spec", None):
        return
    from onespark import specs
    user = _vllm_extra(args)
    spec_args, i = specs.get(args.spec, flag="--spec").vllm_args(), 0
    keep = []
    while i < len(spec_args):  # flag value pairs
        flag = spec_args[i]
        if not any(a == flag or a.startswith(flag + "=") for a in user):
            keep += spec_args[i:i + 2]
        i += 2
    args.vllm_args = ["--", *keep, *user]


def _guard_plan(args: argparse.Namespace) -> tuple[Path, Path, list[str]]:
    """The memory guard's log, report and command line for this container."""
    util = memory.vllm_flag(_vllm_extra(args), "--gpu-memory-utilization") or (
        None if args.demo else f"{memory.DEFAULT_GPU_UTIL:g}")
    guard_log, guard_report = memory.guard_files(args.name)
    guard_cmd = memory.guard_command(args.name, floor_gib=guard_floor_gib(args), report=guard_report, util=util,
                                     meminfo=args.meminfo, vmstat=args.vmstat)
    return guard_log, guard_report, guard_cmd


def _clear_the_way(args: argparse.Namespace, image: str, guard_report: Path) -> None:
    """Before the plan: the image exists, a container of this name is gone (--replace), and the last guard
    report of this name is shown once."""
    if _docker("image", "inspect", image, check=False).returncode != 0:
        raise UserError(f"image {image} not found: build it with steps/4-images.sh{' --demo' if args.demo else ''}")
    if _docker("inspect", args.name, check=False).returncode == 0:
        if not args.replace:
            raise UserError(f"a container named {args.name} exists: pass --replace, or --name another")
        _docker("rm", "-f", args.name)
        # The plan below must see the memory the old server gave back (the driver frees it as it exits).
        memory.wait_until_settled(args.meminfo)
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


def _start_guard(args: argparse.Namespace, guard_cmd: list[str], guard_log: Path) -> None:
    """Started right after the container, so it watches start-up profiling too; it ends when `docker wait`
    returns, i.e. with the container (stopped, removed or replaced)."""
    print("onespark serve: + " + shlex.join(guard_cmd) + f" >> {guard_log}")
    try:
        guard = memory.start_guard(guard_cmd, guard_log)
        print(f"onespark serve: memory guard pid {guard.pid}: stops {args.name} if MemAvailable stays below "
              f"{guard_floor_gib(args):g} GiB or the host keeps swapping (log: {guard_log})")
    except OSError as e:  # the server is up: say so loudly, do not take it down
        print(f"onespark serve: warning: the memory guard did not start ({e}); {args.name} runs unguarded "
              f"(stop it with docker rm -f {args.name})", file=sys.stderr)


def _print_smoke(args: argparse.Namespace, base_url: str) -> None:
    r = smoke(base_url, args.prompt, args.max_tokens, args.api_key)
    print(f"onespark serve: {r['model']} answered {args.prompt!r}:\n  {r['answer'].strip()!r}")
    print(f"onespark serve: {r['completion_tokens']} tokens in {r['seconds']:.2f} s = "
          f"{r['tok_per_s']:.1f} tok/s (end to end, prefill included, one request)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "api_key_file", None):
        from onespark.errors import read_secret

        args.api_key = read_secret(args.api_key_file, "--api-key-file")
    options.reject_secret_flags(_vllm_extra(args), "serve")
    image = args.image or (DEMO_IMAGE if args.demo else V2_TQ_IMAGE if args.tq else V2_IMAGE)
    _with_drafter(args, image)
    _with_spec(args)
    if not args.dry_run and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UserError(f"{args.model} has no config.json: --model must be a checkpoint directory "
                        "(steps 1-2 write it; onespark verify checks it)")
    cmd, env = docker_run_command(args, image)
    guard_log, guard_report, guard_cmd = _guard_plan(args)
    if args.dry_run:
        memory_plan(args)
        print("onespark serve: + " + shlex.join(cmd))
        if not args.no_memory_guard:
            print("onespark serve: + " + shlex.join(guard_cmd) + f" >> {guard_log}   (memory guard)")
        return 0
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"onespark serve: warning: --host {args.host} exposes the server beyond this machine without "
              "an API key; pass --api-key", file=sys.stderr)
    _clear_the_way(args, image, guard_report)
    # After removing a replaced container, so that its memory counts as free; before anything is started.
    memory_plan(args)
    print("onespark serve: + " + shlex.join(cmd))
    probe = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    if _port_open(probe, args.port):
        raise UserError(f"something already listens on {probe}:{args.port}: stop it or pass --port")
    if not args.no_memory_guard:
        _check_guard_log(guard_log)
    try:
        subprocess.run(cmd, env={**os.environ, **env}, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise UserError(f"docker run failed: {e.stderr.strip()}") from None
    if not args.no_memory_guard:
        _start_guard(args, guard_cmd, guard_log)
    base_url = f"http://{probe}:{args.port}"
    wait_healthy(args.name, base_url, args.timeout or (600 if args.demo else 1800), tty=sys.stdout.isatty(),
                 guard_report=None if args.no_memory_guard else guard_report)
    if not args.no_smoke:
        try:
            _print_smoke(args, base_url)
        except UserError as e:  # a server that answers wrongly is not left serving; stopped, it keeps its log
            _docker("stop", args.name, check=False)
            raise UserError(f"{e}; stopped container {args.name} (its log: docker logs {args.name}; then "
                            f"docker rm {args.name}, or serve again with --replace)") from None
    print(f"onespark serve: serving on {base_url}/v1 (stop: docker rm -f {args.name})")
    return 0
