"""Dockerfile.base's last build step, for both tracks: fail the build, loudly, on the failures users hit weeks later.

  python base-check.py --vllm 0.32.0 --torch 2.13.0 --cuda 13.0 --triton 3.7.1 --flashinfer 0.7.0.post1

Checks, each against what the Dockerfile pinned:
  - torch is the CUDA build expected (a CPU torch, or one of another CUDA, reports another torch.version.cuda);
    `--torch X+cu130` compares the full version, `--torch X` the release (PyPI's wheels carry no suffix);
  - exactly one installed distribution owns the `torch` and the `triton` packages (two would overwrite each
    other's files: the "two torches" class of ABI failure);
  - vllm imports at the pinned version, and so do its compiled ops (`--compiled-ops`; 0.19.1: vllm._C, 0.32.0:
    vllm._C_stable_libtorch and vllm._moe_C_stable_libtorch): an ABI mismatch with torch shows there. 0.32.0's
    link the driver's libcuda.so.1, which no docker build has; then they are imported against the CUDA
    toolkit's stub (lib64/stubs/libcuda.so), and where there is none (CI's stand-in base has no toolkit) the
    output says they were not checked; each is imported in a child, so a CPU that lacks the wheel's instruction
    set (SIGILL) is reported as not checked on this CPU, not as a crash;
  - FlashInfer and Triton import at their pins;
  - with `--pip-check`: `uv pip check` finds every requirement met and every wheel built for this platform, where a
    wheel NVIDIA tags `..._sbsa` inside counts as the aarch64 wheel it is (pip_check_problems);
  - the ptxas that Triton uses for sm_121 (the GB10) knows `sm_121a`: Triton >= 3.7 picks its bundled
    CUDA 13 `ptxas-blackwell` for sm_100+, older ones use TRITON_PTXAS_PATH (triton-lang/triton#8539).
No GPU is needed: a docker build has none.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def owners(package: str) -> list[str]:
    """Installed distributions whose RECORD lists PACKAGE/__init__.py."""
    found = []
    for dist in md.distributions():
        files = dist.files or []
        if any(str(f) == f"{package}/__init__.py" for f in files):
            found.append(f"{dist.metadata['Name']}=={dist.version}")
    return sorted(found)


def ptxas_for_sm121() -> tuple[str, str]:
    """(path, why) of the ptxas Triton runs for compute capability 12.1."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # Triton >= 3.7: per-architecture ptxas
        return get_ptxas(121).path, "Triton's choice for sm_121 (get_ptxas(121))"
    except ImportError:
        path = os.environ.get("TRITON_PTXAS_PATH", "")
        return path, "TRITON_PTXAS_PATH (this Triton has one ptxas for every architecture)"


def _import_in_child(module: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A compiled module is imported in a child: an illegal instruction kills the process that loads it, and this
    checker must live to say so."""
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)


def _last_line(r: subprocess.CompletedProcess) -> str:
    return r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"


def import_compiled(module: str) -> str:
    """Import a compiled extension in a child; returns how it was checked, raises ImportError on a real failure.

    Two outcomes are not failures of the image, and are reported as "NOT checked": the module links the GPU
    driver's libcuda.so.1 and no toolkit stub stands in for it, or the child died of SIGILL (the wheel was built
    for CPU features this CPU lacks: vLLM's x86_64 CPU wheel imports its AVX-512 `_C` on a CPU with AVX2 only,
    while its server picks the AVX2 kernels at run time). An ABI mismatch with torch is an ImportError in the
    child (exit 1), and still fails."""
    r = _import_in_child(module)
    if r.returncode == -signal.SIGILL:
        return (f"{module} NOT checked on this CPU: importing it is an illegal instruction (SIGILL; the wheel was "
                "built for CPU features this CPU lacks)")
    if r.returncode == 0:
        return f"{module} imports"
    if "libcuda.so.1" not in r.stderr:
        raise ImportError(_last_line(r))
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    stub = Path(cuda, "lib64", "stubs", "libcuda.so")
    if not stub.is_file():
        return f"{module} NOT checked: it links libcuda.so.1 (the GPU driver, absent in a build) and there is no stub at {stub}"
    with tempfile.TemporaryDirectory() as d:
        os.symlink(stub, Path(d, "libcuda.so.1"))
        env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [d, os.environ.get("LD_LIBRARY_PATH")])))
        r = _import_in_child(module, env)
    if r.returncode != 0:
        raise ImportError(_last_line(r))
    return f"{module} imports (against the driver stub {stub})"


# NVIDIA names aarch64 servers SBSA (Arm's Server Base System Architecture): some of its aarch64 wheels carry a
# `..._sbsa` platform tag in their own WHEEL file while their file name says `..._aarch64`. uv's check reports such a
# wheel as "built for a different platform"; nvidia-cusparselt-cu13 0.8.1, which torch 2.13.0 pins exactly, is one
# (found by tests/arm64.sh: without this, every Spark's step 3 stopped at `uv pip check`).
DIFFERENT_PLATFORM = re.compile(r"The package `([^`]+)` was built for a different platform")


def wheel_platforms(name: str) -> list[str]:
    """The platform part of each tag in an installed distribution's WHEEL file."""
    try:
        text = md.distribution(name).read_text("WHEEL") or ""
    except md.PackageNotFoundError:
        return []
    return [tag.split("-")[-1] for tag in re.findall(r"^Tag: (\S+)", text, re.M)]


