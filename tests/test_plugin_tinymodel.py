"""`onespark tiny-model`: deterministic, complete, and readable by the libraries vLLM loads it with."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from onespark.checkpoint.tinymodel import TINY, write_tiny_model
from onespark.errors import UserError


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny_model_dir):
    again = write_tiny_model(tmp_path / "again", seed=0)
    other = write_tiny_model(tmp_path / "other", seed=1)
    meta = [json.loads((d / "onespark-tiny.json").read_text()) for d in (tiny_model_dir, again, other)]
    assert meta[0]["sha256"] == meta[1]["sha256"]
    assert meta[0]["sha256"]["model.safetensors"] != meta[2]["sha256"]["model.safetensors"]
    assert meta[0]["sha256"]["tokenizer.json"] == meta[2]["sha256"]["tokenizer.json"]  # tokenizer has no seed


def test_weights_match_config(tiny_model_dir):
    from safetensors import safe_open  # an independent reader of our hand-written file

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
        dtypes = {f.get_slice(n).get_dtype() for n in names}
    assert dtypes == {"BF16"}
    assert shapes["model.embed_tokens.weight"] == (v, h)
    assert shapes["lm_head.weight"] == (v, h)
    for i in range(cfg["num_hidden_layers"]):
        for e in range(cfg["num_experts"]):
            assert shapes[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"] == (cfg["moe_intermediate_size"], h)
            assert shapes[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"] == (h, cfg["moe_intermediate_size"])
        assert shapes[f"model.layers.{i}.mlp.shared_expert.up_proj.weight"] == (cfg["shared_expert_intermediate_size"], h)
        assert shapes[f"model.layers.{i}.mlp.shared_expert_gate.weight"] == (1, h)
    per_layer = 7 + 3 * cfg["num_experts"] + 3 + 1 + 1  # attn (4 w + 3 b), experts, shared, its gate, router
    assert len(names) == 3 + cfg["num_hidden_layers"] * (per_layer + 2)  # + 2 norms per layer
    assert cfg["hidden_size"] == TINY["hidden_size"]


def test_tokenizer_and_chat_template(tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer  # what vLLM 0.19.1 loads them with

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    cfg = AutoConfig.from_pretrained(str(tiny_model_dir))
    assert cfg.model_type == "qwen2_moe" and len(tok) == cfg.vocab_size
    text = "Paris is the capital of France. Ünïcödé ✓"
    assert tok.decode(tok.encode(text)) == text  # byte-level: every string round-trips
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == cfg.eos_token_id


def test_tied_variant_has_no_lm_head(tmp_path):
    from safetensors import safe_open

    d = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(d / "model.safetensors"), framework="np") as f:
        assert "lm_head.weight" not in set(f.keys())


def test_refuses_non_empty_out_and_leaves_it_alone(tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not an empty directory"):
        write_tiny_model(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]  # no temp dir left behind


def test_cli(tmp_path):
    run = [sys.executable, "-m", "onespark", "tiny-model", "--out", str(tmp_path / "m"), "--seed", "3"]
    ok = subprocess.run(run, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "m" / "onespark-tiny.json").read_text())["seed"] == 3
    again = subprocess.run(run, capture_output=True, text=True)
    assert again.returncode == 1 and "not an empty directory" in again.stderr


# -- the real Qwen3.5-MoE architecture (the 0.32.0 track serves it; tests/test_v032_server.py) ---------------


@pytest.mark.vllm032
def test_qwen35_weights_are_every_tensor_the_real_layout_implies(tiny_qwen35_dir):
    from safetensors import safe_open

    from onespark.model import qwen35

    cfg = json.loads((tiny_qwen35_dir / "config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and tc["model_type"] == "qwen3_5_moe_text"
    assert "quantization_config" not in cfg and tc["attn_output_gate"] is True and tc["mtp_num_hidden_layers"] == 1
    assert tc["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and tc["head_dim"] == 256
    # The independent reference: onespark.model.qwen35 lists what the real checkpoint holds (used by `verify`).
    want = qwen35.expected_tensors(cfg)
    with safe_open(str(tiny_qwen35_dir / "model.safetensors"), framework="np") as f:
        got = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in f.keys()}
        fc = f.get_tensor("mtp.fc.weight")  # ml_dtypes bfloat16
        norm = f.get_tensor("model.language_model.layers.0.input_layernorm.weight")
    vision = {n for n in want if n.startswith("model.visual.")}
    assert set(got) == set(want) - vision  # text + MTP, no vision tower (served --language-model-only)
    assert all(dt == "BF16" and shape == want[n].shape for n, (dt, shape) in got.items())
    assert sum(n.startswith("mtp.") for n in got) == 4 + 2 + 6 + 2 + 3 + 3 * tc["num_experts"]
    h = tc["hidden_size"]
    import numpy as np

    assert np.array_equal(fc.astype(np.float32), np.hstack([np.eye(h), np.zeros((h, h))]))  # --mtp-init agree
    assert not norm.astype(np.float32).any()  # Gemma-style (1 + w) norm at identity


@pytest.mark.vllm032
def test_qwen35_loads_with_transformers_and_mtp_init_random_differs(tmp_path, tiny_qwen35_dir):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(tiny_qwen35_dir))
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen35_dir))
    assert cfg.model_type == "qwen3_5_moe" and cfg.text_config.model_type == "qwen3_5_moe_text"
    assert len(tok) == cfg.text_config.vocab_size and tok.convert_tokens_to_ids("<|im_end|>") == cfg.text_config.eos_token_id
    rnd = write_tiny_model(tmp_path / "rnd", arch="qwen3.5-moe", mtp_init="random")
    meta = json.loads((rnd / "onespark-tiny.json").read_text())
    ref = json.loads((tiny_qwen35_dir / "onespark-tiny.json").read_text())
    assert meta["arch"] == "qwen3.5-moe" and meta["mtp_init"] == "random" and ref["mtp_init"] == "agree"
    assert meta["sha256"]["model.safetensors"] != ref["sha256"]["model.safetensors"]
    with pytest.raises(UserError, match="--arch 'llama' is not one of qwen2-moe, qwen3.5-moe"):
        write_tiny_model(tmp_path / "x", arch="llama")
    with pytest.raises(UserError, match="--tie-word-embeddings is for --arch qwen2-moe only"):
        write_tiny_model(tmp_path / "y", arch="qwen3.5-moe", tie_word_embeddings=True)
