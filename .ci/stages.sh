# shellcheck shell=bash
# Wall time per stage of the lane, for the table .ci/run prints last (sourced by .ci/run and tests/run.sh).
#   stage NAME CMD...   runs CMD, appends "NAME<TAB>seconds<TAB>rc" to $ONESPARK_STAGES (when set), returns CMD's rc;
#                       with STAGE_WITHIN=1 the row ends in "<TAB>within": it ran beside other rows, inside a later
#                       row's time (tests/run.sh's tracks side by side), so the total leaves it out
#   stage_table         prints the table, the total and the budget check (.ci/budget.txt)
stage() {
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  if [[ -n ${ONESPARK_STAGES:-} ]]; then
    printf '%s\t%d\t%d%s\n' "$name" $((SECONDS - t0)) "$rc" "${STAGE_WITHIN:+$'\t'within}" >>"$ONESPARK_STAGES"
  fi
  return "$rc"
}

stage_table() {
  [[ -s ${ONESPARK_STAGES:-} ]] || return 0
  python3 "$(dirname "${BASH_SOURCE[0]}")/stage_table.py" "$ONESPARK_STAGES"
}