def pip_check_problems(output: str, machine: str, platforms=wheel_platforms) -> tuple[list[str], list[str]]:
    """(problems, notes) of a failed `uv pip check`'s output: every line that reports an incompatibility is a
    problem, except a wheel tagged only `*_sbsa` on an aarch64 machine, which is noted."""
    problems, notes = [], []
    for line in (x.strip() for x in output.splitlines()):
        if not line or line.startswith(("Using Python", "Checked ", "Found ")):
            continue
        m = DIFFERENT_PLATFORM.fullmatch(line)
        tags = platforms(m.group(1)) if m else []
        if m and machine == "aarch64" and tags and all(t.endswith("_sbsa") for t in tags):
            notes.append(f"{m.group(1)} is tagged {', '.join(tags)} (NVIDIA's name for aarch64): accepted")
        else:
            problems.append(line)
    return problems, notes


def pip_check() -> tuple[list[str], list[str]]:
    r = subprocess.run([sys.executable, "-m", "uv", "pip", "check", "--python", sys.executable], capture_output=True,
                       text=True)
    if r.returncode == 0:
        return [], ["uv pip check: every requirement met"]
    problems, notes = pip_check_problems(r.stdout + r.stderr, platform.machine())
    if r.returncode != 0 and not problems and not notes:
        problems.append(f"uv pip check exited {r.returncode}: {(r.stdout + r.stderr).strip()[-300:]}")
    return [f"uv pip check: {p}" for p in problems], notes


def check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    problems, facts = [], []
    import torch

    release = torch.__version__.split("+")[0]
    got = torch.__version__ if "+" in args.torch else release
    if got != args.torch or torch.version.cuda != args.cuda:
        problems.append(f"torch is {torch.__version__} (CUDA {torch.version.cuda}), expected {args.torch} with CUDA "
                        f"{args.cuda}: a CPU or other-CUDA torch was resolved")
    facts.append(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    for package in ("torch", "triton"):
        own = owners(package)
        if len(own) != 1:
            problems.append(f"{len(own)} distributions install the {package} package ({', '.join(own) or 'none'}): "
                            "exactly one may")
    for name, want in (("vllm", args.vllm), ("flashinfer", args.flashinfer), ("triton", args.triton)):
        try:
            mod = importlib.import_module(name)
            if mod.__version__ != want:
                problems.append(f"{name} is {mod.__version__}, expected {want}")
            facts.append(f"{name} {mod.__version__}")
        except Exception as e:  # report every failure, then fail once
            problems.append(f"import {name} failed: {e!r}")
    for module in filter(None, args.compiled_ops.split(",")):
        try:
            facts.append(import_compiled(module))
        except Exception as e:
            problems.append(f"import {module} failed: {e!r}")
    if args.pip_check:
        found, said = pip_check()
        problems += found
        facts += said
    path, why = ptxas_for_sm121()
    try:
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60).stdout
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
        if "sm_121a" not in out:
            problems.append(f"{path} ({why}) does not know sm_121a: Triton kernels would fail on the GB10; point "
                            "TRITON_PTXAS_PATH at CUDA 13's ptxas")
        facts.append(f"ptxas for sm_121: {path} ({why}; {version.strip().splitlines()[-1] if version else '?'})")
    except OSError as e:
        problems.append(f"no ptxas for sm_121 ({why}: {path or 'unset'}): {e}")
    return problems, facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    for flag in ("--vllm", "--torch", "--cuda", "--triton", "--flashinfer"):
        p.add_argument(flag, required=True)
    p.add_argument("--compiled-ops", default="vllm._C", help="comma-separated compiled modules to import")
    p.add_argument("--pip-check", action="store_true", help="also run `uv pip check` (pip_check_problems)")
    args = p.parse_args(argv)
    problems, facts = check(args)
    if problems:
        print("Dockerfile.base check failed:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("ok: " + "; ".join(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
