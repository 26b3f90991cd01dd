#!/usr/bin/env bash
# The GPU lane's benchmarks inside vLLM 0.26.0 (installed by tests/gpu_vllm/install.sh) on the H200:
#
#   tests/gpu_vllm/bench.sh step [vllm_step.py args]        real 122B / 35B shapes, dummy weights, per technique
#   tests/gpu_vllm/bench.sh turboquant [turboquant.py args] TurboQuant decode, ours beside upstream vLLM's
#
# Needs ONESPARK_WHEEL (the onespark wheel built at this commit) and ONESPARK_GIT_SHA, as lane.sh. Writes
# $OUT/<bench>_h200.json (or under bench/results) and its log.
set -euo pipefail
cd "$(dirname "$0")/../.."

STORE=${STORE:-/root/gpu-vllm}
py=${PYTHON:-python3}
out=${OUT:-bench/results}
sha=${ONESPARK_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
what=${1:-}
shift || true
case $what in
  step) script=bench/lab/vllm_step.py name=vllm_step_h200 ;;
  turboquant) script=bench/lab/turboquant.py name=turboquant_h200 ;;
  *) echo "bench.sh: say which benchmark: step or turboquant" >&2; exit 2 ;;
esac
[[ -f $STORE/env.sh ]] || { echo "bench.sh: no vLLM at $STORE: run tests/gpu_vllm/install.sh install first" >&2; exit 2; }
[[ -f ${ONESPARK_WHEEL:-} ]] || { echo "bench.sh: ONESPARK_WHEEL names no wheel (build one at this commit)" >&2; exit 2; }
# shellcheck disable=SC1091
source "$STORE/env.sh"
site=$STORE/onespark
rm -rf "$site"
WHEEL_PATH=$ONESPARK_WHEEL
"$py" -m pip install -q --no-deps --no-compile --target "$site" "$WHEEL_PATH"
export PYTHONPATH=$site:$PYTHONPATH PYTHONUNBUFFERED=1
mkdir -p "$out"
"$py" "$script" --out "$out/$name.json" --git-sha "$sha" "$@" 2>&1 | tee "$out/$name.log"
exit "${PIPESTATUS[0]}"
