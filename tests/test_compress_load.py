"""Issue 58, item 2: `onespark compress serve` under load, slow clients and upstream faults, on loopback.

A fake vLLM written with the proxy's own stack (Starlette on uvicorn, in a thread) answers chat requests, JSON or
SSE, with bytes that depend only on the request's `user` field (so a compressed request gets the same answer as
the original, and the proxy's answer can be compared byte for byte with the direct one). The LLMLingua model is
replaced by FakeCompressor (the Proxy's `compressor` argument: count() and compress()), since the real one needs
torch and a model; tests/test_compress.py runs the real one.

Bounded: 64 requests each way, 50 idle and 5 slow connections, short limits through the proxy's own Limits (the
flags'): the file runs in well under 60 s on 2 cores, and stops by itself (every wait has a timeout).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import statistics
import threading
import time

import httpx
import pytest

from onespark.serving.compress import FIELD, HEADER, REASON_HEADER, STATUS_HEADER, Ask, Limits, Proxy
from tests._ports import free_port

LIMITS = Limits(max_body_bytes=256 * 1024, header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_s=2.0,
                connect_timeout_s=1.0, read_timeout_s=1.5, max_compressions=64, backlog=2048)
N = 64
IDLE, SLOW = 50, 5


class FakeCompressor:
    """Keeps every other word; a text holding SLOW-n takes n/10 seconds. `calls` counts compressions run."""

    def __init__(self):
        self.calls = self.finished = 0

    def count(self, text: str) -> int:
        return len(text.split())

    def compress(self, texts, ask):
        self.calls += 1
        for t in texts:
            if "SLOW-" in t:
                time.sleep(int(t.split("SLOW-")[1].split()[0]) / 10)
        self.finished += 1
        return [" ".join(t.split()[::2]) for t in texts]


# ---- the fake vLLM ------------------------------------------------------------------------------------------


def _answer(user: str, stream: bool) -> bytes:
    words = [hashlib.sha256(f"{user}-{i}".encode()).hexdigest()[:6] for i in range(40)]
    usage = {"prompt_tokens": 100, "completion_tokens": len(words)}
    if not stream:
        return json.dumps({"id": user, "choices": [{"index": 0, "message": {"role": "assistant",
                                                                             "content": " ".join(words)}}],
                           "usage": usage}).encode()
    events = [{"id": user, "choices": [{"index": 0, "delta": {"content": w + " "}}]} for w in words]
    events.append({"id": user, "choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


def fake_vllm(seen: list):
    """A Starlette app: POST /v1/chat/completions as vLLM answers it; X-Fault picks a broken answer."""
    from starlette.applications import Starlette
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def chat(request):
        body = json.loads(await request.body())
        seen.append(body)
        fault, user, stream = request.headers.get("x-fault"), body.get("user", ""), bool(body.get("stream"))
        if fault == "slow":
            await asyncio.sleep(LIMITS.read_timeout_s + 2)
        if fault == "big":  # past the proxy's --max-body-bytes: must come through whole, unchanged
            doc = {"choices": [{"index": 0, "message": {"content": "x" * (LIMITS.max_body_bytes + 1000)}}],
                   "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
            return Response(json.dumps(doc), media_type="application/json")
        data = _answer(user, stream)
        if fault != "cut":
            if stream:
                async def events():
                    for i in range(0, len(data), 300):  # several writes: the proxy relays them as they come
                        yield data[i:i + 300]
                        await asyncio.sleep(0)
                return StreamingResponse(events(), media_type="text/event-stream")
            return Response(data, media_type="application/json")

        async def cut():  # half the answer, then the connection drops (uvicorn closes it on the exception)
            yield data[:len(data) // 2]
            await asyncio.sleep(0.05)
            raise ConnectionAbortedError("scripted cut")
        headers = {} if stream else {"content-length": str(len(data))}
        return StreamingResponse(cut(), headers=headers,
                                 media_type="text/event-stream" if stream else "application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


class Server:
    """uvicorn in a thread, on a port of tests._ports.free_port."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                                    access_log=False, lifespan="off"))
        self.base_url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 20 and self.thread.is_alive(), "the fake vLLM did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


