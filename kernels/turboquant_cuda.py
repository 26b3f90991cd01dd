"""TurboQuant K4V4 decode attention in CUDA C++ (turboquant_decode.cuh): mma.sync with the 4-bit codes turned into
mma fragments in registers, the same cache layout, workspace and merge as the Triton decode kernel
(turboquant_triton.decode_attention, which stays the default and serves every other preset).

Built on first use with torch.utils.cpp_extension (nvcc and ninja, as vLLM's images have them) for the GPU it runs
on, or for TORCH_CUDA_ARCH_LIST when that is set (the v2-tq image builds it for 12.1 at image build time, so a
container never compiles). The build lands in TORCH_EXTENSIONS_DIR (torch's default: ~/.cache/torch_extensions).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import turboquant as tq
from . import turboquant_triton as tt

HERE = Path(__file__).resolve().parent
TILE = 64  # keys per pipeline step (turboquant_decode.cuh); splits are whole steps
MAX_ROWS = 64  # G x T query rows of a KV head the kernel takes (4 row tiles of 16)
NAME = "onespark_tq_decode_v1"  # the build cache's name (torch rebuilds it when the sources change)
TABLES = list(tt.prmt_tables(tq.codebook(4).levels))  # the PRMT decoder's tables, as the Triton kernels use them


@functools.lru_cache(maxsize=1)
def module():
    """The compiled extension (compiles once per source version and GPU arch; later calls load the cached build)."""
    from torch.utils.cpp_extension import load

    return load(
        name=NAME,
        sources=[str(HERE / "turboquant_decode.cu")],
        extra_include_paths=[str(HERE)],
        extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"],
        verbose=False,
    )


def supports(preset: tq.Preset, num_q_heads: int, num_kv_heads: int, q_len: int, head_dim: int) -> bool:
    return (preset.k_bits, preset.v_bits) == (4, 4) and head_dim == tq.HEAD_DIM and num_q_heads % num_kv_heads == 0 \
        and num_q_heads // num_kv_heads * q_len <= MAX_ROWS


@functools.lru_cache(maxsize=None)
def _slots(device_index: int, rows: int, stages: int) -> int:
    """CTAs the GPU holds at once for this row count: SMs x CTAs per SM (registers and shared memory decide)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count * module().ctas_per_sm(rows, stages)


def num_splits_for(batch: int, num_kv_heads: int, max_seq_len: int, slots: int, waves: int) -> int:
    """Splits per (request, KV head) for `waves` full waves of CTAs, each split >= 4 steps of keys. Host-known sizes
    only, so a CUDA graph captured for max_seq_len stays valid."""
    most = max(1, -(-max_seq_len // (4 * TILE)))
    return max(1, min(256, most, waves * slots // (batch * num_kv_heads)))


def decode_attention(q, cache, layout: tq.CacheLayout, block_table, seq_lens, seed: int, sm_scale: float,
                     max_seq_len: int, num_splits: int | None = None, waves: int = 1, stages: int = 3, out=None):
    """As turboquant_triton.decode_attention (q [B, Hq, T, d] -> out, q's dtype), for K4V4 and G x T <= 64 rows.
    stages: cp.async pipeline depth (2 or 3); waves: full waves of CTAs the splits make (num_splits_for)."""
    B, Hq, T, d = q.shape
    H = layout.num_kv_heads
    tt._check_attention(Hq, d, cache, layout, "turboquant_cuda.decode_attention")
    if not supports(layout.preset, Hq, H, T, d):
        raise ValueError(f"the CUDA decode kernel takes K4V4 with at most {MAX_ROWS} query rows per KV head; got "
                         f"{layout.preset.name}, {Hq // H} x {T} rows: use turboquant_triton.decode_attention")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be int32 [{B}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be int32 [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_table.shape[1] * layout.page < max_seq_len:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table ({block_table.shape[1]} blocks of {layout.page})")
    G = Hq // H
    t = tt._tables(layout.preset, seed, q.device, d)
    if num_splits is None:
        num_splits = num_splits_for(B, H, max_seq_len, _slots(q.device.index or 0, G * T, stages), waves)
    qr = torch.matmul(q, t["rt"][q.dtype]).to(torch.float16).contiguous()  # as the Triton kernel's _load_q rounds it
    rows = B * H * num_splits * G * T
    ws_acc = torch.empty(rows * d, dtype=torch.float32, device=q.device)
    ws_ml = torch.empty(rows * 2, dtype=torch.float32, device=q.device)
    module().decode_k4v4(qr, cache, block_table, seq_lens, ws_acc, ws_ml, layout.block_bytes, layout.v_offset,
                         layout.s_offset, H, layout.page, num_splits, sm_scale * tt.LOG2E,
                         TABLES, stages)
    if out is None:
        out = torch.empty_like(q)
    tt._tq_merge_kernel[(B * H, G * T)](
        ws_acc, ws_ml, t["r"], out, out.stride(0), out.stride(1), out.stride(2), num_splits,
        H=H, G=G, T=T, D=d, ROWS=G * T, S_BLOCK=min(16, tt.triton.next_power_of_2(num_splits)), num_warps=4,
    )
    return out
