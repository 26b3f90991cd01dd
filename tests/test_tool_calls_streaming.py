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

The servers run vLLM with patches/responses-tool-calls.diff and patches/reasoning-boundary.diff applied (as the
images do). Stock vLLM 0.19.1 streams every tool call of a /v1/responses answer into one function_call item and
types every argument of a Responses call as a string, and on /v1/chat/completions drops the reasoning that
arrives in one delta with `</think>` (at 4 tokens per chunk the script's last reasoning piece shares the
`</think>` chunk); `test_stock_vllm_merges_responses_calls_and_drops_boundary_reasoning` shows both, so that a
diff goes when a vLLM upgrade makes its half of that test fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._scripted_model import write_scripted_model
from tests._tool_calls import (
    PARSERS,
    REASONING,
    REPLY,
    chat_exchange,
    check_chat_answers,
    check_responses,
    responses_events,
    streamed_chat,
)
from tests.test_turboquant_patch import harness, installed_vllm_root, make_patched_tree
from tests.vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
DIFF = Path(__file__).resolve().parent.parent / "patches" / "responses-tool-calls.diff"
TARGETS = ["vllm/entrypoints/openai/responses/serving.py", "vllm/tool_parsers/qwen3xml_tool_parser.py"]
BOUNDARY_DIFF = DIFF.with_name("reasoning-boundary.diff")
BOUNDARY_TARGETS = ["vllm/entrypoints/openai/chat_completion/serving.py"]
DIFFS = ((DIFF, TARGETS), (BOUNDARY_DIFF, BOUNDARY_TARGETS))  # as Dockerfile.v2 applies them, in order
BOUNDARY_CHUNK = 4  # tokens per chunk at which the script's `</think>` shares a chunk with reasoning text
MERGED_CHUNK = 6  # two MTP-2 steps merged (a client that reads late): one call's end shares a chunk with the next's start


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("scripted") / "model"
    return out, len(write_scripted_model(out, REPLY)) + 1  # the reply's tokens and <|im_end|>


@pytest.fixture(scope="module")
def patched_vllm(tmp_path_factory) -> Path:
    return make_patched_tree(tmp_path_factory.mktemp("vllm-responses"), diffs=DIFFS)


@pytest.fixture(scope="module", params=[1, 3, BOUNDARY_CHUNK, MERGED_CHUNK],
                ids=["1-token-chunks", "3-token-chunks", f"{BOUNDARY_CHUNK}-token-chunks", f"{MERGED_CHUNK}-token-chunks"])
def server(request, scripted_model, patched_vllm):
    model, tokens = scripted_model
    with VLLMServer(model, args=[*PARSERS, "--stream-interval", str(request.param)],
                    env={"PYTHONPATH": str(patched_vllm)}) as srv:
        yield srv, request.param, tokens


@pytest.mark.parametrize("diff, targets", DIFFS, ids=["responses-tool-calls", "reasoning-boundary"])
def test_the_diff_touches_only_its_files_and_applies_once(patched_vllm, diff, targets):
    assert sorted(harness.diff_targets(diff)) == sorted(targets)
    from tests.test_turboquant_patch import apply

    again = apply(diff, patched_vllm, dry_run=True)
    assert again.returncode != 0, "applying twice must fail (the image build must notice an already-patched tree)"


def test_chat_completions_tool_calls_survive_multi_token_deltas(server):
    srv, interval, tokens = server
    whole, streamed, chunks = chat_exchange(srv)
    check_chat_answers(whole, streamed)
    print(f"stream interval {interval}: {tokens} tokens in {chunks} chunks")
    if interval > 1:  # the server really sent several tokens per chunk
        assert chunks <= tokens / interval + 3, (chunks, tokens)


def test_responses_api_tool_calls_survive_multi_token_deltas(server):
    """At BOUNDARY_CHUNK tokens a chunk the reasoning's last piece shares a delta with </think> and the first call:
    responses-tool-calls.diff keeps it in the reasoning item (stock 0.19.1 lost it, as its chat path did)."""
    check_responses(server[0])


def test_stock_vllm_merges_responses_calls_and_drops_boundary_reasoning(scripted_model):
    """Why the two diffs exist: stock vLLM 0.19.1 streams the two calls of a /v1/responses answer as one item
    (responses-tool-calls.diff), and streams chat reasoning without its piece in the `</think>` chunk
    (reasoning-boundary.diff)."""
    model, _ = scripted_model
    with VLLMServer(model, args=[*PARSERS, "--stream-interval", str(BOUNDARY_CHUNK)]) as srv:
        events = responses_events(srv)
        streamed, _ = streamed_chat(srv)
    calls = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["arguments"].count("{") == 2, calls
    lost = REASONING.removeprefix(streamed["reasoning"])
    assert streamed["reasoning"] != REASONING and REASONING.startswith(streamed["reasoning"]) and lost.strip(), streamed


