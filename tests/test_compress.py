"""Issue 27: `onespark compress serve`, the LLMLingua-2 proxy. The real llmlingua 0.2.2 PromptCompressor runs on a
tiny random BERT token classifier built here (a WordPiece vocabulary written by hand: nothing downloaded), in
front of the scripted stand-in (tests/_openai_standin.py) for most checks and of the session's demo vLLM
server (conftest.vllm_server, shared: no server start of its own) for one.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time

import httpx
import pytest

from onespark.serving import compress
from onespark.serving.compress import FIELD, HEADER, REMOVED_HEADER, STATUS_HEADER, TIME_HEADER, Ask, Proxy
from tests._openai_standin import StandIn

WORDS = ("the a of and to in is was for on that with by it as at from this be are an or which have has not but "
         "who they their were been more one all also two first other its new after when there than into most "
         "some only over time can three may these about such any so made used many then year city river road "
         "house market people water light story keeper lighthouse night sea ship").split()


def write_tiny_lingua(d, seed: int = 0):
    """A tiny LLMLingua-2-shaped model (BertForTokenClassification, 2 labels, 512 positions as llmlingua's
    chunking needs) with a lower-cased WordPiece tokenizer over WORDS, letters, digits and punctuation."""
    import torch
    from transformers import BertConfig, BertForTokenClassification, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(".,:;!?'\"()[]{}-_/=#`0123456789") + WORDS
    vocab += [chr(c) for c in range(97, 123)] + ["##" + chr(c) for c in range(97, 123)]
    vocab += ["##" + c for c in "0123456789_"]
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=512, num_labels=2,
                     architectures=["BertForTokenClassification"])
    BertForTokenClassification(cfg).save_pretrained(d)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def compressor(tmp_path_factory):
    pytest.importorskip("llmlingua")
    return compress.Compressor(write_tiny_lingua(tmp_path_factory.mktemp("lingua") / "tiny-lingua"), "cpu")


@pytest.fixture(scope="module")
def standin():
    with StandIn() as srv:
        yield srv


@pytest.fixture(scope="module")
def proxy(standin, compressor):
    with Proxy(standin.base_url, compressor, defaults=Ask(0.5, 64), log=lambda m: None) as p:
        yield p


def prose(n_words: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < n_words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + ".")
    return " ".join(sentences)


def chat(content: str, **extra) -> dict:
    return {"model": "standin", "messages": [{"role": "system", "content": "be brief. " + prose(120, 9)},
                                             {"role": "user", "content": content}], "max_tokens": 4, **extra}


def sent(standin) -> dict:
    return json.loads(standin.bodies[-1])


# ---- pass-through --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_not_opted_in_is_byte_for_byte(proxy, standin, stream):
    # odd spacing and key order: the proxy must not re-serialize a body it was not asked to touch
    raw = b'{"model":"standin",  "messages":[{"role":"user","content":"' + prose(400).encode() + \
        b'\\u00e9"}], "stream": %s}' % (b"true" if stream else b"false")
    with httpx.Client() as c:
        direct = c.post(standin.base_url + compress.CHAT, content=raw)
        via = c.post(proxy.base_url + compress.CHAT, content=raw)
    assert standin.bodies[-1] == standin.bodies[-2] == raw
    assert via.status_code == direct.status_code == 200
    assert via.content == direct.content
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert STATUS_HEADER.lower() not in via.headers


def test_other_paths_and_errors_pass_through(proxy, standin):
    with httpx.Client() as c:
        for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", b'{"x": 1}'),
                                   ("POST", compress.RESPONSES, b'{"input": "hi"}'),
                                   ("POST", compress.CHAT, b"not json at all")]:
            direct = c.request(method, standin.base_url + path, content=body)
            via = c.request(method, proxy.base_url + path, content=body)
            assert (via.status_code, via.content) == (direct.status_code, direct.content), path


def test_an_ipv6_host_is_served(standin):
    """--host ::1: the proxy bound IPv4 sockets only, so an IPv6 address could not be served at all."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with Proxy(standin.base_url, None, host="::1", log=lambda m: None) as p:
        assert p.base_url.startswith("http://[::1]:")
        r = httpx.get(p.base_url + "/v1/models")
    assert r.status_code == 200 and r.content == httpx.get(standin.base_url + "/v1/models").content


