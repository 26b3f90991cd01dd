"""Issue 23, item 7: every reader of outside input, fed mutations of a valid input, either succeeds or raises the
one error type the CLI prints as one line (UserError); any other exception is a traceback a user would see.

A seeded mutator (no Hypothesis in the test venv): for each JSON input, every field down to depth 2 replaced by
each of the values below, then random deeper fields; for each file, text-level damage (truncation, random bytes,
a UTF-8 BOM, flipped bytes, a 5000-digit number, nesting past the stack). Bounded: MUTANTS random mutations per
input on top of the systematic ones; the whole file runs in well under 60 s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import shutil
from pathlib import Path

import httpx
import pytest

from onespark.checkpoint import draft_vocab
from onespark.checkpoint.hybrid import Plan
from onespark.checkpoint.mtp import mtp
from onespark.checkpoint.safetensors_io import encode_header, parse_header
from onespark.checkpoint.synth import synth
from onespark.checkpoint.verify import verify
from onespark.checkpoint.writer import INDEX_FILE, open_checkpoint
from onespark.errors import UserError, read_secret
from onespark.serving import memory

SEED = 23
MUTANTS = 60  # random deep mutations per input, on top of the systematic depth <= 2 ones
WEIRD = [None, True, 0, -1, 2.5, 10**30, float("nan"), float("inf"), "", "x\u00e9", [], {}, [None], {"k": None}]


def _nodes(doc, path=()):
    """Every (path, value) in a JSON document, parents first."""
    yield path, doc
    if isinstance(doc, dict):
        # a map (weight_map: 600 tensors -> file) is its first few entries; a record (text_config) every field
        for k, v in list(doc.items())[: 4 if len(doc) > 64 else None]:
            yield from _nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:4]):  # the first few items of a list stand for the rest
            yield from _nodes(v, path + (i,))


def _set(doc, path, value):
    doc = copy.deepcopy(doc)
    if not path:
        return value
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    if value is _DELETE:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return doc


_DELETE = object()


def json_mutants(doc, rng: random.Random, mutants: int = MUTANTS):
    """Documents: every node at depth <= 2 replaced by each WEIRD value, wrapped in a list, or deleted; then
    `mutants` random nodes anywhere replaced the same ways."""
    nodes = list(_nodes(doc))
    shallow = [p for p, _ in nodes if len(p) <= 2]
    deep = [p for p, _ in nodes if len(p) > 2]
    for p in shallow:
        for w in WEIRD:
            yield _set(doc, p, w)
    for _ in range(mutants):
        p = rng.choice(deep or shallow)
        cur = doc
        for k in p:
            cur = cur[k]
        yield _set(doc, p, rng.choice(WEIRD + [[cur], {"x": cur}] + ([_DELETE] if p else [])))


def text_mutants(raw: bytes, rng: random.Random, n: int = 12):
    """Damaged bytes of a file: truncations, random bytes, a BOM, flipped bytes, a huge number, deep nesting."""
    yield b""
    yield b"\xef\xbb\xbf" + raw
    yield b"1" * 5000
    yield b"[" * 100_000
    yield b"null"
    yield "\u00e9t\u00e9".encode("utf-16")
    for _ in range(n):
        yield raw[: rng.randrange(max(1, len(raw)))]
        yield bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        b = bytearray(raw)
        for _ in range(3):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        yield bytes(b)


def dumps(doc) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


def mutants_of(path: Path, rng: random.Random, mutants: int = MUTANTS):
    raw = path.read_bytes()
    for doc in json_mutants(json.loads(raw), rng, mutants):
        yield dumps(doc)
    yield from text_mutants(raw, rng)


def survives(call) -> str:
    """Run `call`; 'ok' or 'user' (UserError). Any other exception fails the test, naming the input."""
    try:
        call()
    except UserError:
        return "user"
    return "ok"


# ---- the checkpoint tools: config.json, the index, a shard header ------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    synth(d / "int4", "int4", seed=3, shards=2)
    synth(d / "fp8", "fp8", seed=3, shards=2)
    return d


def _checkpoint_readers(d: Path, fp8: Path):
    """What reads a checkpoint directory: verify (open_checkpoint, the layout, the spec check), step 1's plan,
    step 2, and the memory plan's weight count."""
    def run():
        try:
            verify(d, fast=True)
        finally:
            # step 1's plan from these files (no byte written), step 2 (writes the index: restored by the caller)
            int4 = open_checkpoint(d)
            Plan(int4, open_checkpoint(fp8), {"int4": {}, "fp8": {"path": str(fp8)}})
    return run


