#!/usr/bin/env bash
# One device call of a GPU session, on the GPU host, from the checkout's root (docs/development.md, "The GPU vLLM
# lane", says what each step is for). The onespark wheel built at SHA is carried at .gpu-vllm/ (WHEEL= overrides);
# each mode writes its log and results under $OUT; files under /root stay while the host is held.
#
#   tests/gpu_vllm/session.sh lane SHA [PIECE]   stash PIECE (e.g. .gpu-vllm/part-00) first, then the GPU lane
#   tests/gpu_vllm/session.sh stash PIECE...     stash pieces of vLLM's wheel set (one a call: 56 MiB each)
#   tests/gpu_vllm/session.sh bench SHA          stash .gpu-vllm/part-03, install vLLM, bench.sh turboquant
#   tests/gpu_vllm/session.sh ab SHA DIFF        turboquant_merge_ab.sh DIFF (a candidate against the shipped code)
#   tests/gpu_vllm/session.sh cuda SHA           lab/turboquant_cuda.py as shipped
#
# The CUDA decode kernel is built once into /root/cb for sm_90 and sm_121a and reused by every later mode.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
me=tests/gpu_vllm/session.sh
(($# >= 2)) || { sed -n '6,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
if [[ $1 == stash ]]; then
  shift
  exec tests/gpu_vllm/install.sh stash "$@"
fi
mode=$1 sha=$2
shift 2
[[ $mode =~ ^(lane|bench|ab|cuda)$ ]] || { echo "$me: mode must be lane, stash, bench, ab or cuda, got '$mode'" >&2; exit 2; }
[[ $sha =~ ^[0-9a-f]{7,40}$ ]] || { echo "$me: SHA must be 7-40 hex digits, got '$sha'" >&2; exit 2; }
: "${OUT:?$me: set OUT to the folder that comes back}"
WHEEL_PATH=${WHEEL:-$PWD/.gpu-vllm/onespark-0.1.0-py3-none-any.whl}
[[ -f $WHEEL_PATH ]] || { echo "$me: no wheel at $WHEEL_PATH (python3 -m pip wheel --no-deps -w .gpu-vllm .)" >&2; exit 2; }
export ONESPARK_WHEEL=$WHEEL_PATH ONESPARK_GIT_SHA=$sha ONESPARK_CUDA_BUILD=/root/cb TORCH_CUDA_ARCH_LIST="9.0;12.1a"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

run() {  # run LOG CMD...: the command's output into $OUT/LOG, its exit status and last lines here
  local log=$1
  shift
  "$@" >"$OUT/$log" 2>&1
  local rc=$?
  echo "$log: rc=$rc"
  tail -40 "$OUT/$log"
  return "$rc"
}

case $mode in
  lane)
    (($# == 0)) || tests/gpu_vllm/install.sh stash "$1" || exit 1
    run lane.log env JOBS=14 timeout 540 tests/gpu.sh --tests-only ;;
  bench)
    tests/gpu_vllm/install.sh stash .gpu-vllm/part-03 && tests/gpu_vllm/install.sh install || exit 1
    run bench.log timeout 520 tests/gpu_vllm/bench.sh turboquant ;;
  ab)
    (($# == 1)) || { echo "$me: ab takes one candidate diff" >&2; exit 2; }
    run ab.log timeout 540 lab/turboquant_merge_ab.sh "$1" ;;
  cuda)
    site=/root/site-$sha
    rm -rf "$site" && python3 -m pip install -q --no-deps --target "$site" "$WHEEL_PATH" || exit 1
    gpu=$(PYTHONPATH=lab python3 -c 'from harness import gpu_name; print(gpu_name())')
    run cuda.log env PYTHONPATH="$site" timeout 520 python3 lab/turboquant_cuda.py \
      --out "$OUT/turboquant_cuda_$gpu.json" --git-sha "$sha" ;;
esac
