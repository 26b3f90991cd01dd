"""The lab scripts in bench/lab/ (no part of the distribution; their GPU runs are tests/gpu.sh's) on CPU: each
one starts as the GPU lane starts it (`python bench/lab/X.py`: onespark from the installed package, the harness
as a sibling module) and prints its usage; the harness's result file and relative error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LAB = Path(__file__).resolve().parents[1] / "bench" / "lab"
sys.path.insert(0, str(LAB))  # the harness is a lab module, imported here as the lab scripts import it
import harness

SCRIPTS = sorted(p.name for p in LAB.glob("*.py") if p.name != "harness.py")


def test_the_lab_holds_the_benchmarks():
    assert SCRIPTS == ["checkpoint.py", "draft_head.py", "lm_head.py", "lm_head_glue.py", "turboquant.py",
                       "turboquant_quality.py", "vllm_step.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_lab_script_starts(script):
    r = subprocess.run([sys.executable, str(LAB / script), "--help"], cwd=LAB.parents[1], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, f"{script} --help failed:\n{r.stdout}{r.stderr[-3000:]}"


def test_result_file_is_written_whole_with_its_header(tmp_path):
    path = tmp_path / "sub" / "r.json"
    res = harness.header("abc123", gpu=False, argv=["--out", "a b"]) | {"rows": [1]}
    assert harness.write_result(path, res) == path
    got = json.loads(path.read_text())
    assert got["git_sha"] == "abc123" and got["schema_version"] == harness.SCHEMA_VERSION and got["rows"] == [1]
    assert got["command"].endswith("--out 'a b'") and got["date"].endswith("Z")
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o644  # not the temporary file's 0600


def test_rel_err_is_frobenius_and_never_a_silent_nan():
    assert harness.rel_err(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0])) == 4 / 3
    assert harness.rel_err(torch.tensor([float("nan"), 1.0]), torch.ones(2)) == float("inf")
