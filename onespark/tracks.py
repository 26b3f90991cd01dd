"""The vLLM releases onespark supports: what images, serve, cluster, the plugin and the tests read.

Standard library only: `onespark cluster` reads an image's vLLM label with it before any venv exists, and the
plugin's version seam (patches/_compat.py) imports it inside every vLLM process.
"""

from __future__ import annotations

import re

# The source-build track (reproduces the published tables) first; then the wheels track.
SUPPORTED_VLLM: tuple[str, ...] = ("0.19.1", "0.32.0")
# What ./install.sh builds without --vllm (steps/lib.sh VLLM_DEFAULT): official aarch64 CUDA 13 wheels, no compile.
DEFAULT_VLLM = "0.32.0"


def release_of(version: str, releases: tuple[str, ...]) -> str | None:
    """The release of `releases` that `version` is a build of (local suffixes such as +cpu allowed), or None."""
    for release in releases:
        if re.fullmatch(re.escape(release) + r"([.+].*)?", version):
            return release
    return None


def supported_release(version: str) -> str | None:
    """'0.32.0+cpu' -> '0.32.0'; None for anything that is not a build of a supported release (0.19.10,
    0.32.1, 0.19, and the GPU lane's 0.26.0: see patches/_compat.lane_release)."""
    return release_of(version, SUPPORTED_VLLM)
