"""The one launch path of `onespark serve` (one Spark) and `onespark cluster` (two, through Ray): the
container's docker-run flags, the port probe, the wait for /health and the smoke request.

Standard library only at module level: install.sh --dry-run runs serve and cluster with the system python3
before the venv exists; httpx is imported by the one function that sends a request (a dry run sends none).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping

from onespark import options
from onespark.errors import UserError, check_key_pair, plain_key, read_secret
from onespark.serving import memory
from onespark.serving.vllm_log import detect_stage

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
NOT_VLLM = "not what vLLM answers: is another server on that port? The server's log says more"


def probe_host(host: str) -> str:
    """Where this machine reaches a server that binds `host`: a wildcard bind answers on loopback."""
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def url(scheme: str, host: str, port: int) -> str:
    """SCHEME://HOST:PORT, an IPv6 address in brackets (http://::1:8000 is no URL: httpx raises InvalidURL, curl
    refuses it)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def base_url(host: str, port: int) -> str:
    """http://HOST:PORT where this machine reaches a server that binds `host`."""
    return url("http", probe_host(host), port)


KEY_ENV = "ONESPARK_API_KEY"


def add_key_arguments(p: argparse.ArgumentParser) -> None:
    """The API key's two flags, as serve and cluster take them (api_key reads them)."""
    p.add_argument("--api-key", default=os.environ.get(KEY_ENV),
                   help="require this key on /v1 (default: $ONESPARK_API_KEY; none); visible in `ps`: prefer "
                        "--api-key-file or the variable")
    p.add_argument("--api-key-file", help="read the key from this file (first line)")


def api_key(args: argparse.Namespace) -> str | None:
    """The key of add_key_arguments' flags: --api-key-file's first line, else --api-key, else $ONESPARK_API_KEY
    (--api-key's default). Both flags at once are refused, as bench refuses them; the variable beside the file is
    no conflict (the file wins, as in bench)."""
    given = args.api_key if args.api_key != os.environ.get(KEY_ENV) else None  # the default is no choice
    check_key_pair(given, args.api_key_file, "--api-key")
    if args.api_key_file:
        return read_secret(args.api_key_file, "--api-key-file")
    return plain_key(args.api_key, f"--api-key (or ${KEY_ENV})")


def warn_if_exposed(prog: str, host: str, api_key: str | None) -> None:
    if host not in LOCAL_HOSTS and not api_key:
        print(f"{prog}: warning: --host {host} exposes the server beyond this machine without an API key; "
              "pass --api-key", file=sys.stderr)


# A Docker named volume at the container's ~/.cache: what a start compiles (vLLM's torch.compile artifacts, Triton
# kernels and autotuning results, FlashInfer's JIT for sm_121a: the images point each there) is kept for the next
# container, which every `onespark serve` and `--replace` is; without it each start compiles all of it again.
# `docker volume rm onespark-cache` clears it; every cache keys its entries by code and configuration.
CACHE_VOLUME = "onespark-cache"
CACHE_DIR = "/root/.cache"


