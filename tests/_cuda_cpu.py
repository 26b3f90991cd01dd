"""The CUDA TurboQuant decode kernel's source (kernels/turboquant_decode.cuh, or a variant of it) run on the CPU:
g++ builds it against tests/cuda_cpu/shim.h (each CTA's threads as fibers; mma.sync, ldmatrix, prmt, cp.async,
named barriers and shuffles emulated from the PTX ISA), and `decode_attention` mirrors
kernels/turboquant_cuda.decode_attention: the same Params, workspace and merge (in torch here). Slow (a few
seconds per small case) and blind to timing, but it checks a kernel's indexing, fragment layouts and barriers
against float64 where no GPU is lent (tests/test_turboquant_cuda_cpu.py)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_triton as tt

HERE = Path(__file__).resolve().parent / "cuda_cpu"
REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "kernels" / "turboquant_decode.cuh"
# The header's helpers that hold inline PTX: shim.h defines each for the CPU.
PTX_HELPERS = ("prmt", "mma", "ldsm4", "cp_async", "cp_commit", "cp_wait", "bar_arrive", "bar_sync", "smid")


# Candidate diffs that change the header: the CUDA kernel's own, and the merge candidates that touch it too (their
# other files are the Triton side, checked in tests/test_turboquant_triton.py).
LAB = REPO / "lab"
HEADER_CANDIDATES = sorted([*(LAB / "turboquant_cuda_candidates").glob("*.diff"),
                            *(d for d in (LAB / "turboquant_merge_candidates").glob("*.diff")
                              if f"+++ b/kernels/{HEADER.name}" in d.read_text())])


def patched_header(diffs: list[Path], work: Path) -> str:
    """kernels/turboquant_decode.cuh with `diffs` applied in order (`git apply` of their hunks for it on a copy in
    work/kernels/, which tests/test_kernels_compile_cuda.py compiles from), as the candidate and diagnostic diffs
    are taken everywhere; ValueError naming the diff that does not apply."""
    (work / "kernels").mkdir(parents=True, exist_ok=True)
    (work / "kernels" / HEADER.name).write_bytes(HEADER.read_bytes())
    for diff in diffs:
        r = subprocess.run(["git", "apply", f"--include=kernels/{HEADER.name}", str(Path(diff).resolve())], cwd=work,
                           capture_output=True, text=True, timeout=60)
        if r.returncode:
            raise ValueError(f"{Path(diff).name} does not apply to kernels/{HEADER.name}: {r.stderr.strip()}")
    return (work / "kernels" / HEADER.name).read_text()


def cpu_source(header_text: str) -> str:
    """The header as the CPU build takes it: no CUDA includes, no inline-PTX helpers, the dynamic shared memory
    from the fiber scheduler."""
    text = re.sub(r"#include <cuda_(bf16|fp16)\.h>\n", "", header_text)
    text, n = re.subn(r"extern __shared__ __align__\(16\) uint8_t (\w+)\[\];",
                      r"uint8_t* \1 = sim::cta().smem.data();", text)
    if n != 1:
        raise ValueError("the header declares its dynamic shared memory other than as expected")
    for name in PTX_HELPERS:
        m = re.search(r"(template <[^>]*>\s*)?__device__ __forceinline__ [\w ]+\b" + name + r"\s*\(", text)
        if m is None:
            continue
        depth, i = 0, text.index("{", m.end())
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
        text = text[:m.start()] + text[i:]
    if "asm" in re.sub(r"//.*", "", text):
        raise ValueError("the header has inline PTX outside the helpers tests/cuda_cpu/shim.h stands in for")
    return text


def build(header_text: str | None = None, build_dir: Path | None = None) -> ctypes.CDLL:
    """Compile the header (default: the shipped one) into a shared library; reused while the sources match."""
    source = cpu_source(HEADER.read_text() if header_text is None else header_text)
    shim, runner = (HERE / "shim.h").read_text(), (HERE / "runner.cc").read_text()
    key = hashlib.sha256("\0".join((source, shim, runner)).encode()).hexdigest()[:16]
    d = Path(build_dir or Path(tempfile.gettempdir()) / "onespark-cuda-cpu")
    d.mkdir(parents=True, exist_ok=True)
    so = d / f"tq_{key}.so"
    if not so.is_file():
        hdr = d / f"tq_{key}.h"
        hdr.write_text(source)
        tmp = d / f".tq_{key}.{os.getpid()}.so"
        r = subprocess.run(["g++", "-std=c++20", "-O2", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                            f"-I{HERE}", f'-DONESPARK_TQ_HEADER="{hdr}"', "-o", str(tmp), str(HERE / "runner.cc")],
                           capture_output=True, text=True, timeout=900)
        if r.returncode:
            raise RuntimeError(f"g++ could not build the header for the CPU:\n{r.stderr[-4000:]}")
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.tq_decode.restype = ctypes.c_int
    lib.tq_error.restype = ctypes.c_char_p
    return lib


def _ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def decode_attention(lib: ctypes.CDLL, q, cache, layout: tq.CacheLayout, block_table, seq_lens, seed: int,
                     sm_scale: float, max_seq_len: int, num_splits: int, stages: int = 3, split_max: list | None = None):
    """As kernels/turboquant_cuda.decode_attention (same positional arguments after `lib`; max_seq_len unused: the
    split count is given), on CPU tensors: q [B, Hq, T, 256] fp16 or bf16 -> fp32. split_max: a list that gets
    each split's running max m, [B * H, num_splits, G * T] (-inf: the split saw no key of that row)."""
    B, Hq, T, d = q.shape
    H = layout.num_kv_heads
    G = Hq // H
    t = tt._tables(layout.preset, seed, "cpu", d)
    qr = torch.matmul(q.float(), t["rt"][torch.float32]).to(q.dtype).contiguous()
    rows = B * H * num_splits * G * T
    ws_acc = torch.full((rows, d), float("nan"), dtype=torch.float32)
    ws_ml = torch.full((rows, 2), float("nan"), dtype=torch.float32)
    tab = (ctypes.c_uint32 * 4)(*tt.prmt_tables(tq.codebook(4).levels))
    bt = block_table.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    rc = lib.tq_decode(_ptr(qr), B, Hq, T, int(q.dtype == torch.bfloat16), _ptr(cache.contiguous()), _ptr(bt),
                       ctypes.c_int64(bt.stride(0)), ctypes.c_int64(bt.shape[1]), _ptr(sl), _ptr(ws_acc), _ptr(ws_ml),
                       ctypes.c_int64(layout.block_bytes), layout.v_offset, layout.s_offset, H, layout.page,
                       num_splits, ctypes.c_float(sm_scale * tt.LOG2E), tab, stages)
    if rc == 3:
        raise RuntimeError(f"the kernel stopped: {lib.tq_error().decode()}")
    if rc == 4:
        raise RuntimeError("the kernel left its ticket counters non-zero: the next launch would take wrong items")
    if rc:
        raise ValueError(f"tq_decode refused the arguments (code {rc})")
    # the merge (turboquant_triton._tq_merge_kernel): splits weighed by 2^(m - max m), normalised, rotated back
    acc = ws_acc.view(B * H, num_splits, G * T, d)
    m, l = ws_ml.view(B * H, num_splits, G * T, 2).unbind(-1)
    if split_max is not None:
        split_max.append(m.clone())
    m_all = m.amax(1, keepdim=True)
    w = torch.exp2(m - torch.where(m_all == float("-inf"), 0.0, m_all))
    live = w > 0  # an empty split's accumulator is never written (NaN here): weighed 0, not read
    o = torch.where(live[..., None], acc * w[..., None], 0.0).sum(1) / (w * l).sum(1)[..., None]
    out = (o @ t["r"]).view(B, H, G, T, d).reshape(B, Hq, T, d)
    return out
