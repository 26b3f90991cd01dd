#!/usr/bin/env bash
# Step 3: the vLLM base image. On a Spark: Dockerfile.base (vLLM 0.19.1 from source for SM121, ~1 h the
# first time). With --demo: the CPU stand-in (demo/rootfs.sh + demo/Dockerfile.cpu-base, a few minutes).
# Skips when an image with the expected fingerprint label already exists; --no-cache rebuilds.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

BASE_IMAGE_TAG=${ONESPARK_BASE_IMAGE:-onespark/vllm-base:0.19.1-cu130-sm121}
DEMO_BASE_IMAGE_TAG=onespark-demo/vllm-cpu:0.19.1
MAX_JOBS=${MAX_JOBS:-12}
NVCC_THREADS=${NVCC_THREADS:-2}
LABEL_KEY=dev.onespark.fingerprint

usage() {
  cat <<USAGE
usage: steps/3-base-image.sh [options]
  --tag NAME:TAG      image to build (default: $BASE_IMAGE_TAG; with --demo: $DEMO_BASE_IMAGE_TAG)
  --demo              build the CPU stand-in (Debian rootfs + vllm-cpu 0.19.1) instead of the GB10 image
  --max-jobs N        parallel compile jobs (default: $MAX_JOBS; lower it if the build is OOM-killed)
  --nvcc-threads N    threads per nvcc (default: $NVCC_THREADS)
  --no-cache          rebuild even if the image exists (docker build --no-cache)
  --dry-run           print the commands, run nothing
  -h, --help          this text
USAGE
}

main() {
  local demo=0 no_cache=0 tag=""
  while (($#)); do
    case $1 in
      --tag) tag=${2:?--tag needs a value}; shift ;;
      --demo) demo=1 ;;
      --max-jobs) MAX_JOBS=${2:?--max-jobs needs a value}; shift ;;
      --nvcc-threads) NVCC_THREADS=${2:?--nvcc-threads needs a value}; shift ;;
      --no-cache) no_cache=1 ;;
      --dry-run) DRY_RUN=1 ;;
      -h|--help) usage; return 0 ;;
      *) err "unknown option: $1"; usage >&2; return 2 ;;
    esac
    shift
  done
  cd "$ONESPARK_ROOT" || die "cannot cd to $ONESPARK_ROOT"
  local dockerfile fp
  local -a args=(docker build --network host)
  if ((demo)); then
    tag=${tag:-$DEMO_BASE_IMAGE_TAG}
    dockerfile=demo/Dockerfile.cpu-base
    # The rootfs first (it skips itself when up to date): the base is only current for this rootfs.
    local -a rootfs=(demo/rootfs.sh)
    ((no_cache)) && rootfs+=(--no-cache)
    [[ $DRY_RUN == 1 ]] && rootfs+=(--dry-run)
    timed "demo rootfs (debootstrap + docker import)" "${rootfs[@]}"
    local rootfs_id=onespark-demo/debian:bookworm
    if [[ $DRY_RUN != 1 ]]; then
      rootfs_id=$(docker image inspect --format '{{.Id}}' onespark-demo/debian:bookworm) \
        || die "demo rootfs image missing after demo/rootfs.sh"
    fi
    fp=$(fingerprint "$dockerfile" tests/requirements.txt tests/overrides.txt "$rootfs_id")
  else
    tag=${tag:-$BASE_IMAGE_TAG}
    dockerfile=Dockerfile.base
    fp=$(fingerprint "$dockerfile" "MAX_JOBS=$MAX_JOBS" "NVCC_THREADS=$NVCC_THREADS")
    # BuildKit: Dockerfile.base uses cache mounts and a heredoc. Spark's Docker has buildx.
    args=(env DOCKER_BUILDKIT=1 "${args[@]}" --target vllm-base
          --build-arg "MAX_JOBS=$MAX_JOBS" --build-arg "NVCC_THREADS=$NVCC_THREADS")
  fi
  if [[ $DRY_RUN != 1 ]]; then
    need_cmd docker "install Docker: https://docs.docker.com/engine/install/ (DGX OS ships it)"
    if ((no_cache == 0)) && [[ $(image_label "$tag" "$LABEL_KEY") == "$fp" ]]; then
      say "step 3: $tag is up to date ($LABEL_KEY=$fp), skipping"
      return 0
    fi
  fi
  ((no_cache)) && args+=(--no-cache)
  args+=(--label "$LABEL_KEY=$fp" -f "$dockerfile" -t "$tag" .)
  say "step 3: building $tag from $dockerfile"
  timed "docker build $tag" "${args[@]}"
  timing_summary
}

main "$@" || exit $?; exit 0
