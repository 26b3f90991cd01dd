"""INT8 LM head for vLLM 0.19.1 and 0.32.0 through the head's `register_oot` (no vLLM file is edited).

`install()` registers `OnesparkParallelLMHead` under the name "ParallelLMHead" (0.19.1: `CustomOp.register_oot`;
0.32.0, where ParallelLMHead is a PluggableLayer: `PluggableLayer.register_oot`; the seam is
`patches._compat.register_lm_head`): from then on every
`ParallelLMHead(...)` that vLLM's model code constructs (target and MTP draft) is ours. It builds exactly
what vLLM builds (same BF16 `weight` parameter, same weight_loader, same vocab padding and TP shard
indices) and then, where the head is an ordinary unquantized one, swaps in `Int8LMHeadMethod`:

- process_weights_after_loading (vLLM calls it after the checkpoint is read, before it profiles memory
  and sizes the KV cache): quantize this rank's [N/tp, K] shard per row (onespark.kernels), keep
  `onespark_w_int8` + `onespark_w_scale` as buffers, replace `weight` with an empty tensor so the BF16
  bytes are freed, and log the bytes freed.
- apply (vLLM's LogitsProcessor._get_logits and get_top_tokens call `lm_head.quant_method.apply`):
  this shard's logits with the INT8 kernel (CUDA) or its plain-torch reference (CPU). vLLM's own code
  still gathers the shards across TP ranks and slices off the vocab padding, so TP > 1 stays correct.

Left stock (logged): heads whose checkpoint already quantizes them (quant method not unquantized), and
heads tied to the input embedding (the embedding keeps the BF16 weight, so nothing would be freed).

MTP: vLLM's EagleProposer._maybe_share_lm_head (0.32.0: inherited from SpecDecodeBaseProposer, same code for
MTP drafts: "Detected MTP model. Sharing target model lm_head weights") sets `draft.lm_head = target.lm_head`
(and every MTP layer's `shared_head.head`) to the target's module, so the draft computes its logits through
this same INT8 method; on 0.32.0 the draft's greedy path (LocalArgmaxMixin.get_top_tokens ->
LogitsProcessor._apply_head) calls the same `quant_method.apply`. The draft's own head (loaded from the same lm_head.weight) is quantized too and then
dropped by that assignment; nothing of the target's head is zeroed, only its BF16 copy is released.
"""

from __future__ import annotations

import logging

import torch
from torch.nn import Parameter
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

from onespark.patches._compat import register_lm_head
from onespark.patches.int8_head import int8_logits, quantize_head

logger = logging.getLogger("vllm.onespark")

OOT_NAME = "ParallelLMHead"  # the in-tree class name CustomOp.__new__ looks up in op_registry_oot


class Int8LMHeadMethod(QuantizeMethodBase):
    """Per-row INT8 weight, logits through onespark.patches.int8_head.int8_logits."""

    def create_weights(self, layer, *args, **kwargs):
        # The stock unquantized method created `weight` before this one was swapped in (same layout).
        UnquantizedEmbeddingMethod().create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.weight
        if w.is_meta or w.numel() == 0:  # dummy/missing layer (pipeline stage without a head)
            return
        w_int8, scale = quantize_head(w.data)
        # Persistent buffers: vLLM 0.32.0's in-place reload (reload_weights: RL weight sync, sleep mode level 2)
        # runs this method on a fresh copy of the layer and copies the result into the old tensors, leaving out
        # non-persistent buffers; as those the old head stayed after a reload (tests/test_plugin_reload.py).
        layer.register_buffer("onespark_w_int8", w_int8)
        layer.register_buffer("onespark_w_scale", scale)
        freed = w.numel() * w.element_size()
        held = w_int8.numel() * w_int8.element_size() + scale.numel() * scale.element_size()
        # Keep a `weight` attribute (vLLM code checks hasattr(lm_head, "weight")), but without bytes.
        layer.weight = Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)
        del w
        layer.onespark_bytes_freed = freed
        logger.info(
            "onespark: INT8 LM head %s in use: [%d x %d] %s -> int8 + fp32 row scales; freed %d bytes of "
            "%s weight, holds %d bytes (saves %d bytes, %.2f GiB)",
            getattr(layer, "onespark_prefix", "lm_head"), w_int8.shape[0], w_int8.shape[1],
            str(layer.weight.dtype).replace("torch.", ""), freed, str(layer.weight.dtype).replace("torch.", ""),
            held, freed - held, (freed - held) / 2**30,
        )

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_logits(x, layer.onespark_w_int8, layer.onespark_w_scale, bias)


def _tied_embeddings() -> bool:
    vllm_config = get_current_vllm_config_or_none()
    model_config = getattr(vllm_config, "model_config", None)
    text_config = getattr(model_config, "hf_text_config", None)
    return bool(getattr(text_config, "tie_word_embeddings", False))


class OnesparkParallelLMHead(ParallelLMHead):
    """vLLM's ParallelLMHead, with Int8LMHeadMethod where it applies (see the module docstring)."""

    def __init__(self, *args, prefix: str = "", **kwargs):
        super().__init__(*args, prefix=prefix, **kwargs)
        self.onespark_prefix = prefix or "lm_head"
        stock = type(self.quant_method)
        if stock not in (UnquantizedEmbeddingMethod, UnquantizedLinearMethod):
            logger.info("onespark: LM head %s is quantized by the checkpoint (%s): INT8 head not applied",
                        self.onespark_prefix, stock.__name__)
            return
        if _tied_embeddings():
            logger.info("onespark: LM head %s is tied to the input embedding: INT8 head not applied "
                        "(the embedding keeps the BF16 weight, nothing would be freed)", self.onespark_prefix)
            return
        self.quant_method = Int8LMHeadMethod()


def install() -> None:
    """Register the OOT head once per process; refuse if another plugin already replaced ParallelLMHead."""
    current = op_registry_oot.get(OOT_NAME)
    if current is OnesparkParallelLMHead:
        return
    if current is not None:
        raise RuntimeError(
            f"onespark: {OOT_NAME} is already replaced by {current.__module__}.{current.__qualname__} "
            f"(another vLLM plugin): set ONESPARK_INT8_LM_HEAD=0, or remove that plugin from VLLM_PLUGINS"
        )
    register_lm_head(OnesparkParallelLMHead, OOT_NAME)
