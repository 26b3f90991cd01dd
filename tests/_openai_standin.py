"""A scripted stand-in for an OpenAI-compatible server (stdlib http.server in a thread), for answers a real
vLLM never gives: a JSON list where an object belongs, strings for numbers, a non-JSON /v1/models.

    with StandIn(models=..., answers=["ok", "list", "ok"]) as srv:   # one answer kind per chat request, in turn
        srv.base_url, srv.requests (path of every request), srv.auth (every Authorization header),
        srv.bodies (the raw body of every POST)

`metrics`: the texts GET /metrics answers, one per request in turn, the last one repeated (None: 404, as a
server without it); `tokenize`: the body POST /tokenize answers.

Answer kinds for POST /v1/chat/completions (streamed with usage, as vLLM streams; a request with stream false
gets one JSON answer without logprobs, of the same kind: ok, list, strnum or garbage):
  ok       3 text chunks, then a usage chunk {"prompt_tokens": 5, "completion_tokens": 3}, then [DONE]
  list     a chunk that is a JSON list
  strnum   the usage chunk carries strings: {"completion_tokens": "3"}
  choices  a chunk whose "choices" is a string
  garbage  a chunk that is not JSON
  huge     the usage chunk says 10**400 completion tokens (valid JSON, past any float)
  hang     no answer until the stand-in closes (`hung` is set once such a request arrived)
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODELS_OK = json.dumps({"object": "list", "data": [{"id": "standin", "max_model_len": 4096}]})


class StandIn:
    def __init__(self, models: str = MODELS_OK, answers: list[str] | None = None, metrics: list[str] | None = None,
                 tokenize: str = '{"count": 5}'):
        self.models, self.answers = models, list(answers or ["ok"])
        self.metrics, self.tokenize = metrics, tokenize
        self._metrics_served = 0
        self.requests: list[str] = []
        self.auth: list[str | None] = []
        self.bodies: list[bytes] = []
        self._chat = 0
        self._lock = threading.Lock()
        self.hung, self._closing = threading.Event(), threading.Event()
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: the body ends when the socket closes

            def log_message(self, *a):  # quiet
                pass

            def _send(self, status: int, body: str, ctype: str = "application/json") -> None:
                raw = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                srv._seen(self)
                if self.path == "/v1/models":
                    self._send(200, srv.models)
                elif self.path == "/version":
                    self._send(200, json.dumps({"version": "standin"}))
                elif self.path == "/metrics" and srv.metrics:
                    with srv._lock:
                        text = srv.metrics[min(srv._metrics_served, len(srv.metrics) - 1)]
                        srv._metrics_served += 1
                    self._send(200, text, "text/plain; version=0.0.4")
                else:
                    self._send(404, "{}")

            def do_POST(self):
                srv._seen(self)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with srv._lock:
                    srv.bodies.append(raw)
                try:
                    body = json.loads(raw or b"{}")
                except (ValueError, RecursionError):  # as vLLM answers a body that is not JSON
                    self._send(400, json.dumps({"error": {"message": "not JSON", "code": 400}}))
                    return
                if self.path == "/tokenize":
                    self._send(200, srv.tokenize)
                    return
                if self.path != "/v1/chat/completions":
                    self._send(404, "{}")
                    return
                with srv._lock:
                    kind = srv.answers[srv._chat % len(srv.answers)]
                    srv._chat += 1
                if kind == "hang":
                    srv.hung.set()
                    srv._closing.wait(60)
                    return
                if not body.get("stream"):  # one JSON answer, no logprobs (as a server started without them)
                    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi hi hi"}}],
                              "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
                    text = {"list": json.dumps([answer]), "garbage": "<html>bad gateway</html>",
                            "strnum": json.dumps({**answer, "usage": {"prompt_tokens": 5, "completion_tokens": "3"}}),
                            "huge": json.dumps({**answer, "usage": {"prompt_tokens": 5, "completion_tokens": 10**400}}),
                            }.get(kind, json.dumps(answer))
                    self._send(200, text)
                    return
                chunk = {"choices": [{"index": 0, "delta": {"content": "hi "}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
                events = [json.dumps(chunk)] * 3
                usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
                if kind == "list":
                    events[1] = json.dumps([chunk])
                elif kind == "strnum":
                    usage["usage"] = {"prompt_tokens": "5", "completion_tokens": "3"}
                elif kind == "choices":
                    events[1] = json.dumps({"choices": "hi"})
                elif kind == "garbage":
                    events[1] = "<html>bad gateway</html>"
                elif kind == "huge":
                    usage["usage"] = {"prompt_tokens": 5, "completion_tokens": 10**400}
                events.append(json.dumps(usage))
                body = "".join(f"data: {e}\n\n" for e in events) + "data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(body.encode())

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _seen(self, h: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self.requests.append(h.path)
            self.auth.append(h.headers.get("Authorization"))

    def __enter__(self) -> StandIn:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
