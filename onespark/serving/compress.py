"""`onespark compress serve`: an OpenAI-compatible proxy in front of vLLM that compresses long prompts with
LLMLingua-2 (issue 27), only for the requests that ask for it.

    onespark compress serve --model-dir WORK/llmlingua2/xlm-roberta-large [--upstream http://127.0.0.1:8000]
                            [--port 8001] [--rate 0.5] [--min-tokens 1024]

A request opts in with the body field `onespark_compress` (true, or an object of the options below) or the
header `X-Onespark-Compress` (`on`, or a rate such as `0.4`); the field's options win over the header's rate.
    rate          fraction of the tokens kept, in (0, 1] (default --rate)
    min_tokens    a user or tool message shorter than this (compressor tokens) is left alone (default --min-tokens)
    question      also compress the last user message's last paragraph, the question (default false)
    code          also compress fenced code blocks and tool results that are JSON (default false)
    keep_digits   keep every word with a digit: numbers, versions, ids (default true)
    force_tokens  extra words always kept (at most 32, each at most 32 characters)

Compressed: user and tool messages (Chat Completions), user items and function_call_output items (Responses).
Never: system/developer messages and `instructions`, assistant messages and their tool calls, the last user
paragraph, code blocks, JSON tool results, words that look like identifiers (snake_case, camelCase).

Every other request, and every request that does not opt in, is forwarded as its bytes and answered with vLLM's
bytes. An opted-in answer carries X-Onespark-Compression (compressed, skipped, failed, timeout), and with it
X-Onespark-Tokens-Removed and X-Onespark-Compressor-Ms; a non-streamed JSON answer also carries
usage.onespark_compression. Tokens are counted with the compressor's tokenizer (the served model's differ:
compare usage.prompt_tokens of the two runs for those, as `onespark bench --suite compression` does).
A compressor that fails or runs past --timeout leaves the request uncompressed, never lost. A malformed
`onespark_compress` or header is one 400 in the OpenAI error shape.

Standard library only at module level (onespark.serving's rule): torch and llmlingua load in `Compressor`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import hmac
import http.client
import json
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from onespark import options, shape
from onespark.errors import UserError, plain_key, read_secret
from onespark.serving import launch

FIELD = "onespark_compress"
HEADER = "X-Onespark-Compress"
STATUS_HEADER = "X-Onespark-Compression"
REMOVED_HEADER = "X-Onespark-Tokens-Removed"
TIME_HEADER = "X-Onespark-Compressor-Ms"
CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
# A 64K-token prompt is ~0.3 MB of JSON; 32 MiB keeps a hostile Content-Length from becoming an allocation.
MAX_BODY = 32 * 1024 * 1024
BLOCK = 64 * 1024
DEFAULT_RATE = 0.5  # keep half: LLMLingua-2's paper reports small losses at 2x-3x (docs/guides/compression.md)
DEFAULT_MIN_TOKENS = 1024  # below ~1K tokens prefill costs ~0.5 s on a Spark: nothing worth a lossy step
DEFAULT_TIMEOUT_S = 30.0
# Words the compressor never drops: line breaks keep the layout, '?' keeps questions questions.
BASE_FORCE = ["\n", "?"]
MAX_FORCE = 100  # llmlingua 0.2.2's max_force_token: the added [NEWi] tokens it maps multi-token words to
MAX_USER_FORCE = 32
HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
       "transfer-encoding", "upgrade", "host", "content-length"}
FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)
# snake_case, dotted.names, camelCase, PascalCase with an inner capital: code words a prose model would drop
IDENT = re.compile(r"\b(?:[A-Za-z][A-Za-z0-9]*(?:[_.][A-Za-z0-9]+)+|[a-z]+[A-Z][A-Za-z0-9]*|[A-Z][a-z]+[A-Z][A-Za-z0-9]*)\b")
ON, OFF = {"1", "true", "on", "yes"}, {"0", "false", "off", "no"}

ASK = shape.Obj(optional={
    "rate": shape.Num(what="a fraction of the tokens kept"),
    "min_tokens": shape.Int(0, 10**7, what="a token count"),
    "question": shape.Bool(), "code": shape.Bool(), "keep_digits": shape.Bool(),
    "force_tokens": shape.ListOf(shape.Str("a word (string)"), what="a list of words (strings)"),
}, what="true, false or an object of compression options")


class BadRequest(Exception):
    """The request's own compression options are wrong: a 400, its message one line."""


