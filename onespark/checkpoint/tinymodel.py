"""`onespark tiny-model --out DIR [--arch qwen2-moe|qwen3.5-moe]`: a tiny model that vLLM serves on CPU.

Two architectures, one per vLLM track:
  qwen2-moe (default)  Qwen2MoeForCausalLM, for vLLM 0.19.1, whose CPU build cannot run Qwen3.5's Gated
                       DeltaNet layers (GPU-only there); described below.
  qwen3.5-moe          the real Qwen3.5-MoE architecture, for vLLM 0.32.0: the `architectures`, `model_type`
                       and text_config fields of the real checkpoint (Qwen3_5MoeForConditionalGeneration,
                       text_config.model_type qwen3_5_moe_text, layer_types = 3 linear_attention (Gated
                       DeltaNet) + 1 full_attention (gated: attn_output_gate, q_proj carries the gate),
                       the linear_* head fields, MoE with a shared expert + shared_expert_gate,
                       mtp_num_hidden_layers 1 with every mtp.* tensor), config written by
                       onespark.checkpoint.synth.make_config (the same function `onespark synth` uses), tensor names
                       and shapes from onespark.model.qwen35 (which cites vLLM's model files). BF16, no
                       quantization_config, no vision weights (serve with --language-model-only). Head dim
                       256 as in the real model (what the TurboQuant kernels support). Norms are Gemma-style
                       (x * (1 + w)): their weights are zeros; the Gated DeltaNet output norm is a plain
                       RMSNorm (ones). `--mtp-init agree` (default) sets mtp.fc to pass the next token's
                       normalised embedding through, so the MTP layer drafts what the target predicts
                       (acceptance near 100%); `--mtp-init random` makes mtp.fc random (acceptance near 0).

The tests, the benchmark client and the image smoke tests need a real model behind a real vLLM
server, and Hugging Face is not reachable. This writes one in a few seconds:

  DIR/config.json                 Qwen2MoeForCausalLM (architecture vLLM 0.19.1 runs on CPU; it has a
                                  shared expert + shared_expert_gate like Qwen3.5), torch_dtype bfloat16
  DIR/model.safetensors           BF16 weights, HF tensor names (per-expert gate/up/down_proj)
  DIR/tokenizer.json              byte-level BPE built locally with the `tokenizers` library (no hub)
  DIR/tokenizer_config.json       ChatML chat template (<|im_start|>role ... <|im_end|>), eos <|im_end|>
  DIR/generation_config.json
  DIR/onespark-tiny.json          what made it: {"tool", "seed", "tie_word_embeddings", "sha256": {file: hash}}

Python API (stable; tests/conftest.py, bench/ and the image smoke tests use it):

  write_tiny_model(out, seed=0, tie_word_embeddings=False, arch="qwen2-moe", mtp_init="agree") -> Path
      Writes the directory atomically (built in a sibling temp dir, then renamed). `out` must not
      exist or be an empty directory. Same seed -> byte-identical files.
  TINY: dict      the qwen2-moe architecture numbers (vocab size is the tokenizer's, see `onespark-tiny.json`)
  TINY_QWEN35: dict  the qwen3.5-moe text_config numbers (vocab_size is set from the tokenizer)

The weights are random but not shapeless: the LM head row of token succ(t) is aligned with the
embedding of token t (succ = a fixed permutation), so the model "predicts" a successor with a clear
margin over the other tokens, like a trained model's peaked distribution. That makes greedy decoding
stable against small numeric changes (BF16 vs INT8 LM head), so a comparison between two heads tests
the head, not the coin-flips of a flat random distribution. Host-side: numpy + ml_dtypes, no torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from onespark import options
from onespark.errors import UserError, at_path

# Head dim 64 (vLLM's CPU attention supports multiples of 32); hidden 256 = 4 heads x 64.
TINY = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "tokenizer_vocab_target": 800,
}

# qwen3.5-moe: the real text_config's structure at toy sizes (real: onespark.checkpoint.synth.REAL_TEXT). 4 layers =
# 3 Gated DeltaNet + 1 full attention (full_attention_interval 4, as the real 48); head_dim 256, 2 query
# heads and 1 KV head (real: 32 and 2); GDN 2 key heads and 4 value heads of 64 (real: 16 and 64 of 128).
TINY_QWEN35 = {
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "mtp_num_hidden_layers": 1,
}
ARCHS = ("qwen2-moe", "qwen3.5-moe")
MTP_INITS = ("agree", "random")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Training text for the tokenizer: fixed, so the vocabulary is the same on every machine.
_CORPUS = """\
The quick brown fox jumps over the lazy dog while the model serves tokens on one machine.
A hybrid checkpoint keeps experts in four bits and the shared experts in eight bit floating point.
Streaming responses arrive one chunk at a time; the server counts tokens in its usage field.
Decode speed is limited by memory bandwidth, prefill speed by compute, and both by the scheduler.
What is the capital of France? Paris is the capital of France, and Berlin is the capital of Germany.
Write a short poem about the sea. The sea is wide, the sea is deep, the waves come in and never sleep.
Explain attention in one sentence: each token looks at earlier tokens and mixes what it finds.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 96 128 256 1024 2048 4096 65536 122 10.5 3.14
def add(a, b):\n    return a + b\nprint(add(2, 3))\nfor i in range(10):\n    print(i * i)
{"role": "user", "content": "hello"} [1, 2, 3] <html><body>hello world</body></html>
Speculative decoding drafts a few tokens and the target model verifies them in a single pass.
The key value cache grows with context length; a smaller cache leaves room for more requests.
"""


def _build_tokenizer(vocab_target: int):
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:  # the host venv may not have it; the test venv does (via transformers)
        raise UserError("tiny-model needs the `tokenizers` package: pip install tokenizers") from e
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def _tensors(rng: np.random.Generator, vocab: int, tie: bool) -> dict[str, np.ndarray]:
    """All weights in float32 (converted to BF16 on write), HF Qwen2-MoE names."""
    h = TINY["hidden_size"]
    nh, nkv = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    hd = h // nh

    def w(*shape, std=0.02):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    out: dict[str, np.ndarray] = {}
    embed = rng.standard_normal((vocab, h), dtype=np.float32)  # rms ~1 per row
    out["model.embed_tokens.weight"] = embed
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = np.ones(h, np.float32)
        out[f"{p}.post_attention_layernorm.weight"] = np.ones(h, np.float32)
        out[f"{p}.self_attn.q_proj.weight"] = w(nh * hd, h, std=0.06)
        out[f"{p}.self_attn.q_proj.bias"] = w(nh * hd)
        out[f"{p}.self_attn.k_proj.weight"] = w(nkv * hd, h, std=0.06)
        out[f"{p}.self_attn.k_proj.bias"] = w(nkv * hd)
        out[f"{p}.self_attn.v_proj.weight"] = w(nkv * hd, h, std=0.06)
        out[f"{p}.self_attn.v_proj.bias"] = w(nkv * hd)
        out[f"{p}.self_attn.o_proj.weight"] = w(h, nh * hd)
        out[f"{p}.mlp.gate.weight"] = w(TINY["num_experts"], h, std=0.1)
        for e in range(TINY["num_experts"]):
            q = f"{p}.mlp.experts.{e}"
            out[f"{q}.gate_proj.weight"] = w(TINY["moe_intermediate_size"], h, std=0.06)
            out[f"{q}.up_proj.weight"] = w(TINY["moe_intermediate_size"], h, std=0.06)
            out[f"{q}.down_proj.weight"] = w(h, TINY["moe_intermediate_size"])
        s = f"{p}.mlp.shared_expert"
        out[f"{s}.gate_proj.weight"] = w(TINY["shared_expert_intermediate_size"], h, std=0.06)
        out[f"{s}.up_proj.weight"] = w(TINY["shared_expert_intermediate_size"], h, std=0.06)
        out[f"{s}.down_proj.weight"] = w(h, TINY["shared_expert_intermediate_size"])
        out[f"{p}.mlp.shared_expert_gate.weight"] = w(1, h, std=0.1)
    out["model.norm.weight"] = np.ones(h, np.float32)
    if not tie:
        # Row succ(t) ~ embedding of t: logit margin ~ 0.35 * sqrt(256) = 5.6 for the successor,
        # against N(0, ~0.4) for the rest (std of the 0.025 noise times sqrt(256) plus the mix).
        succ = rng.permutation(vocab)
        head = np.empty((vocab, h), np.float32)
        head[succ] = embed * np.float32(0.35 / np.sqrt(h))
        out["lm_head.weight"] = head + w(vocab, h, std=0.025)
    return out


def _qwen35_config(vocab: int, eos_id: int, pad_id: int) -> dict:
    from onespark.checkpoint.synth import make_config

    # make_config's architecture part is the format's; a BF16 checkpoint has no quantization_config.
    config = make_config("fp8", dict(TINY_QWEN35, vocab_size=vocab))
    del config["quantization_config"]
    config["text_config"].update(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
                                 max_position_embeddings=TINY["max_position_embeddings"])
    return config


def _qwen35_tensors(rng: np.random.Generator, config: dict, mtp_init: str) -> dict[str, np.ndarray]:
    """Every tensor onespark.model.qwen35 lists for `config` (language model + MTP), float32 (BF16 on write)."""
    from onespark.model import qwen35

    tc = config["text_config"]
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    out: dict[str, np.ndarray] = {}
    embed = rng.standard_normal((vocab, h), dtype=np.float32)  # rms ~1 per row
    for m in qwen35.language_modules(config) + qwen35.mtp_modules(config):
        if isinstance(m, qwen35.Linear):
            name, shape = m.prefix + ".weight", (m.out, m.inp)
            if m.prefix == "lm_head":
                # as the qwen2-moe head: row succ(t) ~ embedding of t, a clear margin for the successor
                succ = rng.permutation(vocab)
                head = np.empty((vocab, h), np.float32)
                head[succ] = embed * np.float32(0.35 / np.sqrt(h))
                out[name] = head + rng.standard_normal(shape, dtype=np.float32) * np.float32(0.025)
                continue
            if m.prefix == "mtp.fc" and mtp_init == "agree":
                # fc(cat[norm(embed(t+1)), norm(hidden_t)]) = norm(embed(t+1)): the MTP layer's residual
                # stream then carries token t+1 as the target's carries its own token, so the shared head
                # drafts succ(t+1), the target's next prediction.
                out[name] = np.concatenate([np.eye(h, dtype=np.float32), np.zeros((h, h), np.float32)], axis=1)
                continue
            last = m.prefix.rsplit(".", 1)[-1]
            std = 0.1 if last in ("gate", "shared_expert_gate") else 0.02 if last in (
                "o_proj", "out_proj", "down_proj") else 0.06
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            continue
        name, shape = m.name, m.shape
        if name.endswith("embed_tokens.weight"):
            out[name] = embed
        elif name.endswith("linear_attn.norm.weight"):
            out[name] = np.ones(shape, np.float32)  # gated RMSNorm: plain w
        elif name.endswith("norm.weight") or "norm_" in name.rsplit(".", 2)[-2]:
            out[name] = np.zeros(shape, np.float32)  # Gemma-style (1 + w) RMSNorm: zeros = identity
        elif name.endswith("conv1d.weight"):
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.2)
        elif name.endswith("A_log"):
            out[name] = np.log(rng.uniform(1, 16, shape)).astype(np.float32)  # transformers' init range
        elif name.endswith("dt_bias"):
            out[name] = np.ones(shape, np.float32)
        else:
            raise AssertionError(f"tiny-model: no initialiser for {name}")  # a new tensor kind in qwen35
    return out


def _safetensors_bytes(tensors: dict[str, np.ndarray]) -> tuple[bytes, list[bytes]]:
    """safetensors layout: u64 little-endian header length, JSON header, raw little-endian data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name].astype(ml_dtypes.bfloat16)).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, blobs


