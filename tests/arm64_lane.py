"""The arm64 lane (tests/arm64.sh): build the Spark's default-track images for linux/arm64 and check them, on any
machine with Docker, under qemu-user emulation where the host is not arm64.

  tests/arm64.sh [--no-cache] [--out FILE] [--logs DIR]

What it builds, in order, each stage timed (Docker's classic builder, as CI has it):
  rootfs    demo/rootfs.sh --arch arm64: Debian bookworm arm64, debootstrap + docker import (no registry)
  stand-in  demo/Dockerfile.cuda-standin: the CUDA 13.0 toolkit's compilers and headers on it, for
            nvidia/cuda:13.0.2-devel-ubuntu24.04 (what it lacks: that file's header, docs/guides/tracks.md)
  base      steps/3-base-image.sh --vllm 0.32.0 --from STAND-IN: Dockerfile.base's vllm-wheels stage, the very
            stage a Spark builds, every wheel of docker/vllm-0.32.0.lock.txt by sha256 (Python 3.11 here: 3.12 on
            the Spark, whose wheels tests/test_install.py resolves from metadata)
  v2        steps/4-images.sh --vllm 0.32.0 --base BASE: Dockerfile.v2
  v2-tq     steps/4-images.sh --vllm 0.32.0 --tq: Dockerfile.v2-tq, its CUDA decode kernel compiled for sm_121a
Then tests/arm64_check.py runs inside each image (the checkout mounted read-only), and the serving command each
image's entrypoint prints for the 122B and the 35B is read back (`onespark serve --dry-run`'s arguments,
ONESPARK_PRINT_ONLY=1). The result, written atomically: bench/results/arm64_images.json.
Exit status 0 only when every stage built and every check passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTFS = "onespark-demo/debian:bookworm-arm64"  # demo/rootfs.sh --arch arm64's own name on an x86_64 host
STANDIN = "onespark-arm64/cuda:13.0.2-standin"
BASE = "onespark-arm64/vllm-base:0.32.0"
V2 = "onespark-arm64/v2:0.32.0"
V2_TQ = "onespark-arm64/v2-tq:0.32.0"
LOCK = ROOT / "docker" / "vllm-0.32.0.lock.txt"
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
# qemu-user 7.2 (Debian 12's) dies of SIGSEGV in the guest loading torch 2.13.0's aarch64 libtorch (torch._C); 10.0.2
# (bookworm-backports) loads it. Versions between were not tried.
QEMU_MIN = (10, 0)
# Which checks run in which image (tests/arm64_check.py): the base's own, then what each later image adds.
CHECKS = {BASE: ["arch", "lock", "base-check", "modules", "serve-help"],
          V2: ["lock", "plugin"],
          V2_TQ: ["lock", "turboquant", "cuda-built", "kernels"]}
# What the images and the checks are made of: the lane runs again when one of these changes (tests/test_arm64.py
# holds the committed result to them): the Dockerfiles, the pins, the stand-in, the plugin's import path, the CUDA
# kernel v2-tq compiles, and the lane itself.
# docs/generate.py's MEASURES names the same paths for the result's entry in bench/results/INDEX.md.
INPUTS = ("Dockerfile.base", "Dockerfile.v2", "Dockerfile.v2-tq", "docker", "demo/rootfs.sh", "demo/Dockerfile.cuda-standin",
          "demo/cuda-standin.txt", "demo/cuda_stub.py", "steps/3-base-image.sh", "steps/4-images.sh", "pyproject.toml",
          "patches/__init__.py", "patches/_compat.py", "kernels/turboquant_decode.cu", "kernels/turboquant_decode.cuh",
          "tests/arm64.sh", "tests/arm64_check.py", "tests/arm64_lane.py")
MODELS = ("qwen3.5-122b-a10b", "qwen3.5-35b-a3b")  # whose serving command each image's entrypoint must print


class LaneError(Exception):
    """What stops the lane before it can build: one line with the fix."""


def preflight() -> str:
    """The emulation the host needs, in one line; raises LaneError naming the fix."""
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        raise LaneError("no Docker engine answers: start one (bash .ci/docker-up.sh)")
    if platform.machine() in ("aarch64", "arm64"):
        return "native arm64"
    if not BINFMT.is_file():
        raise LaneError(f"no {BINFMT}: apt-get install -y qemu-user-static binfmt-support (mount -t binfmt_misc "
                        "binfmt_misc /proc/sys/fs/binfmt_misc first if that folder is empty)")
    entry = BINFMT.read_text()
    if "enabled" not in entry.splitlines()[0] or not re.search(r"^flags:.*F", entry, re.M):
        raise LaneError(f"{BINFMT} must be enabled with the F flag (containers use it): update-binfmts --enable "
                        "qemu-aarch64")
    # The *-binfmt-P name refuses to run by hand; the file it links to answers --version.
    interpreter = os.path.realpath(re.search(r"^interpreter (\S+)", entry, re.M).group(1))
    qemu = subprocess.run([interpreter, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    version = tuple(int(x) for x in re.findall(r"version (\d+)\.(\d+)", qemu)[0]) if "version" in qemu else (0, 0)
    if version < QEMU_MIN:
        raise LaneError(f"{interpreter} is {qemu or 'of unknown version'}: qemu-user before {QEMU_MIN[0]}.{QEMU_MIN[1]} "
                        "crashes loading torch 2.13's libtorch (Debian 12's 7.2 does); install a newer one "
                        "(apt-get install -t bookworm-backports qemu-user-static), then register it again: "
                        "update-binfmts --disable qemu-aarch64 && update-binfmts --enable qemu-aarch64")
    return f"{platform.machine()} host, linux/arm64 under qemu-user emulation ({qemu})"


def run_logged(name: str, argv: list[str], logs: Path, env: dict | None = None) -> tuple[float, str]:
    """Run one stage, its output to logs/NAME.log; (seconds, output). Raises LaneError on failure."""
    t0 = time.monotonic()
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})},
                       stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - t0
    out = r.stdout + r.stderr
    (logs / f"{name}.log").write_text(f"$ {shlex.join(argv)}\n{out}")
    if r.returncode != 0:
        raise LaneError(f"{name} failed after {seconds:.0f} s (exit {r.returncode}); last lines:\n"
                        + "\n".join(out.strip().splitlines()[-25:]) + f"\n(whole log: {logs / name}.log)")
    return seconds, out


def image_size(image: str) -> int:
    r = subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", image], capture_output=True, text=True)
    return int(r.stdout.strip() or 0)


def build(no_cache: bool, logs: Path) -> list[dict]:
    """Every stage, in order: [{stage, image, seconds, built, size_bytes}]."""
    nc = ["--no-cache"] if no_cache else []
    legacy = {"DOCKER_BUILDKIT": "0"}  # the classic builder: what CI's Docker has, and what the lane proves
    stages = [
        ("rootfs", ROOTFS, ["demo/rootfs.sh", "--arch", "arm64", "--image", ROOTFS, *nc]),
        ("stand-in", STANDIN, ["docker", "build", "--network", "host", *nc, "--build-arg", f"ROOTFS_IMAGE={ROOTFS}",
                               "-f", "demo/Dockerfile.cuda-standin", "-t", STANDIN, "demo"]),
        ("base", BASE, ["steps/3-base-image.sh", "--vllm", "0.32.0", "--from", STANDIN, "--python", "3.11",
                        "--tag", BASE, *nc]),
        ("v2", V2, ["steps/4-images.sh", "--vllm", "0.32.0", "--base", BASE, "--tag", V2, *nc]),
        ("v2-tq", V2_TQ, ["steps/4-images.sh", "--vllm", "0.32.0", "--base", BASE, "--tag", V2, "--tq"]),
    ]
    done = []
    for name, image, argv in stages:
        print(f"arm64 lane: {name}: {shlex.join(argv)}", flush=True)
        seconds, out = run_logged(name, argv, logs, legacy)
        # A stage whose image was up to date is reused, not built: its seconds are not a build time.
        reused = "up to date" in out and (name != "v2-tq" or out.count("up to date") == 2)
        if name == "stand-in":
            reused = "Step" in out and "Running in" not in out
        done.append({"stage": name, "image": image, "built": not reused, "seconds": round(seconds, 1),
                     "size_bytes": image_size(image)})
        print(f"arm64 lane: {name}: {'reused' if reused else 'built'} in {seconds:.0f} s, "
              f"{done[-1]['size_bytes'] / 1e9:.2f} GB", flush=True)
    return done


def in_image(image: str, checks: list[str], logs: Path) -> list[dict]:
    """tests/arm64_check.py inside IMAGE; one dict per check (a check the run never reached is a failure)."""
    argv = ["docker", "run", "--rm", "--network", "host", "-v", f"{ROOT}:/src:ro", "--entrypoint", "python", image,
            "/src/tests/arm64_check.py", *checks]
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    name = re.sub(r"\W+", "-", image)
    (logs / f"check-{name}.log").write_text(f"$ {shlex.join(argv)}\n{r.stdout}{r.stderr}")
    got = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            got[item["check"]] = item
    return [{"image": image, **got.get(c, {"check": c, "ok": False, "seconds": 0.0,
                                            "detail": f"not reached: exit {r.returncode}: {r.stderr.strip()[-400:]}"})}
            for c in checks]


def serving_argv(model: str, image: str) -> list[str]:
    """The `docker run` arguments `onespark serve` passes for MODEL (its dry run), from the image on."""
    r = subprocess.run([sys.executable, "-m", "onespark", "serve", "--dry-run", "--model", model, "--checkpoint",
                        "/tmp/onespark-arm64-lane-model", "--image", image], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next((x for x in (r.stdout + r.stderr).splitlines() if "+ docker run" in x), None)
    if line is None:
        raise LaneError(f"onespark serve --dry-run --model {model} printed no docker run: {r.stderr.strip()[-400:]}")
    argv = shlex.split(line.split("+ ", 1)[1])
    at = argv.index(image)
    env = [x for i, a in enumerate(argv[:at]) if a == "-e" for x in ("-e", argv[i + 1])]
    return [*env, image, *argv[at + 1:]]


def check_entrypoint(model: str, image: str, want: dict[str, str]) -> dict:
    """The command IMAGE's entrypoint runs for MODEL's serve arguments (ONESPARK_PRINT_ONLY=1), read back."""
    t0 = time.monotonic()
    try:
        argv = serving_argv(model, image)
        r = subprocess.run(["docker", "run", "--rm", "--network", "none", "-e", "ONESPARK_PRINT_ONLY=1", *argv],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
        cmd = r.stdout.splitlines()
        flag = {a: cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a.startswith("--")}
        wrong = {k: flag.get(k) for k, v in want.items() if flag.get(k) != v}
        # docker/entrypoint.sh starts vLLM's OpenAI server as a module (what `vllm serve` runs)
        server = cmd[:2] == ["vllm", "serve"] or cmd[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
        ok = r.returncode == 0 and server and not wrong
        detail = " ".join(cmd) if ok else f"exit {r.returncode}; wrong flags {wrong}; got {cmd or r.stderr[-400:]}"
    except LaneError as e:
        ok, detail = False, str(e)
    return {"image": image, "check": f"entrypoint {model}", "ok": ok, "seconds": round(time.monotonic() - t0, 1),
            "detail": detail}


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def write_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/arm64.sh", allow_abbrev=False,
                                 description="Build and check the Spark's arm64 images (default track) under emulation.")
    ap.add_argument("--no-cache", action="store_true", help="rebuild every stage (a cold measurement)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "arm64_images.json",
                    help="the result file (default: bench/results/arm64_images.json)")
    ap.add_argument("--logs", type=Path, default=None, help="folder for each stage's log (default: a new temp folder)")
    args = ap.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="onespark-arm64-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"arm64 lane: logs in {logs}", flush=True)
    t0 = time.monotonic()
    try:
        hardware = preflight()
        stages = build(args.no_cache, logs)
        # The images' checks side by side: each is one emulated Python at a time, and the host has cores to spare.
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(CHECKS)) as pool:
            print(f"arm64 lane: checks in {', '.join(CHECKS)}", flush=True)
            checks = [c for found in pool.map(lambda item: in_image(*item, logs), CHECKS.items()) for c in found]
        mtp = '{"method":"mtp","num_speculative_tokens":2}'
        for image, extra in ((V2, {}), (V2_TQ, {"--kv-cache-dtype": "turboquant_k4v4", "--attention-backend": "CUSTOM"})):
            for model in MODELS:
                checks.append(check_entrypoint(model, image, {"--served-model-name": model,
                                                              "--speculative-config": mtp, **extra}))
    except LaneError as e:
        print(f"arm64 lane: {e}", file=sys.stderr)
        return 1
    for c in checks:
        said = {True: "ok  ", None: "NEEDS DRIVER", False: "FAIL"}[c["ok"]]
        print(f"arm64 lane: {said} {c['image']} {c['check']} ({c['seconds']:.0f} s): {c['detail'][:300]}", flush=True)
    ok = all(c["ok"] is not False for c in checks)  # a check that needs the driver is listed, not failed
    result = {
        "benchmark": "arm64_images",
        "what": "the default track's Spark images (Dockerfile.base vllm-wheels, Dockerfile.v2, Dockerfile.v2-tq) "
                "built for linux/arm64 and checked without a GPU",
        "hardware": hardware,
        "commit": git("rev-parse", "HEAD"),
        "inputs": list(INPUTS),
        "dirty": bool(git("status", "--porcelain", "--", *INPUTS)),  # the lane's inputs differ from the commit
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "tests/arm64.sh" + (" --no-cache" if args.no_cache else ""),
        "lock": {"file": LOCK.relative_to(ROOT).as_posix(), "sha256": hashlib.sha256(LOCK.read_bytes()).hexdigest()},
        "stand_in": {"image": STANDIN, "for": "nvidia/cuda:13.0.2-devel-ubuntu24.04",
                     "lacks": "Ubuntu 24.04 (Debian 12 here: glibc 2.36, Python 3.11 instead of 3.12); the toolkit's "
                              "libraries beyond cudart (torch's wheels bring their own); NVIDIA's own libcuda stub "
                              "(one generated from cuda.h stands in); Nsight tools; NVIDIA's container environment"},
        "stages": stages,
        "build_seconds": round(sum(s["seconds"] for s in stages if s["built"]), 1),
        "checks": checks,
        "needs_driver": [f"{c['image']}: {c['check']}" for c in checks if c["ok"] is None],
        "ok": ok,
        "seconds": round(time.monotonic() - t0, 1),
    }
    write_atomic(args.out, result)
    print(f"arm64 lane: {'all checks passed' if ok else 'FAILED'}; result {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
