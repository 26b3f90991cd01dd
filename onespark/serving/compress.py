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

Every request that does not opt in is forwarded as its bytes and answered with vLLM's bytes, streams as they
come. A request that asked carries X-Onespark-Compression in its answer (compressed, skipped, failed, timeout,
off, unsupported) with X-Onespark-Tokens-Removed and X-Onespark-Compressor-Ms, and X-Onespark-Compression-Reason
when it was not compressed; a non-streamed JSON answer also carries usage.onespark_compression. A compressor that
fails or runs past --timeout leaves the request uncompressed, never lost; a request whose client left while it
waited is dropped, never sent. Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 (a
malformed onespark_compress or header), 401, 408 (a request too slow to arrive), 413 (a body over
--max-body-bytes), 502 (vLLM unreachable, or its answer broken: the message says which), 503 (--max-compressions
held), 504 (vLLM silent past --upstream-read-timeout). An answer that breaks off upstream reaches the client cut
(the connection closes early), never as a complete one.

The HTTP side is Starlette on uvicorn with httpx to vLLM (the stack vLLM's own server runs on), imported where
used: the serving wing is standard library at module level, and this help needs none of them.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import copy
import hmac
import importlib.util
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from onespark import options
from onespark.errors import UserError
from onespark.serving import launch
from onespark.serving.lingua import (
    CHAT,
    DEFAULT_MIN_TOKENS,
    DEFAULT_RATE,
    FIELD,
    HEADER,
    REASON_HEADER,
    REMOVED_HEADER,
    RESPONSES,
    STATUS_HEADER,
    TIME_HEADER,
    Ask,
    BadRequest,
    Compressor,
    compress_body,
    encode_body,
    read_request,
)

__all__ = ["CHAT", "FIELD", "HEADER", "REASON_HEADER", "REMOVED_HEADER", "RESPONSES", "STATUS_HEADER", "TIME_HEADER",
           "Ask", "Compressor", "Limits", "Proxy", "UserError", "upstream_of"]

VIA = "1.1 onespark-compress"  # RFC 9110's Via, on every answer: `onespark bench --suite compression` checks it
DEFAULT_TIMEOUT_S = 30.0
MIB = 1024 * 1024
# Never forwarded either way: one connection's own headers (RFC 9110 7.6.1), and what the proxy sets itself.
HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
       "transfer-encoding", "upgrade", "host", "content-length", "expect", HEADER.lower()}
ANSWER_HOP = (HOP - {"content-length"}) | {"date"}  # uvicorn writes the Date of the answer it sends


@dataclass(frozen=True)
class Limits:
    """Every limit of the proxy; each is a flag of `compress serve`, with these defaults."""

    # A 64K-token prompt is ~0.3 MB of JSON: 100x room, and a hostile Content-Length is refused, not allocated.
    # Also the most of an opted-in answer read whole to add usage.onespark_compression (past it: passed as is).
    max_body_bytes: int = 32 * MIB
    header_timeout_s: float = 10.0  # a request's headers, from the connection's or the request's first byte
    body_timeout_s: float = 60.0  # its body, from the end of its headers: 32 MiB at ~4 Mbit/s
    keep_alive_s: float = 5.0  # an idle connection between requests (uvicorn's default, and vLLM's)
    connect_timeout_s: float = 10.0  # a connection to vLLM
    # vLLM's silence while it answers: a non-streamed answer comes whole, at the end (8K tokens at 10 tok/s: 800 s)
    read_timeout_s: float = 3600.0
    max_compressions: int = 16  # opted-in requests with the compressor at once, running or waiting their turn
    backlog: int = 2048  # connections the kernel queues before the proxy accepts them (uvicorn's default)


def _error(message: str, status: int, param: str | None = None) -> bytes:
    """vLLM's error shape, so an OpenAI client raises its usual error class."""
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
            413: "RequestTooLargeError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}.get(status, "APIError")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


def _shown(upstream: str) -> str:
    """--upstream as it may be printed: a password in it replaced by ***."""
    u = urlsplit(upstream)
    if u.password is None:
        return upstream
    return upstream.replace(f":{u.password}@", ":***@", 1)


