"""`onespark synth`: small checkpoints in the exact formats of each spec's two real repositories.

    onespark synth --model NAME --format int4 --out DIR [--preset tiny|real] [--mtp-in-index | --no-mtp-in-index]
                   [--mtp-dtype bf16|int4] [--g-idx | --no-g-idx]
    onespark synth --model NAME --format fp8  --out DIR

`int4` is the layout of the spec's Intel AutoRound repository (e.g. Intel/Qwen3.5-122B-A10B-int4-AutoRound),
`fp8` that of its Qwen FP8 one (tensor names, dtypes and shapes: onespark.model.qwen35, which cites its sources;
the repos, dims and MTP layout of each model: onespark.model.specs). `--preset tiny` (default) writes the spec's tiny
dims (~10 MB, every structural feature of the real model), `--preset real` its real dims without weights.
What each file holds:

- `config.json`: Qwen3_5MoeForConditionalGeneration, `text_config`, `vision_config`, and
  `quantization_config` at top level, as transformers writes it. INT4: auto-round's
  (`quant_method: auto-round`, `packing_format: auto_round:auto_gptq`, `bits 4`, `group_size 128`,
  `sym true`, `block_name_to_quantize`, `extra_config` marking the 16-bit layers: every
  `linear_attn.in_proj_a/b` (as Intel's Qwen3.5 AutoRound configs list them) and the shared experts
  + their gate (why the shared experts are BF16 in the Qwen3.5 releases and can be swapped for FP8:
  Entrpi/qwen3.5-122B-A10B-on-spark docs/FINDINGS.md, "144 layers, 0.48 GB")). A W4A16-mixed spec
  (specs.Spec.mixed_bits) marks every non-expert quantized linear, shared experts included, at 8 bits
  instead. auto-round also saves the same dict as `quantization_config.json`, so we do too. FP8:
  `quant_method fp8`, `fmt e4m3`, `activation_scheme dynamic`, `weight_block_size [128, 128]`,
  `modules_to_not_convert`.
- `model-0000N-of-0000M.safetensors` + `model.safetensors.index.json` ({"metadata": {"total_size"},
  "weight_map"}). INT4: the MTP head is in `model_extra_tensors.safetensors` (the file auto-round's
  copy_missing_tensors_from_source writes); whether the index lists it differs between releases (the
  122B index does not, albond's add-mtp-weights.py exists for that; the 35B one does), and whether the MTP
  layer is INT4 or 16-bit too (785 16-bit tensors in the 122B; the 35B's 2329 are INT4 but mtp.fc): the
  spec says which, --mtp-in-index / --mtp-dtype override it.

Both formats derive every weight from (seed, tensor name), so the FP8 shared experts are an FP8
quantization of the very BF16 shared experts in the INT4 checkpoint: a splice can be checked numerically.
Routed experts are random packed words (never compared across formats; this keeps multi-GB synths fast).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from onespark import __version__, options
from onespark.checkpoint.lock import LOCK_FILE, locked
from onespark.checkpoint.safetensors_io import nbytes_of, write_json_atomic, write_safetensors
from onespark.checkpoint.writer import INDEX_FILE, rewrite_index
from onespark.errors import UserError
from onespark.model import qwen35, specs
from onespark.model.qwen35 import EXTRA_FILE

FP8_MAX = 448.0  # largest finite float8_e4m3fn
GROUP = 128

# Linear layers a W4A16-mixed export keeps 16-bit (routers, the small GDN projections).
MIXED_16BIT = re.compile(r"(\.mlp\.gate|\.shared_expert_gate|\.in_proj_a|\.in_proj_b)$")

# The default spec's real and tiny text_config (the dims of every model live in onespark.model.specs).
REAL_TEXT = specs.TEXT_122B
TINY_TEXT = specs.TINY_122B


# vision_config of the real model (transformers Qwen3_5MoeVisionConfig defaults; out_hidden_size = text hidden),
# and a tiny one that keeps every structural feature (Conv3d patches, a square position grid, 2x2 merge).
REAL_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304)
TINY_VISION = dict(REAL_VISION, depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                   num_position_embeddings=64)


def _mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """The real config's [11, 11, 10] (t, h, w) split of the 32 rotary frequency pairs, scaled to any head_dim:
    vLLM's mrope requires the sections to sum to rotary_dim / 2."""
    pairs = int(head_dim * partial_rotary_factor) // 2
    t = h = round(pairs * 11 / 32)
    return [t, h, pairs - t - h]


