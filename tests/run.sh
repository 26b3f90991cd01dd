#!/usr/bin/env bash
# The one test command. Builds each vLLM track's venv from pinned requirements (first run only), then runs
# pytest in each with the same arguments:
#   .venv      vLLM 0.19.1 (the default track: every test)        tests/requirements.txt + overrides.txt
#   .venv-032  vLLM 0.32.0 (the tests marked vllm032, conftest.py) tests/requirements-032.txt + overrides-032.txt
#
#   tests/run.sh [pytest args...]
#   ONESPARK_TEST_TRACKS=0.32.0 tests/run.sh tests/test_v032_server.py -x   (one track: 0.19.1 or 0.32.0)
# Exit status: the first failing track's; a track that collects nothing (pytest's 5: e.g. a 0.19.1-only
# file on the 0.32.0 track) counts as passed when another track ran tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/stages.sh  # stage: wall time per venv build and per track, for .ci/run's table

# The requirement files pin what we name; what those pull in (vLLM's ~180 dependencies) resolves as PyPI stood
# at this instant, so a release tomorrow cannot change the lane. Moving it rebuilds both venvs.
RESOLVE_AT=2026-11-28T00:00:00Z

build_venv() {  # VENV REQUIREMENTS OVERRIDES
  local venv=$1 req=$2 ovr=$3
  if [[ ! -x $venv/bin/python || $req -nt $venv/.installed || $ovr -nt $venv/.installed
        || $(cat "$venv/.installed" 2>/dev/null) != "$RESOLVE_AT" ]]; then
    stage "venv $venv (built)" install_venv "$venv" "$req" "$ovr" || return
  fi
}

install_venv() {  # VENV REQUIREMENTS OVERRIDES (&&-chained: stage runs it where set -e does not apply)
  local venv=$1 req=$2 ovr=$3
  python3 -m venv "$venv" &&
    "$venv/bin/python" -m pip install -q uv==0.9.5 &&
    "$venv/bin/python" -m uv pip install --python "$venv/bin/python" --exclude-newer "$RESOLVE_AT" \
      -r "$req" --override "$ovr" -e ".[bench]" &&
    echo "$RESOLVE_AT" > "$venv/.installed"
}

main() {
  local track venv rc first_fail=0 ran=0
  for track in ${ONESPARK_TEST_TRACKS:-0.19.1 0.32.0}; do
    case $track in
      0.19.1) venv=.venv; build_venv "$venv" tests/requirements.txt tests/overrides.txt ;;
      0.32.0) venv=.venv-032; build_venv "$venv" tests/requirements-032.txt tests/overrides-032.txt ;;
      *) echo "tests/run.sh: ONESPARK_TEST_TRACKS has '$track': use 0.19.1 and/or 0.32.0" >&2; return 2 ;;
    esac
    echo "== tests/run.sh: vLLM $track track ($venv) =="
    rc=0
    stage "pytest, vLLM $track track" "$venv/bin/python" -m pytest "$@" || rc=$?
    if [[ $rc -eq 0 ]]; then
      ran=1
    elif [[ $rc -ne 5 && $first_fail -eq 0 ]]; then
      first_fail=$rc
    fi
  done
  if [[ $first_fail -ne 0 ]]; then return "$first_fail"; fi
  if [[ $ran -eq 0 ]]; then return 5; fi  # no track collected anything
  return 0
}

main "$@" || exit $?
