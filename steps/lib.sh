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

# ---- images (steps 3-4; appended by the images issue) --------------------------------------------

# Print the value of LABEL on IMAGE, or nothing when the image (or the label) does not exist.
image_label() {
  local image=$1 label=$2
  docker image inspect --format "{{ index .Config.Labels \"$label\" }}" "$image" 2>/dev/null || true
}

# sha256 (first 16 hex) over the named files' contents and any extra words: what an image was built from.
# A directory argument means every file under it (sorted; caches excluded).
fingerprint() {
  local -a files=() words=()
  local a
  for a in "$@"; do
    if [[ -d $a ]]; then
      while IFS= read -r -d '' f; do files+=("$f"); done \
        < <(find "$a" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z)
    elif [[ -f $a ]]; then
      files+=("$a")
    else
      words+=("$a")
    fi
  done
  { printf '%s\n' "${words[@]}"; ((${#files[@]})) && sha256sum -- "${files[@]}"; } | sha256sum | cut -c1-16
}

# Run "$@" (through `run`) and record how long it took in STEP_TIMES, for timing_summary.
STEP_TIMES=()
timed() {
  local name=$1 t0=$SECONDS
  shift
  run "$@"
  STEP_TIMES+=("$name: $((SECONDS - t0)) s")
}

timing_summary() {
  [[ $DRY_RUN == 1 ]] && return 0
  ((${#STEP_TIMES[@]})) || return 0
  say "timing:"
  local t
  for t in "${STEP_TIMES[@]}"; do printf '  %s\n' "$t"; done
}

# ---- checkpoint steps 0-2 (appended by the checkpoint issue) -------------------------------------

# onespark_cli, except that --dry-run prints the command even before install.sh has created the CLI.
onespark_step() {
  if [[ $DRY_RUN == 1 ]]; then
    run onespark "$@"
  else
    onespark_cli "$@"
  fi
}