def test_responses_plain_text_stream_is_unchanged_by_the_diff(tiny_model_dir, patched_vllm):
    """An answer without tool calls or reasoning (the tiny model's; its vocabulary has no <think>, so no reasoning
    parser): one message item whose text deltas add up to its final text and to response.completed's."""
    args = ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml"]
    with VLLMServer(tiny_model_dir, args=args, env={"PYTHONPATH": str(patched_vllm)}) as srv:
        events = responses_events(srv, input="Say something.", tools=[], max_output_tokens=24)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["id"]) for e in done] == [(e["output_index"], e["item"]["id"]) for e in added]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    messages = [e["item"] for e in done if e["item"]["type"] == "message"]
    assert text and len(messages) == 1 and messages[0]["content"][0]["text"] == text
    completed = next(e for e in events if e["type"] == "response.completed")["response"]["output"]
    assert [o["content"][0]["text"] for o in completed if o["type"] == "message"] == [text]


# ---------------------------------------------------------------------------------------------
# The qwen3_xml parser alone, fed the reply's text in every chunking a server could send: no server, so every
# chunk size and alignment is affordable (a served run covers only the three stream intervals above).

def _load_parser(path: Path, name: str):
    """The qwen3_xml parser module at `path`, under its own name (the installed module is left alone)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _chunkings(pieces: list[str]):
    """(label, chunks) of the text after `</think>` (what the reasoning parser hands the tool parser): n
    tokens a chunk for n = 1..12 at every alignment, then 200 random chunkings of 1-12 tokens a chunk."""
    import random

    start = len(REASONING) + len("</think>")
    ends, pos = [], 0
    for p in pieces:
        pos += len(p)
        if pos > start:
            ends.append(pos - start)
    text = REPLY[start:]

    def cut(at: list[int]) -> list[str]:
        bounds = [0, *at, len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]

    for n in range(1, 13):
        for offset in range(n):
            yield f"{n} tokens a chunk, offset {offset}", cut(ends[offset::n])
    rng = random.Random(0)
    for k in range(200):
        at, i = [], rng.randrange(12)
        while i < len(ends):
            at.append(ends[i])
            i += rng.randint(1, 12)
        yield f"random chunking {k}", cut(at)


def _streamed_calls(module, chunks: list[str]) -> tuple[list, str]:
    """The calls (name, parsed arguments) and the content the parser streams for these chunks."""
    import json

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from tests._tool_calls import TOOLS

    parser = module.StreamingXMLToolCallParser()
    parser.set_tools(ChatCompletionRequest(model="m", messages=[], tools=TOOLS).tools)
    calls: dict[int, list[str]] = {}
    content = ""
    for chunk in chunks:
        delta = parser.parse_single_streaming_chunks(chunk)
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            name_args = calls.setdefault(tc.index, ["", ""])
            if tc.function:
                name_args[0] += tc.function.name or ""
                name_args[1] += tc.function.arguments or ""
    try:
        return [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())], content
    except ValueError:  # arguments that are not JSON: returned as they streamed, so the comparison fails
        return [tuple(c) for _, c in sorted(calls.items())], content


def test_qwen3_xml_keeps_every_call_whole_at_any_chunking(scripted_model, patched_vllm):
    """With the diff, every chunking streams exactly the script's two calls and no content. Stock vLLM 0.19.1
    does not: a chunk holding one call's `</tool_call>` and the next `<tool_call>` (8 tokens a chunk here; seen
    by hand at --stream-interval 6) closes the new call at once, which streams an empty third call and shifts
    the second call's index, or its arguments end in `}}`. When stock passes every chunking, the hunk can go."""
    from tests._scripted_model import pieces_of
    from tests._tool_calls import WANT_CALLS

    want = [(name, args) for name, args in WANT_CALLS]
    rel = "vllm/tool_parsers/qwen3xml_tool_parser.py"
    patched = _load_parser(patched_vllm / rel, "onespark_test_qwen3xml_patched")
    stock = _load_parser(installed_vllm_root() / rel, "onespark_test_qwen3xml_stock")
    chunkings = list(_chunkings(pieces_of(REPLY)))
    wrong = []
    for label, chunks in chunkings:
        calls, content = _streamed_calls(patched, chunks)
        if calls != want or content.strip():
            wrong.append((label, calls, content))
    assert not wrong, f"{len(wrong)} of {len(chunkings)} chunkings stream the calls wrong, first: {wrong[0]}"
    stock_wrong = [label for label, chunks in chunkings if _streamed_calls(stock, chunks)[0] != want]
    assert "8 tokens a chunk, offset 0" in stock_wrong, stock_wrong[:5]
