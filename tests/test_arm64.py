"""The arm64 lane's parts that run without Docker or emulation (the lane itself: tests/arm64.sh, its committed result
bench/results/arm64_images.json, checked here against the code it measured)."""

from __future__ import annotations

import ctypes
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import arm64_check, arm64_lane

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "arm64_images.json"


def test_lock_entries_are_the_locks_pins():
    text = arm64_lane.LOCK.read_text()
    entries = arm64_check.lock_entries(text)
    pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", text, re.M)
    assert len(entries) == len(pins) > 150
    assert "vllm==0.32.0" in entries and all("--hash" not in e and "\\" not in e for e in entries)
    assert any(e.startswith("torch==2.13.0") for e in entries)


def _lock_of(tmp_path: Path, *names: str) -> Path:
    lines = []
    for name in names:
        lines += [f"{name}=={md.version(name)} ; sys_platform == 'linux' \\", "    --hash=sha256:" + "0" * 64]
    lines += ["nosuch-package==1.0 ; sys_platform == 'win32' \\", "    --hash=sha256:" + "1" * 64]  # not for here
    (tmp_path / "lock.txt").write_text("# header\n" + "\n".join(lines) + "\n")
    return tmp_path / "lock.txt"


def test_the_lock_check_passes_pure_python_wheels_and_names_a_wheel_of_another_platform(tmp_path, monkeypatch):
    """In this venv (uv installed it: INSTALLER uv) pure-Python wheels pass as they would on arm64; torch's wheel here
    is x86_64, which the check must name, as it would name one in an arm64 image."""
    monkeypatch.setattr(arm64_check, "LOCK", _lock_of(tmp_path, "pytest", "pluggy"))
    assert "2 lock entries installed for aarch64" in arm64_check.check_lock()
    monkeypatch.setattr(arm64_check, "LOCK", _lock_of(tmp_path, "pytest", "torch"))
    with pytest.raises(arm64_check.Failed, match=r"torch: wheel tags \[.*x86_64.*\], not aarch64"):
        arm64_check.check_lock()


def test_the_lock_check_names_a_missing_or_other_version(tmp_path, monkeypatch):
    lock = _lock_of(tmp_path, "pytest")
    lock.write_text(lock.read_text().replace(f"pytest=={md.version('pytest')}", "pytest==0.0.1")
                    + "no-such-dist==2.0 \\\n    --hash=sha256:" + "2" * 64 + "\n")
    monkeypatch.setattr(arm64_check, "LOCK", lock)
    with pytest.raises(arm64_check.Failed) as e:
        arm64_check.check_lock()
    assert f"pytest is {md.version('pytest')}, the lock says 0.0.1" in str(e.value)
    assert "no-such-dist==2.0 missing" in str(e.value)


def test_module_names_of_extension_files():
    site = Path("/site")
    assert arm64_check._module_name(site / "vllm/_C_stable_libtorch.abi3.so", site) == "vllm._C_stable_libtorch"
    assert arm64_check._module_name(site / "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", site) == \
        "vllm.vllm_flash_attn._vllm_fa3_C"
    assert arm64_check._module_name(site / "vllm/x/_y.cpython-311-aarch64-linux-gnu.so", site) == "vllm.x._y"


