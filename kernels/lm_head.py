"""INT8 LM head for every token count, and an INT4 (group-128) variant for the MTP draft's logits.

    out[M, N] = (x[M, K] @ w_int8[N, K].T) * scale[N]          in x's dtype, fp32 accumulation
    out[M, N] = sum_g (x[:, g] @ q4[N, g].T) * scale4[N, g]     (INT4, groups of 128 along K)

Three paths, picked by M bucket (16, 32, 64, 128, 512, more); M itself is `do_not_specialize`d, so
a new M never compiles a new kernel:
  * "swap" (M <= 32; every INT4 bucket): `tl.dot` with the operands swapped, each program computes
    out.T[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T, so the weight is the left operand, which the
    tensor cores take from registers, where it is dequantised. BLOCK_M = 16 is the smallest
    dot, so each program reads its weight rows once for up to 16 rows of x. These configs use
    2 warps, so Triton emits mma.sync, whose int8 register operand it loads 4 bytes at a time
    (wgmma's register operand gets 2-byte loads plus re-packing: 1.3-1.45x slower at M = 1, H200).
    No split-K: N / BLOCK_N = 3,880 programs already fill 132 SMs 29 times over.
  * "std" (64 <= M <= 512): the usual orientation, x as wgmma's shared-memory A operand and the
    dequantised weight tile stored to shared memory as B; grouped tile order keeps a band of
    weight tiles in L2 while all token tiles pass over it.
  * "cublas" (M > 512, compute-bound): dequantise 4,096-32,768 weight rows at a time (scale folded,
    one rounding to x's dtype) and let cuBLAS multiply; the only path that allocates (one chunk).

Dequantisation avoids I2F (cvt.rn.f32.s8, which Triton uses for int8 -> bf16, issues at a quarter of
the FP32 rate on sm_90: as long as reading the weight). On the GPU, 4 bytes at a time in PTX: XOR
to offset binary, PRMT each byte under the exponent of 1.5 * 2^23, FSUB, PRMT the top halves
together (exact: the values are small integers). INT4 nibbles become bf16 128 + u with one PRMT per
pair and one packed FMA subtracts 136. Plain Triton forms of the same tricks run in the interpreter.

No host syncs; "swap"/"std" allocate nothing but the output (which `out=` can supply), so calls are
safe inside CUDA-graph capture. Configs: `_CONFIGS`, 1-2 per bucket, pruned to the GPU's shared
memory (`_SMALL_SMEM_CONFIGS` where none fits) and timed once per (bucket, N, K) when two remain
(never while capturing).

Bytes and floors (Qwen3.5-122B-A10B head, N = 248,320, K = 3,072; H200, 4.26 TB/s measured copy
rate, read + write, lab/lm_head.py): INT8 762.8 MB weight + 1.0 MB scales -> 0.179 ms;
BF16 1,525.6 MB -> 0.358 ms; INT4 381.4 MB + 11.9 MB scales -> 0.092 ms.
Measured speed per M against cuBLAS BF16: bench/results/lm_head_h200.json (the table is in
docs/concepts/kernels.md; _CONFIGS come from a --sweep run kept in lab/results/lm_head_h200_sweep.json). Where the targets are missed,
and why (from SASS of the shipped configs, sm_90):
  * M <= 4 (target 2.0x over cuBLAS): 2.0x needs the INT8 read at the bandwidth cuBLAS gets for BF16
    (4.12 TB/s); we reach 3.8-4.1. The loop issues 4.3 instructions per weight byte (PRMT 1.5,
    FADD 1, IMAD moves 0.6, LDS/LDGSTS/HMMA ...), ~0.1 ms of issue per SM against 0.187 ms.
  * M = 64-1,024 (targets 1.3x / 1.0x): the "std" kernel's dequantise -> st.shared -> fence -> wgmma
    chain is not overlapped with the previous wgmma by Triton's pipeliner, and the cuBLAS path pays the
    dequant pass plus small GEMMs. A warp-specialised kernel (producer warps dequantising into shared
    memory for consumer warpgroups) is the known fix and is not written: Triton 3.6's automatic warp
    specialisation (`tl.range(..., warp_specialize=True)`) is documented as Blackwell-only, so on sm_90
    it takes a hand-written mixed-input mainloop (CUTLASS-style); the Spark's sm_121 has no wgmma at all.
    In vLLM the head sees only sampled positions (decode batch x (1 + draft tokens)), so M > 64 means
    > 21 sequences in flight under MTP-2.
  * INT4 (target 3.5x): 5.1 instructions per byte (~0.06 ms of issue) yet 0.153 ms: not issue-bound;
    likely latency with 4 programs of 2 warps per SM (shared memory); not resolved.
"""