@pytest.mark.parametrize("fname", ["config.json", INDEX_FILE])
def test_checkpoint_json(pair, tmp_path, fname):
    rng = random.Random(f"{SEED}-{fname}")
    d = tmp_path / "ck"
    shutil.copytree(pair / "int4", d)
    orig = (d / fname).read_bytes()
    seen = {"ok": 0, "user": 0}
    for raw in mutants_of(d / fname, rng):
        (d / fname).write_bytes(raw)
        try:
            seen[survives(_checkpoint_readers(d, pair / "fp8"))] += 1
            survives(lambda: mtp(d, log=lambda m: None))
            survives(lambda: memory.weights_bytes(d))
        except Exception as e:  # noqa: BLE001 - the assertion names the input that escaped
            pytest.fail(f"{fname} = {raw[:300]!r}: {type(e).__name__}: {e}")
        finally:
            (d / fname).write_bytes(orig)
            (d / INDEX_FILE).write_bytes((pair / "int4" / INDEX_FILE).read_bytes())
    assert seen["user"] > 0 and seen["ok"] > 0, seen  # the mutator reaches both outcomes


def test_memory_plan_of_a_damaged_index(pair, tmp_path):
    """The plan serve and doctor print from the index, made and printed whole (weights_bytes alone returned; the
    plan's float arithmetic then overflowed on a 400-digit total_size), and a NUL byte in a file name (os.stat's
    ValueError): each was a traceback of `onespark serve --dry-run`."""
    rng = random.Random(f"{SEED}-plan")
    d = tmp_path / "ck"
    shutil.copytree(pair / "int4", d)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       125000000 kB\nMemAvailable:   120000000 kB\n")
    doc = json.loads((d / INDEX_FILE).read_bytes())
    some = next(iter(doc["weight_map"]))
    special = [{**doc, "metadata": {"total_size": 10**400}}, {**doc, "metadata": {"total_size": 2**60}},
               {**doc, "weight_map": {**doc["weight_map"], some: "model\u0000.safetensors"}, "metadata": None}]
    for raw in [dumps(x) for x in special] + list(mutants_of(d / INDEX_FILE, rng)):
        (d / INDEX_FILE).write_bytes(raw)
        try:
            for args in ([], ["--kv-cache-memory-bytes", "9" * 400], ["--kv-cache-memory-bytes", "2000T"]):
                survives(lambda args=args: (lambda p: (p.lines(), p.problems()))(
                    memory.make_plan(d, args, meminfo=str(meminfo))))
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"index = {raw[:300]!r}: {type(e).__name__}: {e}")
    for raw in map(dumps, special):
        (d / INDEX_FILE).write_bytes(raw)
        with pytest.raises(UserError, match="the checkpoint is damaged"):
            memory.make_plan(d, [], meminfo=str(meminfo))


def test_doctor_reads_any_compressor_record(tmp_path):
    """onespark-download.json of a compressor: its `bytes` as 10**400 overflowed doctor's GB (a traceback that
    ended the preflight), NaN printed "nan GB"."""
    from onespark.model import specs
    from onespark.serving import doctor

    name = specs.DEFAULT_COMPRESSOR
    c = specs.COMPRESSORS[name]
    d = tmp_path / specs.COMPRESSOR_DIR / name
    d.mkdir(parents=True)
    good = {"complete": True, "repo": c.source.repo, "revision": c.source.revision, "bytes": 2_200_000_000}
    rng = random.Random(f"{SEED}-compressor-record")
    docs = [dumps({**good, "bytes": 10**400}), dumps({**good, "bytes": float("nan")})]
    for raw in docs + [dumps(x) for x in json_mutants(good, rng)] + list(text_mutants(dumps(good), rng)):
        (d / "onespark-download.json").write_bytes(raw)
        try:
            checks = doctor.check_compressor(doctor.Preflight(work=str(tmp_path)))
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"record = {raw[:300]!r}: {type(e).__name__}: {e}")
        assert all("nan GB" not in ch.detail and "inf GB" not in ch.detail for ch in checks), checks
    (d / "onespark-download.json").write_bytes(dumps(good))
    assert ", 2.20 GB;" in doctor.check_compressor(doctor.Preflight(work=str(tmp_path)))[0].detail


