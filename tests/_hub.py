"""A local stand-in for the Hugging Face Hub: nginx serving published repos (files at resolve/REV/, the
tree listing at api/models/REPO/tree/REV), and the environment that points huggingface_hub at it.
Shared by tests/test_download.py (step 0), tests/test_dflash.py (the drafter fetch) and tests/test_reliability.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests._ports import free_port

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
NEEDS_NGINX = "needs nginx (Debian package nginx; .ci/apt-packages.txt)"

NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections 64; }}
http {{
  log_format hub '$request_method $uri $status $body_bytes_sent "$http_range"';
  access_log {d}/access.log hub;
  client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp;
  uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;
  types {{ application/json json; }}
  default_type application/octet-stream;
  server {{
    listen 127.0.0.1:{port};
    root {d}/www;
    # a gated repo asked without a token, as the Hub answers it (files and the API alike)
    location ~ ^/(api/models/)?Gated/ {{ return 401; }}
    location /api/ {{ default_type application/json; }}
    location ~ ^/Slow/[^/]+/resolve/(?<srev>[^/]+)/ {{ add_header X-Repo-Commit $srev always; limit_rate 1m; }}
    location ~ ^/[^/]+/[^/]+/resolve/(?<rev>[^/]+)/ {{ add_header X-Repo-Commit $rev always; }}
  }}
}}
"""


def publish(www: Path, repo: str, sha: str, src: Path) -> None:
    """Every file of `src` as `repo` at commit `sha` (the listing folder is made once per call)."""
    base = www / repo / "resolve" / sha
    base.mkdir(parents=True)
    tree = []
    for p in sorted(src.iterdir()):
        if p.name == ".onespark.lock":  # the lock synth held while writing `src`: no part of a Hub repo
            continue
        shutil.copy(p, base / p.name)
        tree.append({"type": "file", "path": p.name, "size": p.stat().st_size,
                     "oid": hashlib.sha1(p.read_bytes()).hexdigest()})
    api = www / "api" / "models" / repo / "tree"
    api.mkdir(parents=True)
    (api / sha).write_text(json.dumps(tree))


@contextlib.contextmanager
def serve(d: Path):
    """nginx serving d/www on a free port, its access log at d/access.log; yields the endpoint URL."""
    (d / "tmp").mkdir()
    port = free_port()
    (d / "nginx.conf").write_text(NGINX_CONF.format(d=d, port=port))
    proc = subprocess.Popen([NGINX, "-p", str(d), "-c", str(d / "nginx.conf")], stderr=subprocess.PIPE)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail(f"nginx did not start: {proc.stderr.read().decode()}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def hub_env(endpoint: str, tmp: Path) -> dict:
    """huggingface_hub pointed at `endpoint`, with its own cache under `tmp`, no token, no Xet, no proxy."""
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=str(tmp / "hf-home"), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="0", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    env.pop("HF_TOKEN", None)
    return env
