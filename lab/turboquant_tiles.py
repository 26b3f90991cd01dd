"""TurboQuant decode tiles on a GPU: the shipped tile beside the row-tile and lazy-rescale candidates, on the
H200's own code (wgmma) and on the DGX Spark's (mma.sync), against BF16 flash with the GQA heads folded.

    python lab/turboquant_tiles.py --out bench/results/turboquant_tiles_h200.json --git-sha SHA
    python lab/turboquant_tiles.py --mma-sync --out bench/results/turboquant_tiles_h200_mma_sync.json --git-sha SHA

--mma-sync times the Spark's code on the H200: Triton's DISABLE_MMA_V3=1 (read at compile time, part of its
cache key) makes every tl.dot an mma.sync, as on sm_121, which has no wgmma, and the host code is told the GPU is
sm_121 so that it picks the Spark's tiles (decode_block_n, decode_num_warps, decode_once). The result records
how many of the compiled decode kernels hold wgmma (must be 0). This is the Spark's instruction stream on an
H200's SMs, 16x its bandwidth per SM cycle: a ranking of tiles where decode work binds, not a Spark time.

Candidates (decode_attention keywords; {} = the shipped choice for that GPU):
  * block_m: query rows per tile below all G x T rows of a KV head (48 at an MTP-2 verify step): the rows in
    tiles of 16 or 32, one program each, every program reading the KV head's codes (L2 serves the repeats).
    On mma.sync the 64-row verify tile puts its 4 warps over the rows, so each warp decodes every key (4x
    the decode); 16-row tiles decode each key once per program (3x) with no padded rows.
  * lazy: the conditional rescale (turboquant_triton._attend_tile).
Each candidate is first checked against float64 attention on reference-encoded codes (`checks`).
Times: medians of CUDA-graph replays over disjoint cache copies (turboquant.py's bench_config / bench_fa).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

MMA_SYNC = "--mma-sync" in sys.argv
if MMA_SYNC:  # before Triton compiles anything; a fresh cache makes the wgmma count below this run's own
    os.environ["DISABLE_MMA_V3"] = "1"
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tq-mma-sync-")

import harness  # noqa: E402
import turboquant as lab  # noqa: E402

from onespark.kernels import turboquant as tq  # noqa: E402
from onespark.kernels import turboquant_triton as tt  # noqa: E402

SPARK = (12, 1)
DEPTHS = (32768, 262144)
BATCHES = (1, 8)
# (q_len, keywords) per code path; the shipped choice first
CANDIDATES = {
    "wgmma": [(1, {}), (1, dict(lazy=True)),
              (3, {}), (3, dict(lazy=True)), (3, dict(block_m=32)), (3, dict(block_m=16, block_n=64, num_warps=2))],
    "mma_sync": [(1, {}), (1, dict(once=True)), (1, dict(block_n=64, num_warps=2)), (1, dict(lazy=True)),
                 (3, {}), (3, dict(once=True)), (3, dict(block_m=16, block_n=32, num_warps=2)),
                 (3, dict(block_m=16, block_n=32, num_warps=4)), (3, dict(block_m=16, block_n=16, num_warps=1)),
                 (3, dict(block_m=32, block_n=16, num_warps=2)), (3, dict(block_m=16, block_n=16, num_warps=2))],
}
PRESETS = ("turboquant_k4v4", "turboquant_k4v3", "turboquant_k8v4")


def check(name: str, T: int, cfg: dict) -> float:
    """Relative error against float64 attention on reference-encoded codes: 2 requests, 300 and 77 keys."""
    lens = [300, 77]
    q, cache, lay, bt, seq_lens, ref = lab.reference_case(name, lens, T)
    out = tt.decode_attention(q.cuda().half(), cache.cuda(), lay, bt.cuda(), seq_lens.cuda(), tq.rotation_seed(0),
                              lab.SM_SCALE, max(lens), **cfg)
    return harness.rel_err(out.double().cpu(), ref)


def wgmma_kernels() -> tuple[int, int]:
    """(decode kernels compiled in this run's Triton cache, those whose PTX holds wgmma)."""
    ptx = [p for p in Path(os.environ["TRITON_CACHE_DIR"]).rglob("_tq_decode_kernel.ptx")]
    return len(ptx), sum("wgmma" in p.read_text() for p in ptx)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-sha", default="unknown")
    ap.add_argument("--mma-sync", action="store_true", help="the Spark's code (mma.sync, its tiles) on this GPU")
    args = ap.parse_args()
    path = "mma_sync" if args.mma_sync else "wgmma"
    if args.mma_sync:
        tt._capability = lambda device: SPARK  # the host code picks the Spark's tiles
    t0 = time.time()
    result = harness.header(args.git_sha)
    result.update(code_path=path, capability_seen_by_host=list(SPARK) if args.mma_sync else None,
                  candidates=[dict(q_len=T, cfg=c) for T, c in CANDIDATES[path]], checks=[], rows=[], errors=[])
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}, code path {path}", flush=True)
    for name in PRESETS:
        for T, cfg in CANDIDATES[path]:
            try:
                err = check(name, T, cfg)
            except Exception as e:  # a tile this GPU cannot run: say so, time nothing for it
                result["errors"].append(f"{name} T={T} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                print(result["errors"][-1], flush=True)
                continue
            result["checks"].append(dict(preset=name, q_len=T, cfg=cfg, rel_err=err))
            if not err < 3e-3:
                result["errors"].append(f"{name} T={T} {cfg}: rel err {err:.2e} against float64")
    pools = lab.Pools(max_tokens=max(BATCHES) * max(DEPTHS))
    for depth in DEPTHS:
        for B in BATCHES:
            fa = lab.bench_fa(pools, depth, 1, B), lab.bench_fa(pools, depth, 3, B)
            for name in PRESETS:
                for T, cfg in CANDIDATES[path]:
                    if any(c["preset"] == name and c["q_len"] == T and c["cfg"] == cfg for c in result["checks"]):
                        ms, copies = lab.bench_config(pools, name, depth, T, B, **dict(cfg))
                        fold = fa[T > 1]["folded"]
                        result["rows"].append(dict(preset=name, depth=depth, batch=B, q_len=T, cfg=cfg, tq_ms=ms,
                                                   fa_bf16_folded_ms=fold, tq_over_folded=ms / fold, copies=copies))
                        print(f"{name[11:]} {depth:>6} B{B} T{T} {str(cfg):<48} {ms * 1000:8.1f} us  fold"
                              f" {fold * 1000:7.1f}  {ms / fold:.3f}", flush=True)
    if args.mma_sync:
        result["decode_kernels_compiled"], result["decode_kernels_with_wgmma"] = wgmma_kernels()
        if result["decode_kernels_with_wgmma"] or not result["decode_kernels_compiled"]:
            result["errors"].append(f"wgmma in {result['decode_kernels_with_wgmma']} of "
                                    f"{result['decode_kernels_compiled']} decode kernels: not the Spark's code")
    result["wall_s"] = time.time() - t0
    harness.write_result(args.out, result)
    print(f"errors: {result['errors']}\nwrote {args.out} in {result['wall_s']:.0f} s")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
