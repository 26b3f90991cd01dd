"""Hybrid FP8 dispatch: `onespark_hybrid`, an INCConfig subclass (register_quantization_config).

Same code on vLLM 0.19.1 and 0.32.0 (their INCConfig.get_quant_method / from_config / apply_vllm_mapper agree;
0.32.0 turns a None for a MoE layer into UnquantizedFusedMoEMethod as 0.19.1 does).

Selection. `onespark hybrid` (step 1) keeps `quant_method: "auto-round"` and adds
`quantization_config["onespark_fp8"] = {"layers": [HF module names], "weight_block_size": [128, 128],
"activation_scheme": "dynamic", "fmt": "e4m3", "scale_name": "weight_scale_inv", ...}` (onespark.checkpoint.hybrid's
docstring). vLLM (both versions) asks every registered config's `override_quantization_method` before the built-in
ones (config/model.py, `_verify_quantization`); ours answers "onespark_hybrid" for exactly those
checkpoints, so no --quantization flag is needed. Any other checkpoint never reaches this class: stock INC.
An explicit `--quantization inc` (or anything else) is respected.

Dispatch (`get_quant_method(layer, prefix)`), first match wins:
1. a LinearBase whose prefix, or every shard of a merged layer (`gate_up_proj` = gate_proj + up_proj, from
   the model's packed_modules_mapping), is in onespark_fp8.layers -> vLLM's `Fp8LinearMethod` with the
   block size and activation scheme from the checkpoint (block-FP8, dynamic per-token-group activations).
   Some shards FP8 and some not is a broken checkpoint: ValueError naming the shards.
2. `mtp.*` layers that the checkpoint does not mark INT4 (not under block_name_to_quantize, no extra_config
   entry with bits < 16) -> unquantized (UnquantizedLinearMethod; None for fused MoE = vLLM's unquantized
   MoE). Without this, an AutoRound config with no block_name_to_quantize would make vLLM treat the
   16-bit MTP head as INT4.
3. everything else -> INCConfig.get_quant_method, unchanged (routed experts: INT4 GPTQ-Marlin MoE).

Layer names: onespark_fp8.layers are HF names; `apply_vllm_mapper` maps them with the model's
hf_to_vllm_mapper exactly like INC's extra_config (Qwen3.5: model.language_model.X -> language_model.model.X).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.inc import INCConfig

# What step 1 writes; onespark.model.qwen35 imports only the standard library, so the plugin may import it anywhere.
from onespark.model.qwen35 import HYBRID_KEY, SCALE_SUFFIX

logger = logging.getLogger("vllm.onespark")

NAME = "onespark_hybrid"


def _is_mtp(prefix: str) -> bool:
    return prefix == "mtp" or prefix.startswith("mtp.") or ".mtp." in prefix


class OnesparkHybridConfig(INCConfig):
    """INC (AutoRound INT4) plus vLLM block-FP8 for the layers step 1 spliced in."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fp8_layers: frozenset[str] = frozenset()
        self.fp8_config = None

    def __repr__(self) -> str:
        return f"OnesparkHybridConfig({super().__repr__()}, fp8_layers={len(self.fp8_layers)})"

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OnesparkHybridConfig:
        self = super().from_config(config)  # INCConfig.from_config builds cls(...)
        self._set_fp8(config.get(HYBRID_KEY))
        return self

    def _set_fp8(self, spec: Any) -> None:
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config

        where = f"quantization_config.{HYBRID_KEY}"
        if not isinstance(spec, dict):
            raise ValueError(f"{where} is missing or not an object: re-run `onespark hybrid` on the checkpoint")
        layers = spec.get("layers")
        if not isinstance(layers, list) or not layers or not all(isinstance(x, str) for x in layers):
            raise ValueError(f"{where}.layers must be a non-empty list of module names, got {layers!r}")
        expect = {"fmt": "e4m3", "scale_name": SCALE_SUFFIX, "activation_scheme": "dynamic"}
        for key, want in expect.items():
            if spec.get(key, want) != want:
                raise ValueError(f"{where}.{key} is {spec.get(key)!r}; this plugin loads only {want!r}")
        block = spec.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}.weight_block_size must be two positive ints like [128, 128], got {block!r}")
        self.fp8_layers = frozenset(layers)
        self.fp8_config = Fp8Config(
            is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=list(block)
        )

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        # hf_config: vLLM 0.32.0 passes it (0.19.1 does not); unused, so one signature serves both.
        if hf_quant_cfg.get("quant_method") != "auto-round" or not hf_quant_cfg.get(HYBRID_KEY):
            return None
        if user_quant not in (None, NAME):
            return None  # the user chose explicitly
        return NAME

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        super().apply_vllm_mapper(hf_to_vllm_mapper)
        self.fp8_layers = frozenset(hf_to_vllm_mapper.apply_list(sorted(self.fp8_layers)))

    # -- dispatch ----------------------------------------------------------------------------------

    def _names(self, prefix: str) -> list[str]:
        """The checkpoint module names behind a vLLM layer prefix (the shards of a merged layer)."""
        head, _, last = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(last) if head else None
        return [f"{head}.{s}" for s in shards] if shards else [prefix]

    def _in_fp8(self, name: str) -> bool:
        return name in self.fp8_layers or f"model.{name}" in self.fp8_layers

    def is_fp8(self, prefix: str) -> bool:
        names = self._names(prefix)
        hits = [self._in_fp8(n) for n in names]
        if all(hits):
            return True
        if any(hits):
            fp8 = [n for n, h in zip(names, hits) if h]
            raise ValueError(
                f"{prefix} merges {names} but only {fp8} are FP8 in {HYBRID_KEY}.layers: a merged layer needs "
                f"one format for all shards; re-run `onespark hybrid` (it splices gate, up and down together)"
            )
        return False

    def mtp_quantized(self, prefix: str) -> bool:
        """Does the checkpoint say this MTP layer is INT4? (else it is 16-bit, as in the 122B release)"""
        blocks = self.block_name_to_quantize or []
        if any(prefix.startswith(b) for b in blocks if _is_mtp(b + ".")):
            return True
        extra = self.extra_config or {}
        for name in self._names(prefix):
            for key in (name, f"model.{name}"):
                if key in extra and extra[key].get("bits", 16) < 16:
                    return True
        return False

    def get_quant_method(self, layer, prefix: str):
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        if isinstance(layer, LinearBase) and self.is_fp8(prefix):
            from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

            return Fp8LinearMethod(self.fp8_config)
        if _is_mtp(prefix) and not self.mtp_quantized(prefix):
            return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None
        return super().get_quant_method(layer, prefix)


def install() -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    if NAME in QUANTIZATION_METHODS and get_quantization_config(NAME) is OnesparkHybridConfig:
        return
    register_quantization_config(NAME)(OnesparkHybridConfig)
