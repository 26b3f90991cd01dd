#!/usr/bin/env bash
# The GPU lane: every kernel test on CUDA in this process (the cases the CPU lane runs in Triton's
# interpreter, plus the gpu-marked ones), then the kernel benchmarks. Sent to a GPU host as it is:
#
#   tests/gpu.sh [--tests-only | --bench-only] [--bench NAME,...] [--quick]
#
# Benchmarks (NAME): turboquant (decode), turboquant_prefill, lm_head, lm_head_glue, draft_head; all by default
# (the lab scripts in lab/, which share lab/harness.py). On request only: turboquant_tiles and
# turboquant_tiles_mma_sync (the decode tile candidates, on this GPU's code and on the Spark's), turboquant_cuda and
# turboquant_cuda_mma_sync (the CUDA C++ decode kernel beside the Triton kernel's code for this GPU, for the Spark).
#
# Needs: python3 with torch (CUDA) + Triton + pytest-xdist; the vLLM stand-in the TurboQuant backend test
# imports (`.venv/bin/python tests/gpu_lane_stub.py .gpustub` on a machine with the test venv; carried to the
# GPU host, which has no vLLM). onespark is installed into a scratch --target (no path surgery); pytest runs
# with --import-mode=append so that copy, not the checkout's onespark/ folder, is what the tests import.
# Writes into $OUT (the device tool's folder) or bench/results: gpu_lane_<gpu>.json (git_sha, command, gpu,
# torch, triton, passed, failed, skipped, failing ids), the benchmark JSONs, and logs. Exit 1 on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
argv="$*"
tests=1 bench=1 quick=() names=turboquant,turboquant_prefill,lm_head,lm_head_glue,draft_head
while (($#)); do
  arg=$1; shift
  case $arg in
    --bench) [[ $# -gt 0 ]] || { echo "tests/gpu.sh: --bench needs a value (e.g. --bench turboquant_prefill)" >&2; exit 2; }
             names=$1; shift ;;
    --tests-only) bench=0 ;;
    --bench-only) tests=0 ;;
    --quick) quick=(--quick) ;;
    -h|--help) usage; exit 0 ;;
    *) echo "tests/gpu.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

py=${PYTHON:-python3}
out=${OUT:-bench/results}
mkdir -p "$out"
sha=${ONESPARK_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
stub=${ONESPARK_GPU_STUB:-.gpustub}
if [[ ! -f $stub/vllm/v1/attention/backend.py ]]; then
  echo "tests/gpu.sh: no vLLM stand-in at $stub: run '.venv/bin/python tests/gpu_lane_stub.py $stub' where the" \
       "test venv exists, and carry $stub (or set ONESPARK_GPU_STUB)" >&2
  exit 2
fi
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "tests/gpu.sh: torch sees no CUDA device")'

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
PKG_PATH=${ONESPARK_WHEEL:-$PWD}  # a wheel built elsewhere (the host's setuptools may be older), or this checkout
"$py" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" "$PKG_PATH"
export PYTHONPATH="$site:$PWD/$stub" PYTHONUNBUFFERED=1
# The CUDA decode kernel is built once, in the scratch folder (or ONESPARK_CUDA_BUILD, kept for a later run such as
# lab/turboquant_cuda_profile.sh), for this GPU and the Spark (one build proves both compile with the real
# torch binding; kernels/turboquant_cuda.py).
export ONESPARK_CUDA_BUILD="${ONESPARK_CUDA_BUILD:-$site/cuda-build}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0;12.1a}"
# the lab's short name (h200, h100, gb10): file names agree with the bench results' `gpu` field
gpu=$(PYTHONPATH="$PWD/lab:$PYTHONPATH" "$py" -c 'from harness import gpu_name; print(gpu_name())')
rc=0

