"""The one harness of the lab benchmarks in lab/: CUDA-graph (or eager) median timing, the device copy
bandwidth, relative error, the GPU's name, and the result file (git SHA, exact command, GPU, torch / Triton
versions, UTC time; written atomically).

Lab scripts import it as a sibling module: `python lab/X.py` puts lab/ on sys.path. It is no part of
the onespark distribution (pyproject ships onespark.bench's own modules only). torch is imported inside the
functions that need it: lab/checkpoint.py runs on a host without torch.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_VERSION = 1


def _load_vllm_tree():
    """tests/_vllm_tree.py, loaded from its file (standard library only; no sys.path edit): a patched vLLM tree is
    built one way, the tests'."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("onespark_vllm_tree", ROOT / "tests" / "_vllm_tree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_vllm_tree = _load_vllm_tree()
diff_targets, apply_diff, patched_vllm = _vllm_tree.diff_targets, _vllm_tree.apply_diff, _vllm_tree.patched_vllm


def median_ms(fn, *, nbuf: int = 1, calls: int | None = None, samples: int = 7, graph: bool = True) -> float:
    """Median ms per call of fn(i), where call r passes i = r % nbuf (a rotating input/output buffer).

    Each of `samples` timed runs issues `calls` calls back to back between two CUDA events, either
    graph=True: captured once into a CUDA graph and replayed, so the time is the device's alone; or
    graph=False: issued from Python, as vLLM calls compute_logits (outside its CUDA graphs), so host launch
    cost counts wherever the GPU waits for it.
    calls=None: as many as fill ~25 ms (at least nbuf, at most 64), sized from one timed call: one event pair
    around a single graph replay reads 10-18 us on an H200 whatever the kernel does, so calls of a few us
    must be timed many to a run. Warm-up (untimed): one call per buffer, then one whole run.
    """
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.Stream()  # warm-up and capture off the default stream, as torch.cuda.graphs asks
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(nbuf):  # compilation, autotuning, cuBLAS handles
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if calls is None:
        start.record()
        fn(0)
        end.record()
        torch.cuda.synchronize()
        calls = int(min(64, max(nbuf, round(25.0 / max(start.elapsed_time(end), 1e-3)))))

    def issue():
        for r in range(calls):
            fn(r % nbuf)

    run = issue
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
            issue()
        torch.cuda.current_stream().wait_stream(stream)
        run = g.replay
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def copy_gbps(nbytes: int = 2 << 30) -> dict[str, float]:
    """Device-to-device copy bandwidth in GB/s, bytes read + written, of an `nbytes` buffer (far beyond any
    L2): by cudaMemcpy (a graph's memcpy node runs on the copy engines: ~2.8 TB/s on an H200) and by an
    elementwise kernel (~4.2 TB/s). A decode kernel's floor is its bytes over the larger of the two."""
    import torch

    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(100):  # ~0.1 s of copies first: the clocks start low on an idle card
        torch.neg(src, out=dst)
    moved = 2 * nbytes
    by = {"memcpy": moved / median_ms(lambda i: dst.copy_(src)) / 1e6,
          "elementwise": moved / median_ms(lambda i: torch.neg(src, out=dst)) / 1e6}
    return {k: round(v, 1) for k, v in by.items()}


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| (Frobenius) in float64; inf when out holds NaN or inf (never a silent NaN)."""
    import torch

    out = out.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    ref = ref.double()
    return float((out - ref).norm() / ref.norm())


def gpu_name() -> str:
    """Short GPU name for file names and the `gpu` field: h200, h100, gb10, ... (else the full name)."""
    import torch

    name = torch.cuda.get_device_name().lower()
    for short in ("h200", "h100", "gb10", "b200", "a100"):
        if short in name:
            return short
    return name.replace(" ", "_")


def git_sha(given: str | None = None) -> str:
    """`given` (--git-sha; the GPU host's copy of the tree may have no .git), else this checkout's HEAD."""
    if given and given != "unknown":
        return given
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def header(sha: str | None = None, *, gpu: bool = True, argv: list[str] | None = None) -> dict:
    """The fields every result file starts with: schema_version, git_sha, the exact command, the UTC date,
    and with gpu=True the GPU (short and full name) and the torch and Triton versions."""
    args = sys.argv[1:] if argv is None else argv
    res = {"schema_version": SCHEMA_VERSION, "git_sha": git_sha(sha),
           "command": shlex.join(["python", sys.argv[0], *args]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if gpu:
        import torch
        import triton

        res.update(gpu=gpu_name(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__)
    return res


def write_result(path, result: dict) -> Path:
    """JSON to `path`, atomically (a temporary file in the same folder, then a rename): a run killed half-way
    leaves the previous file, never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
        json.dump(result, f, indent=1, default=str)
        f.write("\n")
    os.chmod(f.name, 0o644)  # NamedTemporaryFile makes it 0600; a result is for everyone who reads the repo
    os.replace(f.name, path)
    return path
