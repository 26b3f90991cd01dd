"""Collect the ptxas resource figures tests/test_kernels_compile.py prints (-s) into one result file.

    .venv/bin/python lab/compile_resources.py --out bench/results/kernels_compile_resources.json

Compile facts from this CPU machine (Triton's bundled ptxas and cuobjdump), not timings. The test asserts what
matters (shared memory within each GPU's limit, no spills on sm_121 at the shipped TurboQuant tiles); this keeps
the numbers the docs quote (docs/concepts/kernels.md, turboquant.md) reproducible.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import harness
import triton

ROOT = Path(__file__).resolve().parents[1]
FIGURES = r"(?P<registers>\d+) registers, (?P<spill>\d+) B spilled, (?P<shared>\d+) B shared$"
# "sm_90 turboquant_k4v4 _tq_decode_kernel: ..." and "sm_121 turboquant_k4v4 with the H200 verify tile _tq_decode_kernel: ..."
TQ_LINE = re.compile(r"^sm_(?P<arch>\d+) (?P<launch>turboquant_\w+(?: with [^_]+)?) (?P<kernel>_\w+): " + FIGURES)
# "sm_90 int8 M<=16 ('std', ...): _int8_mm_kernel 96 registers, ..."
LM_LINE = re.compile(r"^sm_(?P<arch>\d+) (?P<launch>int[48] M<=\d+ .+?): (?P<kernel>_\w+) " + FIGURES)


def parse(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.lstrip(".")  # pytest -q writes a test's progress dot before what the next test prints
        m = TQ_LINE.match(line) or LM_LINE.match(line)
        if m:
            rows.append({"arch": f"sm_{m['arch']}", "launch": m["launch"].strip(), "kernel": m["kernel"],
                         "registers": int(m["registers"]), "spill_bytes_per_thread": int(m["spill"]),
                         "shared_bytes": int(m["shared"])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--git-sha", help="the commit measured (default: this checkout's HEAD)")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_kernels_compile.py"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    if r.returncode != 0:
        sys.exit(f"compile_resources: {' '.join(cmd[2:])} failed (exit {r.returncode}):\n{r.stdout[-3000:]}")
    rows = parse(r.stdout)
    if not rows:
        sys.exit("compile_resources: the test printed no resource lines (was -s dropped?)")
    result = harness.header(harness.git_sha(args.git_sha), gpu=False) | dict(
        what="ptxas resource usage of every Triton kernel launch as the host code makes it (compile facts, not timings)",
        hardware="none: compiled on an x86-64 CPU VM with the ptxas/cuobjdump of the Triton wheel",
        triton=triton.__version__, rows=rows)
    harness.write_result(args.out, result)
    print(f"compile_resources: {len(rows)} launches -> {args.out}")


if __name__ == "__main__":
    main()
