# shellcheck shell=bash
# Shared helpers for install.sh and steps/*.sh. Sourced, never run.
# Conventions: progress on stdout, errors on stderr; every external command through `run`
# so --dry-run prints it instead; a step is "done" when its check function says so.

ONESPARK_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY_RUN=${DRY_RUN:-0}

say() { printf 'onespark: %s\n' "$*"; }
err() { printf 'onespark: error: %s\n' "$*" >&2; }
die() { err "$@"; exit 1; }

need_cmd() {
  command -v "$1" >/dev/null 2>&1 || die "need '$1' (command not found)${2:+: $2}"
}

# Print a command (shell-quoted) and run it unless --dry-run.
run() {
  printf '+ '; printf '%q ' "$@"; printf '\n'
  [[ $DRY_RUN == 1 ]] && return 0
  "$@" || die "command failed (exit $?): $*"
}

# The onespark CLI of the project-local virtualenv that install.sh sets up (host side, no torch).
onespark_cli() {
  local venv=${ONESPARK_VENV:-$ONESPARK_ROOT/.venv-host}
  if [[ -x $venv/bin/onespark ]]; then
    run "$venv/bin/onespark" "$@"
  elif command -v onespark >/dev/null 2>&1; then
    run onespark "$@"
  else
    die "onespark CLI not found: run ./install.sh (it creates $venv) or 'pip install -e $ONESPARK_ROOT'"
  fi
}
