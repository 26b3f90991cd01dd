"""Qwen3.5-MoE checkpoint layout: every tensor name, dtype and shape that a config implies.

One description serves `synth` (what to write), `hybrid` (what to splice) and `verify` (what to expect).

Sources, so each detail can be checked again:
- Names and shapes: vLLM 0.19.1 `model_executor/models/qwen3_next.py` (Qwen3NextSparseMoeBlock: `mlp.gate`
  [E, H], `mlp.shared_expert_gate` [1, H], `mlp.shared_expert.{gate,up,down}_proj`, per-expert
  `mlp.experts.{e}.{gate,up,down}_proj`; Qwen3NextAttention: `q_proj` carries the output gate, so
  [2 * heads * head_dim, H]; `q_norm`/`k_norm` [head_dim]), `layers/mamba/gdn_linear_attn.py`
  (`in_proj_qkv` [2 * key_dim + value_dim, H], `in_proj_z` [value_dim, H], `in_proj_b`/`in_proj_a`
  [num_v_heads, H], `conv1d` [conv_dim, 1, kernel], `A_log`/`dt_bias` [num_v_heads], `norm`
  [head_v_dim], `out_proj` [H, value_dim]), `qwen3_5.py` (HF prefix `model.language_model.`, `lm_head`,
  `mtp.` skipped by the main model) and `qwen3_5_mtp.py` (`mtp.fc` [H, 2H], `mtp.norm`,
  `mtp.pre_fc_norm_hidden`, `mtp.pre_fc_norm_embedding`, `mtp.layers.{i}.*` = one full-attention MoE
  decoder layer). Layer types: transformers `Qwen3_5MoeTextConfig` (`layer_types`, or every
  `full_attention_interval`-th layer full attention).
- MTP tensor counts follow from the config (each model's published count: onespark.model.specs). The 122B's
  785 = 4 + (2 norms + 4 attn + 2 qk-norms + gate + shared gate + 3 shared + 256 * 3 experts) single
  `.weight` tensors, i.e. its MTP head is stored 16-bit (albond's add-mtp-weights.py copies them unchanged).
- INT4 packing (`packing_format: auto_round:auto_gptq`): intel/auto-round
  `export/export_to_autogptq/qlinear_triton.py` QuantLinear: `qweight` int32 [in/8, out] (value of
  input row 8j+k in bits 4k..4k+3 of word j), `qzeros` int32 [in/group, out/8] holding zero-1 (the
  GPTQ v1 convention: 0x77777777 for symmetric int4), `scales` fp16 [in/group, out], `g_idx` int32 [in]
  = i // group. Not every AutoRound export writes `g_idx`; both are accepted.
- FP8 (Qwen/*-FP8): `quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`, weights
  `F8_E4M3`, `weight_scale_inv` [ceil(out/128), ceil(in/128)] in BF16 (Qwen3/3.5 FP8 releases store
  BF16 scales: modular/modular#7142, HabanaAI/vllm-fork#2141; F32 is accepted too).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

TEXT_PREFIX = "model.language_model."
LAYERS = TEXT_PREFIX + "layers."
MTP_PREFIX = "mtp."  # the MTP head's tensors (vLLM's qwen3_5_mtp.py); the main model skips them
EXTRA_FILE = "model_extra_tensors.safetensors"  # where the Intel releases keep the MTP head (onespark.checkpoint.mtp)
SHARED_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})
SCALE_SUFFIX = "weight_scale_inv"  # an FP8 weight's per-block scale: `X.weight` -> `X.weight_scale_inv`
HYBRID_KEY = "onespark_fp8"  # quantization_config[HYBRID_KEY]: written by step 1, see onespark.checkpoint.hybrid


# Tuples, not dataclasses, as safetensors_io.TensorInfo: the 122B's layer list has ~37k of them (256 experts x 3
# projections x 48 layers).
class Linear(NamedTuple):
    """One linear layer `prefix` with weight [out, in]."""
    prefix: str
    out: int
    inp: int


class Dense(NamedTuple):
    """A non-linear tensor stored as is (norms, embeddings, conv, A_log...)."""
    name: str
    shape: tuple[int, ...]


def scale_name(weight: str) -> str:
    """The per-block scale tensor of an FP8 weight `X.weight`."""
    return weight[: -len("weight")] + SCALE_SUFFIX


def is_mtp(name: str) -> bool:
    """A tensor of the MTP head (the draft layer vLLM's MTP drafter loads)."""
    return name.startswith(MTP_PREFIX)


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def layer_types(tc: dict) -> list[str]:
    if tc.get("layer_types"):
        return list(tc["layer_types"])
    interval = tc.get("full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(tc["num_hidden_layers"])]


def _attention(p: str, tc: dict) -> list:
    hd, nh, nkv, h = tc["head_dim"], tc["num_attention_heads"], tc["num_key_value_heads"], tc["hidden_size"]
    gate = 2 if tc.get("attn_output_gate", True) else 1
    return [Linear(p + "self_attn.q_proj", gate * nh * hd, h), Linear(p + "self_attn.k_proj", nkv * hd, h),
            Linear(p + "self_attn.v_proj", nkv * hd, h), Linear(p + "self_attn.o_proj", h, nh * hd),
            Dense(p + "self_attn.q_norm.weight", (hd,)), Dense(p + "self_attn.k_norm.weight", (hd,))]


def _linear_attention(p: str, tc: dict) -> list:
    h = tc["hidden_size"]
    key_dim = tc["linear_key_head_dim"] * tc["linear_num_key_heads"]
    value_dim = tc["linear_value_head_dim"] * tc["linear_num_value_heads"]
    nv = tc["linear_num_value_heads"]
    a = p + "linear_attn."
    return [Linear(a + "in_proj_qkv", 2 * key_dim + value_dim, h), Linear(a + "in_proj_z", value_dim, h),
            Linear(a + "in_proj_b", nv, h), Linear(a + "in_proj_a", nv, h),
            Dense(a + "conv1d.weight", (2 * key_dim + value_dim, 1, tc["linear_conv_kernel_dim"])),
            Dense(a + "dt_bias", (nv,)), Dense(a + "A_log", (nv,)),
            Dense(a + "norm.weight", (tc["linear_value_head_dim"],)), Linear(a + "out_proj", h, value_dim)]


def _moe(p: str, tc: dict) -> list:
    h, e, im, isx = tc["hidden_size"], tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
    m = p + "mlp."
    out = [Linear(m + "gate", e, h), Linear(m + "shared_expert_gate", 1, h),
           Linear(m + "shared_expert.gate_proj", isx, h), Linear(m + "shared_expert.up_proj", isx, h),
           Linear(m + "shared_expert.down_proj", h, isx)]
    for i in range(e):
        x = f"{m}experts.{i}."
        out += [Linear(x + "gate_proj", im, h), Linear(x + "up_proj", im, h), Linear(x + "down_proj", h, im)]
    return out


def _norms(p: str, h: int) -> list:
    return [Dense(p + "input_layernorm.weight", (h,)), Dense(p + "post_attention_layernorm.weight", (h,))]


def language_modules(config: dict) -> list:
    """Embeddings, decoder layers, final norm and LM head, in checkpoint order."""
    tc = text_config(config)
    h = tc["hidden_size"]
    out: list = [Dense(TEXT_PREFIX + "embed_tokens.weight", (tc["vocab_size"], h))]
    for i, kind in enumerate(layer_types(tc)):
        p = f"{LAYERS}{i}."
        out += _norms(p, h)
        out += _attention(p, tc) if kind == "full_attention" else _linear_attention(p, tc)
        out += _moe(p, tc)
    out.append(Dense(TEXT_PREFIX + "norm.weight", (h,)))
    if not config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False)):
        out.append(Linear("lm_head", tc["vocab_size"], h))
    return out


