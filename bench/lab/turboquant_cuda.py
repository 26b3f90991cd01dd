"""TurboQuant K4V4 decode on a GPU: the CUDA C++ kernel (kernels/turboquant_decode.cuh: mma.sync, codes decoded into
mma fragments in registers) beside the shipped Triton kernel and BF16 flash with the GQA heads folded, one run.

    python bench/lab/turboquant_cuda.py --out bench/results/turboquant_cuda_h200.json --git-sha SHA

First every case is checked against float64 attention on reference-encoded codes (`checks`: odd lengths, one split
and many, q_len 1 to 4); then decode is timed at 32K to 256K keys, batch 1 and 8, q_len 1 and 3 (an MTP-2 verify
step). Times: medians of CUDA-graph replays over disjoint cache copies (turboquant.py's bench_config / bench_fa).
"""

from __future__ import annotations

import argparse
import sys
import time

import harness
import torch
import turboquant as lab

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_cuda as tq_cuda
from onespark.kernels import turboquant_triton as tt

NAME = "turboquant_k4v4"
DEPTHS = (32768, 65536, 131072, 262144)
BATCHES = (1, 8)
CHECKS = [  # (lens, q_len, num_splits)
    ([300, 77], 1, None), ([300, 77], 3, None), ([300, 77], 3, 1), ([300, 77], 2, 5), ([300, 77], 4, None),
    ([4096, 1001], 1, None), ([4096, 1001], 3, None), ([4096, 1001], 3, 64), ([65, 3], 3, 3), ([2, 129], 1, 7),
]


def check(lens, T, num_splits) -> dict:
    lay = tq.CacheLayout(tq.PRESETS[NAME], num_kv_heads=lab.HKV, page=lab.PAGE)
    nb = sum(-(-n // lab.PAGE) for n in lens) + 3
    bt = lab.scattered_table(lens, nb, torch.Generator().manual_seed(1))
    cache = lay.empty(nb)
    r = tq.rotation(tq.rotation_seed(0))
    g = torch.Generator().manual_seed(2)
    for b, n in enumerate(lens):
        tq.encode_reference(torch.randn(n, lab.HKV, lab.D, generator=g) * 2, torch.randn(n, lab.HKV, lab.D, generator=g),
                            tq.seq_slots(bt[b], n, lab.PAGE), cache, lay, r)
    q = torch.randn(len(lens), lab.HQ, T, lab.D, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = tq.decode_attention_reference(q, cache, lay, bt, seq_lens, r, lab.SM_SCALE)
    args = (q.cuda().to(torch.bfloat16), cache.cuda(), lay, bt.cuda(), seq_lens.cuda(), tq.rotation_seed(0), lab.SM_SCALE,
            max(lens))
    ours = tq_cuda.decode_attention(*args, num_splits=num_splits)
    triton = tt.decode_attention(*args, num_splits=num_splits)
    return dict(lens=lens, q_len=T, num_splits=num_splits, rel_err=harness.rel_err(ours.double().cpu(), ref),
                triton_rel_err=harness.rel_err(triton.double().cpu(), ref))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-sha", default="unknown")
    args = ap.parse_args()
    t0 = time.time()
    result = harness.header(args.git_sha)
    result.update(preset=NAME, baseline="BF16 flash (torch SDPA), the 16 query heads of a KV head folded into its rows",
                  checks=[], rows=[], errors=[])
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}", flush=True)
    tb = time.time()
    tq_cuda.module()
    result["build_s"] = time.time() - tb
    for lens, T, ns in CHECKS:
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
                    cu, _ = lab.bench_config(pools, NAME, depth, T, B, impl="cuda")
                    result["rows"].append(dict(depth=depth, batch=B, q_len=T, triton_ms=tri, cuda_ms=cu,
                                               fa_bf16_folded_ms=fold, cuda_over_folded=cu / fold,
                                               triton_over_folded=tri / fold, cuda_over_triton=cu / tri, copies=copies))
                    print(f"{depth:>6} B{B} T{T}  triton {tri * 1e3:8.1f} us  cuda {cu * 1e3:8.1f} us  fold "
                          f"{fold * 1e3:8.1f} us   cuda/fold {cu / fold:.3f}  triton/fold {tri / fold:.3f}", flush=True)
    result["wall_s"] = time.time() - t0
    harness.write_result(args.out, result)
    print(f"errors: {result['errors']}\nwrote {args.out} in {result['wall_s']:.0f} s")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
