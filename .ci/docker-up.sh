#!/usr/bin/env bash
# Start a Docker engine for the `docker`-marked tests (./install.sh --demo end to end).
# Idempotent: returns at once when an engine already answers. CI calls it from .ci/run; by hand:
#   bash .ci/docker-up.sh
# Needs the Debian packages docker.io and debootstrap (listed in .ci/apt-packages.txt).
# This machine reaches no registry and allows no bridge network, so the engine runs with
# --bridge=none: every build and container uses --network host (or none).
set -euo pipefail

log=${DOCKERD_LOG:-/tmp/onespark-dockerd.log}
timeout_s=${DOCKERD_TIMEOUT_S:-60}

main() {
  if docker info >/dev/null 2>&1; then
    echo "docker-up: engine already running"
    return 0
  fi
  command -v dockerd >/dev/null 2>&1 || { echo "docker-up: dockerd not found: apt-get install -y docker.io" >&2; return 1; }
  # Detached from this shell so that the engine outlives the caller's process group.
  setsid dockerd --bridge=none --iptables=false --ip-forward=false >"$log" 2>&1 < /dev/null &
  echo "docker-up: started dockerd (pid $!, log $log)"
  local waited=0
  until docker info >/dev/null 2>&1; do
    if ((waited >= timeout_s)); then
      echo "docker-up: engine did not answer within ${timeout_s}s; last log lines:" >&2
      tail -n 20 "$log" >&2
      return 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  echo "docker-up: engine ready after ${waited}s ($(docker version --format '{{.Server.Version}}'))"
}

main "$@" || exit 1; exit 0
