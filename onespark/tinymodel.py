"""`onespark tiny-model --out DIR`: a tiny Qwen2-MoE model that vLLM 0.19.1 serves on CPU.

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

  write_tiny_model(out, seed=0, tie_word_embeddings=False) -> Path
      Writes the directory atomically (built in a sibling temp dir, then renamed). `out` must not
      exist or be an empty directory. Same seed -> byte-identical files.
  TINY: dict      the architecture numbers (vocab size is the tokenizer's, see `onespark-tiny.json`)

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

from onespark.errors import UserError

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


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_tiny_model(out: str | os.PathLike, seed: int = 0, tie_word_embeddings: bool = False) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty directory: pick a new --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(TINY["tokenizer_vocab_target"])
    vocab = tok.get_vocab_size()
    eos_id, pad_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    rng = np.random.Generator(np.random.PCG64(seed))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a container user other than us must read it
        header, blobs = _safetensors_bytes(_tensors(rng, vocab, tie_word_embeddings))
        with open(tmp / "model.safetensors", "wb") as f:
            f.write(header)
            for b in blobs:
                f.write(b)
        tok.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", _config(vocab, tie_word_embeddings, eos_id, pad_id))
        _write_json(tmp / "tokenizer_config.json", {
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
        _write_json(tmp / "generation_config.json", {"eos_token_id": eos_id, "pad_token_id": pad_id})
        hashes = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.iterdir())}
        _write_json(tmp / "onespark-tiny.json", {
            "tool": "onespark tiny-model", "seed": seed, "vocab_size": vocab,
            "tie_word_embeddings": tie_word_embeddings, "sha256": hashes,
        })
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="directory to create (must not exist, or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of the seed (default 0)")
    parser.add_argument("--tie-word-embeddings", action="store_true",
                        help="share the LM head with the embedding (default: separate, like Qwen3.5)")


def run(args: argparse.Namespace) -> int:
    if args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")
    out = write_tiny_model(args.out, seed=args.seed, tie_word_embeddings=args.tie_word_embeddings)
    meta = json.loads((out / "onespark-tiny.json").read_text())
    print(f"wrote {out} (Qwen2-MoE, vocab {meta['vocab_size']}, seed {args.seed})")
    return 0
