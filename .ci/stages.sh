# shellcheck shell=bash
# Wall time per stage of the lane, for the table .ci/run prints last (sourced by .ci/run and tests/run.sh).
#   stage NAME CMD...   runs CMD, appends "NAME<TAB>seconds<TAB>rc" to $ONESPARK_STAGES (when set), returns CMD's rc
#   stage_table         prints the table, the total and the budget check (.ci/budget.txt)
stage() {
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  if [[ -n ${ONESPARK_STAGES:-} ]]; then printf '%s\t%d\t%d\n' "$name" $((SECONDS - t0)) "$rc" >>"$ONESPARK_STAGES"; fi
  return "$rc"
}

stage_table() {
  [[ -s ${ONESPARK_STAGES:-} ]] || return 0
  python3 "$(dirname "${BASH_SOURCE[0]}")/stage_table.py" "$ONESPARK_STAGES"
}