class Ask:
    """What one request asked for, checked."""

    def __init__(self, rate: float, min_tokens: int, question: bool = False, code: bool = False,
                 keep_digits: bool = True, force_tokens: list[str] | None = None):
        self.rate, self.min_tokens, self.question, self.code = rate, min_tokens, question, code
        self.keep_digits, self.force_tokens = keep_digits, force_tokens or []


def _rate(value, where: str) -> float:
    if not 0 < value <= 1:
        raise BadRequest(f"{where}: rate {value!r} is outside (0, 1]: it is the fraction of tokens kept, e.g. 0.5")
    return float(value)


def parse_ask(header: str | None, body, defaults: Ask) -> Ask | None:
    """The request's compression options from the header and the body field, or None when it does not opt in.
    `body` is the parsed JSON (any value); raises BadRequest for a malformed header or field."""
    rate, on = defaults.rate, False
    if header is not None:
        h = header.strip().lower()
        if h in ON:
            on = True
        elif h in OFF:
            pass
        else:
            try:
                rate, on = _rate(float(h), HEADER), True
            except ValueError:
                raise BadRequest(f"{HEADER}: {header[:40]!r} is neither on/off nor a rate in (0, 1], e.g. 0.5") from None
    field = body.get(FIELD) if isinstance(body, dict) else None
    if field is None or field is True or field is False:
        on = on or field is True
        if field is False:
            on = False
        return Ask(rate, defaults.min_tokens) if on else None
    if not isinstance(field, dict):
        raise BadRequest(f"{FIELD} is {shape.describe(field)}: expected true, false or an object such as "
                         '{"rate": 0.5}')
    try:
        shape.check(field, ASK, FIELD, "see docs/guides/compression.md")
    except UserError as e:
        raise BadRequest(str(e)) from None
    unknown = sorted(set(field) - set(ASK.optional))
    if unknown:
        raise BadRequest(f"{FIELD}: unknown option {unknown[0][:40]!r}: use {', '.join(ASK.optional)}")
    force = field.get("force_tokens", [])
    if len(force) > MAX_USER_FORCE or any(not 0 < len(t) <= 32 for t in force):
        raise BadRequest(f"{FIELD}.force_tokens: at most {MAX_USER_FORCE} words of 1 to 32 characters each")
    return Ask(_rate(field["rate"], f"{FIELD}.rate") if "rate" in field else rate,
               field.get("min_tokens", defaults.min_tokens), field.get("question", False), field.get("code", False),
               field.get("keep_digits", True), force)


# ---- what of a request is compressed ------------------------------------------------------------------------


class Slot:
    """One string of the request body that may be compressed: container[key], and whether it is the last user
    turn (whose last paragraph is the question) and a tool result."""

    def __init__(self, container, key, last_user: bool = False, tool: bool = False):
        self.container, self.key, self.last_user, self.tool = container, key, last_user, tool

    @property
    def text(self) -> str:
        return self.container[self.key]


def _text_slots(container, key, **kw) -> list[Slot]:
    """The strings of a message's content: the content itself, or its text parts (other parts: images...)."""
    content = container.get(key)
    if isinstance(content, str):
        return [Slot(container, key, **kw)]
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text")
                 and isinstance(p.get("text"), str)]
        return [Slot(p, "text", last_user=kw.get("last_user", False) and p is parts[-1], tool=kw.get("tool", False))
                for p in parts]
    return []


