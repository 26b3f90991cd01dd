#!/usr/bin/env bash
# The GPU lane's benchmarks inside vLLM 0.26.0 (installed by tests/gpu_vllm/install.sh) on the H200:
#
#   tests/gpu_vllm/bench.sh step [vllm_step.py args]        real 122B / 35B shapes, dummy weights, per technique
#   tests/gpu_vllm/bench.sh turboquant [turboquant.py args] TurboQuant decode, ours beside upstream vLLM's
#
# Needs ONESPARK_WHEEL (the onespark wheel built at this commit) and ONESPARK_GIT_SHA, as lane.sh. Writes
# $OUT/<bench>_<gpu>.json (or under bench/results; gpu: the lab's short name, h200 or h100) and its log.
set -euo pipefail
cd "$(dirname "$0")/../.."

what=${1:-}
shift || true
case $what in
  step) script=lab/vllm_step.py name=vllm_step ;;
  turboquant) script=lab/turboquant.py name=turboquant ;;
  *) echo "bench.sh: say which benchmark: step or turboquant" >&2; exit 2 ;;
esac
me=bench.sh
# shellcheck source=tests/gpu_vllm/onespark-env.sh
source tests/gpu_vllm/onespark-env.sh
name=${name}_$(PYTHONPATH="$PWD/lab:$PYTHONPATH" "$py" -c 'from harness import gpu_name; print(gpu_name())')
"$py" "$script" --out "$out/$name.json" --git-sha "$sha" "$@" 2>&1 | tee "$out/$name.log"
exit "${PIPESTATUS[0]}"