def _config(vocab: int, tie: bool, eos_id: int, pad_id: int) -> dict:
    t = TINY
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "vocab_size": vocab,
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": t["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": t["moe_intermediate_size"],
        "shared_expert_intermediate_size": t["shared_expert_intermediate_size"],
        "num_experts": t["num_experts"],
        "num_experts_per_tok": t["num_experts_per_tok"],
        "norm_topk_prob": False,
        "output_router_logits": False,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "qkv_bias": True,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


TINY_RECORD = "onespark-tiny.json"  # what made the directory; verify knows a tiny model by it


def _put(tmp: Path, out: Path, name: str, data: bytes) -> None:
    """tmp/name, written. An error of the write itself (a full disk: the kernel names no file) or of tmp/name is
    reported as out/name: the file the user asked for (tmp is removed on the way out)."""
    with at_path(out / name, tmp / name):
        (tmp / name).write_bytes(data)


def _write_json(tmp: Path, out: Path, name: str, obj: object) -> None:
    _put(tmp, out, name, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_tiny_model(out: str | os.PathLike, seed: int = 0, tie_word_embeddings: bool = False,
                     arch: str = "qwen2-moe", mtp_init: str = "agree") -> Path:
    if arch not in ARCHS:
        raise UserError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")
    if mtp_init not in MTP_INITS:
        raise UserError(f"--mtp-init {mtp_init!r} is not one of {', '.join(MTP_INITS)}")
    if arch == "qwen3.5-moe" and tie_word_embeddings:
        raise UserError("--tie-word-embeddings is for --arch qwen2-moe only (Qwen3.5-MoE has its own LM head)")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty directory: pick a new --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(TINY["tokenizer_vocab_target"])
    vocab = tok.get_vocab_size()
    eos_id, pad_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    rng = np.random.Generator(np.random.PCG64(seed))
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:  # out of inodes: named as --out, not as the random temp name it tried
        raise OSError(e.errno, e.strerror, str(out)) from e
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a container user other than us must read it
        if arch == "qwen2-moe":
            config = _config(vocab, tie_word_embeddings, eos_id, pad_id)
            tensors = _tensors(rng, vocab, tie_word_embeddings)
        else:
            config = _qwen35_config(vocab, eos_id, pad_id)
            tensors = _qwen35_tensors(rng, config, mtp_init)
        header, blobs = _safetensors_bytes(tensors)
        _put(tmp, out, "model.safetensors", b"".join([header, *blobs]))  # a few MB
        # to_str, not tok.save: the library's own write fails as a bare Exception ("No space left on device (os
        # error 28)"), no OSError; pretty=True is what save writes, byte for byte
        _put(tmp, out, "tokenizer.json", tok.to_str(pretty=True).encode())
        _write_json(tmp, out, "config.json", config)
        _write_json(tmp, out, "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": TINY["max_position_embeddings"],
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": None,
            "unk_token": None,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        })
        _write_json(tmp, out, "generation_config.json", {"eos_token_id": eos_id, "pad_token_id": pad_id})
        hashes = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.iterdir())}
        _write_json(tmp, out, TINY_RECORD, {
            "tool": "onespark tiny-model", "seed": seed, "vocab_size": vocab, "arch": arch,
            **({"mtp_init": mtp_init} if arch == "qwen3.5-moe" else {}),
            "tie_word_embeddings": tie_word_embeddings, "sha256": hashes,
        })
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=options.directory_path, help="directory to create (must not exist, or be empty)")
    parser.add_argument("--seed", type=options.number(int, 0), default=0, help="weights are a function of the seed (default 0)")
    parser.add_argument("--tie-word-embeddings", action="store_true",
                        help="share the LM head with the embedding (default: separate, like Qwen3.5; qwen2-moe only)")
    parser.add_argument("--arch", choices=ARCHS, default="qwen2-moe",
                        help="qwen2-moe (default; vLLM 0.19.1's CPU build serves it) or qwen3.5-moe (the real "
                             "architecture: Gated DeltaNet + gated attention + MoE + MTP; vLLM 0.32.0)")
    parser.add_argument("--mtp-init", choices=MTP_INITS, default="agree",
                        help="qwen3.5-moe: MTP layer that drafts what the target predicts (agree, default) or random")


def run(args: argparse.Namespace) -> int:
    if args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")
    out = write_tiny_model(args.out, seed=args.seed, tie_word_embeddings=args.tie_word_embeddings, arch=args.arch,
                           mtp_init=args.mtp_init)
    meta = json.loads((out / TINY_RECORD).read_text())
    what = "Qwen2-MoE" if args.arch == "qwen2-moe" else f"Qwen3.5-MoE + MTP ({args.mtp_init})"
    print(f"wrote {out} ({what}, vocab {meta['vocab_size']}, seed {args.seed})")
    return 0
