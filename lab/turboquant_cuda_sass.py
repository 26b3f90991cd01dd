"""The CUDA decode kernel's key loop as sm_90 machine code: the shipped header and its candidate diffs side by side.

    .venv/bin/python lab/turboquant_cuda_sass.py --out bench/results/turboquant_cuda_sass.json \
        base lab/turboquant_cuda_candidates/occ1.diff

Each argument is `base` (kernels/turboquant_decode.cuh) or a diff against it (`git apply`; A.diff+B.diff applies
both in order), as lab/turboquant_cuda_variants.sh takes them on a GPU. Compiled here, without a GPU, with the
test lane's pinned nvcc (tests/test_kernels_compile_cuda.NVCC) and the flags of the real build
(kernels/turboquant_cuda.py: -O3 --use_fast_math), disassembled with Triton's bundled cuobjdump, and the loop over
64-key steps (the largest backward branch) counted by kind, per warp: `loop`. A kernel with branches that most
steps skip (the mask, taken in a split's last steps only; the accumulator rescale, taken when a row's maximum grows)
is also compiled with them removed (`common`, the instructions a step in the middle of a split issues); a source
without them has `common` = `loop`. Static counts, not timings: lab/turboquant_cuda_variants.sh times.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
from turboquant_sass import KINDS, loop_body

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests._aot import CUOBJDUMP  # noqa: E402
from tests._cuda_cpu import patched_header  # noqa: E402
from tests.test_kernels_compile_cuda import NVCC  # noqa: E402

CONFIGS = [(1, 3), (3, 3), (1, 2), (3, 2)]  # (row tiles, stages): q_len 1 and an MTP-2 verify step (48 rows)
# The rarely taken branches, as the candidates write them (whole lines of source): removed for `common`.
RARE = {"    const bool edge = n0 + TILE > min(end, L - p.T + 1);": "    const bool edge = false;",
        "    if (__any_sync(0xffffffffu, grew)) {": "    if (false) {"}


def source(arg: str, work: Path) -> str:
    try:
        return patched_header([] if arg == "base" else arg.split("+"), work)
    except ValueError as e:
        raise SystemExit(f"turboquant_cuda_sass: {e}") from None


def counts(text: str, work: Path) -> dict:
    """{"M,STAGES": {"all": n, kind: n, ...}} for the loop of each configuration, per warp."""
    header = work / "k.cuh"
    header.write_text(text)
    lines = [f'#include "{header}"'] + [f"template __global__ void onespark_tq::decode_k4v4<{m}, {s}>"
                                         f"(const onespark_tq::Params);" for m, s in CONFIGS]
    (work / "tu.cu").write_text("\n".join(lines) + "\n")
    subprocess.run([str(NVCC), "-std=c++17", "-O3", "--use_fast_math", "-arch=sm_90", "-cubin", "-o",
                    str(work / "k.cubin"), str(work / "tu.cu")], check=True, capture_output=True, text=True)
    sass = subprocess.run([str(CUOBJDUMP), "-sass", str(work / "k.cubin")], check=True, capture_output=True,
                          text=True).stdout
    out = {}
    for function in sass.split("Function : ")[1:]:
        name = function.split()[0]
        m, s = (int(x) for x in name.split("decode_k4v4ILi")[1].split("EEEv")[0].split("ELi"))
        body = loop_body(function)
        tally = collections.Counter(body)
        out[f"{m},{s}"] = {"all": len(body)} | {k: sum(tally[o] for o in ops) for k, ops in KINDS.items()}
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("variants", nargs="+", help="base, a diff against the header, or diffs joined by +")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--git-sha", help="the commit measured (default: git rev-parse HEAD)")
    a = p.parse_args(argv)
    if not NVCC.is_file():
        raise SystemExit(f"turboquant_cuda_sass: no nvcc at {NVCC}: build the test venv (tests/run.sh --collect-only -q)")
    rows = []
    for arg in a.variants:
        with tempfile.TemporaryDirectory() as d:
            text = source(arg, Path(d))
            common = text
            for old, new in RARE.items():
                common = common.replace(old, new)
            loop = counts(text, Path(d))
            row = dict(variant=arg, loop=loop, common=loop if common == text else counts(common, Path(d)))
        rows.append(row)
        for cfg, c in row["common"].items():
            m, s = cfg.split(",")
            print(f"{arg}: q_len {1 if m == '1' else 3} ({m} row tiles), {s} stages: loop {row['loop'][cfg]['all']}, "
                  f"common path {c['all']} instructions per warp and 64 keys ({c['prmt']} PRMT, {c['mma']} HMMA)",
                  flush=True)
    nvcc = next(x for x in subprocess.run([str(NVCC), "--version"], capture_output=True, text=True).stdout.splitlines()
                if "release" in x)
    harness.write_result(a.out, harness.header(a.git_sha, argv=argv, gpu=False)
                         | dict(arch="sm_90", nvcc=nvcc, flags="-std=c++17 -O3 --use_fast_math", rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
