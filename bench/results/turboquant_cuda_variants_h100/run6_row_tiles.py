"""Run 6 (H100, 2026-12-06, a record: README.md here): does an MTP-2 verify step go faster with its 48 query rows
over more CTAs? Needs the kernels of 748bcdd with run6_row_tiles.diff (decode_attention's `row_tiles`), run from the
checkout root with onespark installed from that tree:

    python3 bench/results/turboquant_cuda_variants_h100/run6_row_tiles.py [POOL_TOKENS] [OUT.json]

Checks each way against float64 first, then times the CUDA kernel as shipped (all rows in one CTA), with
row_tiles 1 and 2, and the step as 3 one-query pseudo-requests sharing the block table (row t sees
seq_len - (T-1-t) keys), beside the Triton kernel and folded BF16 flash, at max_seq_len = depth."""
import json
import sys

sys.path.insert(0, "bench/lab")
import harness  # noqa: E402
import torch  # noqa: E402
import turboquant as lab  # noqa: E402

from onespark.kernels import turboquant as tq  # noqa: E402
from onespark.kernels import turboquant_cuda as tq_cuda  # noqa: E402
from onespark.kernels import turboquant_triton as tt  # noqa: E402

T = 3
# correctness first, against float64
for lens in ([300, 77], [4096, 1001], [65, 3]):
    q, cache, lay, bt, seq_lens, ref = lab.reference_case("turboquant_k4v4", lens, T, spare=3)
    q, cache, bt, seq_lens = q.cuda().to(torch.bfloat16), cache.cuda(), bt.cuda(), seq_lens.cuda()
    B = len(lens)
    qp = q.transpose(1, 2).reshape(B * T, lab.HQ, 1, lab.D)
    btp = bt.repeat_interleave(T, 0)
    slp = seq_lens.repeat_interleave(T) - (T - 1 - torch.arange(T, device="cuda", dtype=torch.int32)).repeat(B)
    o = tq_cuda.decode_attention(qp, cache, lay, btp, slp, tq.rotation_seed(0), lab.SM_SCALE, max(lens))
    o = o.view(B, T, lab.HQ, lab.D).transpose(1, 2)
    for n in (1, 2):
        print("check", lens, "row_tiles", n, harness.rel_err(tq_cuda.decode_attention(q, cache, lay, bt, seq_lens, tq.rotation_seed(0), lab.SM_SCALE, max(lens), row_tiles=n).double().cpu(), ref))
    print("check", lens, "pseudo rel_err", harness.rel_err(o.double().cpu(), ref),
          "shipped", harness.rel_err(tq_cuda.decode_attention(q, cache, lay, bt, seq_lens, tq.rotation_seed(0), lab.SM_SCALE, max(lens)).double().cpu(), ref))

pools = lab.Pools(int(sys.argv[1]) if len(sys.argv) > 1 else 8 * 262144)
name = "turboquant_k4v4"
rows = []
for depth in (8192, 32768, 65536, 131072, 262144):
    for B in (1, 2, 4, 8):
        lay, cache = pools.tq_cache(name)
        tokens = B * depth
        copies = max(1, min(32, pools.max_tokens // tokens))
        nb_call = tokens // lab.PAGE
        g = torch.Generator(device="cuda").manual_seed(depth + B)
        tables = [(c * nb_call + torch.randperm(nb_call, device="cuda", generator=g).to(torch.int32)).view(B, depth // lab.PAGE) for c in range(copies)]
        seq_lens = torch.full((B,), depth, dtype=torch.int32, device="cuda")
        q = torch.randn(B, lab.HQ, T, lab.D, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty_like(q) for _ in range(copies)]
        seed = tq.rotation_seed(0)
        ptables = [t.repeat_interleave(T, 0) for t in tables]
        pseq = seq_lens.repeat_interleave(T) - (T - 1 - torch.arange(T, device="cuda", dtype=torch.int32)).repeat(B)
        qp = q.transpose(1, 2).reshape(B * T, lab.HQ, 1, lab.D).contiguous()
        pouts = [torch.empty_like(qp) for _ in range(copies)]
        def shipped():
            for c in range(copies):
                tq_cuda.decode_attention(q, cache, lay, tables[c], seq_lens, seed, lab.SM_SCALE, depth, out=outs[c])
        def triton():
            for c in range(copies):
                tt.decode_attention(q, cache, lay, tables[c], seq_lens, seed, lab.SM_SCALE, depth, out=outs[c])
        def pseudo_pre():  # tables, lengths and the query layout made outside the step (a backend could keep them)
            for c in range(copies):
                tq_cuda.decode_attention(qp, cache, lay, ptables[c], pseq, seed, lab.SM_SCALE, depth, out=pouts[c])
        def pseudo_full():  # everything inside the step: the table and length gathers, query and output copies
            for c in range(copies):
                bt = tables[c].repeat_interleave(T, 0)
                sl = seq_lens.repeat_interleave(T) - (T - 1 - torch.arange(T, device="cuda", dtype=torch.int32)).repeat(B)
                o = tq_cuda.decode_attention(q.transpose(1, 2).reshape(B * T, lab.HQ, 1, lab.D), cache, lay, bt, sl, seed,
                                             lab.SM_SCALE, depth)
                outs[c].copy_(o.view(B, T, lab.HQ, lab.D).transpose(1, 2))
        def tiles(n):
            def f():
                for c in range(copies):
                    tq_cuda.decode_attention(q, cache, lay, tables[c], seq_lens, seed, lab.SM_SCALE, depth, out=outs[c],
                                             row_tiles=n)
            return f
        r = dict(depth=depth, B=B, copies=copies)
        for k, fn in (("shipped", shipped), ("triton", triton), ("pseudo_pre", pseudo_pre), ("pseudo_full", pseudo_full),
                      ("rt1", tiles(1)), ("rt2", tiles(2))):
            r[k] = lab.graph_ms(fn) / copies * 1e3
        f = lab.bench_fa(pools, depth, T, B)["folded"]
        r["fold"] = f * 1e3 if f else None
        r["split_ship"] = tq_cuda.splits_for(B, 2, 48, depth); r["split_pseudo"] = tq_cuda.splits_for(B * T, 2, 16, depth)
        rows.append(r)
        print(json.dumps(r), flush=True)
print(f"{'depth':>7} {'B':>2} {'shipped':>8} {'triton':>8} {'ps_pre':>8} {'ps_full':>8} {'rt1':>8} {'rt2':>8} {'fold':>8}  splits")
for r in rows:
    f = r["fold"] or float("nan")
    print(f"{r['depth']:>7} {r['B']:>2} {r['shipped']:8.1f} {r['triton']:8.1f} {r['pseudo_pre']:8.1f} {r['pseudo_full']:8.1f} {r['rt1']:8.1f} {r['rt2']:8.1f} {f:8.1f}  "
          f"{r['split_ship']}/{r['split_pseudo']}  ratio ship {r['shipped']/f:.2f} rt1 {r['rt1']/f:.2f} rt2 {r['rt2']/f:.2f}")
json.dump(rows, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/pseudo.json", "w"), indent=1)
