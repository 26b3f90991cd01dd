"""TurboQuant K4V4 decode attention in CUDA C++ (turboquant_decode.cuh): mma.sync with the 4-bit codes turned into mma
fragments in registers; the same cache layout, workspace and merge kernel as the Triton decode kernel
(turboquant_triton.decode_attention, which serves every other case).

Where it runs (`chosen`, the TurboQuant backend's ONESPARK_TQ_KERNEL=auto): K4V4 verify steps (q_len > 1, every
decode step with MTP on) on mma.sync-only GPUs, the DGX Spark's GB10 among them, and every K4V4 step on sm_90
(H100, H200). On the Spark the Triton kernel's verify tile spreads 4 warps over the 48 query rows, so a key is
decoded in every warp that reads it; this kernel decodes each code once, straight into the mma operand. Its
current timings against folded BF16 and beside the Triton kernel, on an H100: bench/results/turboquant_cuda_h100.json
(the Triton kernel keeps the one-query steps on the Spark, where this kernel was slower at 32K-64K, batch 1).
No Spark has timed either; how the choice was made, run by run: lab/turboquant/NOTEBOOK.md.

Build: torch.utils.cpp_extension (nvcc, ninja) for TORCH_CUDA_ARCH_LIST, or the GPU present, into BUILD_DIR
(ONESPARK_CUDA_BUILD; the v2-tq image builds it for its 12.1a at image build: `python -m onespark.kernels.turboquant_cuda
--build`). A server never compiles: `available()` loads a build whose sources match these, else Triton serves.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch

from . import turboquant as tq

HERE = Path(__file__).resolve().parent
SOURCES = ("turboquant_decode.cu", "turboquant_decode.cuh")
NAME = "onespark_tq_decode"
TILE = 64  # keys per pipeline step (turboquant_decode.cuh); splits are whole steps
MAX_ROWS = 64  # G x T query rows of a KV head the kernel takes (4 row tiles of 16)
# cp.async pipeline depth. At verify steps, where it serves, 2 and 3 stages were within 1% on the H200 (both in the
# files above: `cuda`); the Spark holds one CTA per SM either way, so the deeper pipeline keeps more bytes in flight.
STAGES = 3


def _tt():
    """The Triton kernels' module (tables, checks, the merge kernel), imported where needed: `--build` runs in an
    image build that may have no Triton."""
    from . import turboquant_triton

    return turboquant_triton


def build_dir() -> Path:
    return Path(os.environ.get("ONESPARK_CUDA_BUILD") or Path.home() / ".cache" / "onespark" / "cuda-build")


def _digest() -> str:
    """The sources, the torch and the arch list a build is for: a build made for anything else is not loaded."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((HERE / name).read_bytes())
    h.update(f"{torch.__version__} {torch.version.cuda} {os.environ.get('TORCH_CUDA_ARCH_LIST', '')}".encode())
    return h.hexdigest()


def _built() -> Path | None:
    so, stamp = build_dir() / f"{NAME}.so", build_dir() / "sources.sha256"
    fresh = so.is_file() and stamp.is_file() and stamp.read_text().strip() == _digest()
    return so if fresh else None