def upstream_of(upstream: str) -> tuple[str, str, int]:
    """--upstream as (scheme, host, port); a UserError for anything else, checked before the compressor loads."""
    u = urlsplit(upstream.rstrip("/"))
    try:
        port = u.port  # ValueError for a port that is no number or out of range (http://h:99999)
    except ValueError:
        port = 0
    if u.scheme not in ("http", "https") or not u.hostname or port == 0:
        raise UserError(f"--upstream {_shown(upstream)!r} is not an http(s) URL: use e.g. http://127.0.0.1:8000")
    if u.username is not None:
        raise UserError(f"--upstream {_shown(upstream)!r} carries a user name or password, which vLLM does not "
                        "read: give its key with --api-key-file (clients' own Authorization goes through as sent)")
    return u.scheme, u.hostname, port if port is not None else (443 if u.scheme == "https" else 80)


def bind(host: str, port: int) -> socket.socket:
    """The proxy's socket, bound (not yet listening): a port in use or an address not of this machine is found
    before the compressor loads."""
    try:
        family, *_, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host {host}: no such address ({e}): give an address of this machine, e.g. "
                        "127.0.0.1") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == 98:  # EADDRINUSE
            raise UserError(f"--port {port}: something already listens there on {host}: stop it or choose "
                            "another --port") from None
        if e.errno == 99:  # EADDRNOTAVAIL
            raise UserError(f"--host {host} is not an address of this machine: use 127.0.0.1 (this machine "
                            "only), 0.0.0.0 (every interface) or one of its own addresses") from None
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}: choose another --port "
                        "(below 1024 needs root)") from None
    return sock


# ---- the compressor's queue ---------------------------------------------------------------------------------


def _job(compressor, path: str, body: dict, ask: Ask, clock: dict) -> tuple[dict, bytes | None]:
    """In the worker thread: compress a copy of the body (a late or failed compression never touches the body
    the proxy sends); the compressed body's bytes, or None when nothing changed."""
    clock["start"] = time.perf_counter()
    try:
        work = copy.deepcopy(body)
        acct = compress_body(path, work, ask, compressor)
        return acct, encode_body(work) if acct["status"] == "compressed" else None
    finally:
        clock["end"] = time.perf_counter()


class Compressions:
    """The compressor's own queue, off the event loop: one worker thread (llmlingua's PromptCompressor is not
    thread-safe: each call adds its force tokens to the shared tokenizer, so Compressor holds a lock and a second
    thread would only wait on it), at most `limit` requests held at once, each for at most timeout_s from its
    arrival. A request that gives up (its deadline passed, its client left) takes its job out of the queue, so no
    compression ever runs for nobody: the next request waits for running work only, and the wait is reported as
    the wait, not as compressor time."""

    def __init__(self, compressor, limit: int, timeout_s: float, log):
        self.compressor, self.limit, self.timeout_s, self.log = compressor, limit, timeout_s, log
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compress")
        self.held = 0

    def full(self) -> bool:
        return self.held >= self.limit

    async def run(self, path: str, body: dict, ask: Ask) -> tuple[dict, bytes | None]:
        """(the accounting, the compressed body or None to send `body` as it is). Cancelled (its client left),
        the job is cancelled with it."""
        if self.compressor is None:
            return {"status": "failed", "reason": "no compressor loaded", "compressor_ms": 0}, None
        self.held += 1
        t0, clock = time.perf_counter(), {}
        job = asyncio.wrap_future(self.pool.submit(_job, self.compressor, path, body, ask, clock))
        try:
            acct, sent = await asyncio.wait_for(asyncio.shield(job), self.timeout_s)
        except asyncio.TimeoutError:
            job.cancel()  # still queued: it never runs; running: its result is dropped
            return self._late(clock, t0), None
        except asyncio.CancelledError:
            job.cancel()
            raise
        except Exception as e:  # the compressor's own failure (a CUDA OOM, a tokenizer error): never the request's
            self.log(f"onespark compress: compressor failed ({type(e).__name__}: {str(e)[:200]}): sent uncompressed")
            return {"status": "failed", "reason": f"the compressor failed ({type(e).__name__}; see the proxy's log)",
                    "compressor_ms": _ms(clock.get("end", 0) - clock.get("start", 0))}, None
        finally:
            self.held -= 1
        acct["compressor_ms"] = _ms(clock["end"] - clock["start"])
        acct["queue_ms"] = _ms(clock["start"] - t0)
        if acct["status"] == "skipped":
            acct["reason"] = "rate 1 keeps every token" if ask.rate >= 1 else \
                f"no user or tool text of {ask.min_tokens} compressor tokens or more (min_tokens)"
        return acct, sent

    def _late(self, clock: dict, t0: float) -> dict:
        now = time.perf_counter()
        if "start" not in clock:
            why = f"waited --timeout {self.timeout_s:g} s for the compressor, busy with earlier requests"
            ran = 0.0
        else:
            ran = now - clock["start"]
            why = (f"compression ran past --timeout {self.timeout_s:g} s (after {clock['start'] - t0:.1f} s "
                   f"waiting for the compressor)")
        self.log(f"onespark compress: {why}: sent uncompressed")
        return {"status": "timeout", "reason": why, "compressor_ms": _ms(ran), "queue_ms": _ms(now - t0 - ran)}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


