"""A tiny dense Qwen3 checkpoint whose attention has head_dim 256, for serving the TurboQuant backend end to end.

`onespark tiny-model` (Qwen2-MoE) has head_dim 64, which the TurboQuant kernels do not take. This keeps its
tokenizer, chat template and generation config (it writes one, then replaces config.json and the weights):
Qwen3ForCausalLM, 2 layers, hidden 256, 4 query heads and 2 KV heads of 256 (Qwen3's `head_dim` is free
of hidden / heads, like Qwen3.5's full-attention layers), BF16 safetensors with HF tensor names.

Attention is made to matter: q_norm/k_norm fix |q| = |k| = 16 per head, so scores are O(1) whatever the
weights; values and o_proj are sized so the attention output is about as large as the residual stream
(rms ~1). A backend that attends to the wrong tokens or decodes the cache wrongly then changes the logits,
not just their last digits. The LM head is tinymodel's "successor" construction (peaked logits).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from onespark.checkpoint.tinymodel import _safetensors_bytes, write_tiny_model

H, NH, NKV, HD, FF, LAYERS = 256, 4, 2, 256, 512, 2
HEAD_MARGIN = 0.35  # tinymodel's value: a clear successor, so teacher-forced top-1 is stable


def write_tiny_qwen3_hd256(out: Path, seed: int = 0) -> Path:
    write_tiny_model(out, seed=seed)
    meta = json.loads((out / "onespark-tiny.json").read_text())
    vocab = meta["vocab_size"]
    rng = np.random.Generator(np.random.PCG64(seed + 1000))

    def w(*shape, std):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    t: dict[str, np.ndarray] = {}
    embed = rng.standard_normal((vocab, H), dtype=np.float32)
    t["model.embed_tokens.weight"] = embed
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = np.ones(H, np.float32)
        t[f"{p}.post_attention_layernorm.weight"] = np.ones(H, np.float32)
        t[f"{p}.self_attn.q_proj.weight"] = w(NH * HD, H, std=0.06)
        t[f"{p}.self_attn.k_proj.weight"] = w(NKV * HD, H, std=0.06)
        t[f"{p}.self_attn.v_proj.weight"] = w(NKV * HD, H, std=0.06)  # value entries ~ N(0, 1)
        t[f"{p}.self_attn.o_proj.weight"] = w(H, NH * HD, std=0.08)
        t[f"{p}.self_attn.q_norm.weight"] = np.ones(HD, np.float32)
        t[f"{p}.self_attn.k_norm.weight"] = np.ones(HD, np.float32)
        t[f"{p}.mlp.gate_proj.weight"] = w(FF, H, std=0.06)
        t[f"{p}.mlp.up_proj.weight"] = w(FF, H, std=0.06)
        t[f"{p}.mlp.down_proj.weight"] = w(H, FF, std=0.02)
    t["model.norm.weight"] = np.ones(H, np.float32)
    succ = rng.permutation(vocab)
    head = np.empty((vocab, H), np.float32)
    head[succ] = embed * np.float32(HEAD_MARGIN / np.sqrt(H))
    t["lm_head.weight"] = head + w(vocab, H, std=0.025)

    header, blobs = _safetensors_bytes(t)
    with open(out / "model.safetensors", "wb") as f:
        f.write(header)
        for b in blobs:
            f.write(b)
    cfg = json.loads((out / "config.json").read_text())
    keep = {k: cfg[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps",
                                "rope_theta", "max_position_embeddings", "hidden_act")}
    cfg = {**keep, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H,
           "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": NH,
           "num_key_value_heads": NKV, "head_dim": HD, "attention_bias": False, "attention_dropout": 0.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
           "sliding_window": None}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    meta.update(tool="tests/_tq_tiny_model.py (Qwen3, head_dim 256)",
                sha256={p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                        for p in sorted(out.iterdir()) if p.name != "onespark-tiny.json"})
    (out / "onespark-tiny.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out