def container_flags(name: str, model: str, *, mounts: tuple[str, ...] = (), gpu: bool = True,
                    cache_volume: str | None = CACHE_VOLUME) -> list[str]:
    """`docker run -d` of a serving container, up to its own extras, environment and image."""
    cache = ("-v", f"{cache_volume}:{CACHE_DIR}") if cache_volume else ()
    cmd = ["docker", "run", "-d", "--name", name, "--network", "host", "-v", f"{model}:/model:ro", *cache, *mounts,
           # Out of memory, the kernel kills the container first, not sshd; and why there is no --memory limit:
           # memory.OOM_SCORE_ADJ's comment.
           "--oom-score-adj", str(memory.OOM_SCORE_ADJ)]
    if gpu:
        # Unified memory: --ipc host for PyTorch's shared memory; unlimited locked memory for NCCL/UCX.
        cmd += ["--gpus", "all", "--ipc", "host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]
    return cmd


def env_flags(env: Mapping[str, str]) -> list[str]:
    """`-e` flags. A secret (the key, --env HF_TOKEN=...) goes by name: docker copies its value from its own
    environment (the caller passes it to the child), so it is never printed and never on an argv `ps` shows."""
    out: list[str] = []
    for k, v in env.items():
        out += ["-e", k if options.is_secret_name(k) else f"{k}={v}"]
    return out


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def http(url: str, body: dict | None = None, api_key: str | None = None, timeout: float = 10) -> tuple[int, bytes]:
    import httpx  # here, not at the top: see the module's docstring

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        if body is None:
            r = httpx.get(url, headers=headers, timeout=timeout)
        else:
            r = httpx.post(url, content=json.dumps(body).encode(), headers=headers, timeout=timeout)
        return r.status_code, r.content
    except (httpx.HTTPError, OSError):  # not up yet, refused, timed out: the callers poll or say what they asked
        return 0, b""


# (seconds waited) -> (the server's log so far, why it stopped or None while it runs)
Poll = Callable[[float], tuple[str, "str | None"]]


def wait_healthy(base_url: str, timeout: float, *, prog: str, poll: Poll, after_timeout: Callable[[str], str],
                 tty: bool, first: str, interval: float = 2) -> None:
    """Until /health answers 200: a progress line naming the start-up stage read from the log (rewritten in
    place on a terminal, one line per stage in a log file); UserError when poll says the server stopped, or
    after `timeout` s with after_timeout(log) saying what is left running."""
    t0 = time.monotonic()
    last_stage = None
    while True:
        elapsed = time.monotonic() - t0
        status, _ = http(f"{base_url}/health", timeout=5)
        if status == 200:
            if tty:
                print(flush=True)
            print(f"{prog}: healthy after {elapsed:.0f} s")
            return
        log, stopped = poll(elapsed)
        if stopped is not None:
            if tty:
                print(flush=True)
            raise UserError(stopped)
        if elapsed > timeout:
            if tty:
                print(flush=True)
            raise UserError(f"/health not green after {timeout:.0f} s (stage: {detect_stage(log) or 'unknown'}); "
                            + after_timeout(log))
        stage = detect_stage(log) or first
        line = f"[{elapsed:5.0f} s] {stage}"
        if tty:
            print(f"\r{line:<70}", end="", flush=True)
        elif stage != last_stage:
            print(line, flush=True)
        last_stage = stage
        time.sleep(interval)


def _json_answer(body: bytes, what: str):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested past Python's stack
        raise UserError(f"{what} is not JSON (it starts {body[:80]!r}): {NOT_VLLM}") from None


def smoke(base_url: str, prompt: str, max_tokens: int, api_key: str | None) -> dict:
    """One chat request to the first model /v1/models lists; every answer checked for the fields read."""
    status, body = http(f"{base_url}/v1/models", api_key=api_key)
    if status != 200:
        raise UserError(f"GET /v1/models answered HTTP {status}: {body[:300]!r}")
    doc = _json_answer(body, "GET /v1/models")
    cards = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(cards, list) or not cards:
        raise UserError(f"GET /v1/models lists no model (it answered {body[:120]!r}): {NOT_VLLM}")
    model = cards[0].get("id") if isinstance(cards[0], dict) else None
    if not isinstance(model, str) or not model:
        raise UserError(f"GET /v1/models: the first model card has no id ({str(cards[0])[:120]!r}): {NOT_VLLM}")
    request = {"model": model, "messages": [{"role": "user", "content": prompt}],
               "max_tokens": max_tokens, "temperature": 0}
    t0 = time.monotonic()
    status, body = http(f"{base_url}/v1/chat/completions", request, api_key=api_key, timeout=600)
    elapsed = time.monotonic() - t0
    if status != 200:
        raise UserError(f"the chat request answered HTTP {status}: {body[:500]!r}")
    reply = _json_answer(body, "the chat answer")
    try:
        message = reply["choices"][0]["message"]
        answer = message.get("content") or message.get("reasoning_content") or ""
        tokens = reply["usage"]["completion_tokens"]
    except (KeyError, IndexError, TypeError, AttributeError):
        answer, tokens = None, None
    if not isinstance(answer, str) or type(tokens) is not int or tokens < 0:
        raise UserError(f"the chat answer has no choices[0].message text or usage.completion_tokens (it answered "
                        f"{body[:120]!r}): {NOT_VLLM}")
    return {
        "model": model,
        "answer": answer,
        "completion_tokens": tokens,
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed if elapsed > 0 else 0.0,
    }


def print_smoke(prog: str, base_url: str, prompt: str, max_tokens: int, api_key: str | None, how: str) -> None:
    """The smoke request and its two lines; `how` says what the rate covers."""
    r = smoke(base_url, prompt, max_tokens, api_key)
    print(f"{prog}: {r['model']} answered {prompt!r}:\n  {r['answer'].strip()!r}")
    print(f"{prog}: {r['completion_tokens']} tokens in {r['seconds']:.2f} s = {r['tok_per_s']:.1f} tok/s ({how})")
