#!/usr/bin/env bash
# Step 1: splice the FP8 shared experts into the INT4 checkpoint: WORK/int4 + WORK/fp8 -> WORK/hybrid.
# Streams bytes (no shard in memory), resumes after an interruption, writes onespark-manifest.json last.
# Already done when every file the manifest lists is intact (onespark hybrid decides; a damaged one is rewritten).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

WORK=
MODEL=$MODEL_DEFAULT

usage() {
  cat <<USAGE
usage: steps/1-hybrid.sh [--model NAME] [--work DIR] [--dry-run]

  --model NAME model spec (onespark specs; default: $MODEL_DEFAULT); a spec without an FP8 source skips this step
  --work DIR   reads DIR/int4 and DIR/fp8 (step 0), writes DIR/hybrid (default: $ONESPARK_ROOT/.work, and
               .work/NAME for a model other than the default)
  --dry-run    print the command, run nothing
  -h, --help   this text

Needs ~72 GB free in DIR (checked before writing).
USAGE
}

main() {
  parse_options checkpoint_option "$@"
  checkpoint_work
  local splice
  splice=$(spec_get "$MODEL" splice) || exit 2
  if [[ $splice != True ]]; then
    say "step 1 skipped for $MODEL: $(spec_get "$MODEL" no_splice)"
    return 0
  fi
  # No manifest shortcut here: `onespark hybrid` decides "already done" itself, from every file the manifest
  # lists (sizes, headers), and rewrites only what is damaged.
  onespark_step hybrid --int4 "$WORK/int4" --fp8 "$WORK/fp8" --out "$WORK/hybrid" --model "$MODEL"
}

main "$@" || exit 1
