#!/usr/bin/env bash
# Step 4: the serving images of a track (--vllm). Dockerfile.v2 FROM the step-3 base (VLLM_BASE), and with --tq
# Dockerfile.v2-tq FROM v2. A base whose dev.onespark.vllm.track label names another track is refused. Skips an
# image whose fingerprint label (its Dockerfile, the files its COPY lines take from the build context, the base
# image id) matches; --no-cache rebuilds.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ONESPARK_ROOT/pyproject.toml")
LABEL_KEY=dev.onespark.fingerprint
TRACK=$VLLM_DEFAULT
BASE=
TAG=
TQ=0
DEMO=0
NO_CACHE=0

option() {
  case $1 in
    --base) need_value "$@"; BASE=$2 ;;
    --tq) TQ=1 ;;
    *) image_option "$@" ;;
  esac
}

usage() {
  cat <<USAGE
usage: steps/4-images.sh [options]
  --vllm VERSION    the vLLM track: ${VLLM_TRACKS[*]} (default: $VLLM_DEFAULT); the base image must carry
                    the label $TRACK_LABEL=VERSION (step 3 sets it)
  --base NAME:TAG   the vLLM base image, passed as VLLM_BASE (default: $(base_tag "$VLLM_DEFAULT"), $(base_tag "$VLLM_SOURCE");
                    with --demo: $(demo_base_tag "$VLLM_DEFAULT"), $(demo_base_tag "$VLLM_SOURCE"))
  --tag NAME:TAG    the v2 image (default: onespark/v2:$VERSION, onespark/v2:$VERSION$(track_suffix "$VLLM_SOURCE");
                    with --demo: onespark-demo/v2:$VERSION, onespark-demo/v2:$VERSION$(track_suffix "$VLLM_SOURCE"))
  --tq              also build Dockerfile.v2-tq as the same tag with v2-tq for v2 (TurboQuant)
  --demo            build v2 on the CPU stand-in base from step 3 --demo
  --no-cache        rebuild even if the images exist
  --dry-run         print the commands, run nothing
  -h, --help        this text
USAGE
}

# The track an image was built for (its label), checked before anything is built on it: a v2 build on a base
# of the other track would fail later, at run time or in the plugin's version guard.
check_base_track() {
  local image=$1 track=$2 got
  got=$(image_label "$image" "$TRACK_LABEL")
  [[ $got == "$track" ]] && return 0
  if [[ -z $got ]]; then
    die "$image has no $TRACK_LABEL label (built by an older onespark): rebuild it with steps/3-base-image.sh --vllm $track --no-cache"
  fi
  die "$image is a vLLM $got base, not $track: pass --vllm $got, or build the $track base first (steps/3-base-image.sh --vllm $track)"
}

# build_image TAG DOCKERFILE FROM_IMAGE BUILD_ARG_NAME TRACK
build_image() {
  local tag=$1 dockerfile=$2 from=$3 arg=$4 track=$5 from_id fp
  from_id=$from
  if [[ $DRY_RUN != 1 ]]; then
    from_id=$(docker image inspect --format '{{.Id}}' "$from" 2>/dev/null) \
      || die "base image $from not found: run steps/3-base-image.sh$([[ $track == "$VLLM_DEFAULT" ]] || printf ' --vllm %s' "$track") first (or pass --base)"
    check_base_track "$from" "$track"
  fi
  # What the image holds from this checkout (.dockerignore + the COPY lines): a README edit changes nothing.
  local -a sources
  mapfile -t sources < <(image_sources "$dockerfile")
  fp=$(fingerprint "$dockerfile" "${sources[@]}" "$from_id" "VLLM_VERSION=$track")
  if [[ $DRY_RUN != 1 && $NO_CACHE == 0 && $(image_label "$tag" "$LABEL_KEY") == "$fp" ]]; then
    say "step 4: $tag is up to date ($LABEL_KEY=$fp), skipping"
    return 0
  fi
  local -a args=(docker build --network host --build-arg "$arg=$from" --build-arg "VLLM_VERSION=$track"
                 --label "$LABEL_KEY=$fp" --label "$TRACK_LABEL=$track")
  ((NO_CACHE)) && args+=(--no-cache)
  args+=(-f "$dockerfile" -t "$tag" .)
  say "step 4: building $tag (vLLM $track) from $dockerfile on $from"
  [[ $DRY_RUN == 1 ]] || REPLACED+=("$tag" "$(image_id "$tag")")
  timed "docker build $tag" "${args[@]}"
}

main() {
  parse_options option "$@"
  check_track "$TRACK"
  cd "$ONESPARK_ROOT" || die "cannot cd to $ONESPARK_ROOT"
  # Dockerfile.v2-tq applies the track's TurboQuant diff (patches/turboquant.diff is 0.19.1's).
  local tq_diff=patches/turboquant.diff
  [[ $TRACK == "$VLLM_SOURCE" ]] || tq_diff=patches/turboquant-$TRACK.diff
  if ((TQ)) && [[ ! -f $tq_diff ]]; then
    die "--tq on vLLM $TRACK needs $tq_diff, which this checkout does not have (TurboQuant is not ported to $TRACK yet)"
  fi
  [[ $DRY_RUN == 1 ]] || need_cmd docker "install Docker: https://docs.docker.com/engine/install/"
  if ((DEMO)); then
    BASE=${BASE:-$(demo_base_tag "$TRACK")}
    TAG=${TAG:-onespark-demo/v2:$VERSION$(track_suffix "$TRACK")}
  else
    BASE=${BASE:-$(base_tag "$TRACK")}
    TAG=${TAG:-onespark/v2:$VERSION$(track_suffix "$TRACK")}
  fi
  local tq_tag=${TAG/\/v2:/\/v2-tq:}
  if ((TQ)) && [[ $tq_tag == "$TAG" ]]; then
    usage_error "--tq with --tag $TAG: the v2-tq image is named after the tag with /v2: replaced by /v2-tq:, so give a tag of the form REPO/v2:TAG"
  fi
  REPLACED=()  # (tag, the image it named before) per build
  build_image "$TAG" Dockerfile.v2 "$BASE" VLLM_BASE "$TRACK"
  if ((TQ)); then
    build_image "$tq_tag" Dockerfile.v2-tq "$TAG" ONESPARK_V2 "$TRACK"
  fi
  # v2-tq's old image first: Docker's classic builder makes it a child of v2's, which stays while it exists.
  local i
  for ((i = ${#REPLACED[@]} - 2; i >= 0; i -= 2)); do drop_replaced "${REPLACED[i]}" "${REPLACED[i + 1]}"; done
  timing_summary
}

main "$@" || exit 1