def vision_modules(config: dict) -> list:
    """The vision tower (`model.visual.*`, 16-bit in both releases; never touched by the steps).

    Names and shapes: vLLM 0.19.1 `qwen3_vl.py` Qwen3_VisionTransformer: Conv3d `patch_embed.proj`
    [hidden, in_channels, temporal_patch, patch, patch] + bias, `pos_embed` [num_position_embeddings, hidden],
    per block LayerNorm `norm1`/`norm2`, `attn.qkv` [3 * hidden, hidden], `attn.proj`, `mlp.linear_fc1`
    [intermediate, hidden], `mlp.linear_fc2` (all with bias), and the `merger` (LayerNorm on hidden, then
    [4 * hidden] -> [4 * hidden] -> out_hidden_size with spatial_merge_size 2). For the real config
    (27 blocks) that is 27 * 12 + 3 + 6 = 333 tensors, the count public model cards of the INT4 release give.
    """
    vc = config.get("vision_config")
    if not vc:
        return []
    h, inter, v = vc["hidden_size"], vc["intermediate_size"], "model.visual."
    merged = h * vc.get("spatial_merge_size", 2) ** 2
    out: list = [Dense(v + "patch_embed.proj.weight", (h, vc.get("in_channels", 3), vc.get("temporal_patch_size", 2),
                                                       vc["patch_size"], vc["patch_size"])),
                 Dense(v + "patch_embed.proj.bias", (h,)),
                 Dense(v + "pos_embed.weight", (vc["num_position_embeddings"], h))]
    for i in range(vc["depth"]):
        b = f"{v}blocks.{i}."
        for name, shape in (("norm1", (h,)), ("norm2", (h,)), ("attn.qkv", (3 * h, h)), ("attn.proj", (h, h)),
                            ("mlp.linear_fc1", (inter, h)), ("mlp.linear_fc2", (h, inter))):
            out += [Dense(f"{b}{name}.weight", shape), Dense(f"{b}{name}.bias", shape[:1])]
    for name, shape in (("norm", (h,)), ("linear_fc1", (merged, merged)), ("linear_fc2", (vc["out_hidden_size"], merged))):
        out += [Dense(f"{v}merger.{name}.weight", shape), Dense(f"{v}merger.{name}.bias", shape[:1])]
    return out


