"""OpenAI-compatible HTTP client for benchmarking: streamed requests timed on the client, tokens from `usage`.

Every request asks for `stream_options.include_usage`, so the server's last chunk carries the exact token
counts. Chunks are only timestamps: with speculative decoding one chunk can carry several tokens, and a
client that counts chunks as tokens reports MTP at half its speed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from onespark import shape
from onespark.bench.stats import RequestTiming
from onespark.errors import UserError
from onespark.shape import Int, ListOf, Nullable, Obj, Str


@dataclass
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted and dropped)
    api_key: str | None = None
    model: str | None = None  # None: the first model /v1/models lists
    api: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)  # e.g. {"chat_template_kwargs": {"enable_thinking": False}}
    stream: bool = True  # False: whole-request timing only (the published script's way); no TTFT or decode
    flag: str = "--base-url"  # the option that gave base_url, named in its errors

    def __post_init__(self) -> None:
        try:
            netloc = urlsplit(self.base_url).netloc
        except ValueError:  # an unclosed "[": httpx's check below names it
            netloc = self.base_url
        if "@" in netloc:  # checked first: every message below shows the URL
            raise UserError(f"{self.flag}: the URL holds a user name or password, which would be recorded with the "
                            "results and shown in errors: give the URL without it, the key with --api-key-file")
        url = self.base_url.rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{self.flag} {self.base_url!r} is not an http(s) URL: use e.g. http://127.0.0.1:8000")
        try:  # what the client will parse: a bad port or bracket would otherwise surface as a traceback
            host = httpx.URL(url).host
        except httpx.InvalidURL as e:
            raise UserError(f"{self.flag} {self.base_url!r} is not a valid URL ({e}): use e.g. "
                            "http://127.0.0.1:8000") from None
        if not host:
            raise UserError(f"{self.flag} {self.base_url!r} names no host: use e.g. http://127.0.0.1:8000")
        self.base_url = url
        if self.api not in ("chat", "completions"):
            raise UserError(f"--api {self.api!r}: use chat or completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def make_client(ep: Endpoint, concurrency: int = 1, transport: httpx.AsyncBaseTransport | None = None
                ) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max(4, concurrency + 2), max_keepalive_connections=max(4, concurrency + 2))
    return httpx.AsyncClient(base_url=ep.base_url, headers=ep.headers(), limits=limits, transport=transport,
                             timeout=httpx.Timeout(ep.timeout_s, connect=10.0))


def _http_error(ep: Endpoint, path: str, e: Exception) -> UserError:
    return UserError(f"cannot reach {ep.base_url}{path} ({type(e).__name__}: {e}): is the server up? "
                     "check --base-url, or start it with `onespark serve`")


# What the bench reads of a /v1/models card (onespark.shape): its name, and vLLM's max_model_len where it says.
CARDS = ListOf(Obj({"id": Str("a model name (string)")}, {"max_model_len": Nullable(Int(1, what="a token count"))},
                   what="a model card {id, ...}"), what="a list of model cards")


async def detect_model(client: httpx.AsyncClient, ep: Endpoint) -> dict:
    """The model card /v1/models lists for ep.model (or the first one). Raises UserError when there is none."""
    try:
        r = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise _http_error(ep, "/v1/models", e) from e
    if r.status_code in (401, 403):
        raise UserError(f"{ep.base_url}/v1/models answered {r.status_code}: pass the server's key with --api-key-file (a file "
                        "holding it; --api-key would show it in `ps`)")
    if r.status_code != 200:
        raise UserError(f"{ep.base_url}/v1/models answered {r.status_code}: {r.text[:200]}")
    try:
        doc = r.json()
    except (ValueError, RecursionError):
        raise UserError(f"{ep.base_url}/v1/models answered something that is not JSON ({r.text[:80]!r}): is "
                        f"--base-url an OpenAI-compatible server (vLLM), not a web page or proxy?") from None
    cards = doc.get("data") if isinstance(doc, dict) else None
    if cards is None or not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
        raise UserError(f"{ep.base_url}/v1/models answered {type(doc).__name__} JSON without a list of model "
                        f"objects under 'data' ({r.text[:80]!r}): is --base-url an OpenAI-compatible server?")
    if not cards:
        raise UserError(f"{ep.base_url}/v1/models lists no model: is the server still loading?")
    shape.check(cards, CARDS, f"{ep.base_url}/v1/models", "is --base-url an OpenAI-compatible server (vLLM)?")
    if ep.model is None:
        return cards[0]
    for card in cards:
        if card.get("id") == ep.model:
            return card
    names = ", ".join(c.get("id", "?") for c in cards)
    raise UserError(f"model {ep.model!r} is not served at {ep.base_url} (it serves: {names}): fix --model")


async def get_text(client: httpx.AsyncClient, path: str) -> str | None:
    """GET path; None when the server does not offer it (metrics and version are optional)."""
    try:
        r = await client.get(path)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


async def server_version(client: httpx.AsyncClient) -> str | None:
    text = await get_text(client, "/version")
    try:
        doc = json.loads(text) if text else None
    except (ValueError, RecursionError):  # not JSON, a 5000-digit number, nesting past the stack
        return None
    version = doc.get("version") if isinstance(doc, dict) else None
    return version if isinstance(version, str) else None  # the record's field is a version string or nothing


async def count_prompt_tokens(client: httpx.AsyncClient, ep: Endpoint, prompt: str) -> int | None:
    """Prompt tokens as the server will count them (vLLM's /tokenize, chat template included); None if absent."""
    body: dict = {"model": ep.model}
    if ep.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if "chat_template_kwargs" in ep.extra_body:  # --no-think changes the template, so the count
            body["chat_template_kwargs"] = ep.extra_body["chat_template_kwargs"]
    else:
        body["prompt"] = prompt
    try:
        r = await client.post("/tokenize", json=body)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        count = r.json().get("count")
    except (ValueError, AttributeError, RecursionError):  # not JSON, or not an object: as if /tokenize were absent
        return None
    return count if is_count(count) else None  # a negative count would size a filler of billions of words


def request_body(ep: Endpoint, prompt: str, max_tokens: int, stream: bool = True,
                 temperature: float = 0.0, extra: dict | None = None) -> tuple[str, dict]:
    path = "/v1/chat/completions" if ep.api == "chat" else "/v1/completions"
    body: dict = {"model": ep.model, "max_tokens": max_tokens, "temperature": temperature}
    if ep.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
        # continuous_usage_stats (vLLM): every chunk says how many tokens so far, so tokens per chunk and a
        # true per-token latency are known; the final usage chunk stays the count of record.
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    body.update(ep.extra_body)
    if extra:
        body.update(extra)
    return path, body


async def error_text(r: httpx.Response, most: int = 300) -> str:
    """The start of an error answer's body, without reading the rest (a server may send any amount)."""
    got = b""
    async for block in r.aiter_bytes():
        got += block
        if len(got) >= most:
            break
    return got.decode(errors="replace")[:most]


class Malformed(ValueError):
    """A server answer of the wrong shape; the request is recorded as failed with this reason."""


# Above 2**53 a count is no longer exact as a float (JSON readers, the rates): no server counts that many tokens,
# and 10**400 would overflow every rate computed from it.
COUNT_MAX = 2**53


def is_count(v) -> bool:
    """A token count: an int (never a bool) in 0..COUNT_MAX."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= COUNT_MAX


def _count(usage: dict, key: str, most: int = COUNT_MAX) -> int | None:
    """usage[key] as a token count, or None when absent; `most`: the request's max_tokens, which vLLM never
    exceeds (a larger count would also expand into that many per-token latencies)."""
    v = usage.get(key)
    if v is None or (is_count(v) and v <= most):
        return v
    if is_count(v):
        raise Malformed(f"usage.{key} is {v}, more than the max_tokens {most} the request asked for")
    raise Malformed(f"usage.{key} is {v!r:.60} ({type(v).__name__}), not a token count")


def _usage(obj: dict) -> dict | None:
    usage = obj.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise Malformed(f"usage is a JSON {type(usage).__name__}, not an object")
    return usage


def _object(data: str | dict | list, what: str) -> dict:
    try:
        doc = json.loads(data) if isinstance(data, str) else data
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as e:  # parses as JSON text, but not into a value we can hold
        raise Malformed(f"{what} is JSON no client should receive ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(doc, dict):
        raise Malformed(f"{what} is a JSON {type(doc).__name__} where an object belongs: {json.dumps(doc)[:120]}")
    choices = doc.get("choices")
    if choices is not None and not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
        raise Malformed(f"{what}: 'choices' is {json.dumps(choices)[:80]}, not a list of objects")
    for c in choices or []:
        if c.get("delta") is not None and not isinstance(c["delta"], dict):
            raise Malformed(f"{what}: a choice's 'delta' is {json.dumps(c['delta'])[:80]}, not an object")
    return doc


def _chunk_has_text(chunk: dict) -> bool:
    for choice in chunk.get("choices") or []:
        if "text" in choice and choice["text"]:  # /v1/completions
            return True
        delta = choice.get("delta") or {}
        # vLLM streams thinking as `reasoning` (0.19) or `reasoning_content` (older); both are generated tokens.
        if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
            return True
    return False


async def stream_request(client: httpx.AsyncClient, ep: Endpoint, prompt: str, max_tokens: int,
                         temperature: float = 0.0, extra: dict | None = None,
                         on_first_token: Callable[[], None] | None = None) -> RequestTiming:
    """One streamed request. Never raises for server-side failures: they land in `error`.

    `on_first_token` is called once, when the first generated text arrives: the request is then known to be
    running on the server (the capacity suite samples /metrics at that moment)."""
    path, body = request_body(ep, prompt, max_tokens, stream=True, temperature=temperature, extra=extra)
    t = RequestTiming(t_start=time.perf_counter(), t_end=0.0)
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                t.error = f"HTTP {r.status_code}: {await error_text(r)}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = _object(data, "a stream chunk")
                    if "error" in chunk:
                        t.error = f"server error in stream: {json.dumps(chunk['error'])[:300]}"
                        break
                    usage = _usage(chunk)
                    if _chunk_has_text(chunk):
                        if on_first_token and not t.chunk_times:
                            on_first_token()
                        t.chunk_times.append(now)
                        if usage and _count(usage, "completion_tokens", max_tokens) is not None:
                            t.chunk_tokens.append(usage["completion_tokens"])
                    if usage:
                        t.prompt_tokens = _count(usage, "prompt_tokens")
                        t.completion_tokens = _count(usage, "completion_tokens", max_tokens)
    except Malformed as e:  # one request of the wrong shape fails alone; the run and its other figures go on
        t.error = f"malformed answer: {e}"
    except json.JSONDecodeError as e:
        t.error = f"malformed answer: a stream chunk is not JSON ({e})"
    except httpx.HTTPError as e:
        t.error = f"{type(e).__name__}: {e}"
    t.t_end = time.perf_counter()
    if t.error is None and t.completion_tokens is None:
        t.error = "stream ended without usage: the server ignored stream_options.include_usage"
    return t


async def plain_request(client: httpx.AsyncClient, ep: Endpoint, prompt: str, max_tokens: int,
                        temperature: float = 0.0, extra: dict | None = None) -> RequestTiming:
    """One non-streamed request, timed whole: exactly what the published script measures (no TTFT, no decode)."""
    path, body = request_body(ep, prompt, max_tokens, stream=False, temperature=temperature, extra=extra)
    t = RequestTiming(t_start=time.perf_counter(), t_end=0.0)
    try:
        r = await client.post(path, json=body)
        t.t_end = time.perf_counter()
        if r.status_code != 200:
            t.error = f"HTTP {r.status_code}: {r.text[:300]}"
        else:
            usage = _usage(_object(r.text, "the answer")) or {}
            t.prompt_tokens = _count(usage, "prompt_tokens")
            t.completion_tokens = _count(usage, "completion_tokens", max_tokens)
    except Malformed as e:
        t.error = f"malformed answer: {e}"
    except json.JSONDecodeError as e:
        t.error = f"malformed answer: not JSON ({e})"
    except httpx.HTTPError as e:
        t.t_end = time.perf_counter()
        t.error = f"{type(e).__name__}: {e}"
    return t


async def complete(client: httpx.AsyncClient, ep: Endpoint, prompt: str, max_tokens: int,
                   extra: dict | None = None) -> dict:
    """One non-streamed request; returns the response JSON. Raises UserError on failure."""
    path, body = request_body(ep, prompt, max_tokens, stream=False, extra=extra)
    try:
        r = await client.post(path, json=body)
    except httpx.HTTPError as e:
        raise _http_error(ep, path, e) from e
    if r.status_code != 200:
        raise UserError(f"{ep.base_url}{path} answered {r.status_code}: {r.text[:300]}")
    try:
        return _object(r.text, f"{ep.base_url}{path}'s answer")
    except (Malformed, json.JSONDecodeError) as e:
        raise UserError(f"{ep.base_url}{path}: malformed answer ({e}): is it an OpenAI-compatible server?") from None
