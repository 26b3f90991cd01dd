"""Where the block scheduler puts the working CTAs of a TurboQuant decode launch: the bench's grid (every CTA works)
against a server's (the grid sized for max_model_len, the CTAs past a short request's splits empty), and the same
server grid with the split order reversed (the empty CTAs first). A probe kernel with the decode kernel's block
size and shared memory (so the same CTAs fit an SM) records each working CTA's SM (%smid) and spins; the empty ones
return at once, as the decode kernel's do. All of a launch is resident at once (grid <= SMs x CTAs per SM), so the
placement at dispatch is the placement for the whole kernel.

    python lab/turboquant_cta_placement.py --out OUT.json [--git-sha SHA]

Needs a GPU and nvcc (torch.utils.cpp_extension.load_inline); writes one JSON and prints one table: per grid, the
SMs the working CTAs use and the most working CTAs on one SM (1 = each its own SM).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import harness
import torch
from torch.utils.cpp_extension import load_inline

KERNELS = Path(__file__).resolve().parents[1] / "kernels"

CUDA = r"""
#include <torch/extension.h>
#include "turboquant_decode.cuh"

template <int M>
__global__ void __launch_bounds__(onespark_tq::NW * 32) probe(int live, int reverse, long long spin, int* sm_of) {
  extern __shared__ char smem[];
  const int split = reverse ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
  if (split >= live) return;  // an empty split, as decode_k4v4's: gone at once
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    sm_of[split * gridDim.x + blockIdx.x] = static_cast<int>(sm);
  }
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {
  }
  smem[threadIdx.x] = 0;
}

template <int M>
std::vector<int64_t> run_m(int64_t grid_x, int64_t splits, int64_t live, int64_t reverse, int64_t spin, torch::Tensor sm_of) {
  constexpr int smem = onespark_tq::smem_bytes<M, 3>();  // 3: the served pipeline depth (turboquant_cuda.STAGES)
  cudaFuncSetAttribute(probe<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, probe<M>, onespark_tq::NW * 32, smem);
  probe<M><<<dim3(grid_x, splits), onespark_tq::NW * 32, smem>>>(live, reverse, spin, sm_of.data_ptr<int>());
  return {smem, per_sm};
}

std::vector<int64_t> run(int64_t m, int64_t grid_x, int64_t splits, int64_t live, int64_t reverse, int64_t spin,
                         torch::Tensor sm_of) {
  return m == 1 ? run_m<1>(grid_x, splits, live, reverse, spin, sm_of)
                : run_m<3>(grid_x, splits, live, reverse, spin, sm_of);
}
"""

# (q_len, splits on the bench's grid, splits on a server's): bench/results/turboquant_grid_profile_h100.json, H100,
# batch 1, 2 KV heads (the grid's x)
CASES = [(1, 16, 198), (1, 64, 198), (1, 128, 198), (3, 16, 132), (3, 64, 132), (3, 128, 132)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-sha", default="unknown")
    args = ap.parse_args()
    t0 = time.time()
    decl = "std::vector<int64_t> run(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, torch::Tensor);"
    mod = load_inline("onespark_cta_probe", cpp_sources=decl, cuda_sources=CUDA, functions=["run"],
                      extra_include_paths=[str(KERNELS)], extra_cuda_cflags=["-O3"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    spin = 40_000  # clocks: ~20 us at an H100's 1.98 GHz, a working split's decode at 32K (the grid profile)
    rows = []
    for T, live, server in CASES:
        for grid, splits, reverse in (("own", live, 0), ("server", server, 0), ("server reversed", server, 1)):
            sm_of = torch.full((2 * live,), -1, dtype=torch.int32, device="cuda")
            smem, per_sm = mod.run(T, 2, splits, live, reverse, spin, sm_of)
            torch.cuda.synchronize()
            placed = sm_of.tolist()
            per = collections.Counter(placed)
            rows.append({"q_len": T, "grid": grid, "splits": splits, "working_ctas": 2 * live, "ctas": 2 * splits,
                         "smem": smem, "ctas_per_sm": per_sm, "sms_used": len(per), "most_on_one_sm": max(per.values()),
                         "unplaced": per.get(-1, 0), "sm_of": placed})
            r = rows[-1]
            print(f"T={T} {grid:<16} splits {splits:>3}: {r['working_ctas']:>3} working of {r['ctas']:>3} CTAs on "
                  f"{r['sms_used']:>3} of {sms} SMs, at most {r['most_on_one_sm']} on one ({per_sm} fit an SM)", flush=True)
    result = {**harness.header(args.git_sha), "sms": sms, "rows": rows, "wall_s": time.time() - t0}
    harness.write_result(args.out, result)
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
