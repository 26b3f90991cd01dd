"""The TurboQuant decode kernels' key loop as machine code: the shipped kernel, its decode-once choice both ways,
and the lab's transposed candidate.

    .venv/bin/python lab/turboquant_sass.py --out bench/results/turboquant_sass.json
    .venv/bin/python lab/turboquant_sass.py --arch 121 --out bench/results/turboquant_sass_sm121.json

sm_90 is the H200's (wgmma), sm_121 the DGX Spark's GB10 (mma.sync only); the host code picks each one's tiles.
Machine-code counts (`per_64_keys`) are sm_90 only: Triton 3.6.0 bundles CUDA 12.8's cuobjdump and nvdisasm,
which cannot decode sm_121a ("Cannot decode architecture 'SM121a'"). Every row also counts the loop in PTX
(`ptx_per_64_keys`, the same scaling: a thread's instructions are its warp's): before ptxas, so not issue slots,
but PRMT and mma map one to one, which is what shows decode duplicated across warps on either GPU.

Compiles each kernel as its host code launches it (tests/_aot.py: Triton's bundled ptxas, no GPU), disassembles
the cubin with the bundled cuobjdump and counts the instructions of the innermost loop (the largest backward
branch's body) by kind. `per_64_keys` is the loop's instructions x warps x 64 / keys per tile: the warp
instructions the SM issues for 64 keys of one KV head, comparable across tiles and warp counts. A static count,
not a timing: it says where decode work is duplicated across warps (PRMT, the 4-bit decode, at its minimum is
1,280 per 64 keys: 32,768 values x 10 PRMT per 8 values / 32 lanes) and where spills or shared-memory round
trips sit in the loop; lab/turboquant.py times the same tiles on the H200.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
import torch
import triton
import turboquant_swap

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_triton as tt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/_aot.py: the compile-for-a-GPU-that-is-not-here helper the tests use
from tests._aot import CUOBJDUMP, captured_launches, compile_for  # noqa: E402

KINDS = {"prmt": ("PRMT",), "mma": ("HMMA", "HGMMA"), "shared_store": ("STS",), "shared_load": ("LDS", "LDSM"),
         "global_load": ("LDG",), "spill_store": ("STL",), "spill_load": ("LDL",), "shuffle": ("SHFL",),
         "barrier": ("BAR",), "mufu": ("MUFU",), "fp32": ("FMUL", "FFMA", "FADD", "FMNMX")}
PTX_KINDS = {"prmt": ("prmt",), "mma": ("mma.sync", "wgmma.mma_async"), "shared_store": ("st.shared",),
             "shared_load": ("ld.shared", "ldmatrix"), "barrier": ("bar.sync", "barrier.sync")}
# (impl, q_len, keys per tile, warps): the shipped kernel at its tiles (None: decode_block_n / decode_num_warps)
# with its choices (shipped: decode_once's) and with the decoders pure or decoded once (ONCE) on every preset; the
# previous decoder (decoder="gather": L1 gathers from the codebook) at the tile 3-bit values had with it; the
# transposed candidate (turboquant_swap.py) at its tiles that compile without spills or nearly so on sm_90
TILES = [("shipped", 1, None, None), ("pure", 1, None, None), ("once", 1, None, None), ("gather", 1, 32, 4),
         ("swap", 1, 64, 4), ("shipped", 3, None, None), ("pure", 3, None, None), ("once", 3, None, None),
         ("gather", 3, 32, 4), ("swap", 3, 16, 4), ("swap", 3, 64, 8)]
CANDIDATES = {"swap": turboquant_swap.decode_attention_swap, "pure": functools.partial(tt.decode_attention, once=False),
              "once": functools.partial(tt.decode_attention, once=True),
              "gather": functools.partial(tt.decode_attention, decoder="gather")}
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def loop_body(sass: str) -> list[str]:
    """Opcodes of the largest loop: from a backward branch's target to the branch."""
    ins = [(int(a, 16), op.split(".")[0], rest) for a, op, rest in INSTRUCTION.findall(sass)]
    best: list[str] = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return best