# ---- compression ---------------------------------------------------------------------------------------------


def test_opted_in_by_field_compresses_long_user_text_only(proxy, standin):
    question = "What is the name of the keeper?"
    code = "```python\ndef keeper_name(x):\n    return x.first_name\n```"
    body = chat(prose(700) + "\n\n" + code + "\n\n" + prose(300, 3) + " the_keeper_id is kept.\n\n" + question,
                **{FIELD: {"rate": 0.4}})
    body["messages"].append({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "look_up", "arguments": '{"q": "keeper"}'}}]})
    body["messages"].append({"role": "tool", "tool_call_id": "c1", "content": json.dumps({"rows": prose(300)})})
    body["messages"].append({"role": "tool", "tool_call_id": "c1", "content": prose(500, 4)})
    body["messages"].append({"role": "user", "content": "\n\n" + prose(300, 5) + "\n\n" + question})
    r = httpx.post(proxy.base_url + compress.CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = sent(standin)
    assert FIELD not in out
    assert r.headers[STATUS_HEADER] == "compressed"
    removed = int(r.headers[REMOVED_HEADER])
    acct = r.json()["usage"]["onespark_compression"]
    assert acct["tokens_removed"] == removed > 0 and acct["tokens_before"] - acct["tokens_after"] == removed
    assert float(r.headers[TIME_HEADER]) > 0
    # rate 0.4 keeps about 40% (llmlingua's threshold is a percentile of word probabilities: roughly, not exactly)
    assert 0.2 < acct["tokens_after"] / acct["tokens_before"] < 0.7, acct
    m = out["messages"]
    assert m[0] == body["messages"][0]  # the system prompt
    assert code in m[1]["content"] and "the_keeper_id" in m[1]["content"]  # code block, identifier
    assert len(m[1]["content"]) < len(body["messages"][1]["content"]) * 0.8
    assert m[2] == body["messages"][2]  # assistant tool call JSON
    assert m[3] == body["messages"][3]  # a JSON tool result
    assert len(m[4]["content"]) < len(body["messages"][4]["content"]) * 0.8  # a prose tool result
    assert m[5]["content"].endswith("\n\n" + question) and len(m[5]["content"]) < len(body["messages"][5]["content"])


def test_opted_in_by_header_streams_in_order_and_counts(proxy, standin):
    body = chat(prose(600) + "\n\nwhat is it?", stream=True)
    with httpx.Client(timeout=60) as c, c.stream("POST", proxy.base_url + compress.CHAT, json=body,
                                                 headers={HEADER: "0.5"}) as r:
        assert r.headers[STATUS_HEADER] == "compressed" and int(r.headers[REMOVED_HEADER]) > 0
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 5
    assert [json.loads(ln[5:])["choices"] for ln in lines[:3]] == [[{"index": 0, "delta": {"content": "hi "}}]] * 3
    assert len(sent(standin)["messages"][1]["content"]) < len(body["messages"][1]["content"])


def test_responses_input_is_compressed_but_instructions_are_not(proxy, standin):
    body = {"model": "standin", "instructions": prose(900, 7),
            "input": [{"role": "user", "content": [{"type": "input_text", "text": prose(600)},
                                                   {"type": "input_text", "text": "and the question?"}]},
                      {"type": "function_call_output", "call_id": "c", "output": prose(500, 2)}],
            FIELD: True}
    r = httpx.post(proxy.base_url + compress.RESPONSES, json=body, timeout=60)
    assert r.headers[STATUS_HEADER] == "compressed"  # the stand-in answers 404: relayed with the headers
    out = sent(standin)
    assert out["instructions"] == body["instructions"]
    parts = out["input"][0]["content"]
    assert len(parts[0]["text"]) < len(body["input"][0]["content"][0]["text"]) and parts[1]["text"] == "and the question?"
    assert len(out["input"][1]["output"]) < len(body["input"][1]["output"])


def test_short_prompts_are_skipped(proxy, standin):
    body = chat(prose(20) + "\n\n" + "why?", **{FIELD: {"min_tokens": 5000}})
    r = httpx.post(proxy.base_url + compress.CHAT, json=body, timeout=60)
    assert r.headers[STATUS_HEADER] == "skipped" and r.headers[REMOVED_HEADER] == "0"
    assert sent(standin)["messages"] == body["messages"]


def test_every_opt_in_is_seen(proxy, standin):
    """Issue 58: a JSON-escaped field name, a lone surrogate in the text, or the header on /v1/completions went to
    vLLM with the field still in it and no header saying the request was not compressed."""
    escaped = json.dumps(chat(prose(300) + "\n\nwhy?", **{FIELD: True})).replace(FIELD, "onespark\\u005fcompress")
    assert FIELD.encode() not in escaped.encode()
    r = httpx.post(proxy.base_url + compress.CHAT, content=escaped, timeout=60)
    assert r.headers[STATUS_HEADER] == "compressed" and b"onespark" not in standin.bodies[-1]
    lone = json.dumps(chat(prose(300) + " \ud800 \n\nwhy?", **{FIELD: True}))  # json.dumps escapes it: \\ud800
    r = httpx.post(proxy.base_url + compress.CHAT, content=lone, timeout=60)
    assert r.status_code == 200 and r.headers[STATUS_HEADER] in ("compressed", "failed")
    assert b"onespark" not in standin.bodies[-1] and b"\\ud800" in standin.bodies[-1]
    for headers, body in [({HEADER: "on"}, {"prompt": "hi"}), ({}, {"prompt": "hi", FIELD: {"rate": 0.5}})]:
        r = httpx.post(proxy.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.headers[STATUS_HEADER] == "unsupported", r.headers
        assert "/v1/completions is not compressed" in r.headers[compress.REASON_HEADER]
        assert json.loads(standin.bodies[-1]) == {"prompt": "hi"}
    r = httpx.post(proxy.base_url + compress.CHAT, json=chat("hi", **{FIELD: False}), headers={HEADER: "on"})
    assert r.headers[STATUS_HEADER] == "off" and "is false" in r.headers[compress.REASON_HEADER]
    r = httpx.post(proxy.base_url + compress.CHAT, json=chat("short\n\nwhy?", **{FIELD: {"min_tokens": 5000}}))
    assert r.headers[STATUS_HEADER] == "skipped" and "min_tokens" in r.headers[compress.REASON_HEADER]


# ---- failure and bad input -----------------------------------------------------------------------------------


class Broken:
    def __init__(self, delay: float = 0.0, error: bool = True):
        self.delay, self.error = delay, error

    def count(self, text):
        return len(text.split())

    def compress(self, texts, ask):
        time.sleep(self.delay)
        if self.error:
            raise RuntimeError("CUDA out of memory (scripted)")
        return texts


@pytest.mark.parametrize("broken,status", [(Broken(), "failed"), (Broken(delay=2.0, error=False), "timeout")])
def test_compressor_failure_sends_the_request_uncompressed(standin, broken, status):
    logged = []
    with Proxy(standin.base_url, broken, defaults=Ask(0.5, 10), timeout_s=0.3, log=logged.append) as p:
        body = chat(prose(300) + "\n\nwhy?", **{FIELD: True})
        r = httpx.post(p.base_url + compress.CHAT, json=body, timeout=30)
    assert r.status_code == 200 and r.headers[STATUS_HEADER] == status
    assert r.json()["usage"]["onespark_compression"]["status"] == status
    assert sent(standin)["messages"] == body["messages"]
    assert len(logged) == 1 and "uncompressed" in logged[0]


@pytest.mark.parametrize("field,header,says", [
    ({"rate": 0}, None, "outside (0, 1]"), ({"rate": 1.5}, None, "outside (0, 1]"),
    ({"rate": "0.5"}, None, "expected a fraction"), ({"ratio": 0.5}, None, "unknown option"),
    ("yes", None, "expected true, false or an object"), ({"min_tokens": -1}, None, "min_tokens"),
    ({"force_tokens": ["x" * 40]}, None, "force_tokens"), (None, "0", None), (None, "1.5", "outside (0, 1]"),
    (None, "maybe", "neither on/off"),
], ids=["rate0", "rate1.5", "rate-str", "typo", "str", "neg", "force", "hdr0-ok", "hdr1.5", "hdr-word"])
def test_bad_options_are_one_400(proxy, standin, field, header, says):
    body = chat("hello\n\nwhy?", **({FIELD: field} if field is not None else {}))
    r = httpx.post(proxy.base_url + compress.CHAT, json=body, headers={HEADER: header} if header else {}, timeout=30)
    if says is None:
        assert r.status_code == 200
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says in err["message"] and "\n" not in err["message"] and err["param"] == FIELD and err["code"] == 400


def test_request_reader_fuzz(proxy, standin):
    """Mutated bodies and headers, opted in: an answer below 500 every time, never a traceback."""
    rng = random.Random(27)
    base = chat(prose(80) + "\n\nwhy?", **{FIELD: {"rate": 0.5, "min_tokens": 10, "force_tokens": ["keeper"]}})
    weird = [None, True, 0, -1, 2.5, 10**30, "", "x\u00e9", [], {}, [None], {"k": None}, float("nan")]
    bodies = []
    for path in (("messages",), ("messages", 1), ("messages", 1, "content"), ("messages", 1, "role"),
                 (FIELD,), (FIELD, "rate"), (FIELD, "min_tokens"), (FIELD, "force_tokens")):
        for w in weird:
            doc = json.loads(json.dumps(base))
            cur = doc
            for k in path[:-1]:
                cur = cur[k]
            cur[path[-1]] = w
            bodies.append(json.dumps(doc).encode())
    raw = json.dumps(base).encode()
    bodies += [raw[:rng.randrange(len(raw))] for _ in range(10)]
    bodies += [b"\xef\xbb\xbf" + raw, b"[" * 100000, b'{"onespark_compress": 1' + b"0" * 5000 + b"}", b"\xff\xfe"]
    with httpx.Client(timeout=30) as c:
        for i, b in enumerate(bodies):
            r = c.post(proxy.base_url + compress.CHAT, content=b, headers={HEADER: "on"} if i % 2 else {})
            assert r.status_code < 500, (b[:80], r.text)
        for h in [b"", b"nan", b"inf", b"-0", b"1e999", b"0.5, 0.6", b"\xc3\xa9"]:
            r = c.post(proxy.base_url + compress.CHAT, content=raw, headers={HEADER: h})
            assert r.status_code in (200, 400), (h, r.text)
    # b"\xb2" (latin-1 "²") is str.isdigit() but no int(): it was a 500 and an "internal error" in the log
    for length in (b"99999999999", b"-1", b"0x10", b"1" * 40, b"\xb2"):  # what httpx would not send: a raw socket
        with socket.create_connection(("127.0.0.1", int(proxy.base_url.rsplit(":", 1)[1])), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n{}")
            status = s.recv(64).split(b" ")[1]
        assert status in (b"400", b"413"), (length, status)


def test_api_key_is_checked_and_forwarded(standin, compressor):
    with Proxy(standin.base_url, compressor, key="k3y", log=lambda m: None) as p:
        assert httpx.get(p.base_url + "/v1/models").status_code == 401
        r = httpx.get(p.base_url + "/v1/models", headers={"Authorization": "Bearer k3y"})
    assert r.status_code == 200 and standin.auth[-1] == "Bearer k3y"


def test_unreachable_upstream_is_a_502(compressor):
    with Proxy("http://127.0.0.1:9", compressor, log=lambda m: None) as p:
        r = httpx.post(p.base_url + compress.CHAT, json=chat("hi"))
    assert r.status_code == 502 and "cannot reach vLLM at http://127.0.0.1:9 " in r.json()["error"]["message"]
    # an IPv6 upstream is named as a URL (in brackets)
    with Proxy("http://[::1]:9", compressor, log=lambda m: None) as p:
        r = httpx.post(p.base_url + compress.CHAT, json=chat("hi"))
    assert r.status_code == 502 and "cannot reach vLLM at http://[::1]:9 " in r.json()["error"]["message"]


def test_credentials_in_upstream_are_refused_never_printed(tmp_path, capsys):
    """Issue 58: a password in --upstream was printed on the startup line, and never sent upstream."""
    from onespark.cli import main

    with pytest.raises(compress.UserError) as e:
        Proxy("http://user:s3cret@[::1]:9", None, log=lambda m: None)
    assert "s3cret" not in str(e.value) and "user:***@" in str(e.value)
    (tmp_path / "config.json").write_text("{}")
    assert main(["compress", "serve", "--model-dir", str(tmp_path), "--upstream", "http://u:pw0rd@127.0.0.1:8000"]) == 1
    err = capsys.readouterr().err
    assert "pw0rd" not in err and err.count("\n") == 1 and "--api-key-file" in err


def test_the_printed_url_is_where_this_machine_reaches_the_proxy(standin):
    """--host 0.0.0.0 binds every interface; the URL it prints (and a client on this machine uses) is loopback's,
    as serve prints its own (launch.base_url)."""
    with Proxy(standin.base_url, None, host="0.0.0.0", log=lambda m: None) as p:
        assert p.base_url.startswith("http://127.0.0.1:")
        r = httpx.get(p.base_url + "/v1/models")
    assert r.status_code == 200


def test_concurrent_requests(proxy, standin):
    out = []

    def one(i):
        r = httpx.post(proxy.base_url + compress.CHAT, json=chat(prose(200, i) + "\n\nwhy?", **{FIELD: True}),
                       timeout=60)
        out.append(r.headers[STATUS_HEADER])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == ["compressed"] * 4


# ---- the CLI -------------------------------------------------------------------------------------------------


def test_cli_refuses_a_missing_model_dir(tmp_path, capsys):
    from onespark.cli import main

    assert main(["compress", "serve", "--model-dir", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert "onespark download" in err and err.count("\n") == 1


@pytest.mark.parametrize("upstream", ["http://127.0.0.1:99999", "http://127.0.0.1:port", "http://127.0.0.1:0"])
def test_cli_refuses_a_bad_upstream_before_the_model_loads(tmp_path, capsys, upstream):
    """urlsplit's .port raised ValueError (a traceback) for a port out of range or not a number, and only in
    Proxy(), once the compressor had loaded; port 0 went to port 80. The config.json here is no model's: the
    upstream is what must fail, first."""
    from onespark.cli import main

    (tmp_path / "config.json").write_text("{}")
    assert main(["compress", "serve", "--model-dir", str(tmp_path), "--upstream", upstream]) == 1
    err = capsys.readouterr().err
    assert err == f"onespark compress: error: --upstream {upstream!r} is not an http(s) URL: use e.g. " \
                  "http://127.0.0.1:8000\n", err
    assert compress.upstream_of("http://[::1]:8000/") == ("http", "::1", 8000)
    assert compress.upstream_of("https://vllm.lan") == ("https", "vllm.lan", 443)


def _serve(tmp_path, *flags, env=None) -> tuple[int, str]:
    """`onespark compress serve` with a config.json that is no model's: whatever must fail before the model
    loads fails with its own message, and the rest reaches the model (model_type missing)."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "onespark", "compress", "serve", "--model-dir", str(tmp_path), *flags],
                       capture_output=True, text=True, timeout=120, env=env)
    return r.returncode, r.stderr


def test_cli_checks_host_and_port_before_the_model_loads(tmp_path):
    """Issue 58: a port in use or a bad --host was found only after the model had loaded, and a bad host was
    reported as "choose another --port"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, err = _serve(tmp_path, "--port", str(port))
    assert rc == 1 and f"--port {port}: something already listens" in err and "model_type" not in err, err
    rc, err = _serve(tmp_path, "--host", "192.0.2.1", "--port", "8001")  # TEST-NET-1: no machine's own address
    assert rc == 1 and "--host 192.0.2.1 is not an address of this machine" in err and "--port" not in err, err
    assert err.count("\n") == 1


def test_cli_warns_about_an_exposed_proxy_without_a_key(tmp_path):
    """Issue 58: `compress serve --host 0.0.0.0` without a key gave no warning (serve and cluster warn)."""
    pytest.importorskip("llmlingua")
    from tests._ports import free_port

    env = {k: v for k, v in os.environ.items() if k != "ONESPARK_API_KEY"}
    rc, err = _serve(tmp_path, "--host", "0.0.0.0", "--port", str(free_port()), env=env)
    assert rc == 1 and "model_type" in err  # it went on to the model, as it would serve
    assert "onespark compress: warning: --host 0.0.0.0 exposes the server beyond this machine without an API key" in err
    rc, err = _serve(tmp_path, "--host", "0.0.0.0", "--port", str(free_port()), env={**env, "ONESPARK_API_KEY": "k3y-k3y"})
    assert rc == 1 and "warning" not in err and "k3y-k3y" not in err


def test_cli_refuses_both_key_flags(tmp_path, capsys):
    from onespark.cli import main

    (tmp_path / "key").write_text("k3y\n")
    assert main(["compress", "serve", "--model-dir", str(tmp_path), "--api-key", "a", "--api-key-file",
                 str(tmp_path / "key")]) == 1
    assert "give --api-key or --api-key-file, not both" in capsys.readouterr().err


@pytest.mark.parametrize("missing,says", [("uvicorn", "pip install 'onespark[compress]'"),
                                          ("llmlingua", "run the proxy from the serving image")])
def test_cli_names_what_to_install(tmp_path, capsys, monkeypatch, missing, says):
    """Issue 58: in the host venv `compress serve` ended in ModuleNotFoundError."""
    import importlib.util

    from onespark.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    (tmp_path / "config.json").write_text("{}")
    assert main(["compress", "serve", "--model-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert says in err and missing in err and err.count("\n") == 1, err


def test_cli_refuses_a_model_of_another_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    pytest.importorskip("llmlingua")
    with pytest.raises(compress.UserError, match="no LLMLingua-2 model"):
        compress.Compressor(tmp_path, "cpu")


# ---- the demo vLLM server ------------------------------------------------------------------------------------


def test_through_the_demo_vllm_server(vllm_server, compressor):
    with Proxy(vllm_server.base_url, compressor, defaults=Ask(0.5, 64), log=lambda m: None) as p:
        body = {"model": vllm_server.model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": prose(250) + "\n\nwhat is it?"}]}
        plain = httpx.post(p.base_url + compress.CHAT, json=body, timeout=120)
        direct = httpx.post(vllm_server.base_url + compress.CHAT, json=body, timeout=120)
        squeezed = httpx.post(p.base_url + compress.CHAT, json={**body, FIELD: {"rate": 0.5}}, timeout=120)
    assert plain.status_code == direct.status_code == squeezed.status_code == 200, squeezed.text
    a, b = plain.json(), direct.json()
    for volatile in ("id", "created"):
        a.pop(volatile), b.pop(volatile)
    assert a == b and STATUS_HEADER.lower() not in plain.headers
    assert squeezed.headers[STATUS_HEADER] == "compressed"
    usage = squeezed.json()["usage"]
    assert usage["prompt_tokens"] < plain.json()["usage"]["prompt_tokens"]
    assert usage["onespark_compression"]["tokens_removed"] == int(squeezed.headers[REMOVED_HEADER]) > 0


# ---- step 0's --compressor -----------------------------------------------------------------------------------


def test_download_fetches_the_pinned_compressor_and_checks_it(tmp_path):
    import subprocess
    import sys

    from onespark.model import specs
    from tests._hub import NEEDS_NGINX, NGINX, hub_env, publish, serve

    if NGINX is None:
        pytest.skip(NEEDS_NGINX)
    src = write_tiny_lingua(tmp_path / "src")
    (src / "pytorch_model.bin").write_bytes(b"\0" * 1000)  # the repos' duplicate weights: not fetched
    bert, xlm = specs.COMPRESSORS["bert-base"].source, specs.COMPRESSORS["xlm-roberta-large"].source
    publish(tmp_path / "hub" / "www", bert.repo, bert.revision, src)
    publish(tmp_path / "hub" / "www", xlm.repo, xlm.revision, src)  # a BERT where XLM-R belongs: refused
    dest = tmp_path / "work"
    with serve(tmp_path / "hub") as endpoint:
        def download(name):
            return subprocess.run([sys.executable, "-m", "onespark", "download", "--dest", str(dest), "--skip-int4",
                                   "--skip-fp8", "--compressor", name], env=hub_env(endpoint, tmp_path),
                                  capture_output=True, text=True, timeout=120)
        ok, again, wrong = download("bert-base"), download("bert-base"), download("xlm-roberta-large")
    assert ok.returncode == 0, ok.stderr
    got = dest / "llmlingua2" / "bert-base"
    rec = json.loads((got / "onespark-download.json").read_text())
    assert rec["complete"] and rec["revision"] == bert.revision and not (got / "pytorch_model.bin").exists()
    assert again.returncode == 0 and "already downloaded" in again.stdout
    assert wrong.returncode == 1 and "not the xlm-roberta token classifier" in wrong.stderr
    assert [ln for ln in wrong.stderr.splitlines() if "error" in ln][0].startswith("onespark download: error: ")
    assert compress.Compressor(got, "cpu").family == "bert-base-multilingual-cased"


# ---- the bench's A/B suite -----------------------------------------------------------------------------------


def test_bench_compression_suite_plumbing(proxy, tmp_path, capsys):
    from onespark.bench import compression
    from onespark.cli import main

    prompt, code = compression.needle(2000, 5)
    assert code in prompt and prompt.endswith("Answer with the code only.") and "\n\n" in prompt
    docs, year = compression.rag(2000, 5)
    assert year in docs and docs.count("Document ") == 4
    rc = main(["bench", "--suite", "compression", "--base-url", proxy.base_url, "--compression-lengths", "1k,5k",
               "--runs", "1", "--warmup", "0", "--out", str(tmp_path), "--name", "ab", "--no-png", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads((tmp_path / "ab.json").read_text())
    s = result["suites"]["compression"]
    assert [g["group"] for g in s["groups"]] == ["needle-1024", "rag-1024"]
    assert [k["length"] for k in s["skipped"]] == [5120, 5120]  # past the stand-in's max_model_len 4096
    for g in s["groups"]:
        assert g["compressed"] == 1 and g["tokens_removed"]["mean"] > 0 and g["compressor_ms"]["mean"] > 0
        assert g["agreement"] == 1.0 and g["ttft_s_on"] and g["latency_s_off"]
    assert {r["arm"]: r["status"] for r in s["rows"][:2]} == {"off": None, "on": "compressed"}
    assert "compression: A/B through onespark compress serve" in out and "needle-1024" in out


def test_bench_compression_suite_refuses_a_server_that_is_not_the_proxy(standin, tmp_path, capsys):
    """Issue 58: pointed at a plain server, the suite exited 0 with an "A/B through onespark compress serve" where
    nothing was compressed."""
    from onespark.cli import main

    rc = main(["bench", "--suite", "compression", "--base-url", standin.base_url, "--compression-lengths", "1k",
               "--runs", "1", "--warmup", "0", "--out", str(tmp_path), "--no-png", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "is not `onespark compress serve`" in err, err
    assert f"--base-url {standin.base_url}" in err and list(tmp_path.iterdir()) == []


def test_compression_lengths_example_keeps_its_own_rule(capsys):
    """Issue 58: --compression-lengths (at least 1) offered 0,4k,16k as its example."""
    from onespark import options
    from onespark.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--suite", "compression", "--compression-lengths", "0"])
    err = capsys.readouterr().err
    example = err.split("e.g. ")[1].split()[0]
    assert options.sizes(1)(example), err


# ---- doctor and the memory plan ------------------------------------------------------------------------------


def test_doctor_reports_the_compressor_and_the_plan_counts_it(tmp_path):
    import os

    from onespark.model import specs
    from onespark.serving import doctor, memory

    gib = 1024**3
    work = tmp_path / "work"
    (work / "hybrid").mkdir(parents=True)
    (work / "hybrid" / "config.json").write_text("{}")
    (work / "hybrid" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 71 * 10**9}, "weight_map": {}}))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {int(119.7 * gib) // 1024} kB\nMemAvailable: {115 * gib // 1024} kB\n")
    args = doctor.Preflight(work=str(work), model=None, gpu_memory_utilization=None, meminfo=str(meminfo),
                            host_reserve_gib=memory.HOST_RESERVE_FLOOR_GIB, guard_floor_gib=None, compressor_dir=None)
    assert doctor.check_compressor(args)[0].status == "ok" and "not downloaded" in doctor.check_compressor(args)[0].detail
    without = doctor.check_memory_plan(args)[0]
    c = specs.COMPRESSORS["xlm-roberta-large"]
    d = work / specs.COMPRESSOR_DIR / c.name
    d.mkdir(parents=True)
    with open(d / "model.safetensors", "wb") as f:  # sparse: the plan reads sizes, not bytes
        f.truncate(int(c.source.size_gb * 1e9))
    assert doctor.check_compressor(args)[0].status == "warn"  # no record: not finished
    (d / "onespark-download.json").write_text(json.dumps({"repo": c.source.repo, "revision": c.source.revision,
                                                          "complete": True, "bytes": os.path.getsize(d / "model.safetensors")}))
    got = doctor.check_compressor(args)[0]
    assert got.status == "ok" and c.source.revision[:12] in got.detail and "--model-dir" in got.detail
    with_c = doctor.check_memory_plan(args)[0]
    assert "after the compressor's 4.1 GiB" in with_c.detail and "compressor" not in without.detail
    plan = memory.make_plan(work / "hybrid", [], meminfo=str(meminfo), compressor_dir=d)
    base = memory.make_plan(work / "hybrid", [], meminfo=str(meminfo))
    assert base.host_reserve - plan.host_reserve == plan.compressor == int(c.source.size_gb * 1e9) + 2 * gib
    assert plan.lines()[0].startswith("compressor") and "outside vLLM's share" in plan.lines()[0]
    # at 0.84 the host keeps 19.2 GiB without the compressor: refused either way, and the fix counts it
    tight = memory.make_plan(work / "hybrid", ["--gpu-memory-utilization", "0.84"], meminfo=str(meminfo),
                             compressor_dir=d)
    assert any("the compressor's 4.1 GiB leave the host" in p and "--gpu-memory-utilization 0.79" in p
               for p in tight.problems()), tight.problems()
