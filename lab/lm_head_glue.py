"""The INT8 LM head as the vLLM plugin runs it, against F.linear on the BF16 weight (real shape).

    python lab/lm_head_glue.py --git-sha SHA [--out bench/results/lm_head_glue_h200.json]

What is timed, per M (tokens per logits call: 1 decode, 3 MTP-2 verify, 12 = 4 x 3 concurrent, 96 prefill
chunk / 32 x 3):
  bf16     torch.nn.functional.linear(x, w_bf16)          what vLLM's unquantized head runs on CUDA
  kernel   onespark.kernels.int8_gemv(x, w_int8, scale)   the bare kernel
  method   onespark.patches.int8_head.int8_logits(...)    exactly what Int8LMHeadMethod.apply calls: the
                                                          reshape to [T, K], the CUDA/CPU dispatch, the
                                                          kernel, the view back (vLLM-free, so no vLLM here)
each two ways: `eager` = median per call of back-to-back Python calls between CUDA events, which is how
vLLM 0.19.1 calls it (GPUModelRunner runs compute_logits outside the CUDA graph of the forward pass), so
host cost of the glue and the launch counts where the GPU waits for it; `graph` = median per call of
CUDA-graph replays (device time only); both harness.median_ms, 9 samples of --reps calls. Three interleaved
rounds per variant; the median round is reported. glue_us = method - kernel; kernel_spread_us = the kernel's
max - min over the rounds (a smaller glue_us is noise). Shape: N = 248,320 (vocab; a multiple of 64, so vLLM's
padding adds nothing at TP = 1) x K = 3,072. Weight N(0, 0.02^2) in BF16 (never zero), x N(0, 1);
x rotates over 8 buffers; the weights (763 MB INT8, 1,526 MB BF16) are 13x / 25x the H200's 60 MB L2.
Correctness: the method's logits vs a float64 reference of the same INT8 weight (rel. Frobenius error)
and top-1 agreement with the float64 logits of the BF16 weight.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import harness
import torch

from onespark.kernels import int8_gemv, int8_gemv_ref
from onespark.patches.int8_head import int8_logits, quantize_head

N, K = 248_320, 3_072
MS = [1, 3, 12, 96]
NBUF = 8
ROUNDS = 3


def _row(m: int, w, w_int8, scale, reps: int) -> dict:
    xs = [torch.randn(m, K, device="cuda").to(torch.bfloat16) for _ in range(NBUF)]
    fns = {
        "bf16": lambda i: torch.nn.functional.linear(xs[i], w),
        "kernel": lambda i: int8_gemv(xs[i], w_int8, scale),
        "method": lambda i: int8_logits(xs[i], w_int8, scale),
    }
    row = {"m": m}
    for mode in ("graph", "eager"):
        # ROUNDS interleaved rounds (bf16, kernel, method, ...): the median of the rounds is reported, and
        # the kernel's own spread across rounds says how small a glue difference is still noise.
        times = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                times[name].append(harness.median_ms(fn, nbuf=NBUF, calls=reps, samples=9, graph=mode == "graph"))
        for name, t in times.items():
            row[f"{name}_{mode}_ms"] = round(statistics.median(t), 5)
        row[f"glue_{mode}_us"] = round(1000 * (row[f"method_{mode}_ms"] - row[f"kernel_{mode}_ms"]), 2)
        row[f"kernel_spread_{mode}_us"] = round(1000 * (max(times["kernel"]) - min(times["kernel"])), 2)
        row[f"speedup_{mode}"] = round(row[f"bf16_{mode}_ms"] / row[f"method_{mode}_ms"], 3)
    x = xs[0]
    out = int8_logits(x, w_int8, scale)
    ref = int8_gemv_ref(x, w_int8, scale, acc_dtype=torch.float64, out_dtype=torch.float64)
    full = torch.nn.functional.linear(x.double(), w.double())
    row["method_rel_err"] = harness.rel_err(out, ref)
    row["top1_vs_bf16_weight"] = float((out.argmax(-1) == full.argmax(-1)).double().mean())
    row["method_gbps_graph"] = round((N * K + 4 * N + 2 * m * (K + N)) / row["method_graph_ms"] / 1e6, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--git-sha", required=True)
    ap.add_argument("--out", type=Path, default=harness.ROOT / "bench" / "results" / "lm_head_glue_h200.json")
    ap.add_argument("--reps", type=int, default=32, help="calls per timed sample (default 32)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("lm_head_glue: needs a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    w = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    w_int8, scale = quantize_head(w)
    rows = [_row(m, w, w_int8, scale, args.reps) for m in MS]
    result = harness.header(args.git_sha, argv=argv) | {
        "what": "INT8 LM head as Int8LMHeadMethod.apply runs it (onespark.patches.int8_head.int8_logits) vs F.linear BF16",
        "shape": {"n": N, "k": K, "dtype": "bfloat16"},
        "reps_per_sample": args.reps,
        "rows": rows,
    }
    harness.write_result(args.out, result)
    print(f"{result['device']}, torch {result['torch']}, N={N} K={K}; ms per call (median), graph | eager")
    print(f"{'M':>4} {'bf16':>8} {'kernel':>8} {'method':>8} {'glue us':>8} {'spread':>7} {'x bf16':>7} | "
          f"{'bf16':>8} {'method':>8} {'glue us':>8} {'x bf16':>7} {'relerr':>8} {'top1':>5}")
    for r in rows:
        print(f"{r['m']:>4} {r['bf16_graph_ms']:>8.4f} {r['kernel_graph_ms']:>8.4f} {r['method_graph_ms']:>8.4f} "
              f"{r['glue_graph_us']:>8.2f} {r['kernel_spread_graph_us']:>7.2f} {r['speedup_graph']:>7.3f} | {r['bf16_eager_ms']:>8.4f} "
              f"{r['method_eager_ms']:>8.4f} {r['glue_eager_us']:>8.2f} {r['speedup_eager']:>7.3f} "
              f"{r['method_rel_err']:>8.2e} {r['top1_vs_bf16_weight']:>5.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