def test_an_unknown_check_is_one_line():
    r = subprocess.run([sys.executable, "tests/arm64_check.py", "lock", "nosuch"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1 and "nosuch" in r.stderr


@pytest.mark.parametrize("model, name", [("qwen3.5-122b-a10b", "qwen3.5-122b-a10b"), ("qwen3.5-35b-a3b", "qwen3.5-35b-a3b")])
def test_the_serving_arguments_are_serves_own(model, name):
    """What the lane hands each image's entrypoint is `onespark serve`'s docker run, from the image on."""
    argv = arm64_lane.serving_argv(model, arm64_lane.V2)
    at = argv.index(arm64_lane.V2)
    assert all(a == "-e" or "=" in a for a in argv[:at]) and "--gpus" not in argv
    assert argv[at + 1:][argv[at + 1:].index("--served-model-name") + 1] == name


def test_the_driver_stub_exports_what_vllms_arm64_modules_link(tmp_path):
    """demo/cuda_stub.py on the CUDA 13.0 header of the test venv's toolkit wheels (the stand-in's own pins): the
    driver entry points vLLM 0.32.0's aarch64 modules leave undefined (read from that wheel with nm -D) are exported,
    and a call answers CUDA_ERROR_STUB_LIBRARY as NVIDIA's stub does."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    import sysconfig

    toolkit = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13"
    if not (toolkit / "include" / "cuda.h").is_file():
        pytest.fail(f"no cuda.h under {toolkit}: tests/requirements.txt installs nvidia-cuda-runtime")
    home = tmp_path / "cuda"
    home.mkdir()
    (home / "include").symlink_to(toolkit / "include")
    r = subprocess.run([sys.executable, str(ROOT / "demo" / "cuda_stub.py"), str(home)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    stub = home / "lib64" / "stubs" / "libcuda.so"
    exported = subprocess.run(["nm", "-D", "--defined-only", str(stub)], capture_output=True, text=True).stdout
    for sym in ("cuGetProcAddress_v2", "cuPointerGetAttribute", "cuTensorMapEncodeTiled", "cuMemCreate",
                "cuMemAddressReserve", "cuMemMap", "cuInit", "cuMemAlloc_v2", "cuMemAlloc"):
        assert re.search(rf" T {sym}$", exported, re.M), sym
    assert "SONAME" in subprocess.run(["readelf", "-d", str(stub)], capture_output=True, text=True).stdout
    assert ctypes.CDLL(str(stub)).cuInit(0) == 34  # CUDA_ERROR_STUB_LIBRARY


def test_the_stand_in_toolkit_is_the_test_lanes_nvcc_by_hash():
    """demo/cuda-standin.txt pins the CUDA 13.0 toolkit wheels the CPU lane compiles with (tests/requirements.txt), each
    with sha256s for pip's --require-hashes."""
    standin = (ROOT / "demo" / "cuda-standin.txt").read_text()
    pins = dict(re.findall(r"^(nvidia-[a-z-]+)==(\S+) ", standin, re.M))
    lane = dict(re.findall(r"^(nvidia-[a-z-]+)==(\S+)", (ROOT / "tests" / "requirements.txt").read_text(), re.M))
    assert pins and pins == {k: lane[k] for k in pins}, (pins, lane)
    for block in re.split(r"\n(?=nvidia-)", standin.split("\nnvidia-", 1)[1]):
        assert "--hash=sha256:" in block, block


def test_the_index_holds_the_result_to_the_lanes_inputs():
    """bench/results/INDEX.md's staleness rule for this result (docs/generate.py MEASURES) names the lane's inputs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("onespark_docs_generate", ROOT / "docs" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.measures("arm64_images.json")[1] == arm64_lane.INPUTS


def test_the_committed_result_passed_at_the_code_it_measured():
    """bench/results/arm64_images.json: every stage built or reused, every check passed, on a clean tree, and nothing
    the images are built from changed since its commit (else run tests/arm64.sh again and commit its result)."""
    if not RESULT.is_file():
        pytest.fail(f"{RESULT.relative_to(ROOT)} missing: run tests/arm64.sh and commit its result")
    result = json.loads(RESULT.read_text())
    assert result["ok"] and not result["dirty"] and all(c["ok"] is not False for c in result["checks"])
    # a check that cannot run without the driver is named, with why: never counted as a pass
    assert all(c["detail"] for c in result["checks"] if c["ok"] is None)
    assert result["needs_driver"] == [f"{c['image']}: {c['check']}" for c in result["checks"] if c["ok"] is None]
    assert [s["stage"] for s in result["stages"]] == ["rootfs", "stand-in", "base", "v2", "v2-tq"]
    # the Spark's three stages were built in this run: their seconds are build times under emulation
    assert all(s["built"] and s["seconds"] > 0 for s in result["stages"][2:]), result["stages"]
    # the image's nvcc built every launch of the CUDA decode kernel for sm_121 with no spill
    kernels = next(c["detail"] for c in result["checks"] if c["check"] == "kernels")
    assert len(re.findall(r"sm_121 \S+: \d+ registers, 0 B spilled", kernels)) == 8, kernels
    inputs = [p for p in arm64_lane.INPUTS if (ROOT / p).exists()]
    r = subprocess.run(["git", "diff", "--stat", result["commit"], "HEAD", "--", *inputs], cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode != 0 and "unknown revision" in r.stderr:
        pytest.skip(f"commit {result['commit'][:12]} not in this clone (shallow?)")
    assert r.returncode == 0 and r.stdout == "", f"changed since the lane ran at {result['commit'][:12]}:\n{r.stdout}"
