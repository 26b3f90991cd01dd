"""A real vLLM 0.19.1 OpenAI server on CPU, with the onespark plugin, serving the tiny model end to end.

`vllm_server` (conftest.py) runs with the plugin's defaults, so its LM head is INT8; a second server with
ONESPARK_INT8_LM_HEAD=0 keeps vLLM's BF16 head. Both score the same prompts (teacher-forced prompt logprobs,
so one early difference cannot cascade) and generate greedily.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.vllm_server import ServerError, VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the model serves tokens on one machine.",
    "What is the capital of France? Paris is the capital of France, and Berlin is the capital of Germany.",
    "Write a short poem about the sea. The sea is wide, the sea is deep, the waves come in and never sleep.",
    "Explain attention in one sentence: each token looks at earlier tokens and mixes what it finds.",
    "def add(a, b):\n    return a + b\nprint(add(2, 3))\nfor i in range(10):\n    print(i * i)",
    "Speculative decoding drafts a few tokens and the target model verifies them in a single pass.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 96 128 256 1024 2048 4096 65536 122 10.5 3.14",
    "Streaming responses arrive one chunk at a time; the server counts tokens in its usage field.",
    "A hybrid checkpoint keeps experts in four bits and the shared experts in eight bit floating point.",
    "The key value cache grows with context length; a smaller cache leaves room for more requests.",
    "Decode speed is limited by memory bandwidth, prefill speed by compute, and both by the scheduler.",
    '{"role": "user", "content": "hello"} [1, 2, 3] <html><body>hello world</body></html> Ünïcödé ✓',
]
GEN_TOKENS = 24


def score(server: VLLMServer) -> dict:
    """Per prompt: teacher-forced top-1 token and the actual token's logprob at every position, and the
    greedy continuation with its logprobs."""
    out = {"top1": [], "actual_lp": [], "gen_tokens": [], "gen_lp": []}
    for prompt in PROMPTS:
        r = server.post_json("/v1/completions", {
            "model": server.model, "prompt": prompt, "max_tokens": GEN_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "prompt_logprobs": 1, "return_tokens_as_token_ids": True,
        })
        choice = r["choices"][0]
        positions = choice["prompt_logprobs"][1:]  # position 0 has no context
        top1, actual = [], []
        for pos in positions:
            ranked = {int(tok): v for tok, v in pos.items()}
            top1.append(next(t for t, v in ranked.items() if v["rank"] == 1))
            actual.append(max(ranked.values(), key=lambda v: v["rank"])["logprob"])  # the prompt's own token
        out["top1"].append(top1)
        out["actual_lp"].append(actual)
        out["gen_tokens"].append(choice["logprobs"]["tokens"])
        out["gen_lp"].append(choice["logprobs"]["token_logprobs"])
    return out


@pytest.fixture(scope="module")
def bf16_head_server(tiny_model_dir):
    with VLLMServer(tiny_model_dir, env={"ONESPARK_INT8_LM_HEAD": "0"}) as server:
        yield server


def test_chat_completions_stream(vllm_server):
    chunks = vllm_server.stream_chat({
        "model": vllm_server.model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,  # random weights may pick <|im_end|> early; we want all 12 tokens
        "stream_options": {"include_usage": True},
    })
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert sum(1 for d in deltas if d) >= 2, f"not streamed: {deltas!r}"  # several content chunks, not one blob
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-1]["usage"]["prompt_tokens"] > 5


def test_logs_name_the_int8_head_and_the_bytes_freed(vllm_server, bf16_head_server, tiny_model_dir):
    log = vllm_server.log_text()
    assert "onespark plugin active on vLLM 0.19.1: hybrid-fp8, int8-lm-head" in log
    m = re.search(r"INT8 LM head lm_head in use: \[(\d+) x (\d+)\].*freed (\d+) bytes", log)
    assert m, "the INT8 head's log line is missing:\n" + vllm_server.log_tail()
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    rows, hidden, freed = map(int, m.groups())
    assert rows == -(-vocab // 64) * 64 and freed == rows * hidden * 2  # vLLM pads the vocab to 64; BF16
    other = bf16_head_server.log_text()
    assert "INT8 LM head" not in other and "off: int8-lm-head (ONESPARK_INT8_LM_HEAD=0)" in other


def test_int8_head_matches_bf16_head(vllm_server, bf16_head_server, record_property):
    int8, bf16 = score(vllm_server), score(bf16_head_server)
    pairs = [(a, b) for p, q in zip(int8["top1"], bf16["top1"]) for a, b in zip(p, q)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    lp_diff = max(abs(a - b) for p, q in zip(int8["actual_lp"], bf16["actual_lp"]) for a, b in zip(p, q))
    gen_same = sum(p == q for p, q in zip(int8["gen_tokens"], bf16["gen_tokens"]))
    gen_lp_diff = max(abs(a - b) for p, q, tp, tq in zip(int8["gen_lp"], bf16["gen_lp"], int8["gen_tokens"],
                                                            bf16["gen_tokens"])
                      for a, b, s, t in zip(p, q, tp, tq) if s == t)
    summary = (f"top-1 identical at {agree:.2%} of {len(pairs)} teacher-forced positions; max |logprob diff| "
               f"{lp_diff:.4f} (prompt tokens), {gen_lp_diff:.4f} (greedy tokens); greedy continuations "
               f"identical for {gen_same}/{len(PROMPTS)} prompts")
    record_property("int8_vs_bf16", summary)
    print(summary)
    assert len(pairs) >= 200  # enough positions for a 99% threshold to mean something
    assert agree >= 0.99, summary
    # The heads differ (a no-op plugin would give 0.0), but only by INT8 rounding of the logits.
    assert 0 < lp_diff < 0.5, summary


def test_a_server_that_cannot_start_fails_fast_with_its_log(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nope"}')
    server = VLLMServer(tmp_path, startup_timeout_s=300)
    with pytest.raises(ServerError, match=r"exited with code \d+ during start-up\n--- last \d+ lines of "):
        server.start()
    assert not server.running
    server.stop()  # idempotent
    assert str(tmp_path) in server.log_text()  # the log names what it tried to load


def test_tied_head_stays_bf16_and_serves(tmp_path):
    # Qwen2-MoE ties by assigning the embedding's Parameter to lm_head.weight: quantizing would free
    # nothing (the embedding keeps it), so the plugin must leave that head alone, and serving must work.
    from onespark.checkpoint.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    with VLLMServer(model) as server:
        r = server.post_json("/v1/completions", {"model": server.model, "prompt": "The quick brown fox",
                                                 "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        log = server.log_text()
    assert r["usage"]["completion_tokens"] == 4
    assert "tied to the input embedding: INT8 head not applied" in log
    assert "INT8 LM head lm_head in use" not in log
