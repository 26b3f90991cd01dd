"""Make the minimal vLLM stand-in that the GPU lane needs for the TurboQuant backend's CUDA test.

The H200 host has torch and Triton but no vLLM; the backend imports only vLLM 0.19.1's
`vllm/v1/attention/backend.py` (which reaches `vllm.distributed.parallel_state` for context-parallel sizes).
Run here, where the test venv has vLLM 0.19.1, then carry the folder to the GPU host:

    .venv/bin/python tests/gpu_lane_stub.py .gpustub        # .gpustub is git-ignored via .git/info/exclude
    # on the GPU host: tests/gpu.sh installs onespark into a scratch folder and puts .gpustub on PYTHONPATH
    tests/gpu.sh --tests-only
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

PARALLEL_STATE = '''# GPU-lane stand-in: no distributed state, as in vLLM's unit tests (backend.py catches the AssertionError)
def get_dcp_group():
    raise AssertionError("decode context parallel group is not initialized")


def get_pcp_group():
    raise AssertionError("prefill context parallel group is not initialized")
'''


def main(out: Path) -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("gpu_lane_stub: vLLM is not installed here; run it with the test venv (.venv/bin/python)")
    src = Path(next(iter(spec.submodule_search_locations))) / "v1" / "attention" / "backend.py"
    pkg = out / "vllm"
    for sub in ("", "v1", "v1/attention", "distributed"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").touch()
    shutil.copyfile(src, pkg / "v1" / "attention" / "backend.py")
    (pkg / "distributed" / "parallel_state.py").write_text(PARALLEL_STATE)
    print(f"gpu_lane_stub: wrote {pkg} (backend.py from {src})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    main(Path(sys.argv[1]))