def mtp_modules(config: dict) -> list:
    tc = text_config(config)
    h = tc["hidden_size"]
    out: list = [Linear("mtp.fc", h, 2 * h), Dense("mtp.norm.weight", (h,)),
                 Dense("mtp.pre_fc_norm_hidden.weight", (h,)), Dense("mtp.pre_fc_norm_embedding.weight", (h,))]
    for i in range(tc.get("mtp_num_hidden_layers", 0) or 0):
        p = f"mtp.layers.{i}."
        out += _norms(p, h) + _attention(p, tc) + _moe(p, tc)
    return out if tc.get("mtp_num_hidden_layers", 0) else []


def shared_expert_weights(config: dict) -> list[str]:
    """The 3 x num_hidden_layers tensors step 1 replaces (MTP's shared expert stays as it is)."""
    n = text_config(config)["num_hidden_layers"]
    return [f"{LAYERS}{i}.mlp.shared_expert.{p}.weight" for i in range(n) for p in SHARED_EXPERT_PROJS]


# ---- which scheme stores each linear layer ------------------------------------------------------

INT4_ALWAYS_16BIT = re.compile(r"(\.mlp\.gate|\.shared_expert_gate)$")  # auto-round ignores routers


def int4_layer_bits(prefix: str, qc: dict) -> int:
    """Bits of a linear layer under an auto-round quantization_config (the rule vLLM's INCConfig uses:
    exact extra_config entry, then regex entries, then block_name_to_quantize membership)."""
    extra = qc.get("extra_config") or {}
    if prefix in extra:
        return int(extra[prefix].get("bits", qc["bits"]))
    for pattern, cfg in _regex_entries(qc):
        if pattern.search(prefix):
            return int(cfg.get("bits", qc["bits"]))
    if INT4_ALWAYS_16BIT.search(prefix):
        return 16
    blocks = qc.get("block_name_to_quantize") or qc.get("to_quant_block_names")
    if blocks is None:
        return int(qc["bits"]) if prefix != "lm_head" else 16
    if isinstance(blocks, str):
        blocks = blocks.split(",")
    return int(qc["bits"]) if any(prefix.startswith(b) for b in blocks) else 16


_REGEX_CACHE: dict[int, tuple[dict, list]] = {}