# The lane's tests (tests/test_gpu_lane_list.py checks on CPU that each file exists and defines each test named).
LANE_TESTS=(
  tests/test_turboquant_triton.py tests/lab/test_turboquant_swap.py tests/test_turboquant_decoders.py
  tests/test_turboquant_cuda.py tests/test_kernels_lm_head.py
  tests/test_draft_head.py::test_draft_logits_match_masked_full_head
  tests/test_draft_head.py::test_draft_logits_int4_match_reference
  tests/test_draft_head.py::test_argmax_maps_back_with_a_clear_winner_and_with_ties
  tests/test_draft_head.py::test_a_better_token_outside_the_subset_is_never_drafted
  tests/test_draft_head.py::test_real_shape_cuda_graph_replay_equals_eager
  tests/test_turboquant_backend.py::test_cuda_path_triton_kernels
  tests/test_turboquant_backend.py::test_padded_uniform_step_replays_in_a_cuda_graph
)

if ((tests)); then
  # pytest-xdist's workers drop a path that does not exist without a word, and such a run records 0 passed
  for t in "${LANE_TESTS[@]}"; do
    [[ -f ${t%%::*} ]] || { echo "tests/gpu.sh: no test file ${t%%::*} (named in LANE_TESTS): fix the list" >&2; exit 2; }
  done
  set +e
  "$py" -P -m pytest --import-mode=append -p no:cacheprovider -q -n "${JOBS:-8}" --junitxml "$out/gpu_lane.xml" \
    "${LANE_TESTS[@]}" 2>&1 | tee "$out/gpu_lane.log"
  rc=${PIPESTATUS[0]}
  set -e
  rc2=0
  "$py" - "$out/gpu_lane.xml" "$out/gpu_lane_$gpu.json" "$sha" "tests/gpu.sh $argv" <<'EOF' || rc2=$?
import json, os, sys, time
import xml.etree.ElementTree as ET

import torch
import triton

xml, dest, sha, command = sys.argv[1:]
cases = list(ET.parse(xml).getroot().iter("testcase"))
failing = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("failure") is not None or c.find("error") is not None]
skipped = sum(c.find("skipped") is not None for c in cases)
result = dict(schema_version=1, git_sha=sha, command=command, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
              triton=triton.__version__, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              passed=len(cases) - len(failing) - skipped, failed=len(failing), skipped=skipped, failing=failing)
if not result["passed"]:  # nothing ran (or nothing passed): no result file, which would read as a lane run
    sys.exit(f"gpu lane: no test passed ({result['failed']} failed), so no {dest}: gpu_lane.log says why")
with open(dest + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(dest + ".tmp", dest)
print(f"gpu lane: {result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped -> {dest}")
EOF
  ((rc)) || rc=$rc2
fi

if ((bench)); then
  declare -A cmds=(
    [turboquant]="lab/turboquant.py --out $out/turboquant_$gpu.json ${quick[*]}"
    [turboquant_prefill]="lab/turboquant.py --prefill --out $out/turboquant_prefill_$gpu.json ${quick[*]}"
    [lm_head]="lab/lm_head.py --out $out/lm_head_$gpu.json"
    [lm_head_glue]="lab/lm_head_glue.py --out $out/lm_head_glue_$gpu.json"
    [draft_head]="lab/draft_head.py --out $out/draft_head_$gpu.json"
    [turboquant_tiles]="lab/turboquant_tiles.py --out $out/turboquant_tiles_$gpu.json"
    [turboquant_tiles_mma_sync]="lab/turboquant_tiles.py --mma-sync --out $out/turboquant_tiles_${gpu}_mma_sync.json"
    [turboquant_cuda]="lab/turboquant_cuda.py --out $out/turboquant_cuda_$gpu.json"
    [turboquant_cuda_mma_sync]="lab/turboquant_cuda.py --mma-sync --out $out/turboquant_cuda_${gpu}_mma_sync.json")
  IFS=, read -ra picked <<<"$names"
  for name in "${picked[@]}"; do
    cmd=${cmds[$name]:-}
    [[ -n $cmd ]] || { echo "tests/gpu.sh: unknown benchmark '$name' (${!cmds[*]})" >&2; exit 2; }
    echo "== $cmd"
    # No -P here: a script's own folder (lab/, the harness) must be on sys.path; the checkout root is not.
    # shellcheck disable=SC2086  # word splitting wanted: the command's arguments
    "$py" $cmd --git-sha "$sha" || rc=1
  done
fi
exit "$rc"