# ---- the HTTP side: Starlette on uvicorn, httpx to vLLM ------------------------------------------------------


class Refused(Exception):
    """An answer of the proxy's own (an error): status, message, and whether the connection must close (a
    request body left unread)."""

    def __init__(self, status: int, message: str, close: bool = False, param: str | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.close, self.param, self.extra = status, message, close, param, extra or {}


class Cut(Exception):
    """vLLM's answer broke off after the proxy had started relaying it: the client's connection must close
    short, so the client sees the cut."""


def _header_value(text: str) -> str:
    """Text fit for a header value: ASCII without control characters (a path may carry any of them)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:300]


async def _disconnected(receive) -> None:
    """Returns once the client has gone (the request body already read: uvicorn answers nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(aw, receive):
    """aw's result, or _GONE when the client disconnects first (aw is then cancelled)."""
    task, watch = asyncio.ensure_future(aw), asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return _GONE
    finally:
        watch.cancel()


_GONE = object()


class Gateway:
    """The proxy's one route, an ASGI app: read the request whole (bounded in size and time), compress it when
    it asks, relay it to vLLM with httpx and the answer back as it streams."""

    def __init__(self, proxy: Proxy):
        self.proxy, self.limits, self.log = proxy, proxy.limits, proxy.log
        self.client = None  # httpx.AsyncClient: made in the server's event loop (Proxy.app's lifespan)

    async def __call__(self, scope, receive, send) -> None:
        from starlette.requests import ClientDisconnect, Request

        request = Request(scope, receive)
        try:
            await self._handle(request, scope, receive, send)
        except Refused as e:
            await self._refuse(e, scope, receive, send)
        except ClientDisconnect:
            pass  # the client left while sending its request: nobody to answer

    async def _refuse(self, e: Refused, scope, receive, send) -> None:
        from starlette.responses import Response

        headers = {**e.extra, "via": VIA, **({"connection": "close"} if e.close else {})}
        await Response(_error(e.message, e.status, e.param), e.status, headers, "application/json")(scope, receive, send)

    async def _handle(self, request, scope, receive, send) -> None:
        key = self.proxy.key
        if key is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode("latin-1"),
                                                       f"Bearer {key}".encode()):
            raise Refused(401, "missing or wrong API key (Authorization: Bearer ...)", close=True)
        raw = await self._body(request)
        try:
            reading = read_request(scope["method"], scope["path"], request.headers.get(HEADER), raw,
                                   self.proxy.defaults)
        except BadRequest as e:
            raise Refused(400, str(e), param=FIELD) from None
        acct = {"status": reading.status, "reason": reading.reason} if reading.status is not None else None
        if reading.ask is not None:
            if self.proxy.compressions.full():
                raise Refused(503, f"the compressor is busy: {self.limits.max_compressions} requests are with it "
                                   "(--max-compressions); retry, or send without onespark_compress",
                              extra={STATUS_HEADER: "busy", "retry-after": "1"})
            got = await _unless_gone(self.proxy.compressions.run(scope["path"], reading.body, reading.ask), receive)
            if got is _GONE:
                self.log(f"onespark compress: the client of a {scope['path']} request left while it waited for "
                         "compression: dropped, not sent to vLLM")
                return
            acct, compressed = got
            raw = compressed if compressed is not None else encode_body(reading.body)
        elif reading.body is not None:
            raw = encode_body(reading.body)
        await self._relay(scope, receive, send, raw, acct)

    async def _body(self, request) -> bytes:
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and not (length.isascii() and length.isdigit()):  # uvicorn's parsers check it too
            raise Refused(400, f"Content-Length {length[:20]!r} is not a byte count", close=True)
        if length is not None and int(length) > limit:  # refused before a byte is read (and before 100 Continue)
            raise Refused(413, f"request body of {length} bytes: the limit is {limit} (--max-body-bytes)", close=True)
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise Refused(413, f"request body over {limit} bytes (--max-body-bytes)", close=True)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise Refused(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                               f"(--body-timeout): {size} bytes came", close=True) from None
        return b"".join(chunks)

    def _headers_out(self, scope) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in HOP]

    async def _relay(self, scope, receive, send, raw: bytes, acct: dict | None) -> None:
        import httpx

        method = scope["method"]
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        url = httpx.URL(self.proxy.upstream_url).copy_with(raw_path=target)
        body = raw if raw or method not in ("GET", "HEAD", "DELETE", "OPTIONS") else None
        req = self.client.build_request(method, url, headers=self._headers_out(scope), content=body)
        extra = _report(acct)
        try:
            resp = await _unless_gone(self.client.send(req, stream=True), receive)
        except httpx.HTTPError as e:
            raise Refused(*self._upstream_failure(e), extra=extra) from None
        if resp is _GONE:
            return  # the client left while vLLM worked on the answer: the cancelled send closed that connection
        try:
            ctype = resp.headers.get("content-type", "")
            if acct is not None and acct["status"] not in ("off", "unsupported") and resp.status_code == 200 and "json" in ctype \
                    and "content-encoding" not in resp.headers:
                await self._whole(resp, scope, receive, send, extra, acct)
            else:
                await self._stream(resp, resp.aiter_raw(), b"", scope, receive, send, extra)
        except Cut as e:
            self.log(f"onespark compress: {e}: the client's connection is closed short, so it sees the cut")
        finally:
            await resp.aclose()

    def _upstream_failure(self, e) -> tuple[int, str]:
        import httpx

        at = f"vLLM at {self.proxy.upstream_url}"
        what = str(e)[:160] or type(e).__name__
        if isinstance(e, httpx.ConnectTimeout):
            return 504, f"cannot reach {at}: no connection within {self.limits.connect_timeout_s:g} s " \
                        "(--upstream-connect-timeout): is it up, and reachable from here?"
        if isinstance(e, httpx.ConnectError):
            return 502, f"cannot reach {at} ({what}): is it up?"
        if isinstance(e, httpx.TimeoutException):
            return 504, f"{at} sent nothing for {self.limits.read_timeout_s:g} s (--upstream-read-timeout)"
        if isinstance(e, httpx.RemoteProtocolError) and "without sending" in what:
            return 502, f"{at} closed the connection without an answer ({what})"
        if isinstance(e, httpx.RemoteProtocolError):
            return 502, f"{at} answered with something that is not HTTP ({what}): is --upstream vLLM's address?"
        return 502, f"the connection to {at} failed ({type(e).__name__}: {what})"

    def _answer_headers(self, resp, extra: dict, length: int | None = None) -> list[tuple[bytes, bytes]]:
        out = [(k, v) for k, v in resp.headers.raw if k.decode("latin-1").lower() not in ANSWER_HOP
               and not (length is not None and k.lower() == b"content-length")]
        out += [(k.lower().encode(), v.encode()) for k, v in {**extra, "via": VIA}.items()]
        if length is not None:
            out.append((b"content-length", str(length).encode()))
        return out

    async def _whole(self, resp, scope, receive, send, extra: dict, acct: dict) -> None:
        """An opted-in JSON answer, read whole to add usage.onespark_compression. One that breaks off is a 502,
        never a complete 200; one past --max-body-bytes goes on as it comes, unchanged (never cut to the limit)."""
        import httpx
        from starlette.responses import Response

        data, chunks = bytearray(), resp.aiter_raw()
        try:
            async for chunk in chunks:
                data += chunk
                if len(data) > self.limits.max_body_bytes:
                    return await self._stream(resp, chunks, bytes(data), scope, receive, send, extra)
        except httpx.HTTPError as e:
            status, message = self._upstream_failure(e)
            raise Refused(status if status == 504 else 502, f"{self.proxy.upstream_url}'s answer broke off after "
                          f"{len(data)} bytes ({str(e)[:160] or type(e).__name__}): not relayed", extra=extra) from None
        try:
            doc = json.loads(data)
            if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                doc["usage"]["onespark_compression"] = acct
                data = bytearray(json.dumps(doc, ensure_ascii=False).encode())
        except (ValueError, RecursionError):
            pass  # whole, but not JSON after all: vLLM's bytes as they came
        r = Response(bytes(data), resp.status_code)
        r.raw_headers = self._answer_headers(resp, extra, len(data))
        await r(scope, receive, send)

    async def _stream(self, resp, chunks, first: bytes, scope, receive, send, extra: dict) -> None:
        """vLLM's answer as it arrives (SSE chunk by chunk); upstream's Content-Length, when it sent one, stays."""
        import httpx
        from starlette.responses import StreamingResponse

        async def body():
            if first:
                yield first
            try:
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as e:
                raise Cut(f"vLLM's answer broke off ({type(e).__name__}: {str(e)[:160]})") from None

        r = StreamingResponse(body(), resp.status_code)
        r.raw_headers = self._answer_headers(resp, extra)
        await r(scope, receive, send)


