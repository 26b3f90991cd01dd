"""Checkpoint helpers the step tests share: a synthetic INT4 + FP8 release pair, and a directory's tensors read
back with the `safetensors` library (the real reader, not ours)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from onespark.checkpoint.synth import synth


def load_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            for k in g.keys():
                out[k] = g.get_tensor(k)
    return out


def synth_pair(d: Path, seed: int) -> Path:
    """d/int4 and d/fp8: the default spec's tiny INT4 release (MTP 16-bit, not in the index) and its FP8
    release, from one seed, so the FP8 shared experts quantize the INT4 checkpoint's BF16 ones."""
    synth(d / "int4", "int4", seed=seed)
    synth(d / "fp8", "fp8", seed=seed)
    return d
