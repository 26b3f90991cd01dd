"""Checks run INSIDE an arm64 image by tests/arm64.sh (under qemu-user emulation on an x86_64 host), with the image's
own Python: what can be checked of a Spark image without a GPU or a driver.

  python /src/tests/arm64_check.py CHECK [CHECK ...]      (the checkout mounted read-only at /src)

One JSON line per check on stdout: {"check", "ok", "seconds", "detail"}, ok null for a check that cannot run without
the GPU driver (the detail says why); the exit status is 0 only if no check failed. The checks (arm64_lane.py picks which run in which image):
  arch        this is aarch64, and torch is the pinned CUDA 13.0 build of it
  lock        every entry of the image's lock (/opt/onespark/vllm-lock.txt) that applies here is installed at its
              version, through the hash-checked uv step (INSTALLER uv), as an aarch64 or pure-Python wheel; what is
              installed beyond the lock is listed (pinned by version in the Dockerfiles, not by hash)
  base-check  docker/base-check.py again, as Dockerfile.base's last step ran it (one torch, one triton, the pins,
              vllm's compiled ops, Triton's ptxas for sm_121)
  modules     every compiled extension module in the vllm package imports; a module that links the driver's
              libcuda.so.1 (no build has a driver) is imported against the toolkit stub of the image, and the
              detail names each such module
  serve-help  `vllm serve --help` works
  plugin      vLLM's plugin loader activates onespark: "onespark plugin active on vLLM 0.32.0: ..."
  turboquant  python -m onespark.patches.turboquant_check (v2-tq)
  cuda-built  the CUDA C++ TurboQuant decode kernel that Dockerfile.v2-tq built is there, stamped for these
              sources, this torch and TORCH_CUDA_ARCH_LIST (v2-tq)
  kernels     Triton compiles the INT8 LM head's and TurboQuant's (K4V4) kernels for sm_121a with this image's Triton
              and the ptxas it picks, and the image's nvcc (CUDA_HOME) builds the CUDA decode kernel for sm_121a
              without spills: tests/test_kernels_compile.py (KERNELS) and tests/test_kernels_compile_cuda.py's
              sm_121 case, run by pytest installed for this check alone into /tmp (the runner, not the thing checked)
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOCK = Path("/opt/onespark/vllm-lock.txt")
STUB = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64", "stubs", "libcuda.so")
SRC = Path(__file__).resolve().parent.parent
PINS = {"vllm": "0.32.0", "torch": "2.13.0", "cuda": "13.0", "triton": "3.7.1", "flashinfer": "0.7.0.post1"}
PYTEST = ["pytest==8.4.2", "pytest-timeout==2.4.0"]  # tests/requirements.txt's
# The Triton compiles run here: v2-tq's default preset (K4V4) and the INT8 LM head's decode bucket (up to 16 rows: a
# decode step and an MTP-2 verify), every candidate config of it, for sm_121. Each takes tens of seconds under
# emulation; the other buckets and presets and the INT4 draft head compile for sm_121 in the CPU lane. `-k` applies to
# every collected test, so it names the CUDA spill case too (its file is given with the [121] id only).
KERNELS = "(sm121 and (turboquant_k4v4 or int8-M16)) or cuda_decode_kernel_builds_for_the_spark"


class Failed(Exception):
    """A check's failure, with the line that says what was found."""