def _report(acct: dict | None) -> dict:
    """The X-Onespark-* headers of an answer to a request that asked."""
    if acct is None:
        return {}
    out = {STATUS_HEADER: acct["status"]}
    if acct["status"] not in ("off", "unsupported"):
        out[REMOVED_HEADER] = str(acct.get("tokens_removed", 0))
        out[TIME_HEADER] = str(acct.get("compressor_ms", 0))
    if acct.get("reason"):
        out[REASON_HEADER] = _header_value(acct["reason"])
    return out


LINGER_S = 2.0  # a slow client's next byte comes within ~1 s: it has read its 408 by then


def _protocol(header_timeout_s: float):
    """uvicorn's HTTP protocol (httptools where installed, else h11, as vLLM runs it) with a deadline on a
    request's headers: uvicorn times out only the idle time after an answer, so a connection that never sends a
    byte, or sends its headers a byte at a time, would be held for ever (a file descriptor and a buffer each)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    late = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"via: " + VIA.encode() + b"\r\n")
    message = _error(f"the request's headers did not arrive within {header_timeout_s:g} s (--header-timeout)", 408)
    late += b"content-length: %d\r\n\r\n%s" % (len(message), message)

    class Protocol(AutoHTTPProtocol):
        _deadline = None
        _heard = False
        _ended = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._ended:
                return  # after its 408: read and dropped until the close (see _expire)
            if self._deadline is None and self._between():
                self._arm()  # the first byte of the next request: its headers have their own deadline
            self._heard = True
            super().data_received(data)
            if self._deadline is not None and not self._between():
                self._deadline.cancel()  # the headers are in: the body has --body-timeout
                self._deadline = None

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _between(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._heard = False
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if not self._between() or self.transport.is_closing():
                return
            if not self._heard:  # a silent connection just closes
                self.transport.close()
                return
            # Part of a request came: say why it ends. Closed at once, a socket with unread input sends a reset,
            # which can destroy the 408 before the client reads it; so the answer and a FIN go first, the
            # client's next bytes are read and dropped, and the socket closes a little later (a lingering close).
            self._ended = True
            self.transport.write(late)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    return Protocol


class Proxy:
    """The proxy server: `with Proxy(...) as p: p.base_url` (in a thread, for tests), or `serve_forever()`."""

    def __init__(self, upstream: str, compressor=None, *, host: str = "127.0.0.1", port: int = 0,
                 key: str | None = None, defaults: Ask | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 limits: Limits | None = None, log=None, sock: socket.socket | None = None):
        self.scheme, self.up_host, self.up_port = upstream_of(upstream)
        self.upstream_url = launch.url(self.scheme, self.up_host, self.up_port)  # never a password: upstream_of
        self.key, self.limits = key, limits or Limits()
        self.defaults = defaults or Ask(DEFAULT_RATE, DEFAULT_MIN_TOKENS)
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.compressions = Compressions(compressor, self.limits.max_compressions, timeout_s, self.log)
        self.sock = sock or bind(host, port)
        self.base_url = launch.base_url(host, self.sock.getsockname()[1])  # where this machine reaches it
        self.gateway = Gateway(self)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs
        self._server = self._thread = None

    def app(self):
        """The Starlette app: one catch-all route, the httpx client to vLLM opened and closed with it."""
        import httpx
        from starlette.applications import Starlette
        from starlette.routing import Route

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self.loop = asyncio.get_running_loop()
            lim = self.limits
            # trust_env off: a proxy set in the environment (HTTP_PROXY) is for the internet, not for vLLM
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(lim.read_timeout_s, connect=lim.connect_timeout_s, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64), trust_env=False)
            for name in ("user-agent", "accept", "accept-encoding"):  # the client's own go through, httpx's do not
                del client.headers[name]
            self.gateway.client = client
            try:
                yield
            finally:
                await client.aclose()

        async def internal(request, exc):  # a bug of ours: one line in the log, and OpenAI's shape to the client
            from starlette.responses import Response

            self.log(f"onespark compress: internal error on {request.method} {request.url.path[:80]}: "
                     f"{type(exc).__name__}: {str(exc)[:200]}")
            return Response(_error("internal error in onespark compress (see its log)", 500), 500,
                            media_type="application/json")

        return Starlette(routes=[Route("/{path:path}", self.gateway, methods=None)], lifespan=lifespan,
                         exception_handlers={Exception: internal})

    def server(self):
        import uvicorn

        lim = self.limits
        config = uvicorn.Config(self.app(), http=_protocol(lim.header_timeout_s), timeout_keep_alive=lim.keep_alive_s,
                                backlog=lim.backlog, log_level="warning", access_log=False, server_header=False,
                                lifespan="on", timeout_graceful_shutdown=5)
        return uvicorn.Server(config)

    def __enter__(self) -> Proxy:
        self._server = self.server()
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self._thread.start()
        t0 = time.monotonic()
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > 30:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self.sock.close()
        self.compressions.pool.shutdown(wait=False, cancel_futures=True)

    def serve_forever(self) -> None:
        """In the main thread: uvicorn's own Ctrl-C and SIGTERM handling (answers in flight finish)."""
        try:
            self.server().run(sockets=[self.sock])
        finally:
            self.sock.close()
            self.compressions.pool.shutdown(wait=False, cancel_futures=True)


