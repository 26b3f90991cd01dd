"""A real vLLM 0.19.1 OpenAI server on CPU serves the tiny model with the onespark plugin installed."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


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
