"""What a cheaper 4-bit decode would cost in quality (CPU, float64): the shipped Lloyd-Max codebooks against
codebooks whose decode takes fewer integer operations per value, on the same coordinate law and attention data.

    python lab/turboquant_codebooks.py --out bench/results/turboquant_codebooks.json

The decode kernel spends 2.5 integer operations per 4-bit value on the Lloyd-Max table (PRMT lookups of
sign-magnitude codes: kernels/turboquant_triton._byte_asm; 5 with the ascending codes before) and was bound by that
work on an H200, not by bytes
(docs/concepts/turboquant.md). Candidates, each with the instruction count of the sequence that would decode
it (counted from the sequence, not measured):

  lloyd-max  the shipped table: 20 ops / 8 values (the PRMT sequence in turboquant_triton._byte_asm)
  fp8-e5m2   symmetric levels restricted to s x {e5m2 values}: the table holds one byte per magnitude, and an
             e5m2 byte shifted left by 8 is its fp16, so one PRMT looks up 4 values and two more spread them
             into fp16 pairs: ~8 ops / 4 values with sign-magnitude codes (an encode-side numbering change)
  fp8-e4m3   the same on the e4m3 grid (3 mantissa bits), but its fp16 needs cvt.f16x2.e4m3x2: ~8 ops / 4
  uniform    the MSE-best uniform grid: (code | 0x6400) is the fp16 1024 + code, so one LOP3 and one HSUB2 give
             two centred values: ~9 ops / 8 values (the Marlin INT4 sequence); the grid step joins the scale

The s of the fp8 grids is searched (the token scale absorbs it, so it costs nothing at decode). Reported per
candidate: the per-coordinate MSE on the rotated law, its ratio to Lloyd-Max, and the attention-output relative
error against unquantized float64 on lab/turboquant_quality.py's data (tq.structured_kv, mean over SEEDS)
with the candidate used for K and V.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import harness
import torch

from onespark.kernels import turboquant as tq

SM_SCALE = 1 / 16
# 4-bit only: 3-bit codes decode by an L1 gather per value today, and their planes would take other sequences
OPS_PER_VALUE = {"lloyd-max": 20 / 8, "fp8-e5m2": 8 / 4, "fp8-e4m3": 8 / 4, "uniform": 9 / 8}
SEEDS = (0, 1, 2, 3)  # attention data per kind: one seed's outlier error swings by tens of percent


def _fp_grid(mantissa_bits: int) -> torch.Tensor:
    """Positive values of a float format with this many mantissa bits, exponents wide enough for any s."""
    m = 1 + torch.arange(1 << mantissa_bits, dtype=torch.float64) / (1 << mantissa_bits)
    return torch.cat([m * 2.0**e for e in range(-12, 6)])


def _nearest(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    i = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    return torch.where((x - lo) <= (hi - x), lo, hi)


def grid_codebook(bits: int, mantissa_bits: int, steps: int = 64) -> tuple[torch.Tensor, float, float]:
    """Symmetric levels on s x (a float grid): projected Lloyd iteration for each s in [1, 2) (the grid repeats
    per octave, so that covers every s), the MSE-best kept. Returns (levels ascending, MSE, s)."""
    grid = _fp_grid(mantissa_bits)
    best = None
    for k in range(steps):
        s = 2.0 ** (k / steps)
        levels = tq.codebook(bits).levels.clone()
        for _ in range(200):
            mags = _nearest(levels[levels > 0] / s, grid) * s
            levels = torch.cat([-mags.flip(0), mags])
            bounds = (levels[1:] + levels[:-1]) / 2
            m0, m1, _ = tq._interval_moments(bounds)
            cent = m1 / m0
            new = _nearest(cent[cent > 0] / s, grid) * s
            new = torch.cat([-new.flip(0), new])
            if torch.equal(new, levels):
                break
            levels = new
        bounds = (levels[1:] + levels[:-1]) / 2
        mse = tq._mse(levels, bounds)
        if best is None or mse < best[1]:
            best = (levels, mse, s)
    return best


def roundtrip(x: torch.Tensor, r: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """tq.quantize then tq.dequantize with these levels (nearest level, the length kept), float64."""
    d = x.shape[-1]
    x = x.to(torch.float64)
    norm = x.norm(dim=-1)
    z = (x @ r.T) * (math.sqrt(d) / norm.clamp(min=1e-300))[..., None]
    c = levels[torch.searchsorted((levels[1:] + levels[:-1]) / 2, z.contiguous())]
    return (c * (norm / c.norm(dim=-1))[..., None]) @ r


def candidates(bits: int) -> dict[str, dict]:
    out = {"lloyd-max": dict(levels=tq.codebook(bits).levels, mse=tq.codebook(bits).mse)}
    for name, mb in (("fp8-e5m2", 2), ("fp8-e4m3", 3)):
        levels, mse, s = grid_codebook(bits, mb)
        out[name] = dict(levels=levels, mse=mse, grid_scale=s)
    u = tq._uniform_codebook(bits)
    out["uniform"] = dict(levels=u.levels, mse=u.mse, step=u.delta)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", default="bench/results/turboquant_codebooks.json")
    args = ap.parse_args(argv)
    t0 = time.time()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    r = tq.rotation(tq.rotation_seed(0), dtype=torch.float64)
    data = {kind: [tq.structured_kv(kind, seed=s) for s in SEEDS] for kind in ("random", "outlier", "neardup")}
    rows = []
    for bits in (4, 3):
        books = candidates(bits)
        ref_mse = books["lloyd-max"]["mse"]
        for name, b in books.items():
            err = {}
            for kind, sets in data.items():
                errs = []
                for k, v, q in sets:
                    ref = tq.attention_reference(q[:, None], k[:, None], v[:, None], SM_SCALE)
                    kh, vh = roundtrip(k, r, b["levels"]), roundtrip(v, r, b["levels"])
                    errs.append(harness.rel_err(
                        tq.attention_reference(q[:, None], kh[:, None], vh[:, None], SM_SCALE), ref))
                err[kind] = sum(errs) / len(errs)
            rows.append(dict(bits=bits, codebook=name, mse=b["mse"], mse_over_lloyd_max=b["mse"] / ref_mse,
                             decode_ops_per_value=OPS_PER_VALUE[name] if bits == 4 else None, attention_rel_err=err,
                             levels=[round(float(x), 6) for x in b["levels"]],
                             **{k: b[k] for k in ("grid_scale", "step") if k in b}))
    res = harness.header(gpu=False, argv=argv) | dict(torch=torch.__version__, head_dim=256, rows=rows,
                                                       wall_s=round(time.time() - t0, 1))
    harness.write_result(args.out, res)
    print("| bits | codebook | MSE | / Lloyd-Max | decode ops / value | attention rel. err (random / outlier / neardup) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        e = row["attention_rel_err"]
        ops = "-" if row["decode_ops_per_value"] is None else f"{row['decode_ops_per_value']:.2f}"
        print(f"| {row['bits']} | {row['codebook']} | {row['mse']:.5f} | {row['mse_over_lloyd_max']:.3f} | {ops} | {e['random']:.3f} / {e['outlier']:.3f} / {e['neardup']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
