#!/usr/bin/env bash
# Step 0: download Intel/Qwen3.5-122B-A10B-int4-AutoRound (pinned commit, resumable) to WORK/int4, and
# fetch only the 144 FP8 shared-expert weights + scales of Qwen/Qwen3.5-122B-A10B-FP8 by byte range to
# WORK/fp8. Skipped when both are complete. Safe to interrupt and re-run. --compressor NAME also fetches a
# pinned LLMLingua-2 checkpoint to WORK/llmlingua2/NAME (onespark compress serve).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

WORK=
MODEL=$MODEL_DEFAULT
DRAFTER=mtp
COMPRESSOR=
EXTRA=()

option() {
  case $1 in
    --int4-revision | --fp8-revision | --drafter-revision) need_value "$@"; EXTRA+=("$1" "$2") ;;
    --drafter) need_value "$@"; DRAFTER=$2 ;;
    --compressor) need_value "$@"; COMPRESSOR=$2 ;;
    *) checkpoint_option "$@" ;;
  esac
}

usage() {
  cat <<USAGE
usage: steps/0-download.sh [--model NAME] [--work DIR] [--int4-revision SHA] [--fp8-revision SHA]
                           [--drafter mtp|dflash] [--drafter-revision SHA] [--compressor NAME] [--dry-run]

  --model NAME          model spec (onespark specs; default: $MODEL_DEFAULT)
  --work DIR            checkpoints go to DIR/int4 and DIR/fp8 (default: $ONESPARK_ROOT/.work, and
                        .work/NAME for a model other than the default)
  --int4-revision SHA   commit of the INT4 repo (default: the spec's pin; required where it has none)
  --fp8-revision SHA    commit of the FP8 repo (default: the spec's pin)
  --drafter dflash      also fetch the spec's DFlash drafter to DIR/dflash (vLLM 0.32.0 track; default mtp:
                        nothing to fetch)
  --drafter-revision SHA  commit of the drafter repo (required with --drafter dflash: no public pin)
  --compressor NAME     also fetch a pinned LLMLingua-2 prompt compressor to DIR/llmlingua2/NAME
                        (xlm-roberta-large ~2.2 GB, bert-base ~0.7 GB; for onespark compress serve)
  --dry-run             print the command, run nothing
  -h, --help            this text

Needs ~78 GB free in DIR. HF_TOKEN / HF_ENDPOINT are honoured (huggingface_hub).
USAGE
}

# complete DIR [need_index]: step 0 wrote DIR's record (it does so last), it says complete (a JSON true), and DIR's
# files are still whole: the check `onespark download` makes before it says "already downloaded" (headers parse,
# sizes match, every file the index names is there), with the system python3 like spec_get. A file lost since is
# fetched again, not skipped.
complete() {
  PYTHONPATH=$ONESPARK_ROOT python3 -c 'import sys
from pathlib import Path
from onespark.checkpoint.writer import DOWNLOAD_RECORD, FINISHED_RECORD, load_json, open_checkpoint
d = Path(sys.argv[1])
if load_json(d / DOWNLOAD_RECORD, "download record", "", FINISHED_RECORD)["complete"] is not True:
    sys.exit(1)
open_checkpoint(d, need_index=sys.argv[2] == "1")' "$1" "${2:-1}" >/dev/null 2>&1
}

# Complete when every directory this run asks for is.
done_already() {
  complete "$WORK/int4" &&
    { [[ $SPLICE != True ]] || complete "$WORK/fp8"; } &&
    { [[ $DRAFTER != dflash ]] || complete "$WORK/dflash" 0; } &&
    { [[ -z $COMPRESSOR ]] || complete "$WORK/llmlingua2/$COMPRESSOR" 0; }
}

# check_choice FLAG VALUE CHOICES: VALUE is one of the words in CHOICES, or one line and exit 2. --drafter and
# --compressor are checked here, so that --dry-run refuses a typo as the run itself does (onespark download's
# parser); the names come from onespark/model/specs.py, read with the system python3 as spec_get does.
check_choice() {
  [[ " $3 " == *" $2 "* ]] || usage_error "$1 '$2': expected one of: ${3// /, } (see $0 --help)"
}

spec_names() {  # DRAFTERS or COMPRESSORS: that table's names, one line
  PYTHONPATH=$ONESPARK_ROOT python3 -c 'import sys; from onespark.model import specs
print(*sorted(getattr(specs, sys.argv[1])))' "$1"
}

main() {
  parse_options option "$@"
  checkpoint_work
  check_choice --drafter "$DRAFTER" "$(spec_names DRAFTERS)"
  [[ -z $COMPRESSOR ]] || check_choice --compressor "$COMPRESSOR" "$(spec_names COMPRESSORS)"
  SPLICE=$(spec_get "$MODEL" splice) || exit 2
  if ((${#EXTRA[@]} == 0)) && done_already; then
    say "step 0 already done: $WORK/int4 and $WORK/fp8 are complete"
    return 0
  fi
  local -a drafter=()
  [[ $DRAFTER == mtp ]] || drafter=(--drafter "$DRAFTER")
  local -a compressor=()
  [[ -z $COMPRESSOR ]] || compressor=(--compressor "$COMPRESSOR")
  onespark_step download --dest "$WORK" --model "$MODEL" "${drafter[@]}" "${compressor[@]}" "${EXTRA[@]}"
}

main "$@" || exit 1