def build(verbose: bool = False):
    """Compile (ninja skips what is up to date) and load; stamps the build with _digest()."""
    from torch.utils.cpp_extension import load

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    mod = load(name=NAME, sources=[str(HERE / SOURCES[0])], extra_include_paths=[str(HERE)], build_directory=str(d),
               extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"], verbose=verbose)
    _stamp(d)
    return mod


def _stamp(d: Path) -> None:
    """Write d/sources.sha256 atomically. Every process that builds writes it (test workers, servers starting
    together), so each through its own temp file: a shared one would be moved away under another writer."""
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".sources.sha256.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(_digest() + "\n")
    os.replace(tmp, d / "sources.sha256")


@functools.lru_cache(maxsize=1)
def module():
    """The extension: a fresh build in build_dir() is imported as it is; otherwise it is built first."""
    so = _built()
    if so is None:
        return build()
    spec = importlib.util.spec_from_file_location(NAME, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def available() -> bool:
    """A fresh build exists (nothing is compiled to find out)."""
    return _built() is not None


def supports(preset: tq.Preset, num_q_heads: int, num_kv_heads: int, q_len: int, head_dim: int) -> bool:
    return ((preset.k_bits, preset.v_bits) == (4, 4) and head_dim == tq.HEAD_DIM and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads * q_len <= MAX_ROWS)


def chosen(q_len: int, capability: tuple[int, int] | None, preset: tq.Preset) -> bool:
    """The measured choice (module docstring): K4V4 verify steps on mma.sync-only GPUs, every K4V4 step on sm_90."""
    if (preset.k_bits, preset.v_bits) != (4, 4):
        return False
    return capability == (9, 0) or (q_len > 1 and _tt()._mma_sync_only(capability))


@functools.lru_cache(maxsize=None)
def _slots(device_index: int, rows: int, stages: int) -> int:
    """CTAs the GPU holds at once for this row count: SMs x CTAs per SM (registers and shared memory decide)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count * module().ctas_per_sm(rows, stages)


def num_splits_for(batch: int, num_kv_heads: int, max_seq_len: int, slots: int, waves: int) -> int:
    """Splits per (request, KV head) for `waves` full waves of CTAs, each split >= 8 steps of keys: the pipeline's
    fill and the split's workspace row and merge share pay off over 8 steps, not 4 (on an H100, 5-10% less time at
    32K and 64K keys, batch 1, one query; at 128K and up the waves bound the grid either way). Host-known sizes
    only, so a CUDA graph captured for max_seq_len stays valid."""
    most = max(1, -(-max_seq_len // (8 * TILE)))
    return max(1, min(256, most, waves * slots // (batch * num_kv_heads)))


def splits_for(batch: int, num_kv_heads: int, rows: int, max_seq_len: int, device_index: int = 0,
               stages: int = STAGES, waves: int = 1) -> int:
    """The split count decode_attention picks for these sizes (rows = query rows per KV head) on this GPU."""
    return num_splits_for(batch, num_kv_heads, max_seq_len, _slots(device_index, rows, stages), waves)


def decode_attention(q, cache, layout: tq.CacheLayout, block_table, seq_lens, seed: int, sm_scale: float,
                     max_seq_len: int, num_splits: int | None = None, waves: int = 1, stages: int = STAGES, out=None,
                     merge_how: str = "fwht"):
    """As turboquant_triton.decode_attention (q [B, Hq, T, d] fp16/bf16 -> out, q's dtype), for K4V4 and at most
    MAX_ROWS = G x T rows. stages: cp.async pipeline depth (2 or 3); waves: full waves of CTAs (num_splits_for);
    merge_how: turboquant_triton.MERGES."""
    tt = _tt()
    B, Hq, T, d = q.shape
    H = layout.num_kv_heads
    tt.check_decode(q, cache, layout, block_table, seq_lens, max_seq_len, "turboquant_cuda.decode_attention")
    if not supports(layout.preset, Hq, H, T, d):
        raise ValueError(f"the CUDA decode kernel takes K4V4 with at most {MAX_ROWS} query rows per KV head; got "
                         f"{layout.preset.name}, {Hq // H} x {T} rows: use turboquant_triton.decode_attention")
    if layout.page % 16:
        raise ValueError(f"the CUDA decode kernel needs pages of a multiple of 16 keys, got {layout.page}")
    G = Hq // H
    t = tt._tables(layout.preset, seed, q.device, d)
    if num_splits is None:
        num_splits = splits_for(B, H, G * T, max_seq_len, q.device.index or 0, stages, waves)
    qr = torch.matmul(q, t["rt"][q.dtype]).contiguous()  # rounded to fp16 in the kernel, as the Triton kernel does
    rows = B * H * num_splits * G * T
    ws_acc = torch.empty(rows * d, dtype=torch.float32, device=q.device)
    ws_ml = torch.empty(rows * 2, dtype=torch.float32, device=q.device)
    module().decode_k4v4(qr, cache, block_table, seq_lens, ws_acc, ws_ml, layout.block_bytes, layout.v_offset,
                         layout.s_offset, H, layout.page, num_splits, sm_scale * tt.LOG2E,
                         list(tt.prmt_tables(tq.codebook(4).levels)), stages)
    if out is None:
        out = torch.empty_like(q)
    return tt.merge(ws_acc, ws_ml, t, out, B, H, G, T, G * T, num_splits, how=merge_how)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onespark.kernels.turboquant_cuda", allow_abbrev=False,
                                 description="Build the CUDA decode kernel into ONESPARK_CUDA_BUILD (the v2-tq image "
                                             "does at image build) for TORCH_CUDA_ARCH_LIST, or the GPU present.")
    ap.add_argument("--build", action="store_true", required=True)
    ap.parse_args(argv)
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None or CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        why = "this torch has no CUDA" if torch.version.cuda is None else "no CUDA toolkit (nvcc) here"
        print(f"onespark: {why}: the CUDA decode kernel is not built (Triton serves every step)")
        return 0
    try:
        build(verbose=True)
    except Exception as e:  # the compiler's own output is above; one line says what failed
        print(f"onespark: building the CUDA decode kernel in {build_dir()} failed: {str(e).splitlines()[0][:300]}",
              file=sys.stderr)
        return 1
    print(f"onespark: the CUDA decode kernel is built in {build_dir()} "
          f"for {os.environ.get('TORCH_CUDA_ARCH_LIST') or 'this GPU'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
