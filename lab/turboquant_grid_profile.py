"""Where the CUDA decode kernel's time goes on a server's split grid (max_seq_len = max_model_len) against the bench's
own grid, at batch 1: each kernel of a decode call (the query rotation, the decode, the merge) timed by the CUDA
profiler, and the call as a whole by CUDA-graph replays, for four grids that take the difference apart:

  own        the depth's own split count and block table (the bench's decode tables)
  table      the own split count, the block table padded to max_model_len (a server's table)
  splits     the server's split count, the table unpadded
  server     both, as a vLLM server's CUDA graph runs it

    python lab/turboquant_grid_profile.py --out OUT.json [--git-sha SHA]

Needs a GPU and the CUDA kernel's build (ONESPARK_CUDA_BUILD); writes one JSON and prints one table.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import harness
import torch
import turboquant as lab

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_cuda as tq_cuda

NAME = "turboquant_k4v4"
CASES = [(8192, 1), (8192, 3), (32768, 1), (32768, 3), (65536, 1), (65536, 3)]
CALLS = 32  # disjoint cache copies per profiled pass, as bench_config's copies


def grids(depth: int, T: int):
    rows = (lab.HQ // lab.HKV) * T
    own = tq_cuda.splits_for(1, lab.HKV, rows, depth)
    server = tq_cuda.splits_for(1, lab.HKV, rows, lab.SERVED_MAX_LEN)
    return {"own": (depth, own), "table": (lab.SERVED_MAX_LEN, own), "splits": (depth, server),
            "server": (lab.SERVED_MAX_LEN, server)}


def calls(pools, depth: int, T: int, max_len: int, splits: int):
    """CALLS decode calls of one request of `depth` keys, each over its own copy of the cache."""
    lay, cache = pools.tq_cache(NAME)
    nb = depth // lab.PAGE
    g = torch.Generator(device="cuda").manual_seed(depth)
    tables = [torch.nn.functional.pad((c * nb + torch.randperm(nb, device="cuda", generator=g)).to(torch.int32),
                                      (0, max_len // lab.PAGE - nb)).view(1, -1) for c in range(CALLS)]
    seq_lens = torch.full((1,), depth, dtype=torch.int32, device="cuda")
    q = torch.randn(1, lab.HQ, T, lab.D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    seed = tq.rotation_seed(0)

    def run():
        for t in tables:
            tq_cuda.decode_attention(q, cache, lay, t, seq_lens, seed, lab.SM_SCALE, max_len, num_splits=splits,
                                     out=out)
    return run


def kernel_us(run) -> dict[str, float]:
    """GPU time per decode call of each kernel name (its first 40 characters), from the profiler."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:40]] += e.time_range.elapsed_us()
    return {k: v / (5 * CALLS) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-sha", default="unknown")
    args = ap.parse_args()
    t0 = time.time()
    tq_cuda.module()
    pools = lab.Pools(CALLS * 65536)
    rows = []
    for depth, T in CASES:
        for grid, (max_len, splits) in grids(depth, T).items():
            run = calls(pools, depth, T, max_len, splits)
            ms = lab.graph_ms(run) / CALLS
            kernels = kernel_us(run)
            rows.append({"depth": depth, "q_len": T, "grid": grid, "max_seq_len": max_len, "num_splits": splits,
                         "graph_us": ms * 1e3, "kernels_us": kernels})
            top = ", ".join(f"{k} {v:.1f}" for k, v in list(kernels.items())[:4])
            print(f"{depth:>6} T={T} {grid:<6} splits {splits:>3}: graph {ms * 1e3:6.1f} us; profiler: {top}", flush=True)
    result = {**harness.header(args.git_sha), "calls": CALLS, "rows": rows, "wall_s": time.time() - t0}
    harness.write_result(args.out, result)
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