def slots(path: str, body: dict) -> list[Slot]:
    """The compressible strings of a Chat Completions or Responses body, in order. Anything of another shape
    is left as it is: vLLM judges the rest of the request."""
    out: list[Slot] = []
    if path == CHAT:
        msgs = body.get("messages")
        msgs = [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
        for i, m in enumerate(msgs):
            if m.get("role") in ("user", "tool"):
                out += _text_slots(m, "content", last_user=i == last, tool=m.get("role") == "tool")
        return out
    items = body.get("input")
    if isinstance(items, str):
        return [Slot(body, "input", last_user=True)]
    items = [m for m in items if isinstance(m, dict)] if isinstance(items, list) else []
    last = max((i for i, m in enumerate(items) if m.get("role") == "user"), default=-1)
    for i, m in enumerate(items):
        if m.get("role") == "user":
            out += _text_slots(m, "content", last_user=i == last)
        elif m.get("type") == "function_call_output" and isinstance(m.get("output"), str):
            out.append(Slot(m, "output", tool=True))
    return out


def _is_json(text: str) -> bool:
    t = text.strip()
    if not t.startswith(("{", "[")):
        return False
    try:
        json.loads(t)
    except (ValueError, RecursionError):
        return False
    return True


def pieces(slot: Slot, ask: Ask) -> list[tuple[str, bool]]:
    """The slot's text cut into (text, compressible) pieces that join back into it: code fences, JSON tool
    results and the question (the last user message's last paragraph) are kept as they are."""
    text = slot.text
    if slot.tool and not ask.code and _is_json(text):
        return [(text, False)]
    tail = ""
    if slot.last_user and not ask.question:
        cut = text.rstrip().rfind("\n\n")
        if cut < 0:
            return [(text, False)]  # one paragraph: it is the question
        text, tail = text[:cut + 2], text[cut + 2:]
    out: list[tuple[str, bool]] = []
    at = 0
    for m in ([] if ask.code else FENCE.finditer(text)):
        out.append((text[at:m.start()], True))
        out.append((m.group(0), False))
        at = m.end()
    out.append((text[at:], True))
    if tail:
        out.append((tail, False))
    return [p for p in out if p[0]]


# ---- the compressor -----------------------------------------------------------------------------------------


class Compressor:
    """llmlingua 0.2.2's PromptCompressor(use_llmlingua2=True) on a local checkpoint; one call at a time."""

    def __init__(self, model_dir: str | Path, device: str = "auto"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: nothing is fetched, ever
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from unittest import mock

        import llmlingua.prompt_compressor as lp
        import torch

        cfg = shape.load(Path(model_dir) / "config.json", shape.Obj({"model_type": shape.Str()}),
                         "download it again: onespark download --compressor ...")
        # llmlingua picks its word-boundary rules by a substring of the model name (utils.is_begin_of_new_word):
        # the two LLMLingua-2 families, named by what the checkpoint says it is, not by its directory's name.
        family = {"bert": "bert-base-multilingual-cased", "xlm-roberta": "xlm-roberta-large"}.get(cfg["model_type"])
        if family is None:
            raise UserError(f"{model_dir}: model_type {cfg['model_type']!r} is no LLMLingua-2 model (bert or "
                            f"xlm-roberta): --model-dir must be a directory `onespark download --compressor` wrote")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # PromptCompressor's __init__ asks tiktoken for GPT-3.5's encoding, which tiktoken downloads on first use
        # (openaipublic.blob.core.windows.net): no network here. LLMLingua-2 uses it only to count tokens, so it
        # counts with the compressor's own tokenizer instead (set once the tokenizer is loaded).
        with mock.patch.object(lp.tiktoken, "encoding_for_model", lambda _name: None):
            pc = lp.PromptCompressor(model_name=str(model_dir), device_map=device, use_llmlingua2=True,
                                     model_config={"trust_remote_code": False})
        pc.model_name = family
        pc.oai_tokenizer = _Counter(pc.tokenizer)
        pc.model.eval()
        self.pc, self.device, self.family = pc, device, family
        self._lock = threading.Lock()

    def count(self, text: str) -> int:
        return len(self.pc.tokenizer(text, add_special_tokens=False).input_ids)

    def compress(self, texts: list[str], ask: Ask) -> list[str]:
        words = sorted({w for t in texts for w in IDENT.findall(t)}, key=len, reverse=True)
        force = list(dict.fromkeys(BASE_FORCE + ask.force_tokens))
        force += [w for w in words if w not in force][:MAX_FORCE - len(force)]
        with self._lock:
            res = self.pc.compress_prompt_llmlingua2(texts, rate=ask.rate, force_tokens=force,
                                                     force_reserve_digit=ask.keep_digits, drop_consecutive=True,
                                                     use_context_level_filter=False)
        return res["compressed_prompt_list"]


class _Counter:
    """What llmlingua wants of tiktoken's Encoding: encode(text) -> token ids. llmlingua calls it once per word
    of the prompt (its __compress weighs each word by its token count), so it goes straight to the Rust
    tokenizer and remembers words: transformers' __call__ costs ~30x the Rust encode per word (285 vs 9 us on
    the 2-core CI machine), which made it most of a 64K-token compression on an H200 (3.3 s)."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._ids = lambda t: backend.encode(t, add_special_tokens=False).ids
        else:  # a slow (Python) tokenizer
            self._ids = lambda t: tokenizer(t, add_special_tokens=False).input_ids
        self.encode = functools.lru_cache(maxsize=1 << 16)(self._encode)

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._ids(text))


def compress_body(path: str, body: dict, ask: Ask, compressor) -> dict:
    """Compress the body's long user and tool text in place; returns the accounting."""
    todo: list[tuple[Slot, list[tuple[str, bool]]]] = []
    for s in slots(path, body):
        ps = pieces(s, ask)
        if sum(compressor.count(t) for t, c in ps if c) >= max(ask.min_tokens, 1):
            todo.append((s, ps))
    texts = [t for _, ps in todo for t, c in ps if c]
    if not texts or ask.rate >= 1:
        return {"status": "skipped", "tokens_before": 0, "tokens_after": 0, "tokens_removed": 0, "messages": 0}
    out = iter(compressor.compress(texts, ask))
    before = after = 0
    for s, ps in todo:
        joined = []
        for t, c in ps:
            if c:
                new = next(out)
                before, after = before + compressor.count(t), after + compressor.count(new)
                # the compressor joins words with single spaces: keep the piece's own edges (a paragraph break)
                lead, trail = t[:len(t) - len(t.lstrip())], t[len(t.rstrip()):]
                t = lead + new.strip() + trail
            joined.append(t)
        s.container[s.key] = "".join(joined)
    return {"status": "compressed", "tokens_before": before, "tokens_after": after,
            "tokens_removed": before - after, "messages": len(todo)}


# ---- the proxy ------------------------------------------------------------------------------------------------


def _error(message: str, status: int, param: str | None = None) -> bytes:
    """vLLM's error shape, so an OpenAI client raises its usual BadRequestError."""
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(status, "APIError")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


def upstream_of(upstream: str) -> tuple[str, str, int]:
    """--upstream as (scheme, host, port); a UserError for anything else, checked before the compressor loads."""
    u = urlsplit(upstream.rstrip("/"))
    try:
        port = u.port  # ValueError for a port that is no number or out of range (http://h:99999)
    except ValueError:
        port = 0
    if u.scheme not in ("http", "https") or not u.hostname or port == 0:
        raise UserError(f"--upstream {upstream!r} is not an http(s) URL: use e.g. http://127.0.0.1:8000")
    return u.scheme, u.hostname, port if port is not None else (443 if u.scheme == "https" else 80)


class _Server6(ThreadingHTTPServer):
    """--host ::1 or :: (an IPv6 address): the standard server binds IPv4 sockets only."""

    address_family = socket.AF_INET6


class Proxy:
    """The proxy server: `with Proxy(...) as p: p.base_url`; or `serve_forever()`."""

    def __init__(self, upstream: str, compressor=None, *, host: str = "127.0.0.1", port: int = 0,
                 key: str | None = None, defaults: Ask | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 upstream_timeout_s: float = 3600.0, log=None):
        self.scheme, self.up_host, self.up_port = upstream_of(upstream)
        self.upstream_url = launch.url(self.scheme, self.up_host, self.up_port)  # no credentials --upstream may carry
        self.compressor, self.key, self.timeout_s = compressor, key, timeout_s
        self.upstream_timeout_s = upstream_timeout_s
        self.defaults = defaults or Ask(DEFAULT_RATE, DEFAULT_MIN_TOKENS)
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        # One compression at a time: a model on one GPU gains nothing from two, and a stuck one must not
        # take a thread per request with it. A request waits at most timeout_s, then goes uncompressed.
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compress")
        self.server = (_Server6 if ":" in host else ThreadingHTTPServer)((host, port), _handler(self))
        self.server.daemon_threads = True
        bound = self.server.server_address[1]
        self.base_url = launch.base_url(host, bound)  # where this machine reaches it, as serve prints its own

    def __enter__(self) -> Proxy:
        # a short poll: shutdown() waits for it (tests start and stop many proxies)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def serve_forever(self) -> None:
        try:
            self.server.serve_forever()
        finally:
            self.server.server_close()

    def connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.up_host, self.up_port, timeout=self.upstream_timeout_s)

    def compress(self, path: str, body: dict, ask: Ask) -> dict:
        """Compress in the worker thread, at most timeout_s; on failure the body is left as it was."""
        if self.compressor is None:
            return {"status": "failed", "reason": "no compressor loaded"}
        work = json.loads(json.dumps(body))  # a copy: a late or failed compression must not touch the body sent
        t0 = time.perf_counter()
        future = self.pool.submit(compress_body, path, work, ask, self.compressor)
        try:
            acct = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self.log(f"onespark compress: compression ran past {self.timeout_s:g} s: sent uncompressed")
            return {"status": "timeout", "compressor_ms": round((time.perf_counter() - t0) * 1000, 1)}
        except Exception as e:  # the compressor's own failure (a CUDA OOM, a tokenizer error): never the request's
            self.log(f"onespark compress: compressor failed ({type(e).__name__}: {str(e)[:200]}): sent uncompressed")
            return {"status": "failed", "reason": type(e).__name__,
                    "compressor_ms": round((time.perf_counter() - t0) * 1000, 1)}
        acct["compressor_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        if acct["status"] == "compressed":
            body.clear()
            body.update(work)
        return acct


def _handler(proxy: Proxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "onespark-compress"

        def log_message(self, *a):  # quiet: a request log of a proxy is the upstream's to keep
            pass

        def _reply(self, status: int, body: bytes, extra: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _read_body(self) -> bytes | None:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                self._reply(411, _error("send the request with a Content-Length (no chunked bodies)", 411))
                return None
            raw = self.headers.get("Content-Length", "0").strip() or "0"
            if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:  # "²".isdigit(), but int("²") fails
                self._reply(400, _error(f"Content-Length {raw[:20]!r} is not a byte count", 400))
                return None
            n = int(raw)
            if n > MAX_BODY:
                self._reply(413, _error(f"request body of {n} bytes: the limit is {MAX_BODY}", 413))
                return None
            return self.rfile.read(n)

        def _authorized(self) -> bool:
            if proxy.key is None:
                return True
            got = self.headers.get("Authorization", "")
            if hmac.compare_digest(got.encode("latin-1", "replace"), f"Bearer {proxy.key}".encode()):
                return True
            self._reply(401, _error("missing or wrong API key (Authorization: Bearer ...)", 401))
            return False

        def _forward(self) -> None:
            self.close_connection = False
            raw = self._read_body()
            if raw is None:
                self.close_connection = True
                return
            if not self._authorized():
                return
            path = self.path.split("?", 1)[0]
            extra: dict[str, str] = {}
            acct = None
            if self.command == "POST" and path in (CHAT, RESPONSES) and (
                    self.headers.get(HEADER) is not None or FIELD.encode() in raw):
                try:
                    raw, acct = self._compressed(path, raw)
                except BadRequest as e:
                    self._reply(400, _error(str(e), 400, FIELD))
                    return
                if acct is not None:
                    extra = {STATUS_HEADER: acct["status"], REMOVED_HEADER: str(acct.get("tokens_removed", 0)),
                             TIME_HEADER: str(acct.get("compressor_ms", 0))}
            self._relay(raw, extra, acct)

        def _compressed(self, path: str, raw: bytes) -> tuple[bytes, dict | None]:
            """(the body to send, the accounting) for an opted-in request; (raw, None) when it does not opt in."""
            try:
                body = shape.parse(raw, "the request body", "send a JSON object")
            except UserError as e:
                if self.headers.get(HEADER) is None:
                    return raw, None  # a field name inside a string of garbage: not ours to judge, vLLM's
                raise BadRequest(str(e)) from None
            ask = parse_ask(self.headers.get(HEADER), body, proxy.defaults)
            if not isinstance(body, dict):
                if ask is None:
                    return raw, None
                raise BadRequest("the request body is not a JSON object")
            if ask is None and FIELD not in body:
                return raw, None
            body.pop(FIELD, None)  # vLLM would warn about, or refuse, a field it does not know
            acct = proxy.compress(path, body, ask) if ask is not None else {"status": "off"}
            return json.dumps(body, ensure_ascii=False).encode(), acct

        def _relay(self, raw: bytes, extra: dict, acct: dict | None) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP and k.lower() != HEADER.lower()}
            conn = proxy.connection()
            try:
                try:
                    conn.request(self.command, self.path, body=raw if raw or self.command != "GET" else None,
                                 headers={**headers, "Content-Length": str(len(raw))})
                    resp = conn.getresponse()
                except (OSError, http.client.HTTPException) as e:
                    self._reply(502, _error(f"cannot reach vLLM at {proxy.upstream_url} "
                                            f"({type(e).__name__}): is it up?", 502), extra)
                    return
                self._answer(resp, extra, acct)
            finally:
                conn.close()

        def _answer(self, resp: http.client.HTTPResponse, extra: dict, acct: dict | None) -> None:
            # Date and Server: send_response writes the proxy's own; vLLM's would be a second copy of each
            kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP | {"date", "server"}]
            ctype = resp.getheader("Content-Type", "")
            if acct is not None and acct["status"] != "off" and resp.status == 200 and "json" in ctype:
                data = resp.read(MAX_BODY)
                try:
                    doc = json.loads(data)
                    if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                        doc["usage"]["onespark_compression"] = acct
                        data = json.dumps(doc, ensure_ascii=False).encode()
                except (ValueError, RecursionError):
                    pass  # not JSON after all: vLLM's bytes as they came
                self._head(resp, kept, extra, length=len(data))
                self.wfile.write(data)
                return
            no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
            length = None if resp.chunked else resp.length
            self._head(resp, kept, extra, length=0 if no_body and length is None else length)
            if no_body:
                return
            if length is not None:
                while length > 0:
                    block = resp.read(min(BLOCK, length))
                    if not block:
                        self.close_connection = True  # upstream ended short: the client must see the cut
                        return
                    self.wfile.write(block)
                    length -= len(block)
                return
            # streamed (SSE) or close-delimited: each piece as it arrives, chunked to our client
            while True:
                block = resp.read1(BLOCK)
                if not block:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def _head(self, resp, kept, extra: dict, length: int | None) -> None:
            self.send_response(resp.status, resp.reason)
            for k, v in kept:
                self.send_header(k, v)
            for k, v in extra.items():
                self.send_header(k, v)
            if length is None:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(length))
            self.end_headers()

        def _safe(self) -> None:
            try:
                self._forward()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client went away mid-answer
            except Exception as e:  # a bug of ours: one line in the log and a 500, never a traceback to the client
                self.log(f"onespark compress: internal error on {self.command} {self.path[:80]}: "
                         f"{type(e).__name__}: {str(e)[:200]}")
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self._reply(500, _error("internal error in onespark compress (see its log)", 500))

        def log(self, message: str) -> None:
            proxy.log(message)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _safe

    return Handler


# ---- CLI ------------------------------------------------------------------------------------------------------

KEY_ENV = "ONESPARK_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="serve", required=True)
    s = sub.add_parser("serve", help="the compressing proxy in front of vLLM", allow_abbrev=False,
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model-dir", required=True, type=Path,
                   help="the LLMLingua-2 checkpoint (onespark download --compressor NAME writes DEST/llmlingua2/NAME)")
    s.add_argument("--upstream", default="http://127.0.0.1:8000", help="vLLM's URL (default: %(default)s)")
    s.add_argument("--host", type=options.bind_host, default="127.0.0.1", help="address to bind (default: %(default)s: this machine only)")
    s.add_argument("--port", type=options.PORT, default=8001, help="port to bind (default: %(default)s)")
    s.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="where the compressor runs (default: auto = cuda when torch sees a GPU)")
    s.add_argument("--rate", type=options.number(float, 0, 1, lo_open=True), default=DEFAULT_RATE,
                   help="default fraction of tokens kept, for requests that give none (default: %(default)s)")
    s.add_argument("--min-tokens", type=options.number(int, 0), default=DEFAULT_MIN_TOKENS,
                   help="default: leave messages shorter than this alone (default: %(default)s)")
    s.add_argument("--timeout", type=options.SECONDS, default=DEFAULT_TIMEOUT_S,
                   help="seconds a compression may take before the request goes uncompressed (default: %(default)s)")
    s.add_argument("--api-key-file", help=f"the key clients must send and vLLM gets (default: ${KEY_ENV}; none: "
                                          "no check, the client's Authorization goes through as sent)")


def run(args: argparse.Namespace) -> int:
    key = read_secret(args.api_key_file, "--api-key-file") if args.api_key_file else \
        plain_key(os.environ.get(KEY_ENV), f"${KEY_ENV}")
    upstream_of(args.upstream)  # a typo found now, not after the model has loaded
    if not (args.model_dir / "config.json").is_file():
        raise UserError(f"--model-dir {args.model_dir}: no config.json: fetch the weights with "
                        "`onespark download --dest WORK --compressor xlm-roberta-large --skip-int4 --skip-fp8`")
    t0 = time.perf_counter()
    compressor = Compressor(args.model_dir, args.device)
    print(f"onespark compress: LLMLingua-2 ({compressor.family}) on {compressor.device}, loaded in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    try:
        proxy = Proxy(args.upstream, compressor, host=args.host, port=args.port, key=key,
                      defaults=Ask(args.rate, args.min_tokens), timeout_s=args.timeout)
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror}: choose another --port") from None
    print(f"onespark compress: {proxy.base_url} -> {args.upstream} (opt in per request: {HEADER}: on, or the "
          f"body field {FIELD})", flush=True)
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0
