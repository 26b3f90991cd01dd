"""The CPU lane for Triton kernels: re-run a test file in a child pytest with TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when a kernel is defined (at import), so setting it in this process would
switch every other Triton user in the session to the interpreter too; a child process keeps it contained.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_interpreter_lane(test_file: str, timeout_s: int) -> str:
    """Run `test_file` (all but its interpreter_lane test) under the interpreter; return pytest's output."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "not interpreter_lane"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, f"interpreter lane failed ({' '.join(cmd)}):\n{r.stdout[-8000:]}\n{r.stderr[-3000:]}"
    assert " passed" in r.stdout, r.stdout[-2000:]
    return r.stdout
