"""The plugin's version seams: where vLLM 0.19.1 and 0.32.0 differ for a hook, one named function here.

Everything else in patches/ is written once against what both versions share. Each seam is keyed by the
supported release (`track()`), not by feature probing, so a change in a third vLLM fails loudly here
instead of silently taking the other branch. patches/README.md names each hook's seam ("Seam" field);
tests/test_plugin_ledger.py checks that every seam it names exists in this file.

  track()                 "0.19.1" | "0.32.0": the supported release the installed vLLM is (local suffixes
                          such as +cpu or .dev0+g<sha> allowed), "0.32.0" for the GPU lane's 0.26.0 (its
                          seams are 0.32.0's); ValueError for any other version.
  register_lm_head(cls)   int8-lm-head: ParallelLMHead is a CustomOp in 0.19.1 and a PluggableLayer in
                          0.32.0; each has its own register_oot (both fill op_registry_oot by class name).
  tq_cache_rows(kv_cache) turboquant-backend: the layer's cache as uint8 [blocks, block bytes]. 0.19.1 allocates
                          it so (the backend's get_kv_cache_shape); 0.32.0 hands every backend a [B, H, N, C]
                          view of one int8 buffer (C = the spec's state_content_bytes, from customize_spec).
"""

from __future__ import annotations

from onespark.tracks import SUPPORTED_VLLM, release_of, supported_release

# The GPU lane's vLLM (tests/gpu_vllm/): not a shipped track, the one whose official x86_64 wheel matches the H200
# host's torch 2.11.0+cu130. Every seam takes its 0.32.0 branch on it (ParallelLMHead is a PluggableLayer there
# too); patches/README.md says which hooks apply. The plugin runs on it and says so.
GPU_LANE_VLLM = "0.26.0"


def lane_release(version: str) -> str | None:
    """The release whose seams a vLLM takes: a shipped track's, or "0.32.0" for the GPU lane's 0.26.0."""
    if release_of(version, (GPU_LANE_VLLM,)):
        return "0.32.0"
    return supported_release(version)


def track(version: str | None = None) -> str:
    if version is None:
        import vllm

        version = vllm.__version__
    release = lane_release(version)
    if release is None:
        raise ValueError(f"vLLM {version} is none of the supported {', '.join(SUPPORTED_VLLM)}")
    return release


def register_lm_head(cls: type, name: str) -> None:
    """Register `cls` as the out-of-tree replacement of vLLM's class `name` (ParallelLMHead)."""
    import vllm
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    release = lane_release(vllm.__version__)
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


def tq_cache_rows(kv_cache):
    """One row of bytes per cache block: what onespark.kernels.turboquant.CacheLayout addresses."""
    import torch

    if kv_cache.dim() == 2:  # 0.19.1 (and the GPU lane's stand-in): allocated as rows already
        return kv_cache
    b, h, n, c = kv_cache.shape
    inner = kv_cache[0] if b else kv_cache
    # A block's [H, N, C] bytes must be one dense run (any order inside: only this backend reads them).
    if b and sum((size - 1) * stride for size, stride in zip(inner.shape, inner.stride())) + 1 != h * n * c:
        raise ValueError(f"TurboQuant: KV-cache blocks of shape {tuple(kv_cache.shape)} strides {kv_cache.stride()} "
                         f"are not contiguous: set VLLM_KV_CACHE_LAYOUT=LBHNC")
    rows = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache  # same bytes, int8 buffer
    # element [b, 0, 0, 0] is block b's lowest address (non-negative strides)
    return rows.as_strided((b, h * n * c), (kv_cache.stride(0), 1), rows.storage_offset())
