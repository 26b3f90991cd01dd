#!/usr/bin/env bash
# Step 2: make every mtp.* tensor of WORK/hybrid loadable (listed in the index at the file that holds it;
# model_extra_tensors.safetensors copied from WORK/int4 if it went missing), then verify the checkpoint.
# `onespark mtp` says "already done" when there is nothing to change.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

WORK=$ONESPARK_ROOT/.work
VERIFY=(--fast)

usage() {
  cat <<USAGE
usage: steps/2-mtp.sh [--work DIR] [--full-verify] [--dry-run]

  --work DIR      fixes DIR/hybrid, using DIR/int4 as the source of the MTP head (default: $WORK)
  --full-verify   also check every file's sha256 against the manifest (default: sizes only, fast)
  --dry-run       print the commands, run nothing
  -h, --help      this text
USAGE
}

parse_args() {
  while (($#)); do
    case $1 in
      --work) need_value "$@"; WORK=$2; shift ;;
      --full-verify) VERIFY=() ;;
      --dry-run) DRY_RUN=1 ;;
      -h | --help) usage; exit 0 ;;
      *) err "unknown option: $1"; usage >&2; exit 2 ;;
    esac
    shift
  done
}

main() {
  parse_args "$@"
  [[ $DRY_RUN == 1 || -d $WORK/hybrid ]] || die "$WORK/hybrid does not exist: run steps/1-hybrid.sh first"
  onespark_step mtp "$WORK/hybrid" --source "$WORK/int4"
  onespark_step verify "$WORK/hybrid" "${VERIFY[@]}"
}

main "$@" || exit 1
