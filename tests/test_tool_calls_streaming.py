"""Tool calls when the server streams several tokens per step, as it does under MTP-2 (1-3 tokens a step),
through Chat Completions and the Responses API.

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

The servers run vLLM with patches/responses-tool-calls.diff applied (as the images do). Stock vLLM 0.19.1
streams every tool call of a /v1/responses answer into one function_call item and types every argument of a
Responses call as a string; `test_stock_vllm_merges_responses_tool_calls` shows it, so that the diff goes
when a vLLM upgrade makes that test fail.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests._scripted_model import write_scripted_model
from tests.test_turboquant_patch import make_patched_tree
from tests.vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
DIFF = Path(__file__).resolve().parent.parent / "patches" / "responses-tool-calls.diff"
TARGETS = ["vllm/entrypoints/openai/responses/serving.py", "vllm/tool_parsers/qwen3xml_tool_parser.py"]
PARSERS = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml"]

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


@pytest.fixture(scope="module")
def patched_vllm(tmp_path_factory) -> Path:
    return make_patched_tree(tmp_path_factory.mktemp("vllm-responses"), diffs=((DIFF, TARGETS),))


@pytest.fixture(scope="module", params=[1, 3], ids=["1-token-chunks", "3-token-chunks"])
def server(request, scripted_model, patched_vllm):
    model, tokens = scripted_model
    with VLLMServer(model, args=[*PARSERS, "--stream-interval", str(request.param)],
                    env={"PYTHONPATH": str(patched_vllm)}) as srv:
        yield srv, request.param, tokens


def test_the_diff_touches_only_its_files_and_applies_once(patched_vllm):
    assert sorted(re.findall(r"^\+\+\+ b/(\S+)", DIFF.read_text(), flags=re.M)) == sorted(TARGETS)
    from tests.test_turboquant_patch import apply

    again = apply(DIFF, patched_vllm, dry_run=True)
    assert again.returncode != 0, "applying twice must fail (the image build must notice an already-patched tree)"


def _post(srv: VLLMServer, body: dict, path: str = "/chat/completions"):
    req = urllib.request.Request(f"{srv.openai_url}{path}", data=json.dumps(body).encode(),
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


def test_chat_completions_tool_calls_survive_multi_token_deltas(server):
    srv, interval, tokens = server
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


def _responses_tools() -> list[dict]:
    return [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
            for t in TOOLS]


def _responses_body(srv, stream: bool, **overrides) -> dict:
    return {"model": srv.model, "input": "Weather in Prague, then list /tmp/a b.", "tools": _responses_tools(),
            "max_output_tokens": 300, "temperature": 0, "stream": stream, **overrides}


def _responses_events(srv, **overrides) -> list[dict]:
    """The events of one streamed /v1/responses request, in order."""
    with _post(srv, _responses_body(srv, stream=True, **overrides), "/responses") as r:
        return [json.loads(line[len(b"data:"):]) for line in r if line.startswith(b"data:")]


def _check_responses_stream(events: list[dict], stray_text: str = "") -> list[tuple[str, dict]]:
    """Every item added is finished once, in order; a call's argument deltas add up to its final arguments.
    Returns the streamed function calls as (name, arguments). A message item may hold only whitespace, or
    `stray_text` (tests/test_v032_server.py: a text its script cannot avoid)."""
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == list(range(len(added))), "output items must be numbered 0, 1, ..."
    assert [(e["output_index"], e["item"]["id"]) for e in done] == [(e["output_index"], e["item"]["id"]) for e in added]
    calls = []
    for e in done:
        item = e["item"]
        if item["type"] == "function_call":
            deltas = "".join(d["delta"] for d in events
                             if d["type"] == "response.function_call_arguments.delta" and d["item_id"] == item["id"])
            assert deltas == item["arguments"], f"{item['name']}: deltas {deltas!r} != final {item['arguments']!r}"
            calls.append((item["name"], json.loads(item["arguments"])))
        elif item["type"] == "reasoning":
            assert item["content"][0]["text"] == REASONING
        else:
            text = "".join(c["text"] for c in item["content"]).strip()
            assert item["type"] == "message" and text in ("", stray_text), f"text in a message item: {text!r}"
    completed = next(e for e in events if e["type"] == "response.completed")["response"]["output"]
    final = [(o["name"], json.loads(o["arguments"])) for o in completed if o["type"] == "function_call"]
    assert final == calls, f"response.completed {final} != the streamed items {calls}"
    return calls


def test_responses_api_tool_calls_survive_multi_token_deltas(server):
    srv, _, _ = server
    with _post(srv, _responses_body(srv, stream=False), "/responses") as r:
        output = json.load(r)["output"]
    assert [(o["name"], json.loads(o["arguments"])) for o in output if o["type"] == "function_call"] == WANT_CALLS
    assert _check_responses_stream(_responses_events(srv)) == WANT_CALLS


def test_stock_vllm_merges_responses_tool_calls(scripted_model):
    """Why patches/responses-tool-calls.diff exists: without it, the two calls stream as one item."""
    model, _ = scripted_model
    with VLLMServer(model, args=PARSERS) as srv:
        events = _responses_events(srv)
    calls = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["arguments"].count("{") == 2, calls


def test_responses_plain_text_stream_is_unchanged_by_the_diff(tiny_model_dir, patched_vllm):
    """An answer without tool calls or reasoning (the tiny model's; its vocabulary has no <think>, so no reasoning
    parser): one message item whose text deltas add up to its final text and to response.completed's."""
    args = ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml"]
    with VLLMServer(tiny_model_dir, args=args, env={"PYTHONPATH": str(patched_vllm)}) as srv:
        events = _responses_events(srv, input="Say something.", tools=[], max_output_tokens=24)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["id"]) for e in done] == [(e["output_index"], e["item"]["id"]) for e in added]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    messages = [e["item"] for e in done if e["item"]["type"] == "message"]
    assert text and len(messages) == 1 and messages[0]["content"][0]["text"] == text
    completed = next(e for e in events if e["type"] == "response.completed")["response"]["output"]
    assert [o["content"][0]["text"] for o in completed if o["type"] == "message"] == [text]
