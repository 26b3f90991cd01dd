"""Tool calls when the server streams several tokens per step, as it does under MTP-2 (1-3 tokens a step).

A real vLLM 0.19.1 server (CPU) with the image's parsers (`--reasoning-parser qwen3 --enable-auto-tool-choice
--tool-call-parser qwen3_xml`) serves a tiny model scripted to reply like Qwen3.5 (tests/_scripted_model.py):
reasoning, `</think>`, then two tool calls, one with two typed parameters and one whose string argument holds
quotes, `&&` and an XML-looking `<x>`. CPU vLLM has no speculative decoding, so `--stream-interval N` makes
the server send N tokens per chunk instead: the same multi-token deltas the serving layer gets from MTP.
The streamed result (tool calls assembled from their deltas, reasoning, content, finish reason) must equal
the non-streamed one, which must equal the script. The reply's pieces (one token each) are 1-4 characters
long at random places, so the chunk boundaries fall inside tags, parameter names and values.

Limit of the script: the next token depends on the current one only, so no token can appear twice. The first
`<tool_call>` / `</tool_call>` are the real single tokens; the second call spells them in pieces. qwen3_xml
reads text, so both forms test it; a parser that finds calls by token id (qwen3_coder) cannot be tested with
this script (it leaks the second call into content even at one token per chunk).
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests._scripted_model import write_scripted_model
from tests.vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

COMMAND = "ls -la \"/tmp/a b\" && echo '<x>'"
REASONING = "\nThe user wants the weather in Prague for 3 days, then a directory listing.\n"
REPLY = (f"{REASONING}</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPrague\n</parameter>\n"
         f"<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run>\n"
         f"<parameter=command>\n{COMMAND}\n</parameter>\n</function>\n</tool_call>")
WANT_CALLS = [("get_weather", {"city": "Prague", "days": 3}), ("run", {"command": COMMAND})]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}}},
]


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("scripted") / "model"
    return out, len(write_scripted_model(out, REPLY)) + 1  # the reply's tokens and <|im_end|>


def _post(srv: VLLMServer, body: dict):
    req = urllib.request.Request(f"{srv.openai_url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300)


def _body(srv: VLLMServer, stream: bool) -> dict:
    return {"model": srv.model, "messages": [{"role": "user", "content": "Weather in Prague, then list /tmp/a b."}],
            "tools": TOOLS, "tool_choice": "auto", "max_tokens": 300, "temperature": 0, "stream": stream}


def _streamed(srv: VLLMServer) -> tuple[dict, int]:
    """The streamed reply assembled as a non-streamed message would read, and the number of chunks."""
    calls: dict[int, dict] = {}
    reasoning, content, finish, chunks = "", "", None, 0
    with _post(srv, _body(srv, stream=True)) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunks += 1
            choice = json.loads(line[len("data:"):])["choices"][0]
            delta = choice.get("delta") or {}
            reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                c["id"] = c["id"] or tc.get("id")
                fn = tc.get("function") or {}
                c["name"] += fn.get("name") or ""
                c["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {"reasoning": reasoning, "content": content, "finish_reason": finish,
            "tool_calls": [calls[i] for i in sorted(calls)]}, chunks


@pytest.mark.parametrize("interval", [1, 3])
def test_tool_calls_survive_multi_token_deltas(scripted_model, interval):
    model, tokens = scripted_model
    args = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml",
            "--stream-interval", str(interval)]
    with VLLMServer(model, args=args) as srv:
        with _post(srv, _body(srv, stream=False)) as r:
            whole = json.load(r)["choices"][0]
        streamed, chunks = _streamed(srv)

    msg = whole["message"]
    assert whole["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == WANT_CALLS
    assert msg["reasoning"] == REASONING and not msg.get("content")

    # streamed == non-streamed, field by field
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"]] == WANT_CALLS, streamed
    assert all(c["id"] for c in streamed["tool_calls"]) and len({c["id"] for c in streamed["tool_calls"]}) == 2
    assert streamed["reasoning"] == REASONING
    assert not streamed["content"].strip(), f"text outside the tool calls leaked into content: {streamed['content']!r}"
    assert streamed["finish_reason"] == "tool_calls"
    print(f"stream interval {interval}: {tokens} tokens in {chunks} chunks")
    if interval > 1:  # the server really sent several tokens per chunk
        assert chunks <= tokens / interval + 3, (chunks, tokens)