def ptx_loop_body(ptx: str) -> list[str]:
    """PTX instruction lines of the largest loop: from a backward branch's label to the branch."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\$L__\w+):", line))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x.strip() for x in lines[labels[m.group(1)]:i + 1]]
            best = max(best, [x for x in body if x and not x.startswith(("$", "//", "."))], key=len)
    return best


def ptx_opcode(line: str) -> str:
    return re.sub(r"^@!?%p\d+\s+", "", line).split()[0]


def launch_of(impl: str, preset: str, T: int, block_n, num_warps):
    lay = tq.CacheLayout(tq.PRESETS[preset], num_kv_heads=2, page=16)
    args = (torch.randn(1, 32, T, 256, dtype=torch.bfloat16), lay.empty(64), lay, torch.zeros(1, 64, dtype=torch.int32),
            torch.tensor([1000], dtype=torch.int32), 7, 1 / 16, 1000)
    with captured_launches() as launches:
        if impl in CANDIDATES:
            CANDIDATES[impl](*args, block_n=block_n, num_warps=num_warps)
        else:
            tt.decode_attention(*args)
    return launches[0]  # the decode kernel (the merge follows)


def row(impl: str, preset: str, T: int, block_n, num_warps, arch: int = 90) -> dict:
    launch = launch_of(impl, preset, T, block_n, num_warps)
    c = compile_for(launch, arch, PRMT=impl != "gather")  # the host ran on CPU tensors: PRMT as on a GPU
    keys, warps = launch.kwargs["BLOCK_N"], launch.kwargs["num_warps"]
    scale = warps * 64 / keys
    ptx = [ptx_opcode(x) for x in ptx_loop_body(c.ptx)]
    out = dict(impl=impl, preset=preset, q_len=T, block_n=keys, num_warps=warps, registers=c.registers,
               spill_bytes_per_thread=c.spill_stack, shared_bytes=c.shared, loop_instructions=None, per_64_keys=None,
               ptx_per_64_keys={k: round(sum(o.startswith(kinds) for o in ptx) * scale) for k, kinds in PTX_KINDS.items()}
               | {"all": round(len(ptx) * scale)})
    if arch == 121:  # no disassembler for it here (module docstring)
        return out
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.cubin)
        f.flush()
        body = loop_body(subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout)
    return out | dict(loop_instructions=len(body),
                      per_64_keys={k: round(sum(body.count(o) for o in ops) * scale) for k, ops in KINDS.items()}
                      | {"all": round(len(body) * scale)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--presets", default=",".join(tq.PRESETS))
    p.add_argument("--arch", type=int, choices=(90, 121), default=90, help="sm_90 (H200) or sm_121 (GB10)")
    p.add_argument("--git-sha", help="the commit measured (default: git rev-parse HEAD)")
    a = p.parse_args(argv)
    tt._capability = lambda device: divmod(a.arch, 10)  # the host code picks that GPU's tiles
    rows = []
    for preset in a.presets.split(","):
        for impl, T, block_n, num_warps in TILES:
            rows.append(row(impl, preset, T, block_n, num_warps, a.arch))
            r = rows[-1]
            sass = r["per_64_keys"] and f"{r['per_64_keys']['all']} warp instructions, "
            print(f"sm_{a.arch} {preset} {impl:7s} q_len {T} {r['block_n']:3d} keys x {r['num_warps']} warps: "
                  f"{r['registers']} registers, {r['spill_bytes_per_thread']} B spilled; per 64 keys {sass or ''}"
                  f"PTX {r['ptx_per_64_keys']['all']} ({r['ptx_per_64_keys']['prmt']} prmt)", flush=True)
    harness.write_result(a.out, harness.header(a.git_sha, argv=argv, gpu=False) | dict(arch=f"sm_{a.arch}", triton=triton.__version__,
                                                                               rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
