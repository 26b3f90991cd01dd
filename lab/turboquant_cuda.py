"""TurboQuant K4V4 decode on a GPU: the CUDA C++ kernel (kernels/turboquant_decode.cuh: mma.sync, codes decoded into
mma fragments in registers) beside the shipped Triton kernel and BF16 flash with the GQA heads folded, one run.

    python lab/turboquant_cuda.py --out bench/results/turboquant_cuda_h200.json --git-sha SHA
    python lab/turboquant_cuda.py --mma-sync --out bench/results/turboquant_cuda_h200_mma_sync.json --git-sha SHA

--mma-sync: the Triton kernel as the DGX Spark runs it (every tl.dot an mma.sync, the Spark's tiles; see
turboquant_tiles.py), on this GPU: the CUDA kernel is the same code on both, so this ranks the two on the Spark's
instruction set (a ranking, not a Spark time).

First every case is checked against float64 attention on reference-encoded codes (`checks`: odd lengths, one split
and many, q_len 1 to 4); then decode is timed at 8K to 256K keys, batch 1 and 8, q_len 1 and 3 (an MTP-2 verify
step). Times: medians of CUDA-graph replays over disjoint cache copies (turboquant.py's bench_config / bench_fa).
Each case also times both kernels with the merge that loads R (turboquant_triton.MERGES["matrix"]: `triton_matrix_ms`,
`cuda_matrix_ms`) beside the default (MERGES["fwht"]), and the merge alone at each MERGE_SWEEP setting and the
default (`merge`); at batch 1 the CUDA kernel also at a half and a quarter of its split count (`cuda_by_splits`);
and both kernels on a server's split grid, max_seq_len = max_model_len (`triton_served_grid_ms`, `cuda_served_grid_ms`:
vLLM's CUDA graphs fix the grid from it, so below it a server runs other splits than the depth's own grid).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

MMA_SYNC = "--mma-sync" in sys.argv
if MMA_SYNC:  # before Triton compiles anything (as in turboquant_tiles.py): every tl.dot an mma.sync, as on sm_121
    os.environ["DISABLE_MMA_V3"] = "1"
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tq-mma-sync-")

import harness  # noqa: E402
import torch  # noqa: E402
import turboquant as lab  # noqa: E402

from onespark.kernels import turboquant as tq  # noqa: E402
from onespark.kernels import turboquant_cuda as tq_cuda  # noqa: E402
from onespark.kernels import turboquant_triton as tt  # noqa: E402

NAME = "turboquant_k4v4"
DEPTHS = (8192, 32768, 65536, 131072, 262144)
BATCHES = (1, 8)
VARIANTS = [dict(stages=3, waves=1), dict(stages=2, waves=1)]
DEFAULT = f"stages={tq_cuda.STAGES},waves=1"  # turboquant_cuda.decode_attention's defaults: the `cuda_ms` field
CHECKS = [  # (lens, q_len, num_splits)
    ([300, 77], 1, None), ([300, 77], 3, None), ([300, 77], 3, 1), ([300, 77], 2, 5), ([300, 77], 4, None),
    ([4096, 1001], 1, None), ([4096, 1001], 3, None), ([4096, 1001], 3, 64), ([65, 3], 3, 3), ([2, 129], 1, 7),
]


def check(lens, T, num_splits) -> dict:
    q, cache, lay, bt, seq_lens, ref = lab.reference_case(NAME, lens, T, spare=3)
    args = (q.cuda().to(torch.bfloat16), cache.cuda(), lay, bt.cuda(), seq_lens.cuda(), tq.rotation_seed(0), lab.SM_SCALE,
            max(lens))
    ours = [tq_cuda.decode_attention(*args, num_splits=num_splits, stages=st) for st in (2, 3)]
    triton = tt.decode_attention(*args, num_splits=num_splits)
    return dict(lens=lens, q_len=T, num_splits=num_splits, rel_err=max(harness.rel_err(o.double().cpu(), ref) for o in ours),
                triton_rel_err=harness.rel_err(triton.double().cpu(), ref))


# the merge alone, on the CUDA kernel's workspace for a case: (splits a load at most, warps, Hadamard transform)
MERGE_SWEEP = {f"{most}x{warps}{'_fwht' if fwht else ''}": (most, warps, fwht)
               for most in (16, 32, 64, 128) for warps in (4, 8) for fwht in (False, True)}


def cuda_splits(B, T, depth) -> int:
    """The CUDA kernel's split count for a case, as decode_attention picks it (one wave)."""
    return tq_cuda.splits_for(B, lab.HKV, lab.HQ // lab.HKV * T, depth)


def merge_alone(B, T, depth) -> dict:
    """ms per merge launch over a workspace of the size the CUDA kernel writes for this case (its split count), for
    each MERGE_SWEEP setting and the default ("default"); one workspace, read again each launch, as the merge reads
    the one the decode just wrote (in L2 where it fits)."""
    H, G, d = lab.HKV, lab.HQ // lab.HKV, lab.D
    splits = cuda_splits(B, T, depth)
    t = tt._tables(tq.PRESETS[NAME], tq.rotation_seed(0), torch.device("cuda"), d)
    rows = B * H * splits * G * T
    acc, ml = torch.randn(rows * d, device="cuda"), torch.randn(rows * 2, device="cuda")
    out = torch.empty(B, lab.HQ, T, d, device="cuda", dtype=torch.bfloat16)
    configs = {**MERGE_SWEEP, "default": None}
    return {name: harness.median_ms(lambda i, cfg=cfg: tt.merge(acc, ml, t, out, B, H, G, T, G * T, splits, config=cfg))
            for name, cfg in configs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", help="the result file (JSON); every run but --one writes one")
    ap.add_argument("--git-sha", default="unknown")
    ap.add_argument("--mma-sync", action="store_true",
                    help="the Triton kernel as the Spark runs it (mma.sync, its tiles; turboquant_tiles.py --mma-sync)")
    ap.add_argument("--unchecked", action="store_true",
                    help="time a diagnostic build that leaves a stage out (wrong output by design: "
                         "lab/turboquant_cuda_diagnostics/) without the float64 checks; the result says so")
    ap.add_argument("--one", metavar="DEPTH,BATCH,Q_LEN,IMPL",
                    help="only run that case a few times, untimed (IMPL cuda or triton): for a profiler such as ncu")
    args = ap.parse_args()
    if not args.one and not args.out:
        ap.error("--out is required (only --one writes nothing)")
    if args.one:
        depth, B, T, impl = args.one.split(",")
        pools = lab.Pools(max_tokens=int(B) * int(depth))
        lab.bench_config(pools, NAME, int(depth), int(T), int(B), copies_cap=1, **({"impl": "cuda"} if impl == "cuda" else {}))
        return 0
    if args.mma_sync:
        tt._capability = lambda device: (12, 1)  # the host code picks the Spark's tiles
    t0 = time.time()
    result = harness.header(args.git_sha)
    result.update(triton_code="the DGX Spark's (mma.sync, sm_121 tiles)" if args.mma_sync else "this GPU's", preset=NAME, baseline="BF16 flash (torch SDPA), the 16 query heads of a KV head folded into its rows",
                  checks=[], rows=[], errors=[])
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}", flush=True)
    tb = time.time()
    tq_cuda.module()
    result["build_s"] = time.time() - tb
    result["unchecked"] = args.unchecked
    for lens, T, ns in [] if args.unchecked else CHECKS:
        c = check(lens, T, ns)
        result["checks"].append(c)
        print(f"check {c}", flush=True)
        # bf16 queries: both kernels round the rotated query to fp16 and the probabilities to fp16 alike
        if not c["rel_err"] < min(5e-3, 1.02 * c["triton_rel_err"] + 1e-5):
            result["errors"].append(f"lens {lens} T={T} splits {ns}: rel err {c['rel_err']:.2e} against float64"
                                    f" (Triton {c['triton_rel_err']:.2e})")
    if result["errors"]:
        print(f"errors: {result['errors']}: nothing timed", flush=True)
    else:
        pools = lab.Pools(max_tokens=max(BATCHES) * max(DEPTHS))
        for depth in DEPTHS:
            for B in BATCHES:
                for T in (1, 3):
                    fold = lab.bench_fa(pools, depth, T, B)["folded"]
                    tri, copies = lab.bench_config(pools, NAME, depth, T, B)
                    row = dict(depth=depth, batch=B, q_len=T, triton_ms=tri, fa_bf16_folded_ms=fold,
                               triton_over_folded=tri / fold, copies=copies, cuda={})
                    for cfg in VARIANTS:
                        cu, _ = lab.bench_config(pools, NAME, depth, T, B, impl="cuda", **cfg)
                        row["cuda"][",".join(f"{k}={v}" for k, v in cfg.items())] = cu
                    best = min(row["cuda"], key=row["cuda"].get)
                    cu = row["cuda"][best]
                    row.update(cuda_ms=row["cuda"][DEFAULT], cuda_best=best, cuda_best_over_folded=cu / fold)
                    # both kernels again with the merge before (MERGES["matrix"]): the default merge side by side
                    row["triton_matrix_ms"], _ = lab.bench_config(pools, NAME, depth, T, B, merge_how="matrix")
                    row["cuda_matrix_ms"], _ = lab.bench_config(pools, NAME, depth, T, B, impl="cuda",
                                                                merge_how="matrix")
                    row["merge"] = merge_alone(B, T, depth)
                    # both kernels on a server's split grid (max_seq_len = max_model_len; turboquant.py's docstring)
                    grid = dict(max_len=lab.SERVED_MAX_LEN)
                    row["triton_served_grid_ms"] = lab.bench_config(pools, NAME, depth, T, B, **grid)[0]
                    row["cuda_served_grid_ms"] = lab.bench_config(pools, NAME, depth, T, B, impl="cuda", **grid)[0]
                    if B == 1:  # fewer, longer splits: less workspace and merge, less of the GPU filled
                        full = cuda_splits(B, T, depth)
                        row["cuda_by_splits"] = {n: lab.bench_config(pools, NAME, depth, T, B, impl="cuda",
                                                                     num_splits=n)[0]
                                                 for n in (full, full // 2, full // 4)}
                    result["rows"].append(row)
                    print(f"{depth:>6} B{B} T{T}  triton {tri / fold:.3f}  "
                          + "  ".join(f"{k} {v / fold:.3f}" for k, v in row["cuda"].items())
                          + f"  (x folded {fold * 1e3:.1f} us); on a server's grid: triton "
                          f"{row['triton_served_grid_ms'] / fold:.3f} cuda {row['cuda_served_grid_ms'] / fold:.3f}"
                          f"; merge before: triton "
                          f"{row['triton_matrix_ms'] / fold:.3f} cuda {row['cuda_matrix_ms'] / fold:.3f}; merge alone us "
                          + " ".join(f"{k} {v * 1e3:.1f}" for k, v in row["merge"].items())
                          + "".join(f"; cuda at {n} splits {v / fold:.3f}" for n, v in row.get("cuda_by_splits", {}).items()),
                          flush=True)
    result["wall_s"] = time.time() - t0
    harness.write_result(args.out, result)
    print(f"errors: {result['errors']}\nwrote {args.out} in {result['wall_s']:.0f} s")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
