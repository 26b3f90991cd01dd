"""Build-time check of a vLLM patched with the track's TurboQuant diff: `python -m onespark.patches.turboquant_check`.

Dockerfile.v2-tq runs it right after `patch`; the tests run it against a patched copy of each track's vLLM. It
checks what serving needs: the plugin registers the backend as vLLM's CUSTOM, and the page size vLLM gives
every preset the diff adds equals the byte layout the backend and kernels address
(onespark.kernels.turboquant.CacheLayout). Prints one line of JSON ({preset: [vLLM's page, the layout's]});
exits 1 with one line naming what disagrees.

How vLLM sizes a page differs by track (patches/README.md, the two TurboQuant entries):
  0.19.1  the diff's TurboQuantAttentionSpec computes it, and has its own block manager;
  0.32.0  a FullAttentionSpec with the diff's KVQuantMode, resized by the backend's customize_spec; upstream's
          own TurboQuant branches must not claim our presets (is_turboquant false).
"""

from __future__ import annotations

import json
import sys

BLOCK, KV_HEADS, HEAD = 16, 2, 256  # one page of Qwen3.5's full-attention layer


def pages() -> dict[str, list[int]]:
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import onespark.kernels.turboquant_triton  # noqa: F401  (the kernels import: Triton is there)
    from onespark.kernels import turboquant as tq
    from onespark.patches import _compat, register

    if "turboquant-backend" not in register():
        raise AssertionError("the plugin did not register the TurboQuant backend (ONESPARK_TURBOQUANT_BACKEND=0?)")
    backend = AttentionBackendEnum.CUSTOM.get_class()
    out = {}
    if _compat.track() == "0.19.1":
        import vllm.model_executor.layers.attention.attention  # noqa: F401  (the two modules the diff patches)
        import vllm.model_executor.models.config  # noqa: F401
        from vllm.v1.core.single_type_kv_cache_manager import spec_manager_map
        from vllm.v1.kv_cache_interface import TurboQuantAttentionSpec as Spec

        if Spec not in spec_manager_map:
            raise AssertionError("no block manager for TurboQuantAttentionSpec")
        for name, preset in tq.PRESETS.items():
            spec = Spec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.uint8, cache_dtype_str=name)
            out[name] = [spec.page_size_bytes, backend.get_kv_cache_shape(1, BLOCK, KV_HEADS, HEAD, name)[1],
                         tq.CacheLayout(preset, KV_HEADS, BLOCK).block_bytes]
    else:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

        for name in ("turboquant_k4v4", "turboquant_k4v3"):  # the 0.32.0 diff's presets (k8v4 is vLLM's own there)
            mode = get_kv_quant_mode(name)
            if mode.is_turboquant:
                raise AssertionError(f"vLLM's own TurboQuant code claims {name}: the 0.32.0 diff did not apply")
            spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.uint8,
                                     kv_quant_mode=mode)
            out[name] = [backend.customize_spec(spec).page_size_bytes,
                         tq.CacheLayout(tq.PRESETS[name], KV_HEADS, BLOCK).block_bytes]
    bad = {n: v for n, v in out.items() if len(set(v)) != 1}
    if bad:
        raise AssertionError(f"page sizes disagree (vLLM, ..., the kernels' layout): {bad}")
    return out


def main() -> int:
    try:
        result = pages()
    except (AssertionError, ImportError) as e:
        print(f"onespark turboquant check: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
