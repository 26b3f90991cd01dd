"""TurboQuant quality report (CPU, plain-torch reference codec): distortion per preset against the paper's
bounds, attention-output error against unquantized float64 on random and structured data, the needle test
at 32K / 128K / 256K keys, and the QJL residual stage measured against spending its bit on the MSE codebook.

    python lab/turboquant_quality.py --out bench/results/turboquant_quality.json

Writes the JSON (atomically) and prints a Markdown summary. About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import harness
import torch

from onespark.kernels import turboquant as tq

PAPER = math.sqrt(3) * math.pi / 2  # E|u - u_hat|^2 <= 2.72 * 4^-b for unit u (TurboQuant, Zandieh et al. 2025)
SM_SCALE = 1 / 16


def unit(n, seed, d=256):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def roundtrip(x, r, bits):
    c, s = tq.quantize(x, r, bits)
    return tq.dequantize(c, s, r, bits)


def distortion(bits, r, n=8000):
    u = unit(n, bits)
    y = torch.randn(n, 256, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    e = roundtrip(u, r, bits) - u
    ip = ((e * y).sum(-1) ** 2 / (y * y).sum(-1)).mean().item() * 256
    return dict(bits=bits, mse=(e * e).sum(-1).mean().item(), inner_product_mse_x_d=ip,
                paper_bound=PAPER * 4.0**-bits, codebook=("uniform" if tq.codebook(bits).delta else "lloyd-max"))


def qjl_vs_mse(r, n=8000, m=256):
    """Inner-product error at an equal bit budget: b-bit MSE codes vs (b-1)-bit MSE codes + 1-bit QJL
    sketch of the residual (sign(S e), |e| kept), the paper's TurboQuant_prod. Unit x, Gaussian y."""
    out = {}
    g = torch.Generator().manual_seed(7)
    S = torch.randn(m, 256, generator=g, dtype=torch.float64)
    for b in (3, 4):
        u = unit(n, 100 + b)
        y = torch.randn(n, 256, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        exact = (u * y).sum(-1)
        mse_only = (roundtrip(u, r, b) * y).sum(-1)
        base = roundtrip(u, r, b - 1)
        e = u - base
        qjl = (base * y).sum(-1) + math.sqrt(math.pi / 2) / m * e.norm(dim=-1) * (torch.sign(e @ S.T) * (y @ S.T)).sum(-1)
        yn = (y * y).sum(-1)
        out[f"{b}bit"] = dict(
            mse_codes_var=((mse_only - exact) ** 2 / yn).mean().item() * 256,
            mse_codes_bias=(mse_only - exact).mean().item(),
            qjl_prod_var=((qjl - exact) ** 2 / yn).mean().item() * 256,
            qjl_prod_bias=(qjl - exact).mean().item(),
        )
    return out


def attention_errors(r):
    rows = []
    for kind in ("random", "outlier", "neardup"):
        k, v, q = tq.structured_kv(kind)
        ref = tq.attention_reference(q[:, None], k[:, None], v[:, None], SM_SCALE)
        row = dict(data=kind, bf16=_attention_err(q, ref, k.bfloat16().double(), v.bfloat16().double()))
        for name, p in tq.PRESETS.items():
            row[name] = _attention_err(q, ref, roundtrip(k, r, p.k_bits), roundtrip(v, r, p.v_bits))
        rows.append(row)
    return rows


def _attention_err(q, ref, kh, vh):
    """Attention output on the decoded keys kh and values vh against ref, the unquantized output."""
    return harness.rel_err(tq.attention_reference(q[:, None], kh[:, None], vh[:, None], SM_SCALE), ref)


def needle(r):
    """Keys with 8 outlier channels (x10); a needle; 31+ distractors at cosine 0.95 to it; the query is the
    needle's direction. Top-1 over the decoded keys, and the margin (needle - best other) / |needle|."""
    rows = []
    for L in (32768, 131072, 262144):
        g = torch.Generator().manual_seed(L)
        k = torch.randn(L, 256, generator=g)
        k[:, :8] *= 10
        pos = int(torch.randint(0, L, (1,), generator=g))
        nd = torch.randn(256, generator=g)
        u = nd / nd.norm()
        near = torch.randint(0, L, (32,), generator=g)
        near = near[near != pos]
        noise = torch.randn(len(near), 256, generator=g)
        noise -= (noise @ u)[:, None] * u
        noise *= nd.norm() / noise.norm(dim=-1, keepdim=True)
        k[near] = 0.95 * nd + math.sqrt(1 - 0.95**2) * noise
        k[pos] = nd
        exact = k.double() @ u.double()
        by_bits = {}
        for name, p in tq.PRESETS.items():
            if p.k_bits not in by_bits:
                s = roundtrip(k, r, p.k_bits) @ u.double()
                others = torch.cat([s[:pos], s[pos + 1 :]])
                by_bits[p.k_bits] = dict(top1=int(s.argmax()) == pos, margin=float(s[pos] - others.max()) / float(nd.norm()))
            rows.append(dict(preset=name, keys=L, exact_top1=int(exact.argmax()) == pos, **by_bits[p.k_bits]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", default="bench/results/turboquant_quality.json")
    args = ap.parse_args(argv)
    t0 = time.time()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    r = tq.rotation(tq.rotation_seed(0), dtype=torch.float64)
    res = harness.header(gpu=False, argv=argv) | dict(torch=torch.__version__, head_dim=256,
               presets={n: dict(k_bits=p.k_bits, v_bits=p.v_bits, bytes_per_token_head=p.bytes_per_token_head()) for n, p in tq.PRESETS.items()})
    res["distortion"] = [distortion(b, r) for b in (3, 4, 8)]
    res["qjl"] = qjl_vs_mse(r)
    res["attention_rel_err"] = attention_errors(r)
    res["needle"] = needle(r)
    res["wall_s"] = time.time() - t0
    harness.write_result(args.out, res)

    print("| bits | codebook | MSE (unit vectors) | paper bound 2.72*4^-b | <y,e>^2 d/|y|^2 |")
    print("|---|---|---|---|---|")
    for d in res["distortion"]:
        print(f"| {d['bits']} | {d['codebook']} | {d['mse']:.5f} | {d['paper_bound']:.5f} | {d['inner_product_mse_x_d']:.5f} |")
    print("\n| data | BF16 | " + " | ".join(tq.PRESETS) + " |\n|---|---|" + "---|" * len(tq.PRESETS))
    for row in res["attention_rel_err"]:
        print(f"| {row['data']} | {row['bf16']:.4f} | " + " | ".join(f"{row[n]:.3f}" for n in tq.PRESETS) + " |")
    print("\n| preset | keys | top-1 | margin |\n|---|---|---|---|")
    for row in res["needle"]:
        print(f"| {row['preset']} | {row['keys']} | {row['top1']} | {row['margin']:.4f} |")
    print(f"\nQJL at equal bits (inner-product error x d): {json.dumps(res['qjl'])}")
    print(f"wrote {args.out} in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
