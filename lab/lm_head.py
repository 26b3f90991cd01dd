"""LM-head kernel benchmark on the real shape: cuBLAS BF16 vs onespark INT8 vs INT4-draft.

    python lab/lm_head.py --git-sha SHA [--out bench/results/lm_head_<gpu>.json] [--m 1,3,16]
    python lab/lm_head.py --sweep [--m ...]        # time every candidate config instead

Shape: Qwen3.5-122B-A10B's head, N = 248,320 x K = 3,072. Inputs are random (never zero): weight
N(0, 0.02^2) in BF16, then quantized; x N(0.01, 1) in BF16. Each method is timed as a CUDA graph of
R calls over 4 rotated x/out buffers (2 at M > 1024), replayed 7 times: the median per call
(harness.median_ms; R fills ~25 ms). The
weights (>= 381 MB) are 6x the H200's 60 MB L2, so no call finds another's weight in cache.
Errors are ||out - ref|| / ||ref|| against float64 references on up to 64 rows; top-1 agreement
compares argmax over the vocabulary with the float64 logits of the BF16 weight on up to 256 rows.
Bandwidth counts each input read once and the output written once; copy_gbps is a 2 GiB
device-to-device copy counting bytes read + written (harness.copy_gbps: the practical ceiling).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import harness
import torch

from onespark.kernels import int4_gemv, int8_gemv, lm_head, quantize_int4_groups, quantize_int8_rows

N, K = 248_320, 3_072
MS = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 1024, 4096, 8192]
TARGETS = [(4, 2.0), (16, 1.8), (64, 1.3), (8192, 1.0)]  # (up to M, INT8 speed-up over cuBLAS BF16)
INT4_TARGET = (3, 3.5)

# Candidates for --sweep, per M bucket, in lm_head._CONFIGS's format.
SWEEP = {
    ("int8", 16): [("swap", 64, 16, 128, 1, 2, 4), ("swap", 64, 16, 128, 1, 2, 3), ("swap", 64, 16, 128, 1, 2, 5),
                   ("swap", 128, 16, 128, 1, 2, 4), ("swap", 128, 16, 128, 1, 2, 3), ("swap", 64, 16, 256, 1, 2, 3),
                   ("swap", 128, 16, 256, 1, 2, 3), ("swap", 64, 16, 64, 1, 2, 8)],
    ("int8", 32): [("swap", 64, 32, 128, 1, 2, 4), ("swap", 128, 32, 128, 1, 2, 4), ("swap", 64, 32, 128, 1, 2, 3),
                   ("swap", 64, 32, 256, 1, 2, 3)],
    ("int8", 64): [("swap", 128, 64, 128, 1, 4, 4), ("std", 256, 64, 64, 8, 4, 3), ("std", 128, 64, 64, 8, 4, 2),
                   ("std", 128, 64, 64, 8, 4, 3), ("std", 256, 64, 64, 8, 4, 2), ("std", 128, 64, 128, 8, 4, 2)],
    ("int8", 128): [("std", 128, 128, 64, 8, 4, 3), ("std", 128, 128, 64, 8, 4, 2), ("std", 64, 128, 64, 8, 4, 3),
                    ("std", 128, 128, 32, 8, 4, 4), ("std", 256, 128, 64, 8, 8, 2), ("cublas", 16384, 0, 0, 0, 0, 0)],
    ("int8", 512): [("std", 128, 128, 64, 16, 4, 3), ("std", 128, 128, 64, 16, 4, 2), ("std", 128, 256, 64, 16, 8, 3),
                    ("std", 256, 128, 64, 16, 8, 2), ("cublas", 4096, 0, 0, 0, 0, 0), ("cublas", 16384, 0, 0, 0, 0, 0)],
    ("int8", 8192): [("cublas", 4096, 0, 0, 0, 0, 0), ("cublas", 8192, 0, 0, 0, 0, 0), ("cublas", 2048, 0, 0, 0, 0, 0),
                     ("cublas", 32768, 0, 0, 0, 0, 0), ("std", 128, 128, 64, 16, 4, 3)],
    ("int4", 16): [("swap", 128, 16, 0, 1, 2, 4), ("swap", 64, 16, 0, 1, 2, 6), ("swap", 128, 16, 0, 1, 2, 3),
                   ("swap", 128, 16, 0, 1, 2, 6), ("swap", 256, 16, 0, 1, 4, 4)],
    ("int4", 32): [("swap", 64, 32, 0, 1, 2, 4), ("swap", 128, 32, 0, 1, 2, 4)],
    ("int4", 64): [("swap", 128, 64, 0, 1, 4, 4)],
    ("int4", 128): [("swap", 128, 128, 0, 8, 8, 3)],
    ("int4", 512): [("swap", 128, 256, 0, 16, 8, 3)],
    ("int4", 8192): [("swap", 128, 256, 0, 16, 8, 3)],
}  # fmt: skip
SWEEP_MS = [1, 4, 16, 32, 64, 128, 256, 1024, 8192]


def _target(m: int) -> float:
    return next(t for up_to, t in TARGETS if m <= up_to)


class Data:
    """The real-shape weights in every form, and float64 references on demand."""

    def __init__(self, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.gen = g
        self.w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        self.q8, self.s8 = quantize_int8_rows(self.w)
        self.q4, self.s4 = quantize_int4_groups(self.w)
        self.w64 = self.w.double()
        self.w8_64 = self.q8.double() * self.s8.double()[:, None]
        self.w4_64 = lm_head.dequantize_int4_groups(self.q4, self.s4, K).double()

    def x(self, m: int) -> torch.Tensor:
        return torch.randn(m, K, device="cuda", generator=self.gen).add_(0.01).to(torch.bfloat16)


def _bytes(kind: str, m: int) -> int:
    io = m * K * 2 + m * N * 2
    return io + {"bf16": 2 * N * K, "int8": N * K + 4 * N, "int4": N * K // 2 + 2 * N * (K // 128)}[kind]


def bench_row(d: Data, m: int) -> dict:
    nbuf = 4 if m <= 1024 else 2
    xs = [d.x(m) for _ in range(nbuf)]
    outs = {
        kind: [torch.empty(m, N, device="cuda", dtype=torch.bfloat16) for _ in range(nbuf)]
        for kind in ("bf16", "int8", "int4")
    }
    fns = {  # cuBLAS: x @ W.T is the GEMM F.linear runs (vLLM's unquantized head)
        "bf16": lambda i: torch.matmul(xs[i], d.w.T, out=outs["bf16"][i]),
        "int8": lambda i: int8_gemv(xs[i], d.q8, d.s8, out=outs["int8"][i]),
        "int4": lambda i: int4_gemv(xs[i], d.q4, d.s4, out=outs["int4"][i]),
    }
    ms = {k: harness.median_ms(f, nbuf=nbuf) for k, f in fns.items()}
    r = min(m, 64)
    x64 = xs[0][:r].double()
    ref8 = x64 @ d.w8_64.T
    ref4 = x64 @ d.w4_64.T
    refb = x64 @ d.w64.T
    top_x = torch.cat([x[:m] for x in xs])[:256]
    top_ref = (top_x.double() @ d.w64.T).argmax(1)

    def top1(kind):
        return float((torch.cat([o[:m] for o in outs[kind]])[:256].argmax(1) == top_ref).double().mean())

    row = {
        "m": m,
        "bf16_ms": round(ms["bf16"], 5),
        "int8_ms": round(ms["int8"], 5),
        "int4_ms": round(ms["int4"], 5),
        "int8_speedup": round(ms["bf16"] / ms["int8"], 3),
        "int4_speedup": round(ms["bf16"] / ms["int4"], 3),
        "bf16_gbps": round(_bytes("bf16", m) / ms["bf16"] / 1e6, 1),
        "int8_gbps": round(_bytes("int8", m) / ms["int8"] / 1e6, 1),
        "int4_gbps": round(_bytes("int4", m) / ms["int4"] / 1e6, 1),
        "int8_tflops": round(2 * m * N * K / ms["int8"] / 1e9, 1),
        "int8_rel_err": harness.rel_err(outs["int8"][0][:r], ref8),
        "int4_rel_err": harness.rel_err(outs["int4"][0][:r], ref4),
        "bf16_rel_err": harness.rel_err(outs["bf16"][0][:r], refb),
        "int8_vs_bf16_weight_rel_err": harness.rel_err(outs["int8"][0][:r], refb),
        "int8_top1": top1("int8"),
        "int4_top1": top1("int4"),
        "bf16_top1": top1("bf16"),
        "top1_rows": int(top_x.shape[0]),
        "int8_config": lm_head._chosen.get(("int8", lm_head._bucket(m), N, K, torch.bfloat16, xs[0].device)),
        "int4_config": lm_head._chosen.get(("int4", lm_head._bucket(m), N, K, torch.bfloat16, xs[0].device)),
    }
    return row


def _precompile(configs: list[tuple[str, tuple]]) -> None:
    """Compile every sweep config in parallel worker processes (Triton's disk cache is shared),
    so the timing process only loads them: ~40 configs in seconds instead of minutes."""
    import multiprocessing as mp

    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(len(configs), max(1, (os.cpu_count() or 2) - 2))) as pool:
        for kind, cfg, err in pool.imap_unordered(_compile_one, configs):
            if err:
                print(f"  precompile {kind} {cfg}: {err}", flush=True)
    print(f"precompiled {len(configs)} configs in {time.time() - t0:.0f}s", flush=True)


def _compile_one(item):
    kind, cfg = item
    try:
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, 256, device="cuda", dtype=torch.bfloat16)
        if kind == "int8":
            q, s = quantize_int8_rows(torch.randn(256, K, device="cuda"))
            lm_head._launch_int8(x, q, s, out, cfg)
        else:
            q, s = quantize_int4_groups(torch.randn(256, K, device="cuda"))
            lm_head._launch_int4(x, q, s, out, cfg)
        torch.cuda.synchronize()
        return kind, cfg, None
    except Exception as e:  # reported, and the config is skipped in the sweep
        return kind, cfg, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _config_ms(launch, xs, q, s, out, cfg) -> float:
    """ms per call of one explicit config (lm_head._launch_int8 / _launch_int4) over the buffers xs."""
    return harness.median_ms(lambda i: launch(xs[i], q, s, out, cfg), nbuf=len(xs))


def _sweep_m(d: Data, m: int) -> list[dict]:
    """Every SWEEP config of M's bucket, both kinds, against cuBLAS BF16 at the same M."""
    xs = [d.x(m) for _ in range(4 if m <= 1024 else 2)]
    out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
    bf16 = harness.median_ms(lambda i: torch.matmul(xs[i], d.w.T), nbuf=len(xs))
    r = min(m, 16)
    x64 = xs[0][:r].double()
    refs = {"int8": x64 @ d.w8_64.T, "int4": x64 @ d.w4_64.T}
    rows = []
    for kind in ("int8", "int4"):
        launch = lm_head._launch_int8 if kind == "int8" else lm_head._launch_int4
        q, s = (d.q8, d.s8) if kind == "int8" else (d.q4, d.s4)
        for cfg in SWEEP[(kind, lm_head._bucket(m))]:
            try:
                t = _config_ms(launch, xs, q, s, out, cfg)
                launch(xs[0], q, s, out, cfg)
                err = harness.rel_err(out[:r], refs[kind])
            except Exception as e:
                t, err = float("nan"), f"{type(e).__name__}"
            row = {"m": m, "kind": kind, "cfg": cfg, "ms": t, "bf16_ms": bf16, "speedup": bf16 / t, "rel_err": err,
                   "gbps": _bytes(kind, m) / t / 1e6}  # fmt: skip
            rows.append(row)
            print(
                f"M={m:5d} {kind} {str(cfg):36s} {t:8.4f} ms  x{bf16 / t:5.2f}  {row['gbps']:7.0f} GB/s  err {err}",
                flush=True,
            )
    return rows


def sweep(d: Data, ms: list[int]) -> list[dict]:
    buckets = {lm_head._bucket(m) for m in ms}
    todo = sorted({(kind, c) for (kind, b), cs in SWEEP.items() if b in buckets for c in cs})
    _precompile(todo)
    return [row for m in ms for row in _sweep_m(d, m)]


def _table(res: dict) -> str:
    lines = [
        f"{res['gpu']}  torch {res['torch']}  triton {res['triton']}  copy {res['copy_gbps']:.0f} GB/s  N={N} K={K}",
        f"{'M':>5} {'bf16 ms':>8} {'int8 ms':>8} {'x':>5} {'target':>6} {'GB/s':>6} {'int4 ms':>8} {'x':>5} "
        f"{'i8 err':>8} {'i4 top1':>7}",
    ]
    for r in res["rows"]:
        t = _target(r["m"])
        ok = "ok" if r["int8_speedup"] >= t else "MISS"
        lines.append(
            f"{r['m']:5d} {r['bf16_ms']:8.4f} {r['int8_ms']:8.4f} {r['int8_speedup']:5.2f} {t:4.1f}{ok:>4} "
            f"{r['int8_gbps']:6.0f} {r['int4_ms']:8.4f} {r['int4_speedup']:5.2f} {r['int8_rel_err']:8.1e} "
            f"{r['int4_top1']:7.3f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--m", default=None, help="comma-separated row counts (default: the full list)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/lm_head_<gpu>.json)")
    p.add_argument("--git-sha", default=os.environ.get("GIT_SHA", "unknown"))
    p.add_argument("--sweep", action="store_true", help="time every candidate config (tuning)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU: run it on the H200 (or the Spark)", file=sys.stderr)
        return 1
    ms = [int(v) for v in args.m.split(",")] if args.m else (SWEEP_MS if args.sweep else MS)
    d = Data()
    res = harness.header(args.git_sha, argv=argv) | {"shape": {"n": N, "k": K}}
    copies = harness.copy_gbps()
    res["copy_gbps"] = max(copies.values())
    res["copy_gbps_by_method"] = copies
    out = Path(args.out or f"bench/results/lm_head_{res['gpu']}{'_sweep' if args.sweep else ''}.json")
    if args.sweep:
        res["sweep"] = sweep(d, ms)
    else:
        res["rows"] = []
        buckets = {lm_head._bucket(m) for m in ms}
        _precompile([(kind, c) for (kind, b), cs in lm_head._CONFIGS.items() if b in buckets for c in cs])
        for m in ms:
            res["rows"].append(bench_row(d, m))
            torch.cuda.empty_cache()
            r = res["rows"][-1]
            print(f"M={m}: bf16 {r['bf16_ms']:.4f} int8 {r['int8_ms']:.4f} (x{r['int8_speedup']}) "
                  f"int4 {r['int4_ms']:.4f} (x{r['int4_speedup']})", flush=True)  # fmt: skip
    harness.write_result(out, res)
    if not args.sweep:
        print(_table(res))
        bad = [r["m"] for r in res["rows"] if not r["int8_rel_err"] < 1e-2 or not r["int4_rel_err"] < 1e-2]
        if bad:
            print(f"numerical error too large at M = {bad}", file=sys.stderr)
            return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
