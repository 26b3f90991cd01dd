"""The scripted Qwen3.5-style tool-call conversation and its client, shared by the tests that stream it
through a real vLLM (tests/test_tool_calls_streaming.py: 0.19.1 at N tokens a chunk; tests/test_v032_server.py:
0.32.0 under MTP-2; tests/test_install_demo.py: the demo image).

The reply (REPLY, written into a model by tests/_scripted_model.py): reasoning, `</think>`, then two tool calls,
one with two typed parameters and one whose string argument holds quotes, `&&` and an XML-looking `<x>`.
The checks: the non-streamed answer equals the script, and the streamed one, assembled from its deltas, equals
the non-streamed one field by field (Chat Completions and the Responses API).
"""

from __future__ import annotations

import json
import urllib.request

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


def post(srv, body: dict, path: str = "/chat/completions"):
    req = urllib.request.Request(f"{srv.openai_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300)


def chat_body(srv, stream: bool) -> dict:
    return {"model": srv.model, "messages": [{"role": "user", "content": "Weather in Prague, then list /tmp/a b."}],
            "tools": TOOLS, "tool_choice": "auto", "max_tokens": 300, "temperature": 0, "stream": stream}


def streamed_chat(srv) -> tuple[dict, int]:
    """The streamed reply assembled as a non-streamed message would read, and the number of chunks."""
    calls: dict[int, dict] = {}
    reasoning, content, finish, chunks = "", "", None, 0
    with post(srv, chat_body(srv, stream=True)) as r:
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


def chat_exchange(srv) -> tuple[dict, dict, int]:
    """The scripted chat request asked twice: the non-streamed choice, the streamed reply (streamed_chat) and
    its number of chunks."""
    with post(srv, chat_body(srv, stream=False)) as r:
        whole = json.load(r)["choices"][0]
    streamed, chunks = streamed_chat(srv)
    return whole, streamed, chunks


def check_chat_answers(whole: dict, streamed: dict, stray_text: str = "") -> None:
    """chat_exchange's `whole` and `streamed`. The script's calls and reasoning in both,
    nothing in content but whitespace or `stray_text` (tests/test_v032_server.py: a text its script cannot
    avoid)."""
    msg = whole["message"]
    assert whole["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == WANT_CALLS
    assert msg["reasoning"] == REASONING and not msg.get("content")

    # streamed == non-streamed, field by field
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"]] == WANT_CALLS, streamed
    assert all(c["id"] for c in streamed["tool_calls"]) and len({c["id"] for c in streamed["tool_calls"]}) == 2
    assert streamed["reasoning"] == REASONING, f"streamed reasoning {streamed['reasoning']!r} != {REASONING!r}"
    assert streamed["content"].strip() in ("", stray_text), \
        f"text outside the tool calls leaked into content: {streamed['content']!r}"
    assert streamed["finish_reason"] == "tool_calls"


def responses_tools() -> list[dict]:
    return [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
            for t in TOOLS]


def responses_body(srv, stream: bool, **overrides) -> dict:
    return {"model": srv.model, "input": "Weather in Prague, then list /tmp/a b.", "tools": responses_tools(),
            "max_output_tokens": 300, "temperature": 0, "stream": stream, **overrides}


def responses_events(srv, **overrides) -> list[dict]:
    """The events of one streamed /v1/responses request, in order."""
    with post(srv, responses_body(srv, stream=True, **overrides), "/responses") as r:
        return [json.loads(line[len(b"data:"):]) for line in r if line.startswith(b"data:")]


def check_responses_stream(events: list[dict], stray_text: str = "") -> list[tuple[str, dict]]:
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


def check_responses(srv, stray_text: str = "") -> None:
    """The scripted request through /v1/responses, non-streamed and streamed: both carry the script's calls."""
    with post(srv, responses_body(srv, stream=False), "/responses") as r:
        output = json.load(r)["output"]
    assert [(o["name"], json.loads(o["arguments"])) for o in output if o["type"] == "function_call"] == WANT_CALLS
    assert check_responses_stream(responses_events(srv), stray_text=stray_text) == WANT_CALLS
