#!/usr/bin/env bash
# Step 2: make every mtp.* tensor of WORK/hybrid loadable (listed in the index at the file that holds it;
# model_extra_tensors.safetensors copied from WORK/int4 if it went missing), then verify the checkpoint.
# `onespark mtp` says "already done" when there is nothing to change.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

WORK=
MODEL=$MODEL_DEFAULT
VERIFY=(--fast)

option() {
  case $1 in
    --full-verify) VERIFY=() ;;
    *) checkpoint_option "$@" ;;
  esac
}

usage() {
  cat <<USAGE
usage: steps/2-mtp.sh [--model NAME] [--work DIR] [--full-verify] [--dry-run]

  --model NAME    model spec (onespark specs; default: $MODEL_DEFAULT); without a splice it fixes DIR/int4
  --work DIR      fixes DIR/hybrid, using DIR/int4 as the source of the MTP head (default: $ONESPARK_ROOT/.work,
                  and .work/NAME for a model other than the default)
  --full-verify   also check every file's sha256 against the manifest (default: sizes only, fast)
  --dry-run       print the commands, run nothing
  -h, --help      this text
USAGE
}

main() {
  parse_options option "$@"
  checkpoint_work
  local served
  served=$(spec_get "$MODEL" served_dir) || exit 2
  if [[ $served == int4 ]]; then  # no splice: the download itself is served, and it holds its own head
    [[ $DRY_RUN == 1 || -d $WORK/int4 ]] || die "$WORK/int4 does not exist: run steps/0-download.sh first"
    onespark_step mtp "$WORK/int4" --model "$MODEL"
  else
    [[ $DRY_RUN == 1 || -d $WORK/hybrid ]] || die "$WORK/hybrid does not exist: run steps/1-hybrid.sh first"
    onespark_step mtp "$WORK/hybrid" --source "$WORK/int4" --model "$MODEL"
  fi
  onespark_step draft-vocab "$WORK/$served" --skip-without-tokenizer  # the MTP draft's 32K-token subset
  onespark_step verify "$WORK/$served" "${VERIFY[@]}" --model "$MODEL"
}

main "$@" || exit 1
