"""`python3 -m onespark ...` from a checkout that is not installed for that Python: one line that says how to
install, exit 1, never a traceback (issue 25). `python -S` stands in for such a Python: no site-packages, so
neither the dependencies (httpx, ...) nor the install's package-dir mapping (onespark.bench) are there, while
`-m` still finds the checkout's onespark/ from the working directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, site: bool = False) -> subprocess.CompletedProcess:
    flags = [] if site else ["-S"]
    return subprocess.run([sys.executable, *flags, "-m", "onespark", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("argv", [["bench", "--help"], ["download", "--dest", "/nonexistent/x"]],
                         ids=lambda a: a[0])
def test_uninstalled_checkout_says_how_to_install(argv):
    r = _run(*argv)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("onespark: No module named ") and "pip install -e " in lines[0], lines[0]


def test_uninstalled_checkout_still_runs_what_needs_no_install():
    r = _run("specs")  # the standard library is all `onespark specs` needs
    assert r.returncode == 0, r.stderr
    assert "qwen3.5-122b-a10b" in r.stdout


def test_installed_runs_as_before():
    r = _run("bench", "--help", site=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: onespark bench")
