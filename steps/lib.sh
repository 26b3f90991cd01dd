# shellcheck shell=bash
# Shared helpers for install.sh, steps/*.sh and demo/rootfs.sh. Sourced, never run.
# Conventions: progress on stdout, errors on stderr; every external command through `run`
# so --dry-run prints it instead; a step is "done" when its check function says so.

ONESPARK_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY_RUN=${DRY_RUN:-0}

say() { printf 'onespark: %s\n' "$*"; }
err() { printf 'onespark: error: %s\n' "$*" >&2; }
die() { err "$@"; exit 1; }

# ---- command lines: one option loop for install.sh, steps/*.sh and demo/rootfs.sh ----------------------

# A wrong command line: one line on stderr and exit 2 (from anywhere, also inside `main "$@" || exit 1`).
usage_error() { err "$@"; exit 2; }

# parse_options HANDLER "$@": every script's option loop. --dry-run and -h/--help are everyone's; any other word
# goes to `HANDLER "$@"`, which handles one option of its script and returns 1 when the word is none of them (an
# unknown option: one error line, then usage, on stderr). A handler whose option takes a value calls
# `need_value "$@"` and reads the value as $2. Each script defines usage().
parse_options() {
  local handler=$1
  shift
  while (($#)); do
    OPTION_WORDS=1
    case $1 in
      --dry-run) DRY_RUN=1 ;;
      -h | --help) usage; exit 0 ;;
      *) "$handler" "$@" || { unknown_option "$1"; usage >&2; exit 2; } ;;
    esac
    shift "$OPTION_WORDS"
  done
}

# The error line for a word no handler took. A word with `=` is shown without its value: `--api-key=KEY` (or
# `HF_TOKEN=...` given as an argument) would otherwise print a secret.
unknown_option() {
  case $1 in
    --*=*) err "unknown option: ${1%%=*}=... (an option's value is the next word: ${1%%=*} VALUE)" ;;
    *=*) err "unknown option: ${1%%=*}=... (an environment variable goes before the command: ${1%%=*}=... $0)" ;;
    *) err "unknown option: $1" ;;
  esac
}

# need_value "$@" in a handler: the option in $1 takes the next word as its value, so it must have one. Names the
# option (bash's own ${2:?} says "line 65: 2: ..."), also when the next word is another option (`--work --demo`).
need_value() {
  if (($# < 2)) || [[ -z $2 ]]; then
    usage_error "$1 needs a value (see $0 --help)"
  elif [[ $2 == --* ]]; then
    usage_error "$1 needs a value, got the option $2 (see $0 --help)"
  fi
  OPTION_WORDS=2
}

# need_count "$@" in a handler: as need_value, for a whole number of at least 1 (jobs, threads).
need_count() {
  need_value "$@"
  [[ $2 =~ ^[1-9][0-9]{0,5}$ ]] || usage_error "$1 $2: give a whole number of at least 1 (see $0 --help)"
}

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

# The two pinned vLLM tracks (patches/_compat.py SUPPORTED_VLLM): 0.32.0, the default, installs official aarch64
# CUDA 13 wheels (Dockerfile.base, stage vllm-wheels: no compile, its arm64 images built and checked by
# tests/arm64.sh); 0.19.1 reproduces the published tables from a source build of about an hour (stage vllm-base).
VLLM_TRACKS=(0.19.1 0.32.0)
VLLM_DEFAULT=0.32.0
# The source-build track: its diffs carry no version in their names (patches/turboquant.diff).
# shellcheck disable=SC2034  # read by the scripts that source this file
VLLM_SOURCE=0.19.1
# The base image label that names the track; steps/4-images.sh refuses a base of the other track by it.
# shellcheck disable=SC2034  # read by the scripts that source this file
TRACK_LABEL=dev.onespark.vllm.track

check_track() {
  local t
  for t in "${VLLM_TRACKS[@]}"; do [[ $1 == "$t" ]] && return 0; done
  usage_error "--vllm must be one of ${VLLM_TRACKS[*]}, got '$1'"
}

# Steps 3-4's shared options (a parse_options handler), into TRACK, TAG, DEMO and NO_CACHE.
# shellcheck disable=SC2034  # the variables are the steps' (this file is sourced)
image_option() {
  case $1 in
    --vllm) need_value "$@"; TRACK=$2 ;;
    --tag) need_value "$@"; TAG=$2 ;;
    --demo) DEMO=1 ;;
    --no-cache) NO_CACHE=1 ;;
    *) return 1 ;;
  esac
}

