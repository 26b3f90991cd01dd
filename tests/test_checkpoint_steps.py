"""steps/0-download.sh, 1-hybrid.sh, 2-mtp.sh: shellcheck-clean, --help, --dry-run, idempotent runs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from onespark.checkpoint.synth import synth

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["steps/0-download.sh", "steps/1-hybrid.sh", "steps/2-mtp.sh"]
ENV = dict(os.environ, ONESPARK_VENV=str(ROOT / ".venv"))


def sh(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck (Debian package shellcheck)")
def test_shellcheck_clean():
    r = sh("shellcheck", "-x", *STEPS, "steps/lib.sh")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", STEPS)
def test_help_exits_0_and_unknown_option_exits_2(script):
    r = sh(script, "--help")
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {script}") and "--dry-run" in r.stdout
    r = sh(script, "--bogus")
    assert r.returncode == 2 and "unknown option: --bogus" in r.stderr


def test_dry_run_prints_and_runs_nothing(tmp_path):
    env = dict(ENV, ONESPARK_VENV=str(tmp_path / "no-venv"), PATH="/usr/bin:/bin")  # no CLI anywhere
    expect = {"steps/0-download.sh": f"+ onespark download --dest {tmp_path}",
              "steps/1-hybrid.sh": f"+ onespark hybrid --int4 {tmp_path}/int4 --fp8 {tmp_path}/fp8 --out {tmp_path}/hybrid",
              "steps/2-mtp.sh": f"+ onespark mtp {tmp_path}/hybrid --source {tmp_path}/int4"}
    for script, line in expect.items():
        r = sh(script, "--work", str(tmp_path), "--dry-run", env=env)
        assert r.returncode == 0, r.stderr
        assert line in r.stdout
    assert list(tmp_path.iterdir()) == [] or [p.name for p in tmp_path.iterdir()] == ["no-venv"]


def test_steps_1_2_run_then_say_already_done(tmp_path):
    synth(tmp_path / "int4", "int4", seed=5)
    synth(tmp_path / "fp8", "fp8", seed=5)
    r = sh("steps/1-hybrid.sh", "--work", str(tmp_path))
    assert r.returncode == 0 and "replaced 12 tensors" in r.stdout, r.stdout + r.stderr
    r = sh("steps/2-mtp.sh", "--work", str(tmp_path), "--full-verify")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr
    r1, r2 = sh("steps/1-hybrid.sh", "--work", str(tmp_path)), sh("steps/2-mtp.sh", "--work", str(tmp_path))
    assert "step 1 already done" in r1.stdout
    assert "step 2 already done" in r2.stdout and r2.returncode == 0


def test_step_1_repairs_a_damaged_output_instead_of_saying_done(tmp_path):
    synth(tmp_path / "int4", "int4", seed=6)
    synth(tmp_path / "fp8", "fp8", seed=6)
    assert sh("steps/1-hybrid.sh", "--work", str(tmp_path)).returncode == 0
    shard = sorted((tmp_path / "hybrid").glob("model-*.safetensors"))[0]
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # truncated, as by a full disk or a killed copy
    r = sh("steps/1-hybrid.sh", "--work", str(tmp_path))
    assert r.returncode == 0 and "step 1 already done" not in r.stdout and "damaged" in r.stdout, r.stdout + r.stderr
    assert shard.read_bytes() == good


def test_step_2_fails_loudly_without_step_1(tmp_path):
    r = sh("steps/2-mtp.sh", "--work", str(tmp_path))
    assert r.returncode == 1 and "run steps/1-hybrid.sh first" in r.stderr
