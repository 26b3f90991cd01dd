"""Issue 12: damaged outputs, OS errors, locks, secrets, strict verify, bench answers of the wrong shape,
no surprise network. Every test here failed before its fix; the references are real files (sha256 of what a
clean run wrote), real permission bits and filesystems, and a real HTTP server standing in for the Hub.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from onespark.checkpoint import MANIFEST_FILE
from onespark.errors import UserError
from onespark.hybrid import hybrid
from onespark.mtp import mtp
from onespark.synth import synth
from onespark.verify import verify

ROOT = Path(__file__).resolve().parents[1]
SHARD = "model-00002-of-00003.safetensors"
EXTRA = "model_extra_tensors.safetensors"


def digest(d: Path, skip=(MANIFEST_FILE,)) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name not in skip}


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onespark", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, **kw)


def one_line_error(r: subprocess.CompletedProcess, command: str) -> str:
    """The last stderr line, asserting it is the CLI's one-line error and no traceback was printed."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"onespark {command}: error: "), r.stderr
    return last


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    synth(d / "int4", "int4", seed=5)
    synth(d / "fp8", "fp8", seed=5)
    return d


@pytest.fixture(scope="module")
def finished(pair, tmp_path_factory):
    """Steps 1 and 2 run cleanly once: the reference every repaired output must equal byte for byte."""
    out = tmp_path_factory.mktemp("finished") / "hy"
    hybrid(pair / "int4", str(pair / "fp8"), out, log=lambda m: None)
    mtp(out, log=lambda m: None)
    assert verify(out)[0] == []
    return out


def _clone(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


# ---- item 2: a damaged step-1 output is never "already done" -----------------------------------------------

@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_damaged_hybrid_output_is_repaired_not_already_done(pair, finished, tmp_path, damage):
    out = _clone(finished, tmp_path / "hy")
    want = digest(finished)
    if damage == "delete":
        (out / SHARD).unlink()
    else:
        data = (out / SHARD).read_bytes()
        (out / SHARD).write_bytes(data[: len(data) // 2])
    # verify and mtp name step 1 (the step that makes the file), not "download it again"
    with pytest.raises(UserError, match=r"step 1 wrote it: re-run step 1") as e:
        verify(out)
    assert "download" not in str(e.value)
    with pytest.raises(UserError, match=r"step 1 wrote it: re-run step 1"):
        mtp(out, log=lambda m: None)
    logs: list[str] = []
    hybrid(pair / "int4", str(pair / "fp8"), out, log=logs.append)
    assert not any("already done" in m for m in logs), logs
    assert any("step 1 output damaged" in m and SHARD in m for m in logs), logs
    assert digest(out) == want  # byte-identical to the clean run, index with step 2's mtp.* entries included
    assert verify(out)[0] == []
    man = json.loads((out / MANIFEST_FILE).read_text())
    assert "mtp" in man["steps"]  # step 2's record survives: its index was intact and kept
    logs.clear()
    hybrid(pair / "int4", str(pair / "fp8"), out, log=logs.append)
    assert any("step 1 already done" in m for m in logs), logs


def test_damaged_index_is_rewritten_and_step_2_is_asked_for(pair, finished, tmp_path):
    out = _clone(finished, tmp_path / "hy")
    (out / "model.safetensors.index.json").write_text("{")
    logs: list[str] = []
    hybrid(pair / "int4", str(pair / "fp8"), out, log=logs.append)
    assert any("run step 2 again" in m for m in logs), logs
    mtp(out, log=lambda m: None)
    assert digest(out) == digest(finished)
    assert verify(out)[0] == []


# ---- item 3: `mtp --source` restores the head's file deleted after step 2 ------------------------------------

def test_mtp_source_restores_extra_file_deleted_after_step_2(pair, finished, tmp_path):
    out = _clone(finished, tmp_path / "hy")
    (out / EXTRA).unlink()  # the index (step 2) lists the 785-style mtp.* tensors in it
    r = cli("mtp", str(out), "--source", str(pair / "int4"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"copying {EXTRA}" in r.stdout
    assert (out / EXTRA).read_bytes() == (pair / "int4" / EXTRA).read_bytes()
    assert digest(out) == digest(finished)
    assert verify(out)[0] == []  # the manifest's entry for the copied file matches again