def _regex_entries(qc: dict) -> list:
    """extra_config keys that are regular expressions (vLLM: any of *+?^$()[]{}|\\), compiled once per dict."""
    hit = _REGEX_CACHE.get(id(qc))
    if hit is None or hit[0] is not qc:
        out = []
        for pattern, cfg in (qc.get("extra_config") or {}).items():
            if any(c in pattern for c in "*+?^$()[]{}|\\"):
                try:
                    out.append((re.compile(pattern), cfg))
                except re.error:
                    continue
        hit = _REGEX_CACHE[id(qc)] = (qc, out)
    return hit[1]


FP8_NEVER = re.compile(r"(\.mlp\.gate|\.shared_expert_gate|\.in_proj_a|\.in_proj_b)$|^lm_head$|^mtp\.fc$")


def fp8_layer_quantized(prefix: str, qc: dict) -> bool:
    """Whether a Qwen FP8 checkpoint stores this linear as F8_E4M3 + weight_scale_inv."""
    skip = qc.get("modules_to_not_convert") or []
    if any(prefix == s or prefix.startswith(s + ".") for s in skip):
        return False
    return not FP8_NEVER.search(prefix)


@dataclasses.dataclass(frozen=True)
class Expect:
    dtypes: frozenset  # allowed safetensors dtypes
    shape: tuple[int, ...]


def expected_tensors(config: dict, *, include_mtp: bool = True) -> dict[str, Expect]:
    """Every tensor the config implies, with its dtype(s) and shape.

    Handles the three layouts this project meets: auto-round INT4, Qwen FP8, and the hybrid
    (auto-round INT4 whose quantization_config[HYBRID_KEY] lists FP8 layers; see onespark.checkpoint.hybrid).
    """
    qc = config.get("quantization_config") or {}
    method = qc.get("quant_method", "")
    hybrid = qc.get(HYBRID_KEY) or {}
    fp8_layers = set(hybrid.get("layers", []))
    block = tuple(qc.get("weight_block_size") or hybrid.get("weight_block_size") or (128, 128))
    mods = language_modules(config) + vision_modules(config) + (mtp_modules(config) if include_mtp else [])
    out: dict[str, Expect] = {}
    for m in mods:
        if isinstance(m, Dense):
            out[m.name] = Expect(FLOAT_DTYPES, m.shape)
            continue
        p = m.prefix
        if p in fp8_layers or (method == "fp8" and fp8_layer_quantized(p, qc)):
            out[p + ".weight"] = Expect(frozenset({"F8_E4M3"}), (m.out, m.inp))
            out[scale_name(p + ".weight")] = Expect(frozenset({"BF16", "F32"}),
                                                  (math.ceil(m.out / block[0]), math.ceil(m.inp / block[1])))
        elif method in ("auto-round", "intel/auto-round") and (bits := int4_layer_bits(p, qc)) < 16:
            group = int(qc["group_size"])
            pack = 32 // bits  # per layer: a W4A16-mixed export stores its 8-bit layers 4 values a word
            out[p + ".qweight"] = Expect(frozenset({"I32"}), (m.inp // pack, m.out))
            out[p + ".qzeros"] = Expect(frozenset({"I32"}), (math.ceil(m.inp / group), m.out // pack))
            out[p + ".scales"] = Expect(frozenset({"F16", "BF16"}), (math.ceil(m.inp / group), m.out))
            out[p + ".g_idx"] = Expect(frozenset({"I32"}), (m.inp,))  # optional: see OPTIONAL_SUFFIXES
        else:
            out[p + ".weight"] = Expect(FLOAT_DTYPES, (m.out, m.inp))
    return out


OPTIONAL_SUFFIXES = (".g_idx",)


def is_optional(name: str) -> bool:
    return name.endswith(OPTIONAL_SUFFIXES)


def category(name: str) -> str:
    """A tensor's family, for reports that count instead of listing 400 names."""
    if is_mtp(name):
        return "mtp head"
    if name.startswith("model.visual."):
        return "vision tower"
    if ".mlp.experts." in name:
        return "routed experts"
    if ".mlp.shared_expert." in name:
        return "shared experts"
    if ".self_attn." in name:
        return "full attention"
    if ".linear_attn." in name:
        return "linear attention"
    if ".mlp.gate." in name or ".shared_expert_gate." in name:
        return "router gates"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings / lm_head"
    if "norm" in name:
        return "norms"
    return "other"