# Image names per track. The default track's v2 images take the plain names; the other track's carry the vLLM
# version in the tag, so that both tracks' images coexist.
base_tag() { printf 'onespark/vllm-base:%s-cu130-sm121' "$1"; }
demo_base_tag() { printf 'onespark-demo/vllm-cpu:%s' "$1"; }
track_suffix() { [[ $1 == "$VLLM_DEFAULT" ]] || printf -- '-vllm%s' "$1"; }

# Print the value of LABEL on IMAGE, or nothing when the image (or the label) does not exist.
image_label() {
  local image=$1 label=$2
  docker image inspect --format "{{ index .Config.Labels \"$label\" }}" "$image" 2>/dev/null || true
}

# The ID of the image TAG names, or nothing when there is none.
image_id() { docker image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# drop_replaced TAG OLD_ID: after TAG was rebuilt, remove the image it named before (OLD_ID, from image_id) once no
# tag names it; otherwise every rebuild of a base (10-30 GB) stays on Docker's disk, untagged. An image a container
# or another image still uses stays, with one note.
drop_replaced() {
  local tag=$1 old=$2
  [[ -n $old && $old != "$(image_id "$tag")" ]] || return 0
  [[ -z $(docker image inspect --format '{{join .RepoTags " "}}' "$old" 2>/dev/null) ]] || return 0
  if docker image rm "$old" >/dev/null 2>&1; then
    say "removed the image $tag named before this build (${old#sha256:}) to free its disk"
  else
    say "note: the image $tag named before this build (${old#sha256:}) is still used by a container or another" \
      "image: docker image prune removes it once nothing does"
  fi
}

# sha256 (first 16 hex) over the named files' contents and any extra words: what an image was built from.
# Files, not directories: image_sources lists the files a Dockerfile's COPY of a directory takes.
fingerprint() {
  local -a files=() words=()
  local a
  for a in "$@"; do
    if [[ -f $a ]]; then files+=("$a"); else words+=("$a"); fi
  done
  { printf '%s\n' "${words[@]}"; ((${#files[@]})) && sha256sum -- "${files[@]}"; } | sha256sum | cut -c1-16
}

# image_sources DOCKERFILE: the files its COPY lines take from the build context: what the image is built from,
# and so what its fingerprint covers. COPY lines here are plain `COPY SRC... DEST` (Dockerfile.v2's form).
image_sources() {
  local -a words srcs=()
  local line
  while read -r line; do
    read -ra words <<<"$line"
    srcs+=("${words[@]:1:${#words[@]}-2}")
  done < <(grep '^COPY ' "$ONESPARK_ROOT/$1")
  if ((${#srcs[@]})); then context_files "${srcs[@]}"; fi
}

# context_files PATH...: the files under PATH... (relative to ONESPARK_ROOT, sorted) that .dockerignore lets
# into the build context. It reads that file in the one form the file keeps: `*`, then `!PATH` lines (what goes
# in), then PATH or **/NAME lines (what stays out of those). tests/test_images.py checks the result against
# Docker's own matching rules, so the build context and the fingerprint cannot drift apart.
context_files() {
  local -a keep=() drop=()
  local line f
  while IFS= read -r line; do
    case $line in
      '' | '#'* | '*') ;;
      '!'*) keep+=("${line#!}") ;;
      *) drop+=("$line") ;;
    esac
  done <"$ONESPARK_ROOT/.dockerignore"
  while IFS= read -r -d '' f; do
    if under "$f" "${keep[@]}" && ! under "$f" "${drop[@]}"; then printf '%s\n' "$f"; fi
  done < <(cd "$ONESPARK_ROOT" && find "$@" -type f -print0 | LC_ALL=C sort -z)
}

# under FILE PATTERN...: FILE is one of the PATTERNs or lies below one; **/NAME means NAME at any depth.
under() {
  local f=$1 p
  shift
  for p in "$@"; do
    p=${p%/}
    if [[ $p == '**/'* ]]; then
      [[ /$f/ == */${p#'**/'}/* ]] && return 0  # unquoted: NAME is a glob (*.pyc)
    elif [[ $f == "$p" || $f == "$p"/* ]]; then
      return 0
    fi
  done
  return 1
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

# Steps 0-2's shared options (a parse_options handler): --model NAME, --work DIR (default: checkpoint_work's).
checkpoint_option() {
  case $1 in
    --work) need_value "$@"; WORK=$2 ;;
    --model) need_value "$@"; MODEL=$2 ;;
    *) return 1 ;;
  esac
}

# work_dir WHAT DIR: DIR made absolute, or one line naming WHAT and exit 2 (call it as WORK=$(work_dir ...) || exit 2).
# A work directory becomes docker's `-v SRC:/model:ro` (split at ':'), the worker's rsync destination and the
# commands a plan prints, so it holds no blank, quote, ':' or ';'; and it is no option: `--work -L` (a value
# forgotten) was an option of realpath, or of the onespark command a step runs.
work_dir() {
  local what=$1 dir=$2
  local fix="use letters, digits and / . _ - + @ only (a blank, a quote, ':' or ';' breaks docker's -v or the printed commands), e.g. --work /data/onespark"
  [[ $dir != -* ]] || usage_error "$what: a directory, not an option (a value missing before it?): $fix"
  dir=$(realpath -m -- "$dir") || usage_error "$what: realpath cannot resolve it: $fix"
  [[ $dir =~ ^[[:alnum:]/._+@%=~-]+$ ]] || usage_error "$what: $fix"
  printf '%s' "$dir"
}

# After parse_options: --work checked (work_dir; kept as given), or without it MODEL's directory under .work.
checkpoint_work() {
  if [[ -n $WORK ]]; then
    work_dir "--work '$WORK'" "$WORK" >/dev/null || exit 2
  else
    WORK=$(model_work "$ONESPARK_ROOT/.work" "$MODEL") || exit 2
  fi
}

# onespark_cli, except that --dry-run prints the command even before install.sh has created the CLI.
onespark_step() {
  if [[ $DRY_RUN == 1 ]]; then
    run onespark "$@"
  else
    onespark_cli "$@"
  fi
}

# ---- model specs (onespark/model/specs.py: repos, pins, sizes, MTP layout, serving defaults per model) ---------

# shellcheck disable=SC2034  # read by install.sh and steps/0-2 (this file is sourced)
MODEL_DEFAULT=qwen3.5-122b-a10b

# spec_get MODEL FIELD: one field of a model spec. The system python3 reads onespark/model/specs.py (standard
# library only), so this works before install.sh has built the host virtualenv, and in --dry-run. An unknown
# MODEL prints the one-line list of specs; callers assign with `x=$(spec_get ...) || exit 2`.
spec_get() {
  PYTHONPATH=$ONESPARK_ROOT python3 -m onespark specs --model "$1" --get "$2"
}

# model_work BASE MODEL: where MODEL's checkpoints go under BASE: BASE itself for the default spec (the layout
# earlier versions wrote, so an existing install resumes), BASE/MODEL for every other model.
model_work() {
  local sub
  sub=$(spec_get "$2" work_subdir) || return 2
  printf '%s' "$1${sub:+/$sub}"
}