def make_config(fmt: str, dims: dict, *, mtp_dtype: str = "bf16", vision: dict | None = None,
                mixed_bits: int | None = None) -> dict:
    tc = dict(dims)
    tc.update(model_type="qwen3_5_moe_text", hidden_act="silu", attn_output_gate=True, attention_bias=False,
              attention_dropout=0.0, full_attention_interval=4, max_position_embeddings=262144,
              rms_norm_eps=1e-6, initializer_range=0.02, router_aux_loss_coef=0.001, output_router_logits=False,
              use_cache=True, tie_word_embeddings=False, dtype="bfloat16", mtp_use_dedicated_embeddings=False,
              eos_token_id=248044 if dims["vocab_size"] > 248044 else dims["vocab_size"] - 1,
              rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25,
                                   mrope_interleaved=True, mrope_section=_mrope_section(dims["head_dim"], 0.25)))
    tc["layer_types"] = qwen35.layer_types(tc)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "text_config": tc,
        "vision_config": dict(vision or TINY_VISION, model_type="qwen3_5_moe_vision", hidden_act="gelu_pytorch_tanh",
                              out_hidden_size=dims["hidden_size"]),
        "transformers_version": "4.57.0.dev0",
    }
    if fmt == "int4":
        config["quantization_config"] = _int4_quantization(tc, mtp_dtype, mixed_bits)
    elif fmt == "fp8":
        config["quantization_config"] = _fp8_quantization(tc)
    else:
        raise UserError(f"unknown format {fmt!r}: use int4 or fp8")
    return config


def _int4_quantization(tc: dict, mtp_dtype: str, mixed_bits: int | None) -> dict:
    """The Intel AutoRound release's quantization_config: which blocks are INT4, and the 16-bit exceptions."""
    blocks = [qwen35.LAYERS.rstrip(".")] + (["mtp.layers"] if mtp_dtype == "int4" else [])
    extra = {}
    for i in range(tc["num_hidden_layers"]):
        for p in ("in_proj_b", "in_proj_a"):
            if tc["layer_types"][i] == "linear_attention":
                extra[f"{qwen35.LAYERS}{i}.linear_attn.{p}"] = {"bits": 16, "data_type": "fp"}
        for p in ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                  "shared_expert_gate"):
            extra[f"{qwen35.LAYERS}{i}.mlp.{p}"] = {"bits": 16, "data_type": "fp"}
    if mtp_dtype == "int4":
        extra["mtp.fc"] = {"bits": 16, "data_type": "fp"}
        for i in range(tc["mtp_num_hidden_layers"]):
            for p in ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"):
                extra[f"mtp.layers.{i}.mlp.{p}"] = {"bits": 16, "data_type": "fp"}
    if mixed_bits:
        # auto-round W4A16_MIXED: routed experts stay 4-bit, every other quantized linear (shared experts
        # included) gets mixed_bits; routers, in_proj_a/b, mtp.fc and lm_head stay 16-bit as above.
        mods = qwen35.language_modules({"text_config": tc})
        mods += qwen35.mtp_modules({"text_config": tc}) if mtp_dtype == "int4" else []
        for m in mods:
            if isinstance(m, qwen35.Linear) and ".mlp.experts." not in m.prefix \
                    and m.prefix not in ("lm_head", "mtp.fc") and not MIXED_16BIT.search(m.prefix):
                extra[m.prefix] = {"bits": mixed_bits, "data_type": "int"}
    return {
        "bits": 4, "data_type": "int", "group_size": GROUP, "sym": True, "iters": 200,
        "autoround_version": "0.9.0",  # illustrative: vLLM reads only the fields above/below
        "block_name_to_quantize": ",".join(blocks),
        "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq",
        "extra_config": extra,
    }


