# shellcheck shell=bash
# shellcheck disable=SC2034,SC2154  # sets py, out and sha for the caller; reads the caller's $me
# Sourced by lane.sh and bench.sh on the GPU host: the lane's vLLM (tests/gpu_vllm/install.sh) and the onespark
# wheel built at this commit, installed fresh into $STORE/onespark and put first on PYTHONPATH. Sets py, out, sha.
# The caller names itself in $me for the error lines.
STORE=${STORE:-/root/gpu-vllm}
py=${PYTHON:-python3}
out=${OUT:-bench/results}
sha=${ONESPARK_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$out"
[[ -f $STORE/env.sh ]] || { echo "$me: no vLLM at $STORE: run tests/gpu_vllm/install.sh install first" >&2; exit 2; }
[[ -f ${ONESPARK_WHEEL:-} ]] || { echo "$me: ONESPARK_WHEEL names no wheel (build one at this commit)" >&2; exit 2; }
# shellcheck disable=SC1091
source "$STORE/env.sh"
site=$STORE/onespark
rm -rf "$site"
WHEEL_PATH=$ONESPARK_WHEEL
"$py" -m pip install -q --no-deps --no-compile --target "$site" "$WHEEL_PATH"
export PYTHONPATH=$site:$PYTHONPATH PYTHONUNBUFFERED=1