class Garbage:
    """A TCP server that answers every connection with bytes that are not HTTP."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", free_port()))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\nnot http at all\r\n\r\n")

    def __enter__(self):
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.sock.close()


@pytest.fixture(scope="module")
def upstream():
    seen: list = []
    with Server(fake_vllm(seen)) as srv:
        srv.seen = seen
        yield srv


@pytest.fixture(scope="module")
def compressor():
    return FakeCompressor()


@pytest.fixture(scope="module")
def proxy(upstream, compressor):
    logged: list = []
    with Proxy(upstream.base_url, compressor, port=free_port(), timeout_s=5, limits=LIMITS, defaults=Ask(0.5, 10),
               log=logged.append) as p:
        p.logged = logged
        yield p


def request(i: int) -> tuple[dict, dict]:
    """(body, headers) of load request i: streamed or not, a quarter opted in (by field or by header)."""
    prose = " ".join(f"word{j} and more" for j in range(200))
    body = {"model": "fake", "user": f"u{i}", "stream": i % 2 == 0, "max_tokens": 40,
            "messages": [{"role": "user", "content": prose + "\n\nwhich word?"}]}
    headers = {}
    if i % 4 == 1:
        body[FIELD] = {"min_tokens": 10}
    elif i % 4 == 3:
        headers[HEADER] = "on"
    return body, headers


def _comparable(content: bytes, stream: bool) -> bytes:
    """The answer without the proxy's accounting (usage.onespark_compression of a JSON answer)."""
    if stream:
        return content
    doc = json.loads(content)
    doc["usage"].pop("onespark_compression", None)
    return json.dumps(doc).encode()


async def _one(client: httpx.AsyncClient, url: str, i: int) -> tuple[float, httpx.Response]:
    body, headers = request(i)
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
    return time.perf_counter() - t0, r


async def _batch(url: str) -> list[tuple[float, httpx.Response]]:
    async with httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=N)) as client:
        return await asyncio.gather(*(_one(client, url, i) for i in range(N)))


async def _one_by_one(url: str, n: int = 32) -> list[float]:
    async with httpx.AsyncClient(timeout=20) as client:
        return [(await _one(client, url, i))[0] for i in range(n)]


def _pcts(seconds: list[float]) -> str:
    q = statistics.quantiles(seconds, n=100)
    return f"p50 {1000 * q[49]:.1f} ms, p99 {1000 * q[98]:.1f} ms"


