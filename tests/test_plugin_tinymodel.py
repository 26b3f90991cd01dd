"""`onespark tiny-model`: deterministic, complete, and readable by the libraries vLLM loads it with."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from onespark.errors import UserError
from onespark.tinymodel import TINY, write_tiny_model


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