def test_shard_header(pair, tmp_path):
    rng = random.Random(f"{SEED}-header")
    d = tmp_path / "ck"
    shutil.copytree(pair / "int4", d)
    shard = d / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    # a tiny header keeps the systematic part small: the first tensors of the shard stand for the rest
    small = {k: header[k] for k in list(header)[:4]}
    for doc in json_mutants(small, rng):
        raw = dumps(doc)
        try:
            survives(lambda raw=raw: parse_header(raw, 8 + len(raw), "fuzz"))
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"header {raw[:300]!r}: {type(e).__name__}: {e}")
    for raw in text_mutants(data[8:8 + n], rng, 4):
        shard.write_bytes(len(raw).to_bytes(8, "little") + raw + body)
        try:
            survives(_checkpoint_readers(d, pair / "fp8"))
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"header {raw[:300]!r}: {type(e).__name__}: {e}")
    assert encode_header([], None)  # (the writer side is not fuzzed: it only writes what a plan decided)


# ---- tokenizer.json (draft-vocab) -----------------------------------------------------------------------------

TOKENIZER = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "c": 3}, "merges": [["a", "b"], "a c"]},
             "added_tokens": [{"id": 4, "content": "<|im_end|>", "special": True}]}


def test_tokenizer_json(tmp_path):
    rng = random.Random(f"{SEED}-tokenizer")
    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    (d / "config.json").write_text(json.dumps({"vocab_size": 8}))
    for raw in mutants_of(d / "tokenizer.json", rng):
        (d / "tokenizer.json").write_bytes(raw)
        try:
            survives(lambda: draft_vocab.build(d, size=3))
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"tokenizer.json = {raw[:300]!r}: {type(e).__name__}: {e}")


# ---- bench: result files (compare), the server's answers, key files -----------------------------------------

def _stats(mean, n=4):
    return {"mean": mean, "std": 1.0, "n": n, "median": mean, "p50": mean, "p99": mean, "min": mean, "max": mean}


def _result() -> dict:
    g = {"group": "Q&A", "max_tokens": 256, "summary": {"e2e_tok_s": _stats(50.0), "decode_tok_s": _stats(55.0),
                                                         "ttft_s": _stats(0.1), "prefill_tok_s": None,
                                                         "requests": 4, "failed": 0}}
    rec = {"top_k": 2, "max_tokens": 3, "rows": [{"group": "Q&A", "prompt": "hi", "tokens": ["a", "b"],
                                                  "top_logprobs": [{"a": -0.1, "b": -2.0}, {"b": -0.5}]}]}
    return {"kind": "onespark-bench", "schema_version": 1, "model": "m", "settings": {"runs": 4},
            "failed_requests": 0, "quality": {"record": rec},
            "suites": {"published": {"groups": [g], "rows": [], "cross_class": {"e2e_tok_s": _stats(50.0, 1),
                                                                               "decode_tok_s": None}},
                       "depth": {"groups": [dict(g, group=0)]},
                       "capacity": {"estimates": [{"context": 4096, "kv_cache_tokens": 100000, "users": 24}]}}}


def test_bench_compare_inputs(tmp_path, capsys):
    from onespark.bench.cli import _compare
    rng = random.Random(f"{SEED}-result")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_result()))
    b.write_text(json.dumps(_result()))
    for raw in mutants_of(a, rng):
        b.write_bytes(raw)
        try:
            survives(lambda: _compare(argparse.Namespace(a=str(a), b=str(b), markdown=False)))
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"result = {raw[:300]!r}: {type(e).__name__}: {e}")
    capsys.readouterr()


MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]}
VERSION = {"version": "0.19.1"}
CHUNKS = [{"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
          {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
ANSWER = {"choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": {"content": [
    {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -2}]}]}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


def _serve(models=b"", version=b"", sse=b"", answer=b""):
    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, content=models)
        if path == "/version":
            return httpx.Response(200, content=version)
        body = json.loads(request.content)
        return httpx.Response(200, content=sse if body.get("stream") else answer)
    return httpx.MockTransport(handle)


def _sse(chunks: list[bytes]) -> bytes:
    return b"".join(b"data: " + c + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


async def _client_run(transport) -> None:
    from onespark.bench.client import Endpoint, detect_model, make_client, plain_request, server_version, stream_request
    from onespark.bench.quality import record
    ep = Endpoint("http://standin", timeout_s=5)
    async with make_client(ep, transport=transport) as client:
        await server_version(client)
        ep.model = (await detect_model(client, ep))["id"]
        await stream_request(client, ep, "hi", 3)  # never raises: a bad answer is a failed request
        await plain_request(client, ep, "hi", 3)
        await record(ep, client, [("Q&A", "hi")], 3, 2)


def _drive(**answers) -> None:
    ok = {"models": dumps(MODELS), "version": dumps(VERSION), "sse": _sse([dumps(c) for c in CHUNKS]),
          "answer": dumps(ANSWER)}
    asyncio.run(_client_run(_serve(**{**ok, **answers})))


@pytest.mark.parametrize("what", ["models", "version", "sse", "answer"])
def test_server_answers(what, tmp_path):
    rng = random.Random(f"{SEED}-{what}")
    doc = {"models": MODELS, "version": VERSION, "sse": CHUNKS[0], "answer": ANSWER}[what]
    (tmp_path / "doc.json").write_bytes(dumps(doc))
    for raw in mutants_of(tmp_path / "doc.json", rng, MUTANTS // 2):
        payload = _sse([raw, dumps(CHUNKS[1])]) if what == "sse" else raw
        try:
            survives(lambda payload=payload: _drive(**{what: payload}))
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{what} = {raw[:300]!r}: {type(e).__name__}: {e}")


def test_key_files(tmp_path):
    rng = random.Random(f"{SEED}-key")
    f = tmp_path / "key"
    good = b"sk-0123456789abcdef\n"
    for raw in text_mutants(good, rng, 20):
        f.write_bytes(raw)
        try:
            key = read_secret(str(f), "--api-key-file")
        except UserError:
            continue
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"key file {raw[:100]!r}: {type(e).__name__}: {e}")
        httpx.Headers({"Authorization": f"Bearer {key}"})  # what the clients do with it: must not raise


# ---- the compression proxy's reading of a request (issue 58, item 4) ------------------------------------------

PROXY_REQUEST = {"model": "m", "stream": True, "messages": [
    {"role": "system", "content": "be brief"}, {"role": "user", "content": "some text\n\nwhy?"},
    {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "rows"}]}],
    "onespark_compress": {"rate": 0.5, "min_tokens": 10, "force_tokens": ["keeper"], "question": False}}
OPT_IN_HEADERS = [None, "on", "off", "0.4", "", "nan", "-0", "1e999", "0.5, 0.6", "\u00e9", "x" * 5000]


def test_compress_proxy_request_reading(tmp_path):
    """Every body and opt-in header either reads (the field gone from any body that is sent on, which is JSON
    again) or is one BadRequest line: the proxy's 400; anything else would be its 500."""
    from onespark.serving.lingua import CHAT, FIELD, Ask, BadRequest, encode_body, pieces, read_request, slots

    rng = random.Random(f"{SEED}-compress")
    (tmp_path / "req.json").write_text(json.dumps(PROXY_REQUEST))
    defaults = Ask(0.5, 1024)
    for i, raw in enumerate(mutants_of(tmp_path / "req.json", rng)):
        header = OPT_IN_HEADERS[i % len(OPT_IN_HEADERS)]
        for method, path in (("POST", CHAT), ("POST", "/v1/completions"), ("GET", "/v1/models")):
            try:
                got = read_request(method, path, header, raw, defaults)
            except BadRequest as e:
                assert "\n" not in str(e), str(e)
                continue
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"{method} {path} {header!r} {raw[:300]!r}: {type(e).__name__}: {e}")
            if got.body is not None:
                assert FIELD not in json.loads(encode_body(got.body))
            if got.ask is not None:  # what the compressor would be given: every slot cuts into pieces
                for s in slots(path, got.body):
                    assert "".join(t for t, _ in pieces(s, got.ask)) in s.text
