#!/usr/bin/env bash
# Nsight Compute on the CUDA decode kernel (kernels/turboquant_decode.cuh) at one case: how busy each pipe is (tensor,
# ALU, FMA, shared memory), the issue rate, the stall reasons, the DRAM throughput. One kernel launch, clocks left as
# they are (--clock-control none):
#
#   ONESPARK_WHEEL=onespark.whl OUT=DIR lab/turboquant_cuda_profile.sh [DEPTH,BATCH,Q_LEN]   (262144,8,3)
#
# Writes DIR/turboquant_cuda_profile_<DEPTH>_<BATCH>_<Q_LEN>.txt (ncu's report, the sha on its first line). Uses the
# build in ONESPARK_CUDA_BUILD when it is fresh for TORCH_CUDA_ARCH_LIST (tests/gpu.sh keeps its build there).
set -euo pipefail
cd "$(dirname "$0")/.."

case=${1:-262144,8,3}
[[ $case =~ ^[0-9]+,[0-9]+,[0-9]+$ ]] || { echo "turboquant_cuda_profile.sh: the case is DEPTH,BATCH,Q_LEN (whole numbers), got '$case'" >&2; exit 2; }
PKG_PATH=${ONESPARK_WHEEL:?turboquant_cuda_profile.sh: set ONESPARK_WHEEL to a built onespark wheel}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
[[ -x $NCU ]] || { echo "turboquant_cuda_profile.sh: no Nsight Compute at '$NCU' (set NCU)" >&2; exit 2; }
out=${OUT:-bench/results}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" "$PKG_PATH"
export PYTHONPATH=$site PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export ONESPARK_CUDA_BUILD=${ONESPARK_CUDA_BUILD:-$site/cuda-build}
python3 -P -c "from onespark.kernels import turboquant_cuda as t; t.module()"  # build outside the profiler
metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
metrics+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
metrics+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed
dest=$out/turboquant_cuda_profile_${case//,/_}.txt
{
  echo "# git_sha ${ONESPARK_GIT_SHA:-unknown}: lab/turboquant_cuda_profile.sh $case"
  "$NCU" --clock-control none -k regex:decode_k4v4 -s 1 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --metrics "$metrics" \
    python3 lab/turboquant_cuda.py --one "$case,cuda"
} >"$dest.tmp"
mv "$dest.tmp" "$dest"
grep -E "hmma|pipe_alu|pipe_fma|pipe_lsu|mem_shared|issue_active|dram__|Warp Cycles Per Issued|Achieved Occupancy" "$dest"
