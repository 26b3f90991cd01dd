#!/usr/bin/env bash
# The one test command. Builds each vLLM track's venv from pinned requirements (first run only), then runs
# pytest in each with the same arguments:
#   .venv      vLLM 0.19.1 (the default track: every test)        tests/requirements.txt + overrides.txt
#   .venv-032  vLLM 0.32.0 (the tests marked vllm032, conftest.py) tests/requirements-032.txt + overrides-032.txt
#
#   tests/run.sh [pytest args...]
#   ONESPARK_TEST_TRACKS=0.32.0 tests/run.sh tests/test_v032_server.py -x   (one track: 0.19.1 or 0.32.0)
# Both tracks run at once (most of each track waits on vLLM servers and image builds, so the 2-core lane's wall
# time is about the longest process's, not the sum), the 0.19.1 track as three pytest processes when no test path
# is given (DEMO_FILES, SPLIT_FILES below); the first process's output streams, the others' are printed after it
# (their log files are named at the start). ONESPARK_TEST_SERIAL=1 runs the tracks one after the other, whole.
# Exit status: the first failing process's (in that order); one that collects nothing (pytest's 5: e.g. a
# 0.19.1-only file on the 0.32.0 track) counts as passed when another ran tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/stages.sh  # stage: wall time per venv build and per track, for .ci/run's table

# The requirement files pin what we name; what those pull in (vLLM's ~180 dependencies) resolves as PyPI stood
# at this instant, so a release tomorrow cannot change the lane. Moving it rebuilds both venvs.
RESOLVE_AT=2026-11-28T00:00:00Z
# What .installed holds once a venv is complete. "bytecode": the install compiles every module (uv's
# --compile-bytecode, ~30 s a venv): uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (this
# project's VMs) each of the lane's hundreds of Python processes would compile vLLM, torch and transformers from
# source again (~7 s of a core per vLLM import, twice per server start: the lane's time doubled).
STAMP="$RESOLVE_AT bytecode"

build_venv() {  # VENV REQUIREMENTS OVERRIDES
  local venv=$1 req=$2 ovr=$3
  if [[ ! -x $venv/bin/python || $req -nt $venv/.installed || $ovr -nt $venv/.installed
        || $(cat "$venv/.installed" 2>/dev/null) != "$STAMP" ]]; then
    stage "venv $venv (built)" install_venv "$venv" "$req" "$ovr" || return
  fi
}

install_venv() {  # VENV REQUIREMENTS OVERRIDES (&&-chained: stage runs it where set -e does not apply)
  local venv=$1 req=$2 ovr=$3
  python3 -m venv "$venv" &&
    "$venv/bin/python" -m pip install -q uv==0.9.5 &&
    "$venv/bin/python" -m uv pip install --python "$venv/bin/python" --exclude-newer "$RESOLVE_AT" \
      -r "$req" --override "$ovr" -e ".[bench]" --compile-bytecode &&
    echo "$STAMP" > "$venv/.installed"
}

# The 0.19.1 track is the long one (every test but the 0.32.0-only ones): where no test path is given it runs as
# three pytest processes, DEMO_FILES in the second, SPLIT_FILES in the third. They share no session fixture with the
# rest (conftest.py's servers and checkpoints) and keep a core busy on their own (Docker image builds,
# Triton-interpreter and g++ children, Ray nodes), so on 2 cores the processes finish close together instead of one
# running alone for its last ~25 min (a cold lane on a 2-core AMD EPYC Zen 1: 48 min with two processes). The demo's
# image builds wait on downloads and the Docker engine (cold: 1,942 s of the 2,620 s its process took with the
# split files after them, at 81fc061), so the CPU-bound split files run beside them, not after. At 93c2a39 (cold:
# 41.9 min) the split took 1,604 s, the rest 2,318 s: five more fixture-free files (compiles, an interpreter lane,
# the lab scripts, the fuzzed readers) moved here after it (docs/development.md).
DEMO_FILES=(tests/test_install_demo.py)
SPLIT_FILES=(tests/test_turboquant_triton.py tests/lab/test_turboquant_swap.py tests/test_cluster.py tests/test_install.py
             tests/test_turboquant_cuda_cpu.py tests/test_kernels_compile.py tests/test_kernels_compile_cuda.py
             tests/test_kernels_lm_head.py tests/lab/test_lab.py tests/test_fuzz_readers.py)

part_name() {  # PART: how the stage table and the log headers name it
  case $1 in
    all) echo "all its files" ;;
    rest) echo "all but ${DEMO_FILES[*]##*/} ${SPLIT_FILES[*]##*/}" ;;
    demo) echo "${DEMO_FILES[*]##*/}" ;;
    split) echo "${SPLIT_FILES[*]##*/}" ;;
  esac
}