from __future__ import annotations

import os
import time

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

__all__ = [
    "quantize_int8_rows",
    "int8_gemv",
    "int8_gemv_ref",
    "quantize_int4_groups",
    "int4_gemv",
    "int4_gemv_ref",
    "INT4_GROUP",
]

INT4_GROUP = 128  # K elements per INT4 scale; also the INT4 kernel's BLOCK_K
_QUANT_CHUNK_FRACTION = 32  # quantizers convert at most 1/32 of the weight's rows to fp32 at a time


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# --------------------------------------------------------------------------- quantizers (plain torch)


def _check_weight(w: torch.Tensor, name: str = "w") -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [N, K], got {getattr(w, 'shape', type(w))}")
    if not w.is_floating_point():
        raise ValueError(f"{name} must be floating point (bf16/fp16/fp32), got {w.dtype}")
    if w.numel() == 0:
        raise ValueError(f"{name} is empty ({tuple(w.shape)}): nothing to quantize")


def _row_chunks(w: torch.Tensor):
    """Row ranges of ceil(N/32) rows: their fp32 copy is 6.25% of a BF16 weight's bytes."""
    n = w.shape[0]
    step = max(1, -(-n // _QUANT_CHUNK_FRACTION))
    for i in range(0, n, step):
        yield i, min(n, i + step)


@torch.no_grad()
def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric INT8: w ~= w_int8 * scale[:, None].

    Returns (w_int8 [N, K] int8, contiguous; scale [N] fp32) with scale = max|w_row| / 127
    (0 for an all-zero row) and w_int8 = round-half-even(w / scale) clamped to [-127, 127].
    Works in row chunks: the only large temporary is one fp32 chunk of ceil(N/32) rows, 4 x K x N/32
    bytes = 6.25% of a BF16 weight's 2 x N x K bytes (95 MB for the 1.5 GB head), never a full copy.
    """
    _check_weight(w)
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int8, device=w.device)
    scale = torch.empty((n,), dtype=torch.float32, device=w.device)
    for i, j in _row_chunks(w):
        c = w[i:j].to(torch.float32, copy=True)  # the one temporary (copy: an fp32 w must stay untouched)
        amax = torch.maximum(c.amax(dim=1), -c.amin(dim=1))
        if not bool(torch.isfinite(amax).all()):
            bad = i + int((~torch.isfinite(amax)).nonzero()[0, 0])
            raise ValueError(f"weight row {bad} holds NaN or inf: fix the checkpoint before quantizing")
        s = amax / 127.0
        scale[i:j] = s
        c.div_(torch.where(s > 0, s, torch.ones_like(s))[:, None]).round_().clamp_(-127, 127)
        q[i:j].copy_(c)  # already integral: the cast is exact, and copy_ needs no int8 temporary
        del c
    return q, scale


@torch.no_grad()
def quantize_int4_groups(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 in groups of 128 along K, for draft logits only.

    Returns (w_int4 [N, G * 64] uint8, scale [N, G] fp16) with G = ceil(K / 128). Each group of 128
    values q in [-7, 7] is stored as 64 bytes: byte j holds q[j] + 8 in its low nibble and
    q[j + 64] + 8 in its high nibble (so a kernel gets two plain [64]-wide halves with one AND and one
    shift, no interleaving). A K tail is padded with q = 0. scale = max|w_group| / 7, rounded to fp16
    first and q computed with the rounded scale, so dequantisation is q * scale exactly.
    """
    _check_weight(w)
    if group != INT4_GROUP:
        raise ValueError(f"group must be {INT4_GROUP} (the kernel's block), got {group}")
    n, k = w.shape
    g = -(-k // group)
    packed = torch.empty((n, g * group // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((n, g), dtype=torch.float16, device=w.device)
    fp16_max = torch.finfo(torch.float16).max
    for i, j in _row_chunks(w):
        c = torch.zeros((j - i, g * group), dtype=torch.float32, device=w.device)
        c[:, :k] = w[i:j]
        c = c.view(j - i, g, group)
        amax = torch.maximum(c.amax(dim=2), -c.amin(dim=2))
        if not bool(torch.isfinite(amax).all()):
            bad = i + int((~torch.isfinite(amax)).nonzero()[0, 0])
            raise ValueError(f"weight row {bad} holds NaN or inf: fix the checkpoint before quantizing")
        if bool((amax / 7.0 > fp16_max).any()):
            raise ValueError(f"weight rows {i}..{j} exceed the fp16 scale range (|w| > {7 * fp16_max:g})")
        s = (amax / 7.0).to(torch.float16)
        scale[i:j] = s
        s32 = s.to(torch.float32)
        c.div_(torch.where(s32 > 0, s32, torch.ones_like(s32))[:, :, None]).round_().clamp_(-7, 7).add_(8)
        u = c.to(torch.uint8)  # [rows, G, 128] in 1..15 (8 = zero)
        packed[i:j] = (u[:, :, : group // 2] | (u[:, :, group // 2 :] << 4)).view(j - i, -1)
        del c, u
    return packed, scale


def dequantize_int4_groups(w_int4: torch.Tensor, scale: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K] fp32 values q * scale of a quantize_int4_groups result (for references and tests)."""
    n = w_int4.shape[0]
    g = scale.shape[1]
    b = w_int4.view(n, g, INT4_GROUP // 2)
    q = torch.cat([(b & 0xF), (b >> 4)], dim=2).to(torch.float32) - 8.0  # [N, G, 128]
    return (q * scale.to(torch.float32)[:, :, None]).reshape(n, g * INT4_GROUP)[:, :k]


# --------------------------------------------------------------------------- references (plain torch)


def int8_gemv_ref(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor, *, acc_dtype: torch.dtype = torch.float32,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-torch INT8 head: (x @ w_int8.T) * scale computed in acc_dtype, returned in out_dtype
    (default x's dtype). Tests use acc_dtype=out_dtype=torch.float64 as the exact reference; with the
    defaults it is also a (slow, 4 x K x N-byte temporary) fallback where Triton cannot run."""
    out = torch.nn.functional.linear(x.to(acc_dtype), w_int8.to(acc_dtype)) * scale.to(acc_dtype)
    return out.to(out_dtype or x.dtype)


def int4_gemv_ref(x: torch.Tensor, w_int4: torch.Tensor, scale: torch.Tensor, *, acc_dtype: torch.dtype = torch.float32,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-torch INT4 head: x @ (q * scale).T in acc_dtype, returned in out_dtype (default x's)."""
    w = dequantize_int4_groups(w_int4, scale, x.shape[1]).to(acc_dtype)
    return torch.nn.functional.linear(x.to(acc_dtype), w).to(out_dtype or x.dtype)


# --------------------------------------------------------------------------- Triton kernels


@triton.jit
def _i8_to(w, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """int8 tensor -> DTYPE, exactly, without I2F conversions (see module docstring).

    FAST (GPU only) does bf16 in PTX: per 4 bytes one XOR to offset binary, 4 PRMT that place each
    byte under the exponent of 1.5 * 2^23, 4 FSUB and 2 PRMT that keep the top halves (2.75 ops a
    value; the plain Triton form below compiles to about 3.5: PRMT sign-extend, IADD, FADD, PRMT).
    """
    if DTYPE == tl.float16:
        u = (w.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16)  # w + 128 in 0..255
        return (u | 0x6400).to(tl.float16, bitcast=True) - 1152.0  # (1024 + w + 128) - 1152
    elif DTYPE == tl.bfloat16 and FAST:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, m, f0, f1, f2, f3;
            xor.b32 t, $2, 0x80808080;
            mov.b32 m, 0x4B400000;
            prmt.b32 f0, t, m, 0x7640;
            prmt.b32 f1, t, m, 0x7641;
            prmt.b32 f2, t, m, 0x7642;
            prmt.b32 f3, t, m, 0x7643;
            sub.f32 f0, f0, 0f4B400080;
            sub.f32 f1, f1, 0f4B400080;
            sub.f32 f2, f2, 0f4B400080;
            sub.f32 f3, f3, 0f4B400080;
            prmt.b32 $0, f0, f1, 0x7632;
            prmt.b32 $1, f2, f3, 0x7632;
            }""",
            constraints="=r,=r,r",
            args=[w],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    else:
        f = (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        if DTYPE == tl.float32:
            return f
        else:
            return (f.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


def _u4_asm(high: bool) -> str:
    """PTX for _u4_to's FAST bf16 path: 4 nibbles u (low, or high after a shift) -> bf16 pairs 0x43uu = 128 + u
    by PRMT, then one packed FMA per pair subtracts 136 (q = u - 8)."""
    first = "shr.b32 t, $2, 4;\n    and.b32 t, t, 0x0F0F0F0F;" if high else "and.b32 t, $2, 0x0F0F0F0F;"
    return f"""{{
    .reg .b32 t, m, one, off;
    {first}
    mov.b32 m, 0x00000043;
    mov.b32 one, 0x3F803F80;
    mov.b32 off, 0xC308C308;
    prmt.b32 $0, t, m, 0x4140;
    prmt.b32 $1, t, m, 0x4342;
    fma.rn.bf16x2 $0, $0, one, off;
    fma.rn.bf16x2 $1, $1, one, off;
    }}"""


_U4_ASM_LOW = tl.constexpr(_u4_asm(high=False))
_U4_ASM_HIGH = tl.constexpr(_u4_asm(high=True))


@triton.jit
def _u4_to(b, HIGH: tl.constexpr, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """Low (or high) nibbles u = q + 8 of a uint8 tensor -> q in DTYPE, exactly.

    FAST (GPU only) does bf16 in PTX: per 4 bytes an AND (and a shift for the high nibbles), 2 PRMT
    that build bf16 pairs 0x43uu = 128 + u, and 2 packed FMA that subtract 136 (1.25-1.5 ops a value).
    """
    if DTYPE == tl.bfloat16 and FAST:
        if HIGH:
            return tl.inline_asm_elementwise(_U4_ASM_HIGH, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_U4_ASM_LOW, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
    if HIGH:
        u = b >> 4
    else:
        u = b & 0xF
    if DTYPE == tl.float16:
        return (u.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    else:
        f = (u.to(tl.int32) | 0x4B400000).to(tl.float32, bitcast=True) - 12582920.0
        if DTYPE == tl.float32:
            return f
        else:
            return (f.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _tile_rows(M, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_N: tl.constexpr):
    """Program id -> its tile's weight rows rn [BLOCK_N] and token rows rm [BLOCK_M] (either may run past
    N or M). GROUP_N weight tiles form a band that stays in L2 while every token tile passes over it (at
    M <= BLOCK_M the weight tile is just pid)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.cdiv(M, BLOCK_M)
    per_band = GROUP_N * num_m
    band = pid // per_band
    first_n = band * GROUP_N
    band_n = min(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_band) % band_n
    pid_m = (pid % per_band) // band_n
    return pid_n * BLOCK_N + tl.arange(0, BLOCK_N), pid_m * BLOCK_M + tl.arange(0, BLOCK_M)


@triton.jit
def _swap_ptrs(x_ptr, w_ptr, rn, rm, rk, N, stride_xm, stride_xk, stride_wn):
    """The "swap" kernels' pointers to their first weight tile [BLOCK_N, len(rk)] and x.T tile [len(rk), BLOCK_M].
    Weight rows past N wrap onto valid rows (rn % N): their loads need no mask and the store drops them.
    Token rows past M are not wrapped; the caller masks them (m_ok): at M = 1 wrapping made every program
    fetch 16 copies of one x row, all from the same L2 lines (H200: 0.227 ms at M = 1 vs 0.194 ms at M = 3)."""
    w_ptrs = w_ptr + (rn % N)[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + rk[:, None] * stride_xk
    return w_ptrs, x_ptrs


@triton.jit
def _store_swapped(o_ptr, acc, rn, rm, M, N, stride_om):
    """A "swap" kernel's acc [BLOCK_N, BLOCK_M] (a tile of out.T) into out[rm, rn], rows past M or N dropped."""
    o_ptrs = o_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rm[None, :] < M))


# Deliberately the signature of _int8_mm_large_kernel: _launch_int8 launches either with one argument list.
@triton.jit(do_not_specialize=["M"])
def _int8_mm_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    rn, rm = _tile_rows(M, N, BLOCK_N, BLOCK_M, GROUP_N)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    w_ptrs, x_ptrs = _swap_ptrs(x_ptr, w_ptr, rn, rm, rk, N, stride_xm, stride_xk, stride_wn)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = rk < K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0)
            xt = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(_i8_to(w, xt.dtype, FAST), xt, acc, input_precision=PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
    acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[:, None]
    _store_swapped(o_ptr, acc, rn, rm, M, N, stride_om)


# Deliberately the signature of _int8_mm_kernel: _launch_int8 launches either with one argument list.
@triton.jit(do_not_specialize=["M"])
def _int8_mm_large_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """Large M: out tile [BLOCK_M, BLOCK_N] = x_tile @ dequant(W_tile).T in the usual orientation.
    The weight tile is loaded 16 bytes a thread along K, dequantised in that layout and stored to
    shared memory as wgmma's B operand (the swapped form keeps it in registers as A, which Triton
    loads 2 bytes at a time: H200, M = 8192: 25 ms vs cuBLAS 18 ms)."""
    rn, rm = _tile_rows(M, N, BLOCK_N, BLOCK_M, GROUP_N)
    rn_ld = rn % N  # rows past N or M wrap onto valid ones: unmasked loads, the store drops them
    rm_ld = rm % M
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm_ld[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + rn_ld[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            xa = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = rk < K - k * BLOCK_K
            xa = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0)
        acc = tl.dot(xa, _i8_to(w, xa.dtype, FAST), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K
    acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
    o_ptrs = o_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _dequant_rows_kernel(w_ptr, s_ptr, o_ptr, numel, K, BLOCK: tl.constexpr):
    """o = round(w_int8 * scale[row]) in o's dtype, over `numel` elements of contiguous rows."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    w = tl.load(w_ptr + offs, mask=ok, other=0).to(tl.float32)
    s = tl.load(s_ptr + offs // K, mask=ok, other=0.0)
    tl.store(o_ptr + offs, (w * s).to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _int4_mm_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_sn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = 64  # INT4_GROUP // 2: bytes per group and row; lo nibbles = first 64 of K
    rn, rm = _tile_rows(M, N, BLOCK_N, BLOCK_M, GROUP_N)
    m_ok = rm < M
    rj = tl.arange(0, HALF)
    w_ptrs, x_ptrs = _swap_ptrs(x_ptr, w_ptr, rn, rm, rj, N, stride_xm, stride_xk, stride_wn)
    s_ptrs = s_ptr + (rn % N).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, 2 * HALF)):
        b = tl.load(w_ptrs)
        if EVEN_K:
            x_lo = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            x_hi = tl.load(x_ptrs + HALF * stride_xk, mask=m_ok[None, :], other=0.0)
        else:
            left = K - g * 2 * HALF
            x_lo = tl.load(x_ptrs, mask=(rj < left)[:, None] & m_ok[None, :], other=0.0)
            x_hi = tl.load(x_ptrs + HALF * stride_xk, mask=(rj + HALF < left)[:, None] & m_ok[None, :], other=0.0)
        part = tl.dot(_u4_to(b, False, x_lo.dtype, FAST), x_lo, input_precision=PRECISION)
        part = tl.dot(_u4_to(b, True, x_lo.dtype, FAST), x_hi, part, input_precision=PRECISION)
        acc += part * tl.load(s_ptrs + g).to(tl.float32)[:, None]
        w_ptrs += HALF
        x_ptrs += 2 * HALF * stride_xk
    _store_swapped(o_ptr, acc, rn, rm, M, N, stride_om)


# --------------------------------------------------------------------------- configs and dispatch

# (kernel, BLOCK_N, BLOCK_M, BLOCK_K, GROUP_N, num_warps, num_stages) per M bucket, best first;
# kernel "swap" = _int8_mm_kernel / _int4_mm_kernel (weight as the register operand), "std" =
# _int8_mm_large_kernel. Small buckets use 2 warps or BLOCK_N < 64 so Triton emits mma.sync, whose
# int8 register operand loads 4 bytes at a time (kWidth 4); for wgmma's register operand it loads 2
# and re-packs them (SASS, sm_90). Filled from the H200 sweep (lab/lm_head.py --sweep);
# later entries need less shared memory (sm_12x parts such as the DGX Spark's GB10 have ~100 KB
# per block, the H200 227 KB).
_CONFIGS: dict[tuple[str, int], list[tuple]] = {
    # H200 sweep, 2026-11-30 (ms per call at the real shape; cuBLAS BF16 in brackets):
    ("int8", 16): [("swap", 64, 16, 128, 1, 2, 4)],  # M=1 0.180 [0.355], M=16 0.197 [0.363]
    ("int8", 32): [("swap", 128, 32, 128, 1, 2, 4)],  # M=32 0.276 [0.381]
    ("int8", 64): [("std", 128, 64, 64, 8, 4, 3), ("std", 256, 64, 64, 8, 4, 3)],  # M=64 0.325 [0.371]
    ("int8", 128): [("std", 128, 128, 64, 8, 4, 3)],  # M=128 0.484 [0.406]
    ("int8", 512): [("std", 128, 128, 64, 16, 4, 3)],  # M=256 0.905 [0.615]
    # M=1024 2.88 / 2.81 [2.36]; M=8192 18.6 / 19.2 [18.6]
    ("int8", 8192): [("cublas", 4096, 0, 0, 0, 0, 0), ("cublas", 32768, 0, 0, 0, 0, 0)],
    ("int4", 16): [("swap", 128, 16, 0, 1, 2, 4)],  # M=1 0.142, M=16 0.150
    ("int4", 32): [("swap", 128, 32, 0, 1, 2, 4)],  # M=32 0.216
    ("int4", 64): [("swap", 128, 64, 0, 1, 4, 4)],  # M=64 0.290
    ("int4", 128): [("swap", 128, 128, 0, 8, 8, 3)],  # M=128 0.461
    ("int4", 512): [("swap", 128, 128, 0, 8, 8, 3)],  # (128, 256, ...) took 1.56 ms at M=256
    ("int4", 8192): [("swap", 128, 128, 0, 8, 8, 3)],
}
# Used only where no _CONFIGS entry fits the GPU's shared memory per block (sm_12x, e.g. the DGX
# Spark's GB10: ~99 KB); each ran correctly in the H200 sweep but is untimed on a Spark.
_SMALL_SMEM_CONFIGS = {
    ("int8", 32): ("swap", 64, 32, 128, 1, 2, 4),
    ("int8", 128): ("std", 128, 64, 64, 8, 4, 3),
    ("int8", 512): ("std", 128, 64, 64, 8, 4, 3),
    ("int4", 64): ("swap", 64, 64, 0, 1, 4, 4),
    ("int4", 128): ("swap", 64, 64, 0, 1, 4, 4),
    ("int4", 512): ("swap", 64, 64, 0, 1, 4, 4),
    ("int4", 8192): ("swap", 64, 64, 0, 1, 4, 4),
}
_INTERPRET_CONFIG = {  # small tiles: the interpreter's cost grows with tile size
    ("int8", 16): ("swap", 32, 16, 32, 1, 4, 1), ("int8", 32): ("swap", 32, 32, 32, 1, 4, 1),
    ("int8", 64): ("swap", 32, 64, 32, 1, 4, 1), ("int8", 128): ("std", 32, 64, 32, 2, 4, 1),
    ("int8", 512): ("std", 64, 32, 32, 2, 4, 1), ("int8", 8192): ("cublas", 64, 0, 0, 0, 0, 0),
    ("int4", 16): ("swap", 32, 16, 0, 1, 4, 1), ("int4", 32): ("swap", 32, 32, 0, 1, 4, 1),
    ("int4", 64): ("swap", 32, 64, 0, 1, 4, 1), ("int4", 128): ("swap", 32, 128, 0, 2, 4, 1),
    ("int4", 512): ("swap", 32, 256, 0, 2, 4, 1), ("int4", 8192): ("swap", 32, 256, 0, 2, 4, 1),
}  # fmt: skip
_chosen: dict[tuple, tuple] = {}  # (kind, bucket, N, K, dtype, device) -> config


def _bucket(m: int) -> int:
    """M -> the bucket whose kernel serves it: 16, 32, 64, 128, 512 or 8192 (anything larger)."""
    for b in (16, 32, 64, 128, 512):
        if m <= b:
            return b
    return 8192


def _smem_bytes(kind: str, cfg: tuple, x_bytes: int) -> int:
    """Estimate of a config's shared memory: the load ring, plus the dequantised tile for "std"."""
    path, bn, bm, bk, _, _, stages = cfg
    if path == "cublas":
        return 0
    if kind == "int4":
        bk = INT4_GROUP
        return (bn * bk // 2 + bm * bk * x_bytes) * stages
    ring = (bn * bk + bm * bk * x_bytes) * stages
    return ring + (bn * bk * x_bytes if path == "std" else 0)


def _candidates(kind: str, bucket: int, x_bytes: int, smem_limit: int) -> list[tuple]:
    """Configs to try, in order, on a GPU with `smem_limit` bytes of shared memory per block (opt-in)."""
    fits = [c for c in _CONFIGS[(kind, bucket)] if _smem_bytes(kind, c, x_bytes) <= smem_limit]
    small = _SMALL_SMEM_CONFIGS.get((kind, bucket))
    return fits or ([small] if small else []) + [_CONFIGS[(kind, bucket)][-1]]


def _pick(kind: str, bucket: int, x: torch.Tensor, n: int, k: int, launch) -> tuple:
    """The config for this (bucket, shape), chosen on its first call and kept for the process:
    candidates that fit the shared memory are launched in order (one that the GPU refuses,
    OutOfResources, is dropped); if two work they are timed (3 launches each) and the faster kept,
    unless ONESPARK_LM_HEAD_AUTOTUNE=0. While a CUDA graph is being captured nothing is tried or
    timed: the first candidate is used (and not remembered)."""
    key = (kind, bucket, n, k, x.dtype, x.device)
    cfg = _chosen.get(key)
    if cfg is not None:
        return cfg
    if _interpreting():
        return _INTERPRET_CONFIG[(kind, bucket)]
    limit = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin
    cands = _candidates(kind, bucket, x.element_size(), limit)
    if torch.cuda.is_current_stream_capturing():
        return cands[0]
    working = []
    for c in cands:
        try:
            launch(c)  # compiles; its result is overwritten by the caller's launch
        except OutOfResources:
            continue
        working.append(c)
    if not working:
        raise RuntimeError(f"no {kind} LM-head config fits this GPU's shared memory (tried {cands})")
    cfg = working[0]
    if len(working) > 1 and os.environ.get("ONESPARK_LM_HEAD_AUTOTUNE", "1") != "0":
        times = []
        for c in working:
            torch.cuda.synchronize(x.device)
            t0 = time.perf_counter()
            for _ in range(3):
                launch(c)
            torch.cuda.synchronize(x.device)
            times.append(time.perf_counter() - t0)
        cfg = working[min(range(len(working)), key=times.__getitem__)]
    _chosen[key] = cfg
    return cfg


def _check_x(x: torch.Tensor, k: int, device: torch.device, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K], got {getattr(x, 'shape', type(x))}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x has K = {x.shape[1]} but the {what} weight has K = {k}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but the {what} weight is on {device}")


def _make_out(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1:
        raise ValueError(
            f"out must be a {x.dtype} tensor of shape ({m}, {n}) on {x.device} with unit column stride, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device} with strides {out.stride()}"
        )
    return out


def _precision(x: torch.Tensor) -> str:
    # fp32 x: exact fp32 products (tf32 would round x to 10 bits); bf16/fp16 products are exact anyway.
    return "ieee" if x.dtype == torch.float32 else "tf32"


def int8_gemv(
    x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out[M, N] = (x @ w_int8.T) * scale, in x's dtype (bf16/fp16; fp32 accepted), fp32 accumulation.

    x [M, K] with any strides; w_int8 [N, K] int8 with unit K stride; scale [N] fp32 (from
    quantize_int8_rows). Any M >= 0, N, K. `out` may supply the [M, N] result buffer.
    """
    if not isinstance(w_int8, torch.Tensor) or w_int8.dim() != 2 or w_int8.dtype != torch.int8:
        raise ValueError(f"w_int8 must be a 2-D int8 tensor [N, K], got {getattr(w_int8, 'dtype', type(w_int8))}")
    n, k = w_int8.shape
    _check_x(x, k, w_int8.device, "INT8")
    if w_int8.stride(1) != 1:
        raise ValueError("w_int8 must have unit stride along K (call .contiguous() once at load time)")
    if scale.shape != (n,) or scale.dtype != torch.float32 or scale.device != w_int8.device:
        raise ValueError(f"scale must be fp32 [{n}] on {w_int8.device}, got {scale.dtype} {tuple(scale.shape)}")
    return _gemv("int8", x, w_int8, scale.contiguous(), n, k, out)


def int4_gemv(
    x: torch.Tensor, w_int4: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out[M, N] = x @ (q * scale).T for a quantize_int4_groups result, in x's dtype.

    x [M, K]; w_int4 [N, ceil(K/128) * 64] uint8; scale [N, ceil(K/128)] fp16. For draft logits:
    INT4 changes which token the draft proposes, never what the target accepts.
    """
    if not isinstance(w_int4, torch.Tensor) or w_int4.dim() != 2 or w_int4.dtype != torch.uint8:
        raise ValueError(f"w_int4 must be a 2-D uint8 tensor, got {getattr(w_int4, 'dtype', type(w_int4))}")
    if not isinstance(scale, torch.Tensor) or scale.dim() != 2 or scale.dtype != torch.float16:
        raise ValueError(f"scale must be a 2-D fp16 tensor [N, groups], got {getattr(scale, 'dtype', type(scale))}")
    n, g = scale.shape
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K], got {getattr(x, 'shape', type(x))}")
    k = x.shape[1]
    if w_int4.shape != (n, g * INT4_GROUP // 2) or -(-k // INT4_GROUP) != g:
        raise ValueError(
            f"w_int4 {tuple(w_int4.shape)} and scale {tuple(scale.shape)} do not fit x with K = {k}: "
            f"expected [N, {-(-k // INT4_GROUP) * INT4_GROUP // 2}] and [N, {-(-k // INT4_GROUP)}]"
        )
    _check_x(x, k, w_int4.device, "INT4")
    if w_int4.stride(1) != 1 or scale.stride(1) != 1 or scale.device != w_int4.device:
        raise ValueError("w_int4 and scale must be on one device with unit stride along groups/bytes")
    return _gemv("int4", x, w_int4, scale, n, k, out)


def _gemv(kind: str, x, w, scale, n: int, k: int, out) -> torch.Tensor:
    """int8_gemv's and int4_gemv's common part, after their checks: the output, the empty cases, then one
    launch with the config _pick chose for this bucket and shape."""
    out = _make_out(x, n, out)
    m = x.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    launcher = _launch_int8 if kind == "int8" else _launch_int4

    def launch(cfg):
        launcher(x, w, scale, out, cfg)

    launch(_pick(kind, _bucket(m), x, n, k, launch))
    return out


def _launch_int8(x, w_int8, scale, out, cfg) -> None:
    """One launch with an explicit config (see _CONFIGS)."""
    (m, k), n = x.shape, w_int8.shape[0]
    path, bn, bm, bk, group, warps, stages = cfg
    if path == "cublas":
        _int8_via_cublas(x, w_int8, scale, out, rows=bn)
        return
    grid = (triton.cdiv(n, bn) * triton.cdiv(m, bm),)
    kernel = {"swap": _int8_mm_kernel, "std": _int8_mm_large_kernel}[path]
    kernel[grid](
        x, w_int8, scale, out, m, n, k,
        x.stride(0), x.stride(1), w_int8.stride(0), out.stride(0),
        BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, GROUP_N=group, EVEN_K=(k % bk == 0),
        PRECISION=_precision(x), FAST=not _interpreting(), num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _int8_via_cublas(x, w_int8, scale, out, rows: int) -> None:
    """Large M, where the GEMM is compute-bound: dequantise `rows` weight rows at a time to x's dtype
    (scale folded in, rounded once: a 2^-9 relative change of each weight, the same as storing the
    head in BF16) and let cuBLAS multiply them; the chunk (rows x K x 2 bytes, 25 MB at 4096 rows)
    is read back from L2. Allocates one chunk per call, from PyTorch's caching allocator."""
    n, k = w_int8.shape
    rows = min(rows, n)
    buf = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        numel = (n1 - n0) * k
        _dequant_rows_kernel[(triton.cdiv(numel, 4096),)](w_int8[n0:n1], scale[n0:n1], buf, numel, k, BLOCK=4096)
        torch.matmul(x, buf[: n1 - n0].T, out=out[:, n0:n1])


def _launch_int4(x, w_int4, scale, out, cfg) -> None:
    """One launch with an explicit config (see _CONFIGS; BLOCK_K is fixed at 128 = the group)."""
    (m, k), n = x.shape, w_int4.shape[0]
    _, bn, bm, _, group, warps, stages = cfg
    grid = (triton.cdiv(n, bn) * triton.cdiv(m, bm),)
    _int4_mm_kernel[grid](
        x, w_int4, scale, out, m, n, k,
        x.stride(0), x.stride(1), w_int4.stride(0), scale.stride(0), out.stride(0),
        BLOCK_N=bn, BLOCK_M=bm, GROUP_N=group, EVEN_K=(k % INT4_GROUP == 0),
        PRECISION=_precision(x), FAST=not _interpreting(), num_warps=warps, num_stages=stages,
    )  # fmt: skip
