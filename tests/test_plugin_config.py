"""OnesparkHybridConfig on its own: selection, validation of what step 1 wrote, name mapping, merged layers.

In-process (it only imports vLLM classes; nothing is registered), against config.json files that the real
`onespark synth` + `onespark hybrid` wrote.
"""

from __future__ import annotations

import copy
import json

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.vllm032, pytest.mark.timeout(600)]  # both tracks


@pytest.fixture(scope="module")
def quant_cfgs(synth_hybrid_root):
    root = synth_hybrid_root
    load = lambda d: json.loads((root / d / "config.json").read_text())  # noqa: E731
    return load("int4"), load("hy")


@pytest.fixture(scope="module")
def cls():
    pytest.importorskip("vllm")
    from onespark.patches.hybrid_fp8 import OnesparkHybridConfig

    return OnesparkHybridConfig


def test_selected_only_for_hybrid_checkpoints_and_never_against_the_user(cls, quant_cfgs):
    stock, hybrid = (c["quantization_config"] for c in quant_cfgs)
    assert cls.override_quantization_method(hybrid, None) == "onespark_hybrid"
    assert cls.override_quantization_method(stock, None) is None  # plain AutoRound: stock INC
    assert cls.override_quantization_method(hybrid, "inc") is None  # --quantization inc is respected


def test_reads_what_step_1_wrote_and_maps_names_like_vllm(cls, quant_cfgs):
    from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration as Model

    config = quant_cfgs[1]
    layers = config["text_config"]["num_hidden_layers"]
    cfg = cls.from_config(config["quantization_config"])
    assert len(cfg.fp8_layers) == 3 * layers
    assert cfg.fp8_config.weight_block_size == [128, 128] and cfg.fp8_config.activation_scheme == "dynamic"
    cfg.apply_vllm_mapper(Model.hf_to_vllm_mapper)
    cfg.packed_modules_mapping = dict(Model.packed_modules_mapping)
    for i in range(layers):
        assert cfg.is_fp8(f"language_model.model.layers.{i}.mlp.shared_expert.gate_up_proj")  # both shards
        assert cfg.is_fp8(f"language_model.model.layers.{i}.mlp.shared_expert.down_proj")
        assert not cfg.is_fp8(f"language_model.model.layers.{i}.mlp.shared_expert_gate")
    assert not cfg.is_fp8("mtp.layers.0.mlp.shared_expert.gate_up_proj")


def test_a_merged_layer_with_some_shards_fp8_is_refused(cls, quant_cfgs):
    q = copy.deepcopy(quant_cfgs[1]["quantization_config"])
    q["onespark_fp8"]["layers"] = [n for n in q["onespark_fp8"]["layers"] if not n.endswith("up_proj")]
    cfg = cls.from_config(q)
    cfg.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    with pytest.raises(ValueError, match=r"merges .*gate_proj.*up_proj.* but only .*gate_proj.* are FP8"):
        cfg.is_fp8("model.language_model.layers.0.mlp.shared_expert.gate_up_proj")


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("layers"), r"onespark_fp8\.layers must be a non-empty list"),
    (lambda s: s.update(layers=[]), r"onespark_fp8\.layers must be a non-empty list"),
    (lambda s: s.update(fmt="e5m2"), r"onespark_fp8\.fmt is 'e5m2'; this plugin loads only 'e4m3'"),
    (lambda s: s.update(activation_scheme="static"), r"activation_scheme is 'static'"),
    (lambda s: s.update(weight_block_size=[128]), r"weight_block_size must be two positive ints"),
], ids=["no-layers", "empty-layers", "e5m2", "static", "block-1d"])
def test_a_malformed_onespark_fp8_is_a_clear_error(cls, quant_cfgs, edit, message):
    q = copy.deepcopy(quant_cfgs[1]["quantization_config"])
    edit(q["onespark_fp8"])
    with pytest.raises(ValueError, match=message):
        cls.from_config(q)


def test_mtp_is_16_bit_unless_the_checkpoint_says_int4(cls, quant_cfgs):
    q = copy.deepcopy(quant_cfgs[1]["quantization_config"])
    q.pop("block_name_to_quantize", None)  # INC alone would then quantize every layer, MTP included
    cfg = cls.from_config(q)
    assert not cfg.mtp_quantized("mtp.layers.0.mlp.experts")
    q["block_name_to_quantize"] = "model.language_model.layers,mtp.layers"  # auto-round >= 0.13 style
    cfg = cls.from_config(q)
    assert cfg.mtp_quantized("mtp.layers.0.self_attn.qkv_proj") and not cfg.mtp_quantized("mtp.fc")