async def _idle(port: int) -> float:
    """Connect, send nothing; seconds until the proxy closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(reader.read(), 10)
        return time.perf_counter() - t0
    finally:
        writer.close()


async def _trickle(port: int, head: bytes, body: bytes) -> tuple[float, bytes]:
    """Send `head` at once, then `body` one byte a second: (seconds until the proxy answered and closed, its
    answer, or None when the connection was reset)."""
    # Connect and send the first bytes in one synchronous step: the proxy's header deadline runs from its accept,
    # and on a loaded machine this event loop can resume a coroutine over a second after the kernel connected it,
    # so a first byte sent from the loop could arrive after the deadline (a silent close, rightly, not a 408).
    sock = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    first = head or body[:1]
    sock.sendall(first)
    body = body if head else body[1:]
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)

    async def drip():
        for b in body:
            writer.write(bytes([b]))
            await asyncio.sleep(1)

    dripping = asyncio.ensure_future(drip())
    try:
        answer = await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        answer = None
    try:
        return time.perf_counter() - t0, answer
    finally:
        dripping.cancel()
        writer.close()


async def _counts(proxy) -> tuple[int, int]:
    """(tasks in the proxy's event loop, threads in this process), read in the proxy's loop."""
    async def tasks():
        return len(asyncio.all_tasks())
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(tasks(), proxy.loop)), threading.active_count()


def test_load_slow_clients_and_idle_connections(proxy, upstream, capsys):
    port = int(proxy.base_url.rsplit(":", 1)[1])
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"

    async def main():
        base_tasks, base_threads = await _counts(proxy)
        alone = await _one_by_one(upstream.base_url), await _one_by_one(proxy.base_url)
        direct = await _batch(upstream.base_url)  # the reference, and the latency without the proxy
        idle = [asyncio.ensure_future(_idle(port)) for _ in range(IDLE)]
        slow = [asyncio.ensure_future(_trickle(port, b"", post)) for _ in range(3)]  # headers a byte a second
        slow += [asyncio.ensure_future(_trickle(port, post + b"Content-Length: 50\r\n\r\n", b"{" * 50))
                 for _ in range(SLOW - 3)]  # the body a byte a second
        await asyncio.sleep(0.2)  # all of them held by the proxy before the load starts
        peak = [(base_tasks, base_threads)]

        async def sample():
            while True:
                peak.append(await _counts(proxy))
                await asyncio.sleep(0.05)

        sampler = asyncio.ensure_future(sample())
        via = await _batch(proxy.base_url)
        sampler.cancel()
        idle_s = await asyncio.gather(*idle)
        slow_got = await asyncio.gather(*slow)
        await asyncio.sleep(0.3)
        after = await _counts(proxy)
        return alone, direct, via, idle_s, slow_got, peak, base_tasks, base_threads, after

    alone, direct, via, idle_s, slow_got, peak, base_tasks, base_threads, after = asyncio.run(main())
    for i, ((_, d), (_, v)) in enumerate(zip(direct, via)):
        body, headers = request(i)
        assert d.status_code == v.status_code == 200, (i, v.text[:200])
        asked = FIELD in body or HEADER in headers
        assert v.headers.get(STATUS_HEADER) == ("compressed" if asked else None), (i, dict(v.headers))
        # byte for byte: a stream as it came; a JSON answer less the proxy's accounting (only an opted-in one has it)
        assert (_comparable(v.content, body["stream"]) if asked else v.content) == \
            (_comparable(d.content, body["stream"]) if asked else d.content), i
        assert "onespark-compress" in v.headers["via"]
    # what vLLM got: the opted-in quarter compressed (every other word), the rest as sent, no field
    sent = {b["user"]: b for b in upstream.seen[-N:]}
    for i in range(N):
        body, headers = request(i)
        got = sent[body["user"]]["messages"][0]["content"]
        original = body["messages"][0]["content"]
        assert FIELD not in sent[body["user"]]
        assert got == original if not (FIELD in body or HEADER in headers) else len(got) < 0.6 * len(original)
    # 50 idle connections and the slow clients: each closed near --header-timeout / --body-timeout, not held
    assert max(idle_s) < LIMITS.header_timeout_s + 2, idle_s
    for k, (took, answer) in enumerate(slow_got):
        assert took < LIMITS.header_timeout_s + LIMITS.body_timeout_s + 2, (took, answer[:200])
        if k < 3 or answer is not None:  # a body-timeout's 408 may be lost to a reset: uvicorn closes at once
            assert answer.startswith(b"HTTP/1.1 408") and b'"code": 408' in answer, (k, took, answer[:200])
    # bounded: no thread per connection (120 of them were open at once), tasks per request in flight only
    tasks, threads = max(t for t, _ in peak), max(t for _, t in peak)
    assert threads <= base_threads + 8, (base_threads, threads)
    assert tasks <= base_tasks + 4 * N + 8, (base_tasks, tasks)
    assert after[0] <= base_tasks + 2, (base_tasks, after)
    added = [v - d for (d, _), (v, _) in zip(sorted(direct, key=lambda x: x[0]), sorted(via, key=lambda x: x[0]))]
    with capsys.disabled():  # in the CI log on every run, not only on a failure
        print(f"\nlatency the proxy adds (percentiles of via minus direct; proxy, fake vLLM and clients share this "
              f"process): one request at a time {_pcts([v - d for d, v in zip(sorted(alone[0]), sorted(alone[1]))])} "
              f"(direct {_pcts(alone[0])}); {N} at once, {IDLE} idle and {SLOW} slow connections beside them, a "
              f"quarter compressed: {_pcts(sorted(added))} (direct {_pcts([t for t, _ in direct])})")


# ---- upstream faults ----------------------------------------------------------------------------------------


def _chat(i: int, stream: bool, opted: bool) -> dict:
    body = {"model": "fake", "user": f"f{i}", "stream": stream,
            "messages": [{"role": "user", "content": "one two three four five six\n\nwhich?"}]}
    if opted:
        body[FIELD] = {"min_tokens": 1}
    return body


@pytest.mark.parametrize("opted", [False, True], ids=["plain", "opted-in"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_cut_answer_is_never_served_as_complete(proxy, opted, stream):
    """The old proxy served an opted-in answer cut mid-body as a 200 with a matching Content-Length."""
    with httpx.Client(timeout=10) as c:
        try:
            r = c.post(proxy.base_url + "/v1/chat/completions", json=_chat(1, stream, opted), headers={"x-fault": "cut"})
        except httpx.RemoteProtocolError:  # the client sees the cut: the connection closed before the end
            assert not (opted and not stream), "an opted-in JSON answer is read whole: a cut one is a 502"
            return
    assert opted and not stream, f"a cut answer came as complete: {r.status_code} {r.content[:200]!r}"
    assert r.status_code == 502 and "broke off" in r.json()["error"]["message"], r.text
    assert r.headers[STATUS_HEADER] == "compressed"


def test_an_answer_past_the_limit_comes_whole(proxy):
    """The old proxy cut an opted-in answer over 32 MiB to exactly 32 MiB of invalid JSON, as a 200."""
    r = httpx.post(proxy.base_url + "/v1/chat/completions", json=_chat(2, False, True), headers={"x-fault": "big"},
                   timeout=10)
    assert r.status_code == 200 and len(r.content) > LIMITS.max_body_bytes
    assert r.json()["choices"][0]["message"]["content"] == "x" * (LIMITS.max_body_bytes + 1000)
    assert r.headers[STATUS_HEADER] == "compressed"


def test_upstream_faults_say_what_happened(proxy, upstream, compressor):
    slow = httpx.post(proxy.base_url + "/v1/chat/completions", json=_chat(3, False, False),
                      headers={"x-fault": "slow"}, timeout=10)
    assert slow.status_code == 504 and "sent nothing for 1.5 s" in slow.json()["error"]["message"], slow.text
    with Garbage() as g, Proxy(g.base_url, compressor, port=free_port(), limits=LIMITS, log=lambda m: None) as p:
        r = httpx.post(p.base_url + "/v1/chat/completions", json=_chat(4, False, True), timeout=10)
    err = r.json()["error"]
    assert r.status_code == 502 and "not HTTP" in err["message"] and "is it up" not in err["message"], err
    assert set(err) >= {"message", "type", "code"} and err["code"] == 502
    assert r.headers[STATUS_HEADER] == "compressed"  # what was done to the request is said on any answer
    down = f"http://127.0.0.1:{free_port()}"
    with Proxy(down, None, port=free_port(), limits=LIMITS, log=lambda m: None) as p:
        r = httpx.post(p.base_url + "/v1/chat/completions", json=_chat(5, True, False), timeout=10)
    assert r.status_code == 502 and f"cannot reach vLLM at {down} (" in r.json()["error"]["message"]


# ---- what the old hand-written server got wrong -------------------------------------------------------------


def _raw(proxy, data: bytes, timeout: float = 10) -> bytes:
    """Send bytes, read until the proxy closes the connection."""
    port = int(proxy.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_connection_close_and_http10_end_the_answer(proxy):
    """The old proxy ignored both: a client reading to end-of-file hung."""
    body = json.dumps(_chat(6, False, False)).encode()
    for version, close in ((b"HTTP/1.0", b""), (b"HTTP/1.1", b"Connection: close\r\n")):
        t0 = time.monotonic()
        out = _raw(proxy, b"POST /v1/chat/completions " + version + b"\r\nHost: x\r\n" + close
                   + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert time.monotonic() - t0 < LIMITS.keep_alive_s, version
        head, _, payload = out.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == b"200" and payload == _answer("f6", False), (version, out[:300])


def test_two_content_lengths_and_an_early_413(proxy, upstream):
    """The old proxy took the first of two Content-Length headers, and told a 50 MB upload "100 Continue"
    before its 413."""
    n = len(upstream.seen)
    out = _raw(proxy, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                      b"Content-Length: 40\r\n\r\n{}" + b" " * 38)
    assert out.split(b" ")[1] == b"400", out[:200]
    out = _raw(proxy, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n"
                      b"Expect: 100-continue\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]
    assert json.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == 413
    with httpx.Client(timeout=10) as c:  # chunked, no length: counted as it comes
        r = c.post(proxy.base_url + "/v1/chat/completions", content=iter([b"{" * 100_000] * 4))
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    assert len(upstream.seen) == n


def test_a_busy_compressor_is_a_503_and_its_wait_is_not_compressor_time(upstream):
    """One compression running past --timeout: the requests behind it waited, then went out uncompressed with a
    reason and no compressor time (the old proxy reported the wait as Compressor-Ms, and ran every timed-out
    job later for nobody). The queue full: a 503 that says so."""
    fake = FakeCompressor()
    limits = Limits(**{**vars(LIMITS), "max_compressions": 2})
    with Proxy(upstream.base_url, fake, port=free_port(), timeout_s=1, limits=limits, log=lambda m: None) as p:
        def post(text, user):
            body = {"model": "fake", "user": user, "messages": [{"role": "user", "content": text + "\n\nq?"}],
                    FIELD: {"min_tokens": 1}}
            return httpx.post(p.base_url + "/v1/chat/completions", json=body, timeout=10)

        out = {}
        threads = [threading.Thread(target=lambda: out.__setitem__("slow", post("a b c SLOW-30 d e f", "s")))]
        threads[0].start()
        _until(lambda: p.compressions.held == 1)
        threads.append(threading.Thread(target=lambda: out.__setitem__("queued", post("g h i j k l", "q"))))
        threads[1].start()
        _until(lambda: p.compressions.held == 2)
        busy = post("m n o p", "b")  # two held: the third is refused
        for t in threads:
            t.join(10)
        _until(lambda: fake.finished == 1)  # the slow compression (3 s) ends, though its request gave up at 1 s
        after = post("q r s t u v", "a")  # the worker is free again: compressed at once, no queue of the dead
    assert busy.status_code == 503 and busy.headers[STATUS_HEADER] == "busy" and busy.json()["error"]["code"] == 503
    slow, queued = out["slow"], out["queued"]
    assert slow.headers[STATUS_HEADER] == "timeout" and "ran past --timeout" in slow.headers[REASON_HEADER]
    assert queued.headers[STATUS_HEADER] == "timeout" and "waited" in queued.headers[REASON_HEADER]
    assert float(queued.headers["x-onespark-compressor-ms"]) == 0
    assert after.headers[STATUS_HEADER] == "compressed"  # within --timeout: no queue of dead jobs before it
    assert fake.calls == 2  # the slow one and `after`: the queued one was dropped with its request, never run


def test_a_client_that_left_during_compression_is_not_sent(upstream):
    fake = FakeCompressor()
    with Proxy(upstream.base_url, fake, port=free_port(), timeout_s=5, limits=LIMITS, log=lambda m: None) as p:
        n = len(upstream.seen)
        body = json.dumps({"model": "fake", "user": "gone", FIELD: {"min_tokens": 1},
                           "messages": [{"role": "user", "content": "a b c SLOW-8 d\n\nq?"}]}).encode()
        port = int(p.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                      + body)
            _until(lambda: fake.calls == 1)  # compressing: the client leaves now
        _until(lambda: fake.finished == 1)
        time.sleep(0.3)  # what the old proxy did next: send it
    assert len(upstream.seen) == n, "a request whose client had left was sent to vLLM"


def _until(done, limit: float = 10) -> None:
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < limit, "timed out"
        time.sleep(0.01)