# TRACK VENV PART PYTEST-ARGS...: the track's pytest (PART: all, rest, demo or split), its wall time a stage row
run_track() {
  local track=$1 venv=$2 part=$3 f
  shift 3
  local -a extra=()
  case $part in
    rest) for f in "${DEMO_FILES[@]}" "${SPLIT_FILES[@]}"; do extra+=("--ignore=$f"); done ;;
    demo) extra=("${DEMO_FILES[@]}") ;;
    split) extra=("${SPLIT_FILES[@]}") ;;
  esac
  local name="pytest, vLLM $track track"
  [[ $part == all ]] || name+=" ($part)"
  echo "== tests/run.sh: vLLM $track track ($venv, $(part_name "$part")) =="
  stage "$name" "$venv/bin/python" -m pytest "$@" "${extra[@]}"
}

# Whether any argument names a test path (a file or folder, or FILE::TEST): then the tracks run what was named, whole.
names_paths() {
  local arg
  for arg in "$@"; do
    [[ $arg != -* && -e ${arg%%::*} ]] && return 0
  done
  return 1
}

BACKGROUND=()  # the pids of the tracks running behind the first (stopped with this script)
stop_background() {
  local pid
  for pid in "${BACKGROUND[@]}"; do
    pkill -TERM -P "$pid" 2>/dev/null || true  # the track's pytest: SIGTERM is a KeyboardInterrupt there (tests/_interrupt.py), so its servers stop in teardown
    kill -TERM "$pid" 2>/dev/null || true
  done
}

main() {
  local track venv rc first_fail=0 ran=0 i wall="" side=0
  local -a tracks jtracks jvenvs jparts rcs logs
  # shellcheck disable=SC2206  # word splitting wanted: one track per word
  tracks=(${ONESPARK_TEST_TRACKS:-0.19.1 0.32.0})
  [[ ${#tracks[@]} -gt 1 && ${ONESPARK_TEST_SERIAL:-0} != 1 ]] && side=1
  for track in "${tracks[@]}"; do  # every venv first: the tracks then run side by side
    case $track in
      0.19.1) venv=.venv; build_venv "$venv" tests/requirements.txt tests/overrides.txt || return ;;
      0.32.0) venv=.venv-032; build_venv "$venv" tests/requirements-032.txt tests/overrides-032.txt || return ;;
      *) echo "tests/run.sh: ONESPARK_TEST_TRACKS has '$track': use 0.19.1 and/or 0.32.0" >&2; return 2 ;;
    esac
    if ((side)) && [[ $track == 0.19.1 ]] && ! names_paths "$@"; then
      jtracks+=("$track" "$track" "$track") jvenvs+=("$venv" "$venv" "$venv") jparts+=(rest demo split)
    else
      jtracks+=("$track") jvenvs+=("$venv") jparts+=(all)
    fi
  done
  if ((side)); then
    # Side by side: each process's row is part of the wall-time row written when all are done (.ci/stage_table.py
    # sums that one, not theirs).
    trap stop_background INT TERM
    local t0=$SECONDS
    for ((i = 1; i < ${#jtracks[@]}; i++)); do
      logs[i]=$(mktemp "${TMPDIR:-/tmp}/onespark-track-${jtracks[i]}-${jparts[i]}.XXXXXX.log")
      echo "== tests/run.sh: vLLM ${jtracks[i]} track ($(part_name "${jparts[i]}")) runs alongside; its output" \
           "follows (log: ${logs[i]}) =="
      STAGE_WITHIN=1 run_track "${jtracks[i]}" "${jvenvs[i]}" "${jparts[i]}" "$@" >"${logs[i]}" 2>&1 &
      BACKGROUND+=($!)
    done
    rcs[0]=0
    STAGE_WITHIN=1 run_track "${jtracks[0]}" "${jvenvs[0]}" "${jparts[0]}" "$@" || rcs[0]=$?
    for ((i = 1; i < ${#jtracks[@]}; i++)); do
      rcs[i]=0
      wait "${BACKGROUND[i - 1]}" || rcs[i]=$?
      cat "${logs[i]}" && rm -f "${logs[i]}"
    done
    trap - INT TERM
    wall=$((SECONDS - t0))
  else
    for i in "${!jtracks[@]}"; do
      rcs[i]=0
      run_track "${jtracks[i]}" "${jvenvs[i]}" all "$@" || rcs[i]=$?
    done
  fi
  for rc in "${rcs[@]}"; do
    if [[ $rc -eq 0 ]]; then
      ran=1
    elif [[ $rc -ne 5 && $first_fail -eq 0 ]]; then
      first_fail=$rc
    fi
  done
  rc=0
  if [[ $first_fail -ne 0 ]]; then rc=$first_fail; elif [[ $ran -eq 0 ]]; then rc=5; fi  # 5: nothing collected anywhere
  if [[ -n $wall && -n ${ONESPARK_STAGES:-} ]]; then
    printf '%s\t%d\t%d\n' "pytest, ${#jtracks[@]} processes side by side" "$wall" "$rc" >>"$ONESPARK_STAGES"
  fi
  return "$rc"
}

main "$@" || exit $?
