#!/usr/bin/env bash
# The arm64 lane: build the Spark's default-track images (Dockerfile.base's vllm-wheels stage, Dockerfile.v2,
# Dockerfile.v2-tq) for linux/arm64 and check them without a GPU; on an x86_64 host under qemu-user emulation.
#   tests/arm64.sh [--no-cache] [--out FILE] [--logs DIR]
# Needs Docker (bash .ci/docker-up.sh) and, on x86_64, qemu-user-static 10+ (Debian 12: from bookworm-backports; its
# own 7.2 crashes loading torch) + binfmt-support. Run it when a Dockerfile,
# a pin (docker/vllm-0.32.0.lock.txt, demo/cuda-standin.txt) or the plugin's import path changes, and commit its
# result (bench/results/arm64_images.json). What it builds and checks: tests/arm64_lane.py's docstring and
# docs/guides/tracks.md ("The arm64 lane").
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 tests/arm64_lane.py "$@"
