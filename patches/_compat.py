"""The plugin's version seams: where vLLM 0.19.1 and 0.32.0 differ for a hook, one named function here.

Everything else in patches/ is written once against what both versions share. Each seam is keyed by the
supported release (`track()`), not by feature probing, so a change in a third vLLM fails loudly here
instead of silently taking the other branch. patches/README.md names each hook's seam ("Seam" field);
tests/test_plugin_ledger.py checks that every seam it names exists in this file.

  track()                 "0.19.1" | "0.32.0": the supported release the installed vLLM is (local suffixes
                          such as +cpu or .dev0+g<sha> allowed); ValueError for any other version.
  register_lm_head(cls)   int8-lm-head: ParallelLMHead is a CustomOp in 0.19.1 and a PluggableLayer in
                          0.32.0; each has its own register_oot (both fill op_registry_oot by class name).
"""

from __future__ import annotations

import re

# The default track (reproduces the published tables) first; then the current one.
SUPPORTED_VLLM: tuple[str, ...] = ("0.19.1", "0.32.0")


def supported_release(version: str) -> str | None:
    """'0.32.0+cpu' -> '0.32.0'; None for anything that is not a build of a supported release (0.19.10,
    0.32.1, 0.19)."""
    for release in SUPPORTED_VLLM:
        if re.fullmatch(re.escape(release) + r"([.+].*)?", version):
            return release
    return None


def track(version: str | None = None) -> str:
    if version is None:
        import vllm

        version = vllm.__version__
    release = supported_release(version)
    if release is None:
        raise ValueError(f"vLLM {version} is none of the supported {', '.join(SUPPORTED_VLLM)}")
    return release


def register_lm_head(cls: type, name: str) -> None:
    """Register `cls` as the out-of-tree replacement of vLLM's class `name` (ParallelLMHead)."""
    import vllm
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    release = supported_release(vllm.__version__)
    if release is None:  # only under ONESPARK_ALLOW_ANY_VLLM=1 (register() refuses otherwise): try what it is
        from vllm.model_executor.custom_op import PluggableLayer

        base = CustomOp if issubclass(ParallelLMHead, CustomOp) else PluggableLayer
    elif release == "0.19.1":
        base = CustomOp
    else:
        from vllm.model_executor.custom_op import PluggableLayer as base
    if not issubclass(ParallelLMHead, base):  # the seam's premise; a mismatch means a build we do not know
        raise RuntimeError(f"onespark: vLLM {vllm.__version__}'s ParallelLMHead is not a {base.__name__}")
    base.register_oot(cls, name=name)