def _run(argv: list[str], env: dict | None = None, timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries(text: str) -> list[str]:
    """The requirement lines of a uv lock (name==version [; marker]), hashes and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [line.split(" --hash")[0].strip() for line in joined.splitlines()
            if line and not line.startswith((" ", "#"))]


def check_arch() -> str:
    import torch

    found = (platform.machine(), torch.__version__.split("+")[0], torch.version.cuda)  # PyPI's aarch64 build: +cu130
    if found != ("aarch64", PINS["torch"], PINS["cuda"]):
        raise Failed(f"machine {found[0]}, torch {found[1]} (CUDA {found[2]}): expected aarch64, torch "
                     f"{PINS['torch']} (CUDA {PINS['cuda']})")
    return f"aarch64; torch {torch.__version__} built for CUDA {torch.version.cuda}"


def check_lock() -> str:
    from packaging.requirements import Requirement

    wanted = {}
    for line in lock_entries(LOCK.read_text()):
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate():
            wanted[_canon(req.name)] = str(next(iter(req.specifier)).version)
    installed = {_canon(d.metadata["Name"]): d for d in md.distributions()}
    problems, sbsa = [], []
    for name, version in sorted(wanted.items()):
        dist = installed.get(name)
        if dist is None:
            problems.append(f"{name}=={version} missing")
            continue
        if dist.version != version:
            problems.append(f"{name} is {dist.version}, the lock says {version}")
        installer = (dist.read_text("INSTALLER") or "").strip()
        if installer != "uv":
            problems.append(f"{name} installed by {installer or 'unknown'}, not the hash-checked uv step")
        tags = [t.split("-")[-1] for t in re.findall(r"^Tag: (\S+)", dist.read_text("WHEEL") or "", re.M)]
        if not tags or not all(t == "any" or t.endswith(("aarch64", "_sbsa")) for t in tags):
            problems.append(f"{name}: wheel tags {tags or 'none'}, not aarch64")
        elif any(t.endswith("_sbsa") for t in tags):
            sbsa.append(name)
    if problems:
        raise Failed("; ".join(problems))
    extra = sorted(f"{n}=={d.version}" for n, d in installed.items() if n not in wanted)
    return (f"{len(wanted)} lock entries installed for aarch64 through the hash-checked step (tagged sbsa, NVIDIA's "
            f"name for aarch64: {', '.join(sbsa) or 'none'}); beyond the lock (version-pinned): "
            f"{', '.join(extra) or 'nothing'}")


def check_base_check() -> str:
    r = _run([sys.executable, "/opt/onespark/base-check.py", "--vllm", PINS["vllm"], "--torch", PINS["torch"],
              "--cuda", PINS["cuda"], "--triton", PINS["triton"], "--flashinfer", PINS["flashinfer"],
              "--compiled-ops", "vllm._C_stable_libtorch,vllm._moe_C_stable_libtorch", "--pip-check"])
    out = (r.stdout + r.stderr).strip()
    if r.returncode != 0:
        raise Failed(out[-1500:])
    return " ".join(out.split())


def _module_name(path: Path, site: Path) -> str:
    rel = path.relative_to(site).as_posix()
    return re.sub(r"\.(abi3|cpython-[^.]+)?\.?so$", "", rel).rstrip(".").replace("/", ".")


def _needs_driver(path: Path) -> bool:
    r = _run(["readelf", "-d", str(path)])
    return "[libcuda.so.1]" in r.stdout


IMPORT_EACH = """
import importlib, json, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        print(json.dumps([name, ""]), flush=True)
    except Exception as e:
        print(json.dumps([name, f"{type(e).__name__}: {str(e)[:300]}"]), flush=True)
"""


def check_modules() -> str:
    import vllm

    site = Path(vllm.__file__).parent.parent
    found = sorted(p for p in Path(vllm.__file__).parent.rglob("*.so"))
    names = {_module_name(p, site): _needs_driver(p) for p in found}
    if not names:
        raise Failed(f"no compiled modules under {Path(vllm.__file__).parent}")
    if any(names.values()) and not STUB.is_file():
        raise Failed(f"modules link libcuda.so.1 and there is no driver stub at {STUB}")
    with tempfile.TemporaryDirectory() as d:
        os.symlink(STUB, Path(d, "libcuda.so.1"))
        ld = ":".join(x for x in (d, os.environ.get("LD_LIBRARY_PATH", "")) if x)
        r = _run([sys.executable, "-c", IMPORT_EACH, *names], env={"LD_LIBRARY_PATH": ld})
    results = dict(json.loads(line) for line in r.stdout.splitlines() if line.startswith("["))
    failed = {n: results.get(n, f"not reached (the child exited {r.returncode}: {r.stderr.strip()[-300:]})")
              for n in names if results.get(n) != ""}
    if failed:
        raise Failed("; ".join(f"{n}: {why}" for n, why in failed.items()))
    driver = [n for n, needs in names.items() if needs]
    return (f"{len(names)} modules import; {len(driver)} of them link the driver's libcuda.so.1 and were loaded "
            f"against the stub {STUB} ({', '.join(driver)}); the others: {', '.join(n for n in names if not names[n])}")


class NeedsDriver(Exception):
    """A check that cannot run without the GPU driver: what it needs, in one line (reported, never a pass)."""


def check_serve_help() -> str:
    r = _run(["vllm", "serve", "--help"])
    out = (r.stdout + r.stderr).strip()
    if r.returncode != 0 and "RuntimeError: Failed to infer device type" in out:
        # vLLM builds its argument defaults from DeviceConfig, which asks NVML for the GPU: with no driver the CUDA
        # wheel infers no device, so even --help needs the Spark's driver.
        raise NeedsDriver("vllm serve --help builds its defaults from the device vLLM infers through NVML (the "
                          "driver's libnvidia-ml.so.1): 'RuntimeError: Failed to infer device type' without one")
    if r.returncode != 0 or "--speculative-config" not in r.stdout:
        raise Failed(f"exit {r.returncode}: {out[-800:]}")
    return f"exit 0, {len(r.stdout.splitlines())} lines of help"


# vLLM's plugin loader, with the plugin's own logger printed here (the line the server logs at start-up), and
# whether the loader, not this script, called register().
PLUGIN = """
import importlib.metadata as md, logging, sys
log = logging.getLogger("vllm.onespark")
log.addHandler(logging.StreamHandler(sys.stdout)); log.setLevel(logging.INFO)
from vllm.plugins import load_general_plugins
load_general_plugins()
import onespark.patches as p
print("entry points:", [e.value for e in md.entry_points(group="vllm.general_plugins")], "called:", p._active is not None)
"""


def check_plugin() -> str:
    r = _run([sys.executable, "-c", PLUGIN])
    out = r.stdout + r.stderr
    line = next((x for x in out.splitlines() if "onespark plugin active on vLLM" in x), "")
    if (r.returncode != 0 or f"active on vLLM {PINS['vllm']}:" not in line
            or "'onespark.patches:register'" not in out or "called: True" not in out):
        raise Failed(f"exit {r.returncode}: {out.strip()[-800:]}")
    return line[line.index("onespark plugin"):] + " (called by vLLM's plugin loader)"


def check_turboquant() -> str:
    r = _run([sys.executable, "-m", "onespark.patches.turboquant_check"])
    if r.returncode != 0:
        raise Failed((r.stdout + r.stderr).strip()[-800:])
    return " ".join(r.stdout.split())[-400:]


def check_cuda_built() -> str:
    code = ("from onespark.kernels import turboquant_cuda as t; import os, sys; so = t._built(); "
            "print(so, os.environ.get('TORCH_CUDA_ARCH_LIST')); sys.exit(0 if so else 1)")
    r = _run([sys.executable, "-c", code])
    if r.returncode != 0:
        raise Failed(f"no fresh build in the image: {(r.stdout + r.stderr).strip()[-600:]}")
    so, arch = r.stdout.split()[-2:]
    return f"{so} ({Path(so).stat().st_size} bytes), stamped for these sources, this torch and arch list {arch}"


def check_kernels() -> str:
    with tempfile.TemporaryDirectory() as d:
        r = _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--target", d, *PYTEST])
        if r.returncode != 0:
            raise Failed(f"installing the test runner failed: {r.stderr.strip()[-400:]}")
        nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
        # --import-mode=append: the checkout goes last on sys.path, so `onespark` is the image's installed package
        # (the checkout's onespark/ has no kernels/: pyproject maps it in) and only `tests` comes from /src.
        argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--noconftest",
                "--import-mode=append", "-o", "addopts=", "--rootdir", str(SRC),
                f"{SRC}/tests/test_kernels_compile.py", "-k", KERNELS,
                f"{SRC}/tests/test_kernels_compile_cuda.py::test_the_cuda_decode_kernel_builds_for_the_spark_and_the_h200_without_spills[121]"]
        r = _run(argv, env={"PYTHONPATH": d, "ONESPARK_TEST_NVCC": str(nvcc),
                            "PYTHONDONTWRITEBYTECODE": "1"}, timeout=5400)
    out = r.stdout + r.stderr
    summary = next((x for x in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", x)), out[-300:])
    if r.returncode != 0:
        raise Failed(f"{summary}: {out.strip()[-1500:]}")
    spills = sorted(set(re.findall(r"sm_121 \S+: \d+ registers, \d+ B spilled", out)))
    if len(spills) != 8:  # one line per (row tiles, stages) launch: a deselected or silent spill case is no pass
        raise Failed(f"{summary}: the nvcc spill case printed {len(spills)} of 8 sm_121 instantiations")
    return f"{summary.strip('= ')} (nvcc {nvcc}); {'; '.join(spills[:8])}"


CHECKS = {"arch": check_arch, "lock": check_lock, "base-check": check_base_check, "modules": check_modules,
          "serve-help": check_serve_help, "plugin": check_plugin, "turboquant": check_turboquant,
          "cuda-built": check_cuda_built, "kernels": check_kernels}


def main(argv: list[str]) -> int:
    unknown = [a for a in argv if a not in CHECKS]
    if not argv or unknown:
        print(f"usage: arm64_check.py CHECK [CHECK ...], CHECK of {', '.join(CHECKS)} (got {unknown or 'none'})",
              file=sys.stderr)
        return 2
    ok = True
    for name in argv:
        t0 = time.monotonic()
        try:
            detail, passed = CHECKS[name](), True
        except NeedsDriver as e:  # not a pass: the result says it needs the Spark's driver, and why
            detail, passed = str(e), None
        except Failed as e:
            detail, passed = str(e), False
        except Exception as e:  # a check that crashed is a failed check, said in one line
            detail, passed = f"{type(e).__name__}: {e}", False
        ok &= passed is not False
        print(json.dumps({"check": name, "ok": passed, "seconds": round(time.monotonic() - t0, 1),
                          "detail": detail}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