# ---- CLI ------------------------------------------------------------------------------------------------------

HTTP_STACK = ("starlette", "uvicorn", "httpx")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="serve", required=True)
    s = sub.add_parser("serve", help="the compressing proxy in front of vLLM", allow_abbrev=False,
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model-dir", required=True, type=options.directory_path,
                   help="the LLMLingua-2 checkpoint (onespark download --compressor NAME writes DEST/llmlingua2/NAME)")
    s.add_argument("--upstream", default="http://127.0.0.1:8000",
                   help="vLLM's URL, without credentials (default: %(default)s)")
    s.add_argument("--host", type=options.bind_host, default="127.0.0.1", help="address to bind (default: %(default)s: this machine only)")
    s.add_argument("--port", type=options.PORT, default=8001, help="port to bind (default: %(default)s)")
    s.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="where the compressor runs (default: auto = cuda when torch sees a GPU)")
    s.add_argument("--rate", type=options.number(float, 0, 1, lo_open=True), default=DEFAULT_RATE,
                   help="default fraction of tokens kept, for requests that give none (default: %(default)s)")
    s.add_argument("--min-tokens", type=options.number(int, 0), default=DEFAULT_MIN_TOKENS,
                   help="default: leave messages shorter than this alone (default: %(default)s)")
    s.add_argument("--timeout", type=options.SECONDS, default=DEFAULT_TIMEOUT_S,
                   help="seconds a request may wait for and take the compressor before it goes uncompressed "
                        "(default: %(default)s)")
    launch.add_key_arguments(s)
    d = Limits()
    g = s.add_argument_group("limits (see docs/guides/compression.md)")
    g.add_argument("--max-body-bytes", type=options.COUNT, default=d.max_body_bytes,
                   help="a request body past this is a 413; an opted-in answer past it is passed on unchanged "
                        "(default: %(default)s = 32 MiB)")
    g.add_argument("--header-timeout", type=options.SECONDS, default=d.header_timeout_s,
                   help="seconds for a request's headers to arrive; then 408 and the connection closes "
                        "(default: %(default)s)")
    g.add_argument("--body-timeout", type=options.SECONDS, default=d.body_timeout_s,
                   help="seconds for a request's body to arrive after its headers; then 408 (default: %(default)s)")
    g.add_argument("--keep-alive", type=options.SECONDS, default=d.keep_alive_s,
                   help="seconds an idle connection is kept between requests (default: %(default)s)")
    g.add_argument("--upstream-connect-timeout", type=options.SECONDS, default=d.connect_timeout_s,
                   help="seconds to connect to vLLM; then 504 (default: %(default)s)")
    g.add_argument("--upstream-read-timeout", type=options.SECONDS, default=d.read_timeout_s,
                   help="seconds vLLM may stay silent while it answers (a non-streamed answer comes whole, at the "
                        "end); then 504, or a cut stream (default: %(default)s)")
    g.add_argument("--max-compressions", type=options.COUNT, default=d.max_compressions,
                   help="opted-in requests with the compressor at once, one running and the rest waiting their "
                        "turn; the next is a 503 (default: %(default)s)")
    g.add_argument("--backlog", type=options.COUNT, default=d.backlog,
                   help="connections the kernel queues before the proxy accepts them (default: %(default)s)")


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout,
                  body_timeout_s=args.body_timeout, keep_alive_s=args.keep_alive,
                  connect_timeout_s=args.upstream_connect_timeout, read_timeout_s=args.upstream_read_timeout,
                  max_compressions=args.max_compressions, backlog=args.backlog)


