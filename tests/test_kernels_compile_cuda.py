"""The CUDA C++ TurboQuant decode kernel (kernels/turboquant_decode.cuh) built for the DGX Spark's GB10 (sm_121) and the
H200 (sm_90) without a GPU, with CUDA 13.0's nvcc from the pinned wheels of the test lane (tests/requirements.txt; the
images and the H200 have CUDA 13.0 too): every instantiation the binding launches compiles with no spill, at most 255
registers and shared memory within the target's per-block limit. Also the build CLI the v2-tq image runs, where there
is nothing to build with. Triton-independent, so it runs on the default track only (tests/test_kernels_compile.py,
which compiles the Triton kernels, runs on both)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests._cuda_cpu import HEADER_CANDIDATES, patched_header
from tests.test_kernels_compile import H200, SMEM_LIMIT, SPARK

# ONESPARK_TEST_NVCC: another toolkit's nvcc (tests/arm64_check.py runs this file inside an arm64 image with the
# image's own CUDA_HOME nvcc, the one Dockerfile.v2-tq builds the kernel with).
NVCC = Path(os.environ.get("ONESPARK_TEST_NVCC") or Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin" / "nvcc")
CONFIGS = [(m, s) for m in (1, 2, 3, 4) for s in (2, 3)]  # row tiles x pipeline stages: every launch the binding has


@pytest.mark.parametrize("arch", [SPARK, H200])
def test_the_cuda_decode_kernel_builds_for_the_spark_and_the_h200_without_spills(arch, tmp_path):
    """Every (row tiles, stages) instantiation compiles for the target with no spill, at most 255 registers, and
    shared memory within the target's per-block limit (a static_assert in the translation unit)."""
    if not NVCC.is_file():
        pytest.fail(f"no nvcc at {NVCC}: tests/requirements.txt installs nvidia-cuda-nvcc into the test venv")
    header = Path(__file__).resolve().parents[1] / "kernels" / "turboquant_decode.cuh"
    lines = [f'#include "{header}"']
    for m, s in CONFIGS:
        lines += [f"template __global__ void onespark_tq::decode_k4v4<{m}, {s}>(const onespark_tq::Params);",
                  f"static_assert(onespark_tq::smem_bytes<{m}, {s}>() <= {SMEM_LIMIT[arch]}, \"smem {m},{s}\");"]
    tu = tmp_path / "tu.cu"
    tu.write_text("\n".join(lines) + "\n")
    r = subprocess.run([str(NVCC), "-std=c++17", "-O3", "--use_fast_math", f"-arch=sm_{arch}", "-cubin",
                        "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(tu)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PATH": f"{NVCC.parent}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr[-3000:]
    found = re.findall(r"Compiling entry function '(\S+)' for 'sm_\d+'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                       r.stderr, re.S)
    assert len(found) == len(CONFIGS), r.stderr[-3000:]
    for name, spill, regs in found:
        print(f"sm_{arch} {name}: {regs} registers, {spill} B spilled")
        assert int(spill) == 0 and int(regs) <= 255, f"sm_{arch} {name}: {spill} B spilled, {regs} registers"


def test_the_build_cli_says_in_one_line_when_there_is_nothing_to_build_with(tmp_path):
    """`python -m onespark.kernels.turboquant_cuda --build` (Dockerfile.v2-tq) where torch finds no CUDA toolkit (the
    CI's demo image): one line, exit 0, nothing written; the v2-tq image's torch has CUDA and nvcc, so it builds."""
    env = {**os.environ, "CUDA_HOME": str(tmp_path / "no-cuda"), "ONESPARK_CUDA_BUILD": str(tmp_path / "build")}
    r = subprocess.run([sys.executable, "-m", "onespark.kernels.turboquant_cuda", "--build"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].endswith("the CUDA decode kernel is not built (Triton serves every step)")
    assert not (tmp_path / "build").exists()


def test_the_build_stamp_is_written_whole_by_writers_at_once(tmp_path):
    """Every process that builds stamps the build (xdist workers, servers starting together): writers at once
    each finish, the stamp is whole and current, no temp file is left behind."""
    from concurrent.futures import ThreadPoolExecutor

    from onespark.kernels import turboquant_cuda as tc

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: tc._stamp(tmp_path), range(200)))
    assert (tmp_path / "sources.sha256").read_text() == tc._digest() + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sources.sha256"]


LAB = Path(__file__).resolve().parents[1] / "lab"
DIAGNOSTICS = sorted((LAB / "turboquant_cuda_diagnostics").glob("*.diff"))
CANDIDATES = HEADER_CANDIDATES  # the CUDA kernel's candidates and the merge candidates that change its header


def _patched_build(diff: Path, tmp_path: Path, arch: str) -> str:
    """The header with `diff` applied (git apply, as lab/turboquant_cuda_variants.sh's patch -p1), compiled
    for sm_<arch> at 1 and 3 row tiles (q_len 1 and an MTP-2 verify step), 3 stages: ptxas's report."""
    if not NVCC.is_file():
        pytest.fail(f"no nvcc at {NVCC}: tests/requirements.txt installs nvidia-cuda-nvcc into the test venv")
    header = Path(__file__).resolve().parents[1] / "kernels" / "turboquant_decode.cuh"
    try:
        patched = patched_header([diff], tmp_path)
    except ValueError as e:
        pytest.fail(str(e))
    assert patched != header.read_text()
    tu = tmp_path / "tu.cu"
    tu.write_text(f'#include "kernels/{header.name}"\n'
                  + "".join(f"template __global__ void onespark_tq::decode_k4v4<{m}, 3>(const onespark_tq::Params);\n"
                            for m in (1, 3)))
    r = subprocess.run([str(NVCC), "-std=c++17", "-O3", "--use_fast_math", f"-arch=sm_{arch}", "-cubin", "-Xptxas",
                        "-v", "-o", str(tmp_path / "k.cubin"), str(tu)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PATH": f"{NVCC.parent}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


@pytest.mark.parametrize("diff", DIAGNOSTICS, ids=lambda p: p.stem)
def test_each_diagnostic_variant_applies_to_the_kernel_and_builds(diff, tmp_path):
    """lab/turboquant_cuda_diagnostics/*.diff (each leaves one stage of the kernel out, or does it twice, for
    lab/turboquant_cuda_variants.sh) still applies to the header as it is and compiles for sm_90: a GPU
    call spent on a diff that has rotted is lost."""
    _patched_build(diff, tmp_path, H200)


@pytest.mark.parametrize("arch", [SPARK, H200])
@pytest.mark.parametrize("diff", CANDIDATES, ids=lambda p: p.stem)
def test_each_candidate_variant_applies_and_builds_without_spills(diff, arch, tmp_path):
    """lab/turboquant_cuda_candidates/*.diff (changes made for the Spark's one CTA per SM, timed and checked
    against float64 by lab/turboquant_cuda_variants.sh) and the merge candidates' hunks for the header apply
    to it as it is and build for the Spark and the H200 with no spill at q_len 1 and 3: a candidate that spills
    would be timed on its spills."""
    assert CANDIDATES, "no candidate diff changes the header"
    found = re.findall(r"(\d+) bytes spill stores.*?Used (\d+) registers", _patched_build(diff, tmp_path, arch), re.S)
    assert len(found) == 2, "ptxas reported no registers"
    assert all(int(spill) == 0 for spill, _ in found), f"{diff.name} spills on sm_{arch}: {found}"