def _fp8_quantization(tc: dict) -> dict:
    """The Qwen FP8 release's quantization_config: block FP8, with the modules it leaves 16-bit."""
    skip = ["lm_head", qwen35.TEXT_PREFIX + "embed_tokens", "mtp.fc", "model.visual"]
    for i in range(tc["num_hidden_layers"]):
        p = f"{qwen35.LAYERS}{i}."
        if tc["layer_types"][i] == "linear_attention":
            skip += [p + "linear_attn.in_proj_a", p + "linear_attn.in_proj_b"]
        skip += [p + "mlp.gate", p + "mlp.shared_expert_gate"]
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128], "modules_to_not_convert": skip}


# ---- numbers -----------------------------------------------------------------------------------

def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def master_weight(seed: int, prefix: str, shape: tuple[int, ...]) -> np.ndarray:
    """The BF16-representable float32 weight both formats quantize (seeded by the layer name)."""
    w = _rng(seed, prefix + "#master").standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return w.astype(ml_dtypes.bfloat16).astype(np.float32)


def quantize_int(w: np.ndarray, bits: int = 4, group: int = GROUP):
    """Symmetric RTN at `bits` (4 or 8), auto_gptq v1 packing. w: [out, in] -> qweight, qzeros, scales, g_idx."""
    out, inp = w.shape
    zero = 1 << (bits - 1)  # 8 for int4, 128 for int8
    g = w.reshape(out, inp // group, group)
    scale = (np.abs(g).max(axis=2) / (zero - 1)).astype(np.float16)  # [out, groups]
    s = np.maximum(scale.astype(np.float32), np.float32(1e-8))[:, :, None]
    q = (np.clip(np.rint(g / s), -zero, zero - 1) + zero).astype(np.uint32).reshape(out, inp)
    return (pack_int(q, bits), _qzeros(inp // group, out, bits), np.ascontiguousarray(scale.T),
            (np.arange(inp) // group).astype(np.int32))


def quantize_int4(w: np.ndarray, group: int = GROUP):
    return quantize_int(w, 4, group)


def pack_int(q: np.ndarray, bits: int = 4) -> np.ndarray:
    """q: [out, in] uint32 values 0..2^bits-1 -> qweight [in*bits/32, out] int32, row (32/bits)j+k in bits k*bits."""
    out, inp = q.shape
    per = 32 // bits
    words = (q.reshape(out, inp // per, per) << (np.arange(per, dtype=np.uint32) * bits)).sum(axis=2, dtype=np.uint32)
    return np.ascontiguousarray(words.T).view(np.int32)


def pack_int4(q: np.ndarray) -> np.ndarray:
    return pack_int(q, 4)


def unpack_int(qweight: np.ndarray, bits: int = 4) -> np.ndarray:
    """qweight [in*bits/32, out] int32 -> [out, in] unsigned values (the inverse of pack_int)."""
    per = 32 // bits
    w = qweight.view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    nib = (w[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)  # [in/per, per, out]
    return nib.reshape(-1, w.shape[1]).T


def unpack_int4(qweight: np.ndarray) -> np.ndarray:
    return unpack_int(qweight, 4)


def _qzeros(groups: int, out: int, bits: int = 4) -> np.ndarray:
    # GPTQ v1 stores zero-1: symmetric int4's zero point 8 becomes 7 in every nibble (0x77777777), int8's
    # 128 becomes 127 in every byte (0x7F7F7F7F).
    per = 32 // bits
    word = sum(((1 << (bits - 1)) - 1) << (bits * k) for k in range(per))
    return np.full((groups, out // per), word, dtype=np.uint32).view(np.int32)


def dequantize_int(qweight: np.ndarray, scales: np.ndarray, bits: int = 4, group: int = GROUP) -> np.ndarray:
    q = unpack_int(qweight, bits).astype(np.float32) - float(1 << (bits - 1))
    return q * np.repeat(scales.astype(np.float32).T, group, axis=1)


def dequantize_int4(qweight: np.ndarray, scales: np.ndarray, group: int = GROUP) -> np.ndarray:
    return dequantize_int(qweight, scales, 4, group)


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """Per-block FP8: weight_scale_inv = amax/448 (BF16), weight = w / scale_inv as float8_e4m3fn."""
    out, inp = w.shape
    bo, bi = block
    go, gi = math.ceil(out / bo), math.ceil(inp / bi)
    pad = np.zeros((go * bo, gi * bi), np.float32)
    pad[:out, :inp] = w
    amax = np.abs(pad.reshape(go, bo, gi, bi)).max(axis=(1, 3))
    scale = np.maximum(amax / FP8_MAX, 1e-12).astype(ml_dtypes.bfloat16)  # round the scale first, then
    s = np.repeat(np.repeat(scale.astype(np.float32), bo, 0), bi, 1)[:out, :inp]  # divide by what is stored
    q = np.clip(w / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def dequantize_fp8_block(q: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    out, inp = q.shape
    s = np.repeat(np.repeat(scale.astype(np.float32), block[0], 0), block[1], 1)[:out, :inp]
    return q.astype(np.float32) * s


def _random_fp8(rng: np.random.Generator, shape) -> np.ndarray:
    # bytes below 0x78 in magnitude: finite, never the NaN codes 0x7F / 0xFF
    b = rng.integers(0, 0x78, size=shape, dtype=np.uint8) | (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7)
    return b.view(ml_dtypes.float8_e4m3fn)


def tensors_for(config: dict, fmt: str, seed: int, *, mtp: bool, g_idx: bool):
    """Yield (name, dtype, shape, bytes-producing thunk) in checkpoint order."""
    qc = config["quantization_config"]
    mods = qwen35.mtp_modules(config) if mtp else qwen35.language_modules(config) + qwen35.vision_modules(config)
    for m in mods:
        if isinstance(m, qwen35.Dense):
            yield m.name, ("F32" if m.name.endswith("A_log") else "BF16"), m.shape, _dense_thunk(seed, m)
            continue
        p, shape = m.prefix, (m.out, m.inp)
        expert = ".mlp.experts." in p
        if fmt == "fp8" and qwen35.fp8_layer_quantized(p, qc):
            bs = tuple(qc["weight_block_size"])
            sshape = (math.ceil(m.out / bs[0]), math.ceil(m.inp / bs[1]))
            if expert:
                yield p + ".weight", "F8_E4M3", shape, lambda p=p, s=shape: _random_fp8(_rng(seed, p), s)
                yield qwen35.scale_name(p + ".weight"), "BF16", sshape, lambda p=p, s=sshape: (
                    _rng(seed, p + "#s").uniform(1e-4, 1e-3, s).astype(ml_dtypes.bfloat16))
            else:
                cache = {}

                def fp8(part, p=p, shape=shape, bs=bs, cache=cache):
                    if not cache:
                        cache["q"], cache["s"] = quantize_fp8_block(master_weight(seed, p, shape), bs)
                    return cache.pop(part)
                yield p + ".weight", "F8_E4M3", shape, lambda f=fp8: f("q")
                yield qwen35.scale_name(p + ".weight"), "BF16", sshape, lambda f=fp8: f("s")
        elif fmt == "int4" and (bits := qwen35.int4_layer_bits(p, qc)) < 16:
            groups = m.inp // GROUP
            if expert and bits == 4:
                yield p + ".qweight", "I32", (m.inp // 8, m.out), lambda p=p, m=m: (
                    _rng(seed, p).integers(0, 2**32, size=(m.inp // 8, m.out), dtype=np.uint32).view(np.int32))
                yield p + ".qzeros", "I32", (groups, m.out // 8), lambda m=m, g=groups: _qzeros(g, m.out)
                yield p + ".scales", "F16", (groups, m.out), lambda p=p, m=m, g=groups: (
                    _rng(seed, p + "#s").uniform(1e-4, 1e-3, (g, m.out)).astype(np.float16))
                if g_idx:
                    yield p + ".g_idx", "I32", (m.inp,), lambda m=m: (np.arange(m.inp) // GROUP).astype(np.int32)
            else:
                cache = {}

                def int4(i, p=p, shape=shape, cache=cache, bits=bits):
                    if not cache:
                        cache["t"] = quantize_int(master_weight(seed, p, shape), bits)
                    return cache["t"][i]
                per = 32 // bits
                yield p + ".qweight", "I32", (m.inp // per, m.out), lambda f=int4: f(0)
                yield p + ".qzeros", "I32", (groups, m.out // per), lambda f=int4: f(1)
                yield p + ".scales", "F16", (groups, m.out), lambda f=int4: f(2)
                if g_idx:
                    yield p + ".g_idx", "I32", (m.inp,), lambda f=int4: f(3)
        else:
            yield p + ".weight", "BF16", shape, lambda p=p, s=shape: master_weight(seed, p, s).astype(ml_dtypes.bfloat16)


def _dense_thunk(seed: int, m: qwen35.Dense):
    def make():
        rng = _rng(seed, m.name)
        if m.name.endswith("A_log"):
            return np.log(rng.uniform(1, 16, m.shape)).astype(np.float32)
        if m.name.endswith("norm.weight") or "layernorm" in m.name:
            return (1.0 + 0.1 * rng.standard_normal(m.shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
        return (0.02 * rng.standard_normal(m.shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
    return make


def _to_bytes(arr: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))


def _write_group(path: Path, items: list, progress: _Progress) -> dict[str, str]:
    names = {t[0]: path.name for t in items}
    if progress.has(path.name):
        return names
    tensors = []
    for name, dtype, shape, thunk in items:
        arr = thunk()
        assert tuple(arr.shape) == tuple(shape), (name, arr.shape, shape)
        b = _to_bytes(arr)
        assert len(b) == nbytes_of(dtype, shape), name
        tensors.append((name, dtype, shape, b))
    write_safetensors(path, tensors, {"format": "pt"})
    progress.wrote(path.name)
    return names


PROGRESS_FILE = ".onespark-synth-progress.json"


class _Progress:
    """What a synth run has written into `out`, under the fingerprint of its arguments, so that a run killed (or
    stopped by a full disk) resumes when the same command runs again: every file is derived from (seed, name),
    so a file of the right size written under the same arguments is the one this run would write. Another
    command into that directory starts it over; a finished run removes the record."""

    def __init__(self, out: Path, fingerprint: str, log=print):
        self.out, self.path = out, out / PROGRESS_FILE
        old = None
        if self.path.is_file():
            try:
                old = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                old = {}  # a damaged record of ours: start over
        if old is None and any(p.name != LOCK_FILE for p in out.iterdir()):
            raise UserError(f"{out} exists and is not empty: choose a new --out directory (nothing was written)")
        same = isinstance(old, dict) and old.get("fingerprint") == fingerprint and isinstance(old.get("done"), dict)
        self.done = {f: n for f, n in (old["done"].items() if same else ())
                     if (out / f).is_file() and (out / f).stat().st_size == n}
        if same and self.done:
            log(f"resuming: {len(self.done)} file(s) already written")
        elif old is not None and not same:
            log("another synth command was interrupted in this directory: starting over")
            for p in out.iterdir():
                if p.is_file() and p.name != LOCK_FILE:
                    p.unlink()
        for p in out.glob(".*.tmp-*"):  # a killed run's temp files: never renamed, so never trusted
            p.unlink()
        self.fingerprint = fingerprint
        self._save()

    def has(self, fname: str) -> bool:
        return fname in self.done

    def wrote(self, fname: str) -> None:
        self.done[fname] = (self.out / fname).stat().st_size
        self._save()

    def json(self, fname: str, doc: dict) -> None:
        if not self.has(fname):
            write_json_atomic(self.out / fname, doc)
            self.wrote(fname)

    def _save(self) -> None:
        write_json_atomic(self.path, {"fingerprint": self.fingerprint, "done": self.done})

    def finish(self) -> None:
        self.path.unlink()


def synth(out: Path, fmt: str, *, dims: dict | None = None, seed: int = 0, mtp_in_index: bool = False,
          mtp_dtype: str = "bf16", g_idx: bool = True, shards: int = 3, weights: bool = True,
          vision: dict | None = None, mixed_bits: int | None = None, log=lambda m: None) -> dict:
    """Write a checkpoint; returns its config. See the module docstring for what is written. Holds --out's lock
    (onespark.checkpoint.lock) while it writes; a killed run resumes when run again with the same arguments (_Progress)."""
    out = Path(out)
    config = make_config(fmt, dims or TINY_TEXT, mtp_dtype=mtp_dtype, vision=vision, mixed_bits=mixed_bits)
    args = dict(fmt=fmt, config=config, seed=seed, mtp_in_index=mtp_in_index, g_idx=g_idx, shards=shards,
                weights=weights, version=__version__)
    fingerprint = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()
    with locked(out, "--out"):
        progress = _Progress(out, fingerprint, log)
        _synth(out, fmt, config, progress, seed=seed, mtp_in_index=mtp_in_index, g_idx=g_idx, shards=shards,
               weights=weights)
        progress.finish()
    return config


def _synth(out: Path, fmt: str, config: dict, progress: _Progress, *, seed: int, mtp_in_index: bool, g_idx: bool,
           shards: int, weights: bool) -> None:
    if weights:
        main = list(tensors_for(config, fmt, seed, mtp=False, g_idx=g_idx))
        mtp = list(tensors_for(config, fmt, seed, mtp=True, g_idx=g_idx))
        weight_map: dict[str, str] = {}
        if fmt == "fp8":  # Qwen's FP8 release keeps mtp.* in its ordinary shards, listed in the index
            main, mtp = main + mtp, []
        total = sum(nbytes_of(d, s) for _, d, s, _ in main)
        per = max(1, math.ceil(total / shards))
        groups, cur, size = [], [], 0
        for item in main:
            cur.append(item)
            size += nbytes_of(item[1], item[2])
            if size >= per and len(groups) < shards - 1:
                groups.append(cur)
                cur, size = [], 0
        groups.append(cur)
        for i, items in enumerate(groups):
            weight_map.update(_write_group(out / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", items,
                                           progress))
        if mtp:
            mtp_map = _write_group(out / EXTRA_FILE, mtp, progress)
            if mtp_in_index:
                weight_map.update(mtp_map)
        progress.json(INDEX_FILE, rewrite_index(None, weight_map, {n: nbytes_of(d, s) for n, d, s, _ in main + mtp}))
    progress.json("config.json", config)
    if fmt == "int4":
        progress.json("quantization_config.json", config["quantization_config"])
    progress.json("generation_config.json", {"bos_token_id": 248044, "eos_token_id": [248046, 248044],
                                             "do_sample": True, "temperature": 0.6, "top_k": 20,
                                             "top_p": 0.95, "transformers_version": "4.57.0.dev0"})


def synth_spec(out: Path, fmt: str, spec: specs.Spec, *, preset: str = "tiny", seed: int = 0,
               weights: bool | None = None, shards: int = 3, **overrides) -> dict:
    """synth() with the spec's dims and INT4 layout (MTP dtype, index, g_idx, mixed bits); overrides win."""
    if spec.name == specs.CUSTOM:
        raise UserError("synth needs a named --model (a custom checkpoint's layout is whatever its config says)")
    kw = dict(mtp_in_index=spec.mtp_in_index, mtp_dtype=spec.mtp_dtype, g_idx=spec.g_idx,
              mixed_bits=spec.mixed_bits, dims=dict(spec.text if preset == "real" else spec.tiny),
              vision=REAL_VISION if preset == "real" else TINY_VISION)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return synth(out, fmt, seed=seed, shards=shards, weights=(preset == "tiny") if weights is None else weights, **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    specs.add_model_argument(p)
    p.add_argument("--format", choices=("int4", "fp8"), required=True,
                   help="int4: the layout of the spec's Intel AutoRound repo; fp8: that of its Qwen FP8 repo")
    p.add_argument("--out", required=True, type=options.directory_path, help="new (or empty) directory to write")
    p.add_argument("--mtp-in-index", action=argparse.BooleanOptionalAction, default=None,
                   help="list model_extra_tensors.safetensors' mtp.* tensors in the index "
                        "(int4; default: as the spec's release: not for the 122B, yes for the 35B)")
    p.add_argument("--mtp-dtype", choices=("bf16", "int4"), default=None,
                   help="int4: store the MTP layer 16-bit (the 122B release: 785 tensors) or INT4 (the 35B's: 2329); "
                        "default: as the spec's release")
    p.add_argument("--g-idx", action=argparse.BooleanOptionalAction, default=None,
                   help="write GPTQ g_idx tensors next to qweight/qzeros/scales (int4; default: as the spec's release)")
    p.add_argument("--seed", type=options.number(int, 0), default=0, help="same seed + dims = splice-compatible int4/fp8 pair")
    p.add_argument("--shards", type=options.COUNT, default=3, help="number of model-*.safetensors files")
    p.add_argument("--preset", choices=("tiny", "real"), default="tiny",
                   help="tiny: ~10 MB; real: the spec's real dims (config and no weights unless --weights)")
    p.add_argument("--weights", action=argparse.BooleanOptionalAction, default=None,
                   help="write weights (default: yes for tiny, no for real)")
    for key in ("hidden_size", "num_hidden_layers", "num_experts", "moe_intermediate_size",
                "shared_expert_intermediate_size", "vocab_size"):
        p.add_argument("--" + key.replace("_", "-"), type=options.COUNT, dest=key,
                       help=f"override text_config.{key}")


def run(args: argparse.Namespace) -> int:
    if args.model == specs.CUSTOM:
        raise UserError("synth needs a named --model (a custom checkpoint's layout is whatever its config says): "
                        f"one of {', '.join(specs.SPECS)}")
    spec = specs.get(args.model)
    dims = dict(spec.text if args.preset == "real" else spec.tiny)
    for key in ("hidden_size", "num_hidden_layers", "num_experts", "moe_intermediate_size",
                "shared_expert_intermediate_size", "vocab_size"):
        if getattr(args, key) is not None:
            dims[key] = getattr(args, key)
    if dims["hidden_size"] % GROUP or dims["moe_intermediate_size"] % GROUP:
        raise UserError(f"hidden size and moe intermediate size must be multiples of {GROUP} "
                        f"(the INT4 group): got {dims['hidden_size']} and {dims['moe_intermediate_size']}")
    if args.shards < 1:
        raise UserError("--shards must be at least 1")
    synth_spec(args.out, args.format, spec, preset=args.preset, seed=args.seed, weights=args.weights,
               shards=args.shards, dims=dims, mtp_in_index=args.mtp_in_index, mtp_dtype=args.mtp_dtype,
               g_idx=args.g_idx, log=lambda m: print(m, flush=True))
    files = sorted(p.name for p in args.out.iterdir() if p.name != LOCK_FILE)
    size = sum((args.out / f).stat().st_size for f in files)
    print(f"wrote {spec.name} {args.format} checkpoint to {args.out}: {len(files)} files, {size / 1e6:.1f} MB")
    return 0