def need_http_stack() -> None:
    missing = [m for m in HTTP_STACK if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"onespark compress serve needs {', '.join(missing)} (not installed here): "
                        "pip install 'onespark[compress]', or run it from the serving image")


def need_compressor_libs() -> None:
    missing = [m for m in ("torch", "llmlingua") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"the compressor needs {' and '.join(missing)} (not installed here): run the proxy from "
                        "the serving image, which holds them pinned (docs/guides/compression.md, Turn it on)")


def run(args: argparse.Namespace) -> int:
    key = launch.api_key(args)
    upstream_of(args.upstream)  # each of these found now, not after the model has loaded
    need_http_stack()
    if not (args.model_dir / "config.json").is_file():
        raise UserError(f"--model-dir {args.model_dir}: no config.json: fetch the weights with "
                        "`onespark download --dest WORK --compressor xlm-roberta-large --skip-int4 --skip-fp8`")
    need_compressor_libs()
    sock = bind(args.host, args.port)
    launch.warn_if_exposed("onespark compress", args.host, key)
    t0 = time.perf_counter()
    compressor = Compressor(args.model_dir, args.device)
    print(f"onespark compress: LLMLingua-2 ({compressor.family}) on {compressor.device}, loaded in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    proxy = Proxy(args.upstream, compressor, host=args.host, key=key, defaults=Ask(args.rate, args.min_tokens),
                  timeout_s=args.timeout, limits=limits_from(args), sock=sock)
    print(f"onespark compress: {proxy.base_url} -> {proxy.upstream_url} (opt in per request: {HEADER}: on, or "
          f"the body field {FIELD})", flush=True)
    proxy.serve_forever()
    return 0
