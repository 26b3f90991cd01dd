#!/usr/bin/env bash
# Step 4: the serving images. Dockerfile.v2 FROM the step-3 base (VLLM_BASE), and with --tq Dockerfile.v2-tq
# FROM v2. Skips an image whose fingerprint label (its Dockerfile, the onespark sources, the base image id)
# matches; --no-cache rebuilds.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ONESPARK_ROOT/pyproject.toml")
BASE=${ONESPARK_BASE_IMAGE:-onespark/vllm-base:0.19.1-cu130-sm121}
V2=onespark/v2:$VERSION
V2_TQ=onespark/v2-tq:$VERSION
DEMO_BASE=onespark-demo/vllm-cpu:0.19.1
DEMO_V2=onespark-demo/v2:$VERSION
LABEL_KEY=dev.onespark.fingerprint
# What the v2 image contains from this checkout.
SOURCES=(pyproject.toml README.md LICENSE onespark kernels patches bench docker)

usage() {
  cat <<USAGE
usage: steps/4-images.sh [options]
  --base NAME:TAG   the vLLM base image, passed as VLLM_BASE (default: $BASE; with --demo: $DEMO_BASE)
  --tag NAME:TAG    the v2 image (default: $V2; with --demo: $DEMO_V2)
  --tq              also build Dockerfile.v2-tq as $V2_TQ (TurboQuant)
  --demo            build v2 on the CPU stand-in base from step 3 --demo
  --no-cache        rebuild even if the images exist
  --dry-run         print the commands, run nothing
  -h, --help        this text
USAGE
}

# build_image TAG DOCKERFILE FROM_IMAGE BUILD_ARG_NAME
build_image() {
  local tag=$1 dockerfile=$2 from=$3 arg=$4 from_id fp
  from_id=$from
  if [[ $DRY_RUN != 1 ]]; then
    from_id=$(docker image inspect --format '{{.Id}}' "$from" 2>/dev/null) \
      || die "base image $from not found: run steps/3-base-image.sh first (or pass --base)"
  fi
  fp=$(fingerprint "$dockerfile" "${SOURCES[@]}" "$from_id")
  if [[ $DRY_RUN != 1 && $NO_CACHE == 0 && $(image_label "$tag" "$LABEL_KEY") == "$fp" ]]; then
    say "step 4: $tag is up to date ($LABEL_KEY=$fp), skipping"
    return 0
  fi
  local -a args=(docker build --network host --build-arg "$arg=$from" --label "$LABEL_KEY=$fp")
  ((NO_CACHE)) && args+=(--no-cache)
  args+=(-f "$dockerfile" -t "$tag" .)
  say "step 4: building $tag from $dockerfile on $from"
  timed "docker build $tag" "${args[@]}"
}

main() {
  local tq=0 demo=0 base="" tag=""
  NO_CACHE=0
  while (($#)); do
    case $1 in
      --base) base=${2:?--base needs a value}; shift ;;
      --tag) tag=${2:?--tag needs a value}; shift ;;
      --tq) tq=1 ;;
      --demo) demo=1 ;;
      --no-cache) NO_CACHE=1 ;;
      --dry-run) DRY_RUN=1 ;;
      -h|--help) usage; return 0 ;;
      *) err "unknown option: $1"; usage >&2; return 2 ;;
    esac
    shift
  done
  cd "$ONESPARK_ROOT" || die "cannot cd to $ONESPARK_ROOT"
  [[ $DRY_RUN == 1 ]] || need_cmd docker "install Docker: https://docs.docker.com/engine/install/"
  if ((demo)); then
    base=${base:-$DEMO_BASE}
    tag=${tag:-$DEMO_V2}
  else
    base=${base:-$BASE}
    tag=${tag:-$V2}
  fi
  build_image "$tag" Dockerfile.v2 "$base" VLLM_BASE
  if ((tq)); then
    build_image "${tag/\/v2:/\/v2-tq:}" Dockerfile.v2-tq "$tag" ONESPARK_V2
  fi
  timing_summary
}

main "$@" || exit $?; exit 0
