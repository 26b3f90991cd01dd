#!/usr/bin/env bash
# The GPU serving lane: vLLM 0.26.0 (installed by tests/gpu_vllm/install.sh) serves the tiny real-architecture
# Qwen3.5-MoE with the onespark plugin on an H200, CUDA graphs and torch.compile on, MTP-2, prefix caching on:
# the 0.32.0 track's server tests (tests/test_v032_server.py, the same assertions as on CPU) with GPU flags.
#
#   tests/gpu_vllm/lane.sh [pytest -k expression]
#
# LANE_DEADLINE_S=N stops pytest after N seconds with SIGTERM (a KeyboardInterrupt there: tests/_interrupt.py), so
# its servers stop in teardown and the tests that finished are still in the JSON: a device call is capped at
# 10 minutes and a server starts in 1-6 (the test it stopped is left out; stopped_at_deadline says the run was cut).
#
# Needs: ONESPARK_WHEEL (the onespark wheel built at this commit, e.g. .gpu-vllm/onespark-0.1.0-py3-none-any.whl)
# and ONESPARK_GIT_SHA. Writes into $OUT (or bench/results): vllm_gpu_lane_<gpu>.json (sha, command, GPU, vLLM,
# torch, every test's outcome and the summaries the tests record), vllm_gpu_lane.log, and server_logs.tar.xz
# (every server's log, kept on failure and success). Exit 1 on any failure.
set -euo pipefail
cd "$(dirname "$0")/../.."

me=lane.sh
# shellcheck source=tests/gpu_vllm/onespark-env.sh
source tests/gpu_vllm/onespark-env.sh
export ONESPARK_VLLM_GPU=1
logs=$(mktemp -d)
export ONESPARK_SERVER_LOG_DIR=$logs

tests=(
  tests/test_v032_server.py::test_log_names_the_int8_head_the_shared_draft_head_and_mtp
  tests/test_v032_server.py::test_mtp_drafts_are_accepted_and_counted_by_vllm
  tests/test_v032_server.py::test_greedy_with_mtp_equals_greedy_without
  tests/test_v032_server.py::test_int8_head_matches_bf16_head_teacher_forced
  tests/test_v032_server.py::test_chat_tool_calls_streamed_under_mtp_equal_the_whole_answer
  tests/test_v032_server.py::test_responses_tool_calls_streamed_under_mtp_equal_the_whole_answer
  # onespark's TurboQuant through patches/turboquant-0.26.0.diff (a patched copy of the lane's vLLM, per server)
  tests/test_v032_server.py::test_turboquant_diff_applies_once_and_only_to_its_files
  tests/test_v032_server.py::test_turboquant_pages_on_032_equal_the_kernels_layout
  tests/test_v032_server.py::test_turboquant_refuses_032s_own_k8v4_by_name
  tests/test_v032_server.py::test_turboquant_serves_the_hybrid_model_close_to_the_bf16_cache
  tests/test_v032_server.py::test_turboquant_with_mtp2_drafts_and_matches_the_bf16_cache
  # the baseline a user would otherwise get, after ours (a deadline cuts the list from the end)
  tests/test_v032_server.py::test_upstream_turboquant_on_the_hybrid_model
)
deadline=()
if [[ -n ${LANE_DEADLINE_S:-} ]]; then
  [[ $LANE_DEADLINE_S =~ ^[1-9][0-9]*$ ]] || { echo "$me: LANE_DEADLINE_S is '$LANE_DEADLINE_S': give whole seconds" >&2; exit 2; }
  deadline=(timeout -s TERM -k 60 "$LANE_DEADLINE_S")
fi
set +e
"${deadline[@]}" "$py" -P -m pytest --import-mode=append -p no:cacheprovider -v -rA --junitxml "$out/vllm_gpu_lane.xml" \
  ${1:+-k "$1"} "${tests[@]}" 2>&1 | tee "$out/vllm_gpu_lane.log"
rc=${PIPESTATUS[0]}
set -e
tar -C "$logs" -cJf "$out/server_logs.tar.xz" . || true
gpu=$(PYTHONPATH="$PWD/lab:$PYTHONPATH" "$py" -c 'from harness import gpu_name; print(gpu_name())')  # h200, h100: as tests/gpu.sh
"$py" - "$out/vllm_gpu_lane.xml" "$out/vllm_gpu_lane_$gpu.json" "$sha" "tests/gpu_vllm/lane.sh $*" "$rc" <<'EOF'
import json, os, sys, time
import xml.etree.ElementTree as ET

import torch
import vllm

xml, dest, sha, command, rc = sys.argv[1:]
tests = []
for c in ET.parse(xml).getroot().iter("testcase"):
    if c.get("name") is None:  # the test a SIGTERM (LANE_DEADLINE_S) stopped: an unnamed, empty testcase
        continue
    outcome = next((k for k in ("failure", "error", "skipped") if c.find(k) is not None), "passed")
    props = {p.get("name"): p.get("value") for p in c.iter("property")}
    tests.append({"id": c.get("name"), "outcome": outcome, "seconds": float(c.get("time", 0)), "recorded": props})
result = dict(schema_version=1, git_sha=sha, command=command, gpu=torch.cuda.get_device_name(),
              vllm=vllm.__version__, torch=torch.__version__,
              flags="tests/vllm_server.py GPU_FLAGS + tests/test_v032_server.py CPU_FLAGS (GPU branch)",
              date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              passed=sum(t["outcome"] == "passed" for t in tests),
              failed=sum(t["outcome"] in ("failure", "error") for t in tests),
              skipped=sum(t["outcome"] == "skipped" for t in tests),
              stopped_at_deadline=rc == "124", tests=tests)
with open(dest + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(dest + ".tmp", dest)
print(f"vllm gpu lane: {result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped -> {dest}")
for t in tests:
    print(f"  {t['outcome']:8s} {t['seconds']:7.1f}s {t['id']}: {'; '.join(t['recorded'].values())}")
EOF
exit "$rc"
