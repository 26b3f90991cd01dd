"""TurboQuant Triton kernels: cache write (encode), split-KV decode attention and varlen prefill attention,
matching turboquant.py.

Decode attention, one program per (sequence, KV head, split):
  * the G = Hq/H query heads of the KV head times the T query positions (16 x 3 for an MTP-2 verify
    step on Qwen3.5-122B) form ONE [BLOCK_M, d] tile, so each compressed K/V tile is read once for
    all of them and every product is a tl.dot (tensor cores);
  * every code byte is loaded once, 16 bytes per load, and decoded in registers: 4-bit and 3-bit codes
    by PRMT byte lookups (below; `decoder="gather"` gathers from the fp16 table in L1 instead), 8-bit
    codes are their own fp16 value (code - 127.5 is exact; the grid step joins the per-token scale);
    per GPU, preset and q_len, decoded once per tile or in each warp that needs them (decode_once);
  * scores are scaled per key by its stored scale (q . x_hat = scale * (Rq) . c), probabilities per
    value by its scale; online softmax in base 2;
  * a merge kernel, one program per output row, weighs the splits (vector loads over the split axis) and
    rotates back in its epilogue by the Hadamard transform in registers (R = H diag(s)/16).
Queries are rotated by one matmul with R^T (entries +-1/16: exact in every dtype) before the launch.
Bytes moved per decode step and KV head: L * (k_bytes + v_bytes + 8), e.g. 264 B/token for K4V4
against 1024 B for BF16: at 256K tokens, 2 KV heads, 138 MB, a 32 us floor at an H200's 4.27 TB/s copy
rate, 0.51 ms at a DGX Spark's 273 GB/s (BF16: 1.97 ms). On Hopper the kernel is bound by decode work, not
bytes (the current timings against BF16 flash with the GQA heads folded: bench/results/turboquant_cuda_h100.json,
read in docs/concepts/turboquant.md).
No host syncs: split bounds come from seq_lens on the device, the grid only from host-known sizes, so the
launch is CUDA-graph safe.

Prefill, two paths. `prefill_attention_flash` (the backend's default) decodes the cached sequence into BF16
once (`_tq_dequant_kernel`, 32K keys at a time) and hands it to torch's FlashAttention-2, merging the pieces
by log-sum-exp: prefill is compute-bound, so it costs the BF16 flash call plus the decode pass. The fused
`prefill_attention` (prompt chunks, continuations, any query lengths, one launch per step, no scratch) runs
the decode kernel's tile step (`_attend_tile`) with a tile of BLOCK_P positions x G query heads, one program
per (position block, KV head, request), decoding each key once per position block: 1.8x the BF16 flash time
on an H200 against 1.02-1.07x for the default (an earlier kernel's run: lab/results/turboquant_prefill_h200.json).
Tiles per GPU: decode_block_n, prefill_tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import turboquant as tq

LOG2E = 1.4426950408889634
_CONSTRAINTS: tl.constexpr = tl.constexpr({1: "=r,=r,r", 3: "=r,=r,r,r,r"})  # _asm's, by the decoder's inputs
LAZY_STEP: tl.constexpr = tl.constexpr(4.0)  # _attend_tile's LAZY: the running max moves by more than 2^4 or not at all


# ---------------------------------------------------------------------------------------------
# 4-bit decode in registers (GPU). A code byte holds coordinates i (A) and 128 + i (B), each a sign and a
# magnitude index m (turboquant.py's docstring). For the 4 bytes of a register: a mask, a shift-OR and a byte
# PRMT make the 4 A magnitudes a PRMT selector, two PRMT look up the low and high bytes of fp16 |level[8 + m]|
# from two 8-byte tables held in registers, one mask-and-OR puts the 4 signs into the high bytes (bit 7 of each
# code byte is its A sign, at the same place), two PRMT pair the bytes into fp16; B likewise after a shift:
# 20 ops for 8 values, no memory access. Per byte, so it is right in whatever register layout Triton gives the
# tile: for P @ V Triton decodes V straight into the mma operand layout, where a thread's 4 bytes are 4 tokens
# (a decoder over 4-byte words would mix them up). The nibble decoder this replaced (ascending codes, ~24 ops per
# 4 values) made the T = 1 decode loop 1115 SASS instructions per 32-key tile on sm_90, this one 872, and the
# verify kernel 3944 -> 3432 (counted in the cubins' SASS, cuobjdump -sass, Triton 3.6.0). With an L1 gather
# per value instead (the `decoder="gather"` path, and the interpreter's) K4V4 decode at 128K tokens, batch 1 took
# 139 us against 90 us for the nibble decoder (H200, at 222ae6e, lab/results/turboquant_h200.json, sweep).


def prmt_tables(levels: torch.Tensor) -> tuple[int, int, int, int]:
    """The 4-bit decoder's PRMT tables: low bytes of fp16 |level[8 + m]| for m = 0..3 and 4..7, then the high
    bytes, as 32-bit words (byte k of a word = entry k). Shared with the CUDA decoder (turboquant_decode.cuh)."""
    lev = levels.to(torch.float16)
    if not torch.equal(lev[:8], -lev[8:].flip(0)):
        raise AssertionError("the 4-bit codebook is not symmetric in fp16: the PRMT decoder needs it")
    bits = [int(b) & 0xFFFF for b in lev[8:].view(torch.int16)]
    word = lambda vals: sum((v & 0xFF) << (8 * i) for i, v in enumerate(vals))  # noqa: E731
    return word(bits[:4]), word(bits[4:]), word([b >> 8 for b in bits[:4]]), word([b >> 8 for b in bits[4:]])


def _byte_asm(levels: torch.Tensor, high: bool) -> str:
    """PTX for 4 code bytes ($2) -> fp16 pairs (A_0, A_1), (A_2, A_3) in $0, $1, or with high=True (B_0, B_1),
    (B_2, B_3) (element k of Triton's pack=4 group is byte k). Two calls rather than one with four outputs:
    fewer registers live at once (one asm for both spilled 8 B per thread in the sm_121 prefill tile with
    Triton 3.7.1)."""
    l0, l1, h0, h1 = prmt_tables(levels)

    def half(mags: str, signs: str, out0: str, out1: str) -> str:
        # mags: the 4 magnitudes at bits 0-2 of bytes 0-3 -> PRMT selector nibbles 0-3 (one shift, one OR, one
        # byte PRMT); the table lookups then hold byte k's entry in byte k, where its sign (bit 7 of byte k of
        # `signs`) is the fp16 sign bit of the high byte: one mask-and-OR.
        return f"""
    shr.b32 x, {mags}, 4;
    or.b32 m, {mags}, x;
    prmt.b32 m, m, 0, 0x0020;
    prmt.b32 lo, t0, t1, m;
    prmt.b32 hi, t2, t3, m;
    and.b32 s, {signs}, 0x80808080;
    or.b32 hi, hi, s;
    prmt.b32 {out0}, lo, hi, 0x5140;
    prmt.b32 {out1}, lo, hi, 0x7362;"""

    tables = f"""
    mov.b32 t0, {l0:#010x};
    mov.b32 t1, {l1:#010x};
    mov.b32 t2, {h0:#010x};
    mov.b32 t3, {h1:#010x};"""
    if high:
        return f"""{{
    .reg .b32 b, x, m, lo, hi, s, sb, t0, t1, t2, t3;{tables}
    shr.b32 b, $2, 4;
    and.b32 b, b, 0x07070707;
    shl.b32 sb, $2, 4;{half("b", "sb", "$0", "$1")}
    }}"""
    return f"""{{
    .reg .b32 a, x, m, lo, hi, s, t0, t1, t2, t3;{tables}
    and.b32 a, $2, 0x07070707;{half("a", "$2", "$0", "$1")}
    }}"""


_BYTE_LO = tl.constexpr(_byte_asm(tq.codebook(4).levels, high=False))
_BYTE_HI = tl.constexpr(_byte_asm(tq.codebook(4).levels, high=True))


# 3-bit decode in registers (GPU). The 8 fp16 levels fit one PRMT table pair, and a 3-bit code is a PRMT selector
# as it stands. The code's 2 low bits are in the low plane (byte j of the row holds coordinates j, 64 + j, 128 + j,
# 192 + j), its high bit in the high plane (byte j % 32 holds bit pairs for coordinates j and j + 32 of each 64:
# tq.pack). Per 4 values: 2 ops take the low bits, 6 the high bit (a per-byte mask, loop-invariant, picks bit
# 2 chunk + 1 for coordinates 32-63 of a chunk), 3 make the selector, 4 PRMT look up and pair: 15 ops, no memory
# access. The gathers this replaced (one L1 load per value from the 8-entry table, `decoder="gather"`) made K4V3
# 1.2-3.1x the folded BF16 time on an H200 (lab/results/turboquant_h200_8b2d5ec_candidates.json).


def _byte3_asm(levels: torch.Tensor, chunk: int) -> str:
    """PTX for 4 bytes of the low plane ($2), the 4 matching bytes of the high plane ($3) and a mask ($4: 0xff in
    bytes whose coordinate's high bit is bit 2 * chunk + 1 of its byte, 0 where it is bit 2 * chunk) -> the fp16
    values of coordinates 64 * chunk + j as pairs (v_0, v_1), (v_2, v_3) in $0, $1 (element k = byte k)."""
    lev = levels.to(torch.float16)
    if len(lev) != 8:
        raise AssertionError("the 3-bit decoder needs an 8-entry codebook")
    bits = [int(b) & 0xFFFF for b in lev.view(torch.int16)]
    word = lambda vals: sum((v & 0xFF) << (8 * i) for i, v in enumerate(vals))  # noqa: E731
    t0, t1 = word(bits[:4]), word(bits[4:])
    t2, t3 = word([b >> 8 for b in bits[:4]]), word([b >> 8 for b in bits[4:]])
    s = 2 * chunk
    return f"""{{
    .reg .b32 c, h, h1, x, sel, lo, hi, t0, t1, t2, t3;
    mov.b32 t0, {t0:#010x};
    mov.b32 t1, {t1:#010x};
    mov.b32 t2, {t2:#010x};
    mov.b32 t3, {t3:#010x};
    shr.b32 c, $2, {s};
    and.b32 c, c, 0x03030303;
    shr.b32 h, $3, {s};
    shr.b32 h1, h, 1;
    xor.b32 x, h, h1;
    and.b32 x, x, $4;
    xor.b32 h, h, x;
    shl.b32 h, h, 2;
    and.b32 h, h, 0x04040404;
    or.b32 c, c, h;
    shr.b32 x, c, 4;
    or.b32 sel, c, x;
    prmt.b32 sel, sel, 0, 0x0020;
    prmt.b32 lo, t0, t1, sel;
    prmt.b32 hi, t2, t3, sel;
    prmt.b32 $0, lo, hi, 0x5140;
    prmt.b32 $1, lo, hi, 0x7362;
    }}"""


_B3_0 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 0))
_B3_1 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 1))
_B3_2 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 2))
_B3_3 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 3))

# 8-bit codes, as an asm for the decode-once path (below): code - 127.5 in fp16, _u8_centred's arithmetic (fp16
# bits 0x6000 | (b << 1) are 512 + b, and 512 + b - 639.5 is exact), as two byte spreads, a shift, an OR and a
# half-pair subtract per 2 values.
_U8_ASM = tl.constexpr("""{
    .reg .b32 x, y, c;
    mov.b32 c, 0x60ff60ff;
    prmt.b32 x, $2, 0, 0x4140;
    shl.b32 x, x, 1;
    or.b32 x, x, 0x60006000;
    sub.rn.f16x2 $0, x, c;
    prmt.b32 y, $2, 0, 0x4342;
    shl.b32 y, y, 1;
    or.b32 y, y, 0x60006000;
    sub.rn.f16x2 $1, y, c;
    }""")

# Decode once or per warp (ONCE). A decoder asm marked pure may be recomputed by Triton in the mma operand layout
# of every warp that needs the value: no shared-memory round trip, but with the warps split over the tile's query
# rows each warp decodes every key. Not pure, the decode stays where the bytes are loaded, once per value, and the
# fp16 values reach the operand layout through shared memory. Which wins is measured per GPU, preset and q_len:
# decode_once.


@triton.jit
def _asm(src: tl.constexpr, inputs, ONCE: tl.constexpr):
    """A decoder asm over pack=4 bytes of each tensor in `inputs` (a tuple) -> fp16 (pure unless ONCE). Triton
    takes is_pure as a literal, hence the two calls."""
    if ONCE:
        out = tl.inline_asm_elementwise(src, _CONSTRAINTS[len(inputs)], inputs, dtype=tl.float16, is_pure=False, pack=4)
    else:
        out = tl.inline_asm_elementwise(src, _CONSTRAINTS[len(inputs)], inputs, dtype=tl.float16, is_pure=True, pack=4)
    return out


# ---------------------------------------------------------------------------------------------
# Tables shared by both kernels (cached per device)

_TABLES: dict = {}


def _tables(preset: tq.Preset, seed: int, device, d: int = tq.HEAD_DIM):
    key = (preset, seed, str(device), d)
    if key not in _TABLES:
        r = tq.rotation(seed, d, torch.float32)
        kcb, vcb = tq.codebook(preset.k_bits), tq.codebook(preset.v_bits)

        def levels(cb):  # fp16 table; 8-bit codes decode arithmetically (placeholder)
            return cb.levels.to(torch.float16) if cb.delta == 0 else torch.zeros(1, dtype=torch.float16)

        _TABLES[key] = {
            "r": r.to(device),
            "signs": torch.sign(r[0]).to(device),  # row 0 of H is all ones: R[0] = s / sqrt(d)
            "rt": {dt: r.T.contiguous().to(dt).to(device) for dt in (torch.float32, torch.float16, torch.bfloat16)},
            "kcb": levels(kcb).to(device), "vcb": levels(vcb).to(device),
            "kbnd": kcb.bounds.to(torch.float32).to(device), "vbnd": vcb.bounds.to(torch.float32).to(device),
            "klev32": kcb.levels.to(torch.float32).to(device), "vlev32": vcb.levels.to(torch.float32).to(device),
            "kdelta": kcb.delta, "vdelta": vcb.delta,
        }
    return _TABLES[key]


# ---------------------------------------------------------------------------------------------
# Encode: x [n, H, d] -> codes + scale, written into the paged cache


@triton.jit
def _quantize(xr, zs, BND, LEV, BITS: tl.constexpr, DELTA: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """Rotated coordinates xr [BLOCK_T, D] times zs = sqrt(d)/|x| -> (codes int32, codebook values fp32)."""
    z = xr * zs[:, None]
    if DELTA > 0:  # uniform grid, bounds at (i - 2^(b-1) + 1) delta: code = #bounds below z, as the reference
        half: tl.constexpr = ((1 << BITS) - 1) / 2
        code = tl.ceil(z / DELTA + (half - 0.5))
        code = tl.minimum(tl.maximum(code, 0.0), (1 << BITS) - 1.0).to(tl.int32)
        c = (code.to(tl.float32) - half) * DELTA
    else:  # code = #bounds below z, c = level[code], both summed over the 2^b - 1 bounds: no gathers,
        # whose dependent L1/L2 round trips made the decode-step encode (1-24 tokens) latency-bound
        code = tl.zeros([BLOCK_T, D], dtype=tl.int32)
        c = tl.zeros([BLOCK_T, D], dtype=tl.float32) + tl.load(LEV)
        for i in tl.static_range((1 << BITS) - 1):
            above = z > tl.load(BND + i)
            code += above.to(tl.int32)
            c += tl.where(above, tl.load(LEV + i + 1) - tl.load(LEV + i), 0.0)
    return code, c


@triton.jit
def _high_bits(c, A: tl.constexpr, BLOCK_T: tl.constexpr):
    """3-bit codes of chunk A (coordinates 64A + j) -> their high bits at the high plane's bit positions:
    coordinate i + 32m sits in byte i at bit m, and chunk A holds m = 2A (j < 32) and 2A + 1."""
    first, second = tl.split(tl.permute(tl.reshape(c >> 2, [BLOCK_T, 2, 32]), [0, 2, 1]))  # columns 0-31, 32-63
    return (first << (2 * A)) | (second << (2 * A + 1))


@triton.jit
def _butterfly(x, H: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """One Hadamard stage on rows of x [BLOCK_T, D]: (x[k], x[k + H]) -> (sum, difference) in blocks of 2H."""
    if H == 1:
        a, b = tl.split(tl.reshape(x, [BLOCK_T * D // 2, 2]))
        return tl.reshape(tl.join(a + b, a - b), [BLOCK_T, D])
    else:
        a, b = tl.split(tl.permute(tl.reshape(x, [BLOCK_T * D // (2 * H), 2, H]), [0, 2, 1]))
        return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 2, 1]), [BLOCK_T, D])


@triton.jit
def _fwht(x, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """x [BLOCK_T, 256] -> x @ H_256 (Sylvester Hadamard, unnormalised), exact up to fp32 adds. Replaces a
    [256, 256] matrix operand: loading it (128 KB) and holding its pointers spilled registers and cost
    ~15 us per decode-step encode on an H200."""
    tl.static_assert(D == 256)
    x = _butterfly(x, 1, BLOCK_T, D)
    x = _butterfly(x, 2, BLOCK_T, D)
    x = _butterfly(x, 4, BLOCK_T, D)
    x = _butterfly(x, 8, BLOCK_T, D)
    x = _butterfly(x, 16, BLOCK_T, D)
    x = _butterfly(x, 32, BLOCK_T, D)
    x = _butterfly(x, 64, BLOCK_T, D)
    return _butterfly(x, 128, BLOCK_T, D)


@triton.jit
def _chunks4(x, BLOCK_T: tl.constexpr):
    """[BLOCK_T, 256] -> its four [BLOCK_T, 64] column chunks (chunk a = 2 hi + lo)."""
    e, o = tl.split(tl.permute(tl.reshape(x, [BLOCK_T, 2, 2, 64]), [0, 3, 1, 2]))  # lo = 0 / 1: [BLOCK_T, 64, hi]
    c0, c2 = tl.split(e)
    c1, c3 = tl.split(o)
    return c0, c1, c2, c3


@triton.jit
def _sm_byte(a, b):
    """4-bit codes of coordinates i (a) and 128 + i (b) -> their sign-magnitude byte (turboquant.py)."""
    na, nb = (a < 8).to(tl.int32), (b < 8).to(tl.int32)
    ma, mb = tl.where(a < 8, 7 - a, a - 8), tl.where(b < 8, 7 - b, b - 8)
    return (ma | (nb << 3) | (mb << 4) | (na << 7)).to(tl.uint8)


@triton.jit
def _encode_rows(X, stride_xn, stride_xh, SIGNS, BND, LEV, rows, rmask, h, OUT, s_ptr,
                 BITS: tl.constexpr, DELTA: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Quantize BLOCK_T rows of one head and store codes at OUT [BLOCK_T] (int64 byte offsets), scale at s_ptr."""
    tl.static_assert(D == 256)  # four 64-column chunks
    cols = tl.arange(0, D)
    j = tl.arange(0, 64)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_xn + h * stride_xh + cols[None, :], mask=rmask[:, None], other=0.0)
    x = x.to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, 1))
    zs = tl.sqrt(D * 1.0) / tl.where(norm > 0, norm, 1.0)
    # x R^T with R = H diag(s) / sqrt(d): (x * s) H / sqrt(d)
    xr = _fwht(x * tl.load(SIGNS + cols)[None, :], BLOCK_T, D) * (1.0 / tl.sqrt(D * 1.0))
    code, c = _quantize(xr, zs, BND, LEV, BITS, DELTA, BLOCK_T, D)
    tl.store(s_ptr, norm / tl.sqrt(tl.sum(c * c, 1)), mask=rmask)
    c0, c1, c2, c3 = _chunks4(code, BLOCK_T)
    out = OUT[:, None] + j[None, :]
    m = rmask[:, None]
    if BITS == 8:
        tl.store(out, c0.to(tl.uint8), mask=m)
        tl.store(out + 64, c1.to(tl.uint8), mask=m)
        tl.store(out + 128, c2.to(tl.uint8), mask=m)
        tl.store(out + 192, c3.to(tl.uint8), mask=m)
    elif BITS == 4:  # byte i: coordinates i and i + 128, sign-magnitude
        tl.store(out, _sm_byte(c0, c2), mask=m)
        tl.store(out + 64, _sm_byte(c1, c3), mask=m)
    else:  # 3 bit: 2-bit plane, byte i: coordinates i + 64m at bits 2m; high plane, byte i: i + 32m at bit m
        tl.store(out, ((c0 & 3) | ((c1 & 3) << 2) | ((c2 & 3) << 4) | ((c3 & 3) << 6)).to(tl.uint8), mask=m)
        high = _high_bits(c0, 0, BLOCK_T) | _high_bits(c1, 1, BLOCK_T) | _high_bits(c2, 2, BLOCK_T) | _high_bits(c3, 3, BLOCK_T)
        tl.store(OUT[:, None] + D // 4 + tl.arange(0, 32)[None, :], high.to(tl.uint8), mask=m)


@triton.jit
def _tq_encode_kernel(
    K, V, stride_kn, stride_kh, stride_vn, stride_vh, SLOTS, CACHE, CACHE_F32, SIGNS,
    KBND, KLEV, VBND, VLEV, n_tokens, block_bytes, v_offset, s_offset,
    H: tl.constexpr, PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    K_DELTA: tl.constexpr, V_DELTA: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Grid (token blocks, H, 2): the last axis picks K or V, so the two run in parallel."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    slot = tl.load(SLOTS + rows, mask=rows < n_tokens, other=-1).to(tl.int64)
    rmask = slot >= 0  # vLLM marks padded tokens with slot -1
    blk = tl.where(rmask, slot // PAGE, 0)
    row = tl.where(rmask, slot % PAGE, 0) * H + h  # row of this (token, head) inside its block
    base = blk * block_bytes
    sidx = (base + s_offset) // 4 + row * 2
    if tl.program_id(2) == 0:
        _encode_rows(K, stride_kn, stride_kh, SIGNS, KBND, KLEV, rows, rmask, h, CACHE + base + row * (K_BITS * D // 8),
                     CACHE_F32 + sidx, K_BITS, K_DELTA, D, BLOCK_T)
    else:
        _encode_rows(V, stride_vn, stride_vh, SIGNS, VBND, VLEV, rows, rmask, h, CACHE + base + v_offset + row * (V_BITS * D // 8),
                     CACHE_F32 + sidx + 1, V_BITS, V_DELTA, D, BLOCK_T)


def _check_cache(cache: torch.Tensor, layout: tq.CacheLayout):
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != layout.block_bytes or not cache.is_contiguous():
        raise ValueError(
            f"cache must be a contiguous uint8 [num_blocks, {layout.block_bytes}] tensor for {layout.preset.name} "
            f"with {layout.num_kv_heads} KV heads and page {layout.page} (CacheLayout.empty makes one); "
            f"got {cache.dtype} {tuple(cache.shape)}"
        )


def encode(k, v, slot_mapping, cache, layout: tq.CacheLayout, seed: int, block_t: int | None = None):
    """Write k, v [num_tokens, H, d] (fp16/bf16; fp32 in the interpreter) into the paged cache.
    block_t rows per program: 4 for a decode step's few tokens (each program's work is serial
    latency), 16 for prefill chunks."""
    n, H, d = k.shape
    if v.shape != k.shape or H != layout.num_kv_heads or d != layout.head_dim:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the layout (H={layout.num_kv_heads}, d={layout.head_dim})")
    if d != 256:
        raise ValueError(f"the TurboQuant kernels support head_dim 256, got {d}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dimension")
    if slot_mapping.shape != (n,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{n}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    _check_cache(cache, layout)
    if n == 0:
        return
    t = _tables(layout.preset, seed, k.device, d)
    if block_t is None:
        block_t = 4 if n <= 256 else 16
    _tq_encode_kernel[(triton.cdiv(n, block_t), H, 2)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slot_mapping, cache, cache.view(torch.float32), t["signs"],
        t["kbnd"], t["klev32"], t["vbnd"], t["vlev32"], n, layout.block_bytes, layout.v_offset, layout.s_offset,
        H=H, PAGE=layout.page, K_BITS=layout.preset.k_bits, V_BITS=layout.preset.v_bits,
        K_DELTA=t["kdelta"], V_DELTA=t["vdelta"], D=d, BLOCK_T=block_t, num_warps=4,
    )


# ---------------------------------------------------------------------------------------------
# Decode attention


@triton.jit
def _nibbles(CACHE, ptr, nmask, TAB, HALF: tl.constexpr, PRMT: tl.constexpr, ONCE: tl.constexpr):
    """4-bit: bytes [64 HALF, 64 HALF + 64) of BLOCK_N code rows -> fp16 values of coordinates 64 HALF + j (A)
    and 128 + 64 HALF + j (B), each [BLOCK_N, 64]."""
    b = tl.load(CACHE + ptr[:, None] + (HALF * 64 + tl.arange(0, 64))[None, :], mask=nmask[:, None], other=0)
    if PRMT:
        lo = _asm(_BYTE_LO, (b,), ONCE)
        hi = _asm(_BYTE_HI, (b,), ONCE)
    else:
        b = b.to(tl.int32)
        lo = tl.load(TAB + _sm_code(b & 7, b >> 7))
        hi = tl.load(TAB + _sm_code((b >> 4) & 7, (b >> 3) & 1))
    return lo, hi


@triton.jit
def _sm_code(mag, neg):
    """Sign-magnitude -> the ascending code (level index)."""
    return tl.where(neg == 1, 7 - mag, 8 + mag)


@triton.jit
def _u8_centred(b):
    """uint8 code -> fp16 code - 127.5 without I2F (quarter rate on sm_90): fp16 bits 0x6000 | (b << 1) are
    512 + b (the ulp is 0.5 in [512, 1024)), and 512 + b - 639.5 is exact, the constant included. (The
    1024 + b - 1151.5 this replaced was half a code low: Triton rounds a Python constant to the tensor's fp16,
    1152; tests/test_turboquant_triton.py::test_u8_centred_is_exact.)"""
    return ((b.to(tl.uint16) << 1) | 0x6000).to(tl.float16, bitcast=True) - 639.5


@triton.jit
def _codes(CACHE, ptr, nmask, TAB, BITS: tl.constexpr, PRMT: tl.constexpr, ONCE: tl.constexpr, D: tl.constexpr):
    """Codebook values of one code row per token: four fp16 [BLOCK_N, 64] chunks (coordinates 64a + j)."""
    j = tl.arange(0, 64)
    if BITS == 4:
        c0, c2 = _nibbles(CACHE, ptr, nmask, TAB, 0, PRMT, ONCE)
        c1, c3 = _nibbles(CACHE, ptr, nmask, TAB, 1, PRMT, ONCE)
    elif BITS == 8:  # code - 127.5, exactly, in the grid's units (the step joins the token's scale)
        row = CACHE + ptr[:, None] + j[None, :]
        b0 = tl.load(row, mask=nmask[:, None], other=0)
        b1 = tl.load(row + 64, mask=nmask[:, None], other=0)
        b2 = tl.load(row + 128, mask=nmask[:, None], other=0)
        b3 = tl.load(row + 192, mask=nmask[:, None], other=0)
        if PRMT and ONCE:
            c0 = _asm(_U8_ASM, (b0,), True)
            c1 = _asm(_U8_ASM, (b1,), True)
            c2 = _asm(_U8_ASM, (b2,), True)
            c3 = _asm(_U8_ASM, (b3,), True)
        else:
            c0, c1, c2, c3 = _u8_centred(b0), _u8_centred(b1), _u8_centred(b2), _u8_centred(b3)
    else:  # 3 bit: both planes loaded once, the high plane broadcast to 64 columns (byte j % 32)
        lo = tl.load(CACHE + ptr[:, None] + j[None, :], mask=nmask[:, None], other=0)
        hb = tl.load(CACHE + ptr[:, None] + D // 4 + (j % 32)[None, :], mask=nmask[:, None], other=0)
        if PRMT:
            up = tl.broadcast_to(tl.where(j >= 32, 255, 0).to(tl.uint8)[None, :], lo.shape)
            c0 = _asm(_B3_0, (lo, hb, up), ONCE)
            c1 = _asm(_B3_1, (lo, hb, up), ONCE)
            c2 = _asm(_B3_2, (lo, hb, up), ONCE)
            c3 = _asm(_B3_3, (lo, hb, up), ONCE)
        else:
            lo = lo.to(tl.int32)
            hb = hb.to(tl.int32)
            sh = (j // 32)[None, :]
            c0 = tl.load(TAB + ((lo & 3) | (((hb >> sh) & 1) << 2)))
            c1 = tl.load(TAB + (((lo >> 2) & 3) | (((hb >> (2 + sh)) & 1) << 2)))
            c2 = tl.load(TAB + (((lo >> 4) & 3) | (((hb >> (4 + sh)) & 1) << 2)))
            c3 = tl.load(TAB + (((lo >> 6) & 3) | (((hb >> (6 + sh)) & 1) << 2)))
    return c0, c1, c2, c3


@triton.jit
def _load_q(qrow, rvalid):
    """The tile's (rotated) query rows as four fp16 [BLOCK_M, 64] chunks; invalid rows are zero."""
    c64 = tl.arange(0, 64)
    q0 = tl.load(qrow[:, None] + c64[None, :], mask=rvalid[:, None], other=0.0).to(tl.float16)
    q1 = tl.load(qrow[:, None] + 64 + c64[None, :], mask=rvalid[:, None], other=0.0).to(tl.float16)
    q2 = tl.load(qrow[:, None] + 128 + c64[None, :], mask=rvalid[:, None], other=0.0).to(tl.float16)
    q3 = tl.load(qrow[:, None] + 192 + c64[None, :], mask=rvalid[:, None], other=0.0).to(tl.float16)
    return q0, q1, q2, q3


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr):
    """Online-softmax state of a tile: running max, running sum and four fp32 [BLOCK_M, 64] accumulators."""
    z = tl.zeros([BLOCK_M, 64], tl.float32)
    return tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32), z, z, z, z


@triton.jit
def _attend_tile(
    CACHE, CACHE_F32, bt_row, n0, end, last, h, q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3,
    KTAB, VTAB, block_bytes, v_offset, s_offset, k_mul, v_mul,
    H: tl.constexpr, PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, PRMT: tl.constexpr,
    ONCE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, LAZY: tl.constexpr,
):
    """One step of online softmax over keys [n0, n0 + BLOCK_N) of KV head h (those < end, and for each
    tile row those <= last[row]): codes decoded in registers, every product a tl.dot. Returns the
    updated (m, l, acc0..acc3); used by the decode and the prefill kernels alike.
    LAZY: the running max moves only when some row's grows by more than LAZY_STEP (base 2), and the
    accumulators are rescaled only then (FlashAttention-4's conditional rescale). Exact either way: the
    max is only a shift; with it p <= 2^LAZY_STEP = 16, so p * v_scale stays within fp16 while |v| does."""
    tok = n0 + tl.arange(0, BLOCK_N)
    nmask = tok < end
    blk = tl.load(bt_row + tok // PAGE, mask=nmask, other=0).to(tl.int64)
    row = (tok % PAGE) * H + h
    base = blk * block_bytes
    KB: tl.constexpr = K_BITS * D // 8
    VB: tl.constexpr = V_BITS * D // 8
    krow = tl.multiple_of(base + row * KB, 16)  # code rows are multiples of 16 bytes: 16-byte loads
    vrow = tl.multiple_of(base + v_offset + row * VB, 16)
    sidx = (base + s_offset) // 4 + row * 2
    ks = tl.load(CACHE_F32 + sidx, mask=nmask, other=0.0) * k_mul
    vs = tl.load(CACHE_F32 + sidx + 1, mask=nmask, other=0.0) * v_mul

    k0, k1, k2, k3 = _codes(CACHE, krow, nmask, KTAB, K_BITS, PRMT, ONCE, D)
    s = tl.dot(q0, tl.trans(k0))
    s = tl.dot(q1, tl.trans(k1), s)
    s = tl.dot(q2, tl.trans(k2), s)
    s = tl.dot(q3, tl.trans(k3), s)
    s = s * ks[None, :]
    s = tl.where(nmask[None, :] & (tok[None, :] <= last[:, None]), s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    if LAZY:
        moved = tl.max((m_new > m_i + LAZY_STEP).to(tl.int32), 0) > 0  # -inf + step is -inf: a first max moves
        m_new = tl.where(moved, m_new, m_i)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = (p * vs[None, :]).to(tl.float16)
    v0, v1, v2, v3 = _codes(CACHE, vrow, nmask, VTAB, V_BITS, PRMT, ONCE, D)
    if LAZY:
        if moved:
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            acc2 = acc2 * alpha[:, None]
            acc3 = acc3 * alpha[:, None]
        acc0 = tl.dot(pv, v0, acc0)
        acc1 = tl.dot(pv, v1, acc1)
        acc2 = tl.dot(pv, v2, acc2)
        acc3 = tl.dot(pv, v3, acc3)
    else:
        acc0 = tl.dot(pv, v0, acc0 * alpha[:, None])
        acc1 = tl.dot(pv, v1, acc1 * alpha[:, None])
        acc2 = tl.dot(pv, v2, acc2 * alpha[:, None])
        acc3 = tl.dot(pv, v3, acc3 * alpha[:, None])
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _tq_decode_kernel(
    Q, stride_qb, stride_qh, stride_qt, CACHE, CACHE_F32, BLOCK_TABLE, stride_bt, SEQ_LENS,
    KTAB, VTAB, WS_ACC, WS_ML, num_splits, block_bytes, v_offset, s_offset, k_mul, v_mul,
    H: tl.constexpr, G: tl.constexpr, T: tl.constexpr, PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    PRMT: tl.constexpr, ONCE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_TILES: tl.constexpr, LAZY: tl.constexpr,
):
    tl.static_assert(D == 256)  # four 64-column chunks
    bh = tl.program_id(0) // ROW_TILES  # the G * T rows of a KV head in ROW_TILES tiles of BLOCK_M
    rt = tl.program_id(0) % ROW_TILES
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    L = tl.load(SEQ_LENS + b)
    per = tl.cdiv(tl.cdiv(L, num_splits), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(L, start + per)

    # tile rows: r = g * T + t (query head h*G + g, position t)
    r = rt * BLOCK_M + tl.arange(0, BLOCK_M)
    rvalid = r < G * T
    t = r % T
    qrow = Q + b.to(tl.int64) * stride_qb + (h * G + r // T) * stride_qh + t * stride_qt
    q0, q1, q2, q3 = _load_q(qrow, rvalid)
    last = L - T + t  # last key position each row may see (causal within an MTP verify step)
    c64 = tl.arange(0, 64)

    m_i, l_i, acc0, acc1, acc2, acc3 = _empty_state(BLOCK_M)
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile(
            CACHE, CACHE_F32, bt_row, n0, end, last, h, q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3,
            KTAB, VTAB, block_bytes, v_offset, s_offset, k_mul, v_mul,
            H, PAGE, K_BITS, V_BITS, PRMT, ONCE, D, BLOCK_N, LAZY)

    ws = (bh.to(tl.int64) * num_splits + split) * (ROW_TILES * BLOCK_M) + r
    wrow = ws[:, None] * D + c64[None, :]
    # An empty split (start >= L: a short sequence in a grid sized for max_seq_len, as a CUDA graph captured at
    # max_model_len is, or a padded request with L = 0) writes only m = -inf and l = 0; the merge weighs it 0 and
    # never reads its accumulators, so they are not written.
    amask = (rvalid & (start < end))[:, None]
    tl.store(WS_ACC + wrow, acc0, mask=amask)
    tl.store(WS_ACC + wrow + 64, acc1, mask=amask)
    tl.store(WS_ACC + wrow + 128, acc2, mask=amask)
    tl.store(WS_ACC + wrow + 192, acc3, mask=amask)
    tl.store(WS_ML + ws * 2, m_i, mask=rvalid)
    tl.store(WS_ML + ws * 2 + 1, l_i, mask=rvalid)


@triton.jit
def _fwht64(x):
    """x [1, 64] -> x @ H_64 (Sylvester, unnormalised): with H_256 = H_4 (x) H_64, a 256-vector's transform is
    this on each 64-column chunk, then sums and differences across the chunks (_tq_merge_kernel)."""
    x = _butterfly(x, 1, 1, 64)
    x = _butterfly(x, 2, 1, 64)
    x = _butterfly(x, 4, 1, 64)
    x = _butterfly(x, 8, 1, 64)
    x = _butterfly(x, 16, 1, 64)
    return _butterfly(x, 32, 1, 64)


@triton.jit
def _rotate_chunk(o0, o1, o2, o3, R, c: tl.constexpr, D: tl.constexpr):
    """Output columns 64c .. 64c+63 of (o0 o1 o2 o3) @ R, R's [256, 256] entries loaded (the merge before)."""
    r64 = tl.arange(0, 64)
    blk = R + r64[:, None] * D + c * 64 + r64[None, :]
    return (tl.sum(o0[:, None] * tl.load(blk), 0) + tl.sum(o1[:, None] * tl.load(blk + 64 * D), 0)
            + tl.sum(o2[:, None] * tl.load(blk + 128 * D), 0) + tl.sum(o3[:, None] * tl.load(blk + 192 * D), 0))


@triton.jit
def _tq_merge_kernel(
    WS_ACC, WS_ML, R, SIGNS, OUT, stride_ob, stride_oh, stride_ot, num_splits,
    H: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, S_BLOCK: tl.constexpr,
    S_ML: tl.constexpr, FWHT: tl.constexpr,
):
    """One program per (sequence, KV head, tile row r): weigh the splits' partial sums, normalise, and write
    out = o_rot @ R for that row. ROWS: workspace rows per split. Built for few programs (batch 1: 32-96 of them)
    as much as for many: every split's (max, sum) in one load of S_ML (>= num_splits), and the partial sums S_BLOCK
    splits a load as four 64-column tiles with no load waiting on another: each a sum of its own, so the compiler
    keeps the tiles in registers (loads in flight) without spilling where one [S_BLOCK, 256] tile spilled.
    FWHT: o_rot @ R = (o_rot @ H_256) * s / 16, H_256 = H_4 (x) H_64 in registers; else R's entries are loaded
    (256 KB per program)."""
    tl.static_assert(D == 256)
    bh = tl.program_id(0)
    r = tl.program_id(1)
    b = bh // H
    h = bh % H
    first = bh.to(tl.int64) * num_splits * ROWS + r  # workspace row of split 0
    s_all = tl.arange(0, S_ML)
    ml = WS_ML + (first + s_all * ROWS) * 2
    m = tl.load(ml, mask=s_all < num_splits, other=float("-inf"))
    m_all = tl.max(m, 0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.sum(tl.exp2(m - m_safe) * tl.load(ml + 1, mask=s_all < num_splits, other=0.0), 0)  # empty: m = -inf
    # The splits that saw a key of this row are a prefix (split s holds keys s * per on, and a row sees keys up to
    # its position): the partial sums past it are never read. A server's grid for max_model_len is mostly empty
    # splits at short contexts.
    live = tl.sum((m > float("-inf")).to(tl.int32), 0)
    sv = tl.arange(0, S_BLOCK)
    c64 = tl.arange(0, 64)
    o0 = tl.zeros([64], tl.float32)
    o1 = tl.zeros([64], tl.float32)
    o2 = tl.zeros([64], tl.float32)
    o3 = tl.zeros([64], tl.float32)
    for s0 in range(0, live, S_BLOCK):
        s = s0 + sv
        smask = s < live
        row = first + s * ROWS
        w = tl.exp2(tl.load(WS_ML + row * 2, mask=smask, other=float("-inf")) - m_safe)  # in L1 since the first load
        keep = (w > 0)[:, None]  # an empty split's never-written sums are dropped by a select, not by the load
        tile = WS_ACC + row[:, None] * D + c64[None, :]
        a0 = tl.load(tile, mask=smask[:, None], other=0.0)
        a1 = tl.load(tile + 64, mask=smask[:, None], other=0.0)
        a2 = tl.load(tile + 128, mask=smask[:, None], other=0.0)
        a3 = tl.load(tile + 192, mask=smask[:, None], other=0.0)
        o0 += tl.sum(w[:, None] * tl.where(keep, a0, 0.0), 0)
        o1 += tl.sum(w[:, None] * tl.where(keep, a1, 0.0), 0)
        o2 += tl.sum(w[:, None] * tl.where(keep, a2, 0.0), 0)
        o3 += tl.sum(w[:, None] * tl.where(keep, a3, 0.0), 0)
    inv = 1.0 / tl.where(l_all > 0, l_all, 1.0)
    optr = OUT + b.to(tl.int64) * stride_ob + (h * G + r // T) * stride_oh + (r % T) * stride_ot
    et = OUT.dtype.element_ty
    if FWHT:
        y0 = tl.reshape(_fwht64(tl.reshape(o0, [1, 64])), [64])
        y1 = tl.reshape(_fwht64(tl.reshape(o1, [1, 64])), [64])
        y2 = tl.reshape(_fwht64(tl.reshape(o2, [1, 64])), [64])
        y3 = tl.reshape(_fwht64(tl.reshape(o3, [1, 64])), [64])
        inv = inv * (1.0 / tl.sqrt(D * 1.0))
        tl.store(optr + c64, ((y0 + y1 + y2 + y3) * inv * tl.load(SIGNS + c64)).to(et))
        tl.store(optr + 64 + c64, ((y0 - y1 + y2 - y3) * inv * tl.load(SIGNS + 64 + c64)).to(et))
        tl.store(optr + 128 + c64, ((y0 + y1 - y2 - y3) * inv * tl.load(SIGNS + 128 + c64)).to(et))
        tl.store(optr + 192 + c64, ((y0 - y1 - y2 + y3) * inv * tl.load(SIGNS + 192 + c64)).to(et))
    else:
        for c in tl.static_range(4):
            tl.store(optr + c * 64 + c64, (_rotate_chunk(o0, o1, o2, o3, R, c, D) * inv).to(et))


MAX_SPLITS = 256  # both decode kernels' num_splits_for cap; the merge loads every split's (max, sum) at once
# (splits a load at most, warps, Hadamard transform in registers). On an H100 (four runs of 2026-12-05, the
# `merge` key of lab/results/turboquant_cuda_h100_492e33f.json and the three beside it) the fastest setting at
# every case was 128 splits a load over 4 warps with the transform, one [128, 256] tile in registers (4.8-7.9 us at
# batch 1 against 8.9-11.8 for the grid-picked setting, the best at batch 8 too), but it spilled 88 B; the tile as
# four 64-column tiles holds 64 splits a load over 4 warps in ~166 registers without spilling. "matrix" loads R's
# entries (16 splits a load), the baseline.
MERGES = {"fwht": (64, 4, True), "matrix": (16, 4, False)}


def merge(ws_acc, ws_ml, t: dict, out, B: int, H: int, G: int, T: int, rows: int, num_splits: int,
          how: str = "fwht", config: tuple[int, int, bool] | None = None):
    """The split-KV decode's second launch (both decode kernels share its workspace layout): out [B, Hq, T, d]
    from ws_acc / ws_ml of num_splits splits x `rows` workspace rows per (sequence, KV head). config: (splits a
    load, warps, transform) instead of MERGES[how] (the lab's sweep)."""
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if how not in MERGES:
        raise ValueError(f"merge must be one of {sorted(MERGES)}, got {how!r}")
    most, warps, fwht = config or MERGES[how]
    _tq_merge_kernel[(B * H, G * T)](
        ws_acc, ws_ml, t["r"], t["signs"], out, out.stride(0), out.stride(1), out.stride(2), num_splits,
        H=H, G=G, T=T, D=out.shape[-1], ROWS=rows, S_BLOCK=min(most, triton.next_power_of_2(num_splits)),
        S_ML=triton.next_power_of_2(num_splits), FWHT=fwht, num_warps=warps,
    )
    return out


def _check_attention(Hq: int, d: int, cache, layout: tq.CacheLayout, what: str) -> None:
    if d != layout.head_dim or d != 256:
        raise ValueError(f"{what} supports head_dim 256 (the layout has {layout.head_dim}, q has {d})")
    if Hq % layout.num_kv_heads:
        raise ValueError(f"{Hq} query heads do not divide into {layout.num_kv_heads} KV heads")
    _check_cache(cache, layout)


def check_decode(q, cache, layout: tq.CacheLayout, block_table, seq_lens, max_seq_len: int, what: str) -> None:
    """A decode call's arguments (both decode kernels'): q [B, Hq, T, d] against the layout and cache, the block
    table and lengths int32 for B requests, max_seq_len within the block table."""
    B, Hq, T, d = q.shape
    _check_attention(Hq, d, cache, layout, what)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be int32 [{B}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be int32 [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_table.shape[1] * layout.page < max_seq_len:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table ({block_table.shape[1]} blocks of {layout.page})")


def _capability(device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if torch.device(device).type == "cuda" else None


def _mma_sync_only(capability: tuple[int, int] | None) -> bool:
    """sm_8x and sm_12x (the DGX Spark's GB10 is sm_121): Triton's dots are mma.sync, which takes both
    operands from registers, so the query tile held across the key loop competes with the fp32
    accumulators for the 255 registers a thread may have. ptxas spills at tiles that fit on sm_90
    (wgmma) without spilling or nearly so (numbers below, from tests/test_kernels_compile.py)."""
    return capability is not None and capability[0] in (8, 12)


def decode_block_n(T: int, capability: tuple[int, int] | None, v_bits: int = 4) -> int:
    """Keys per tile. sm_90, from the H200 timings (lab/results/turboquant_h200.json `sweep`, and
    turboquant_h200_8b2d5ec_candidates.json): 64, with 2 warps at T = 1 (decode_num_warps: 8-9% faster than 32
    keys x 4 warps at 128K batch 1 and 64K batch 8), and for 3-bit values at a verify step too (7-8% faster than
    32 keys, which the gathers' registers needed before the PRMT decoder); 3-bit values at T = 1: 128 keys x 4
    warps, decoded once (decode_once; 4-9% faster than 32 x 4 and 0-20% than 64 x 4 at 32K and 256K, batch 1 and
    8). mma.sync-only parts: 32 for T = 1, 16 for verify steps, the largest tile that ptxas fits in 255 registers
    without spilling at the 64-row tile of T = 3, 16 query heads (64 keys spill 960 bytes per thread on sm_121;
    tests/test_kernels_compile.py checks it). Not timed on a Spark."""
    if _mma_sync_only(capability):
        return 32 if T == 1 else 16
    return 128 if v_bits == 3 and T == 1 else 64


def decode_num_warps(T: int, capability: tuple[int, int] | None, v_bits: int = 4) -> int:
    """Warps per decode program: 2 with decode_block_n's 64 keys at T = 1 on sm_90 (the sweep's best: a
    16-row tile leaves 4 warps little to share), otherwise 4."""
    return 2 if T == 1 and decode_block_n(T, capability, v_bits) == 64 else 4


def decode_once(T: int, capability: tuple[int, int] | None, preset: tq.Preset) -> bool:
    """Whether the decode kernel decodes each code once per tile (ONCE: the decoder asm not pure). sm_90, from
    the H200 timings at 8b2d5ec (lab/results/turboquant_h200_8b2d5ec_candidates.json, against the same kernel
    with pure decoders): 3-bit values at T = 1 (K4V3, with decode_block_n's 128 x 4 tile: 0.69-0.87x folded BF16
    at 32K and 256K, batch 1 and 8, against 0.84-1.16x pure at the 32 x 4 tile it had and 1.17-2.13x with the
    gathers the PRMT decoder replaced; at 128 x 4 itself once is 1-3% faster than pure, lab/results/
    turboquant_h200.json `sweep` at 5e77e93), and 8-bit keys at a verify step (K8V4: 1-6% faster). Not for K4V4:
    no faster at a verify step (its wgmma already takes the values from shared memory) and slower at T = 1 with
    batch 8 (1.00-1.02x against 0.75-0.78x). mma.sync-only parts: once for 3-bit values at T = 1 too, where the
    pure decoder spills 8 B per thread on sm_121 with Triton 3.7.1 (the 0.32.0 track) at the 32-key tile and once
    does not, for the same PTX count (lab/results/turboquant_sass_sm121.json; tests/test_kernels_compile.py
    checks both Tritons), and at every verify step: the Spark's verify tile puts its 4 warps over the 64 rows,
    so a pure decoder decodes each key in every warp. The Spark's code timed on an H200 with wgmma off
    (lab/results/turboquant_tiles_h200_mma_sync.json at b1cf961: a ranking, not a Spark time), once takes 5-22%
    less time at a verify step for every preset at 32K and 256K, batch 1 and 8 (K4V4 9-16%, K4V3 5-9%, K8V4
    13-22%; K4V4 1.30-2.36x folded BF16 on that GPU against 1.43-2.81x pure), and 4-11% more at T = 1 for 4-bit
    values."""
    if capability is None:
        return False
    if preset.v_bits == 3 and T == 1:
        return True
    if _mma_sync_only(capability):
        return T > 1
    return preset.k_bits == 8 and T > 1


def prefill_tile(G: int, capability: tuple[int, int] | None) -> tuple[int, int]:
    """(query positions, keys) per prefill tile; rows = positions x G query heads. sm_90: 64 rows, 64 keys
    (the decode kernel's verify-step tile). mma.sync-only parts: 32 rows, 16 keys, which ptxas fits on sm_121
    without spilling for every preset and both tracks' Tritons (64 rows spill ~1,000 bytes per thread; 32 rows
    with 32 keys spill 8 bytes at K4V4 and K8V4 with Triton 3.7.1 since the sign-magnitude decoder, with 64
    keys 8 bytes at K4V3 before it). The sm_90 tile as timed on an H200 (64K context, 2K chunk): 27.2 ms;
    8 positions x 64 keys with 8 warps 25.2 ms, 8 x 32 43.5 ms (lab/results/turboquant_prefill_h200.json,
    prefill_sweep); this fused kernel is the fallback path (ONESPARK_TQ_PREFILL=triton), so it keeps the
    spill-checked tile. The sm_121 tile is not timed: no Spark here."""
    if _mma_sync_only(capability):
        return max(1, 32 // G), 16
    return max(1, 64 // G), 64


def num_splits_for(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int, waves: int = 2) -> int:
    """Enough (sequence, head, split) programs to fill the GPU `waves` times over, each with >= 4 tiles
    of work. Depends only on host-known sizes, so a CUDA graph captured for max_seq_len stays valid."""
    want = triton.cdiv(waves * num_sms, batch * num_kv_heads)
    most = max(1, triton.cdiv(max_seq_len, 4 * block_n))
    return max(1, min(want, most, 256))


def decode_attention(
    q, cache, layout: tq.CacheLayout, block_table, seq_lens, seed: int, sm_scale: float, max_seq_len: int,
    num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None, num_stages: int = 2,
    decoder: str = "prmt", waves: int = 4, once: bool | None = None, block_m: int | None = None,
    lazy: bool = False, out=None, merge_how: str = "fwht",
):
    """q [B, Hq, T, d] -> out [B, Hq, T, d] (q's dtype). seq_lens [B] int32 on the device (no sync);
    max_seq_len: a host-side upper bound that sizes the split grid. block_n, num_warps, once: None picks the
    measured choice for this GPU (decode_block_n, decode_num_warps, decode_once); decoder="gather" is the
    previous decoder (L1 gathers from the codebook), kept selectable. block_m: query rows per tile (a power
    of two >= 16); None is all G * T rows of a KV head in one tile, fewer splits them over programs that each
    read the KV head's codes. lazy: _attend_tile's conditional rescale. merge_how: MERGES."""
    B, Hq, T, d = q.shape
    H = layout.num_kv_heads
    check_decode(q, cache, layout, block_table, seq_lens, max_seq_len, "decode_attention")
    if decoder not in ("prmt", "gather"):
        raise ValueError(f"decoder must be 'prmt' or 'gather', got {decoder!r}")
    G = Hq // H
    rows = max(16, triton.next_power_of_2(G * T))
    if block_m is None:
        block_m = rows
    if block_m < 16 or block_m & (block_m - 1) or block_m > rows:
        raise ValueError(f"block_m must be a power of two in [16, {rows}], got {block_m}")
    row_tiles = triton.cdiv(G * T, block_m)
    if block_n is None:
        block_n = decode_block_n(T, _capability(q.device), layout.preset.v_bits)
    if num_warps is None:
        num_warps = decode_num_warps(T, _capability(q.device), layout.preset.v_bits)
    if once is None:
        once = decode_once(T, _capability(q.device), layout.preset)
    t = _tables(layout.preset, seed, q.device, d)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = num_splits_for(B, H, max_seq_len, block_n, sms, waves)
    # R^T entries are +-1/16, exact in q's dtype; the rotated q is rounded once to that dtype
    qr = torch.matmul(q, t["rt"][q.dtype])
    qk = sm_scale * LOG2E  # the kernel's softmax is base 2
    k_mul = qk * (t["kdelta"] or 1.0)
    v_mul = t["vdelta"] or 1.0
    ws_acc = torch.empty(B * H * num_splits * row_tiles * block_m * d, dtype=torch.float32, device=q.device)
    ws_ml = torch.empty(B * H * num_splits * row_tiles * block_m * 2, dtype=torch.float32, device=q.device)
    _tq_decode_kernel[(B * H * row_tiles, num_splits)](
        qr, qr.stride(0), qr.stride(1), qr.stride(2), cache, cache.view(torch.float32), block_table, block_table.stride(0),
        seq_lens, t["kcb"], t["vcb"], ws_acc, ws_ml, num_splits,
        layout.block_bytes, layout.v_offset, layout.s_offset, k_mul, v_mul,
        H=H, G=G, T=T, PAGE=layout.page, K_BITS=layout.preset.k_bits, V_BITS=layout.preset.v_bits,
        PRMT=decoder == "prmt" and q.is_cuda, ONCE=once, D=d, BLOCK_M=block_m, BLOCK_N=block_n, ROW_TILES=row_tiles,
        LAZY=lazy, num_warps=num_warps, num_stages=num_stages,
    )
    if out is None:
        out = torch.empty_like(q)
    return merge(ws_acc, ws_ml, t, out, B, H, G, T, row_tiles * block_m, num_splits, how=merge_how)


# ---------------------------------------------------------------------------------------------
# Prefill attention (prompt chunks, chunked-prefill continuations, any query length)


@triton.jit
def _tq_prefill_kernel(
    Q, stride_qt, stride_qh, O, stride_ot, stride_oh, CACHE, CACHE_F32, BLOCK_TABLE, stride_bt, SEQ_LENS, Q_START,
    KTAB, VTAB, block_bytes, v_offset, s_offset, k_mul, v_mul,
    H: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    PRMT: tl.constexpr, ONCE: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (block of BLOCK_P query positions, KV head, request): the G query heads of the
    KV head at those positions form the tile (row = position * G + g), which attends to every cached
    key it may see, the chunk's own keys included (they were encoded first), in one pass: no splits,
    O gets the normalised output still in the rotated basis, fp32."""
    tl.static_assert(D == 256)
    qb = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.program_id(2)
    qs = tl.load(Q_START + req)
    ql = tl.load(Q_START + req + 1) - qs
    p0 = qb * BLOCK_P
    if p0 < ql:  # the grid is sized for the longest request
        L = tl.load(SEQ_LENS + req)
        r = tl.arange(0, BLOCK_M)
        pos = p0 + r // G
        rvalid = (r < BLOCK_P * G) & (pos < ql)
        head = h * G + r % G
        tokrow = (qs + pos).to(tl.int64)
        q0, q1, q2, q3 = _load_q(Q + tokrow * stride_qt + head * stride_qh, rvalid)
        last = L - ql + pos  # the query at chunk position pos is token L - ql + pos of the sequence
        end = L - ql + tl.minimum(p0 + BLOCK_P, ql)  # keys the block's last position sees

        m_i, l_i, acc0, acc1, acc2, acc3 = _empty_state(BLOCK_M)
        bt_row = BLOCK_TABLE + req.to(tl.int64) * stride_bt
        for n0 in range(0, end, BLOCK_N):
            m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile(
                CACHE, CACHE_F32, bt_row, n0, end, last, h, q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3,
                KTAB, VTAB, block_bytes, v_offset, s_offset, k_mul, v_mul,
                H, PAGE, K_BITS, V_BITS, PRMT, ONCE, D, BLOCK_N, False)

        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # every valid row sees key 0 at least: l > 0
        c64 = tl.arange(0, 64)
        orow = O + tokrow[:, None] * stride_ot + head[:, None] * stride_oh + c64[None, :]
        tl.store(orow, acc0 * inv[:, None], mask=rvalid[:, None])
        tl.store(orow + 64, acc1 * inv[:, None], mask=rvalid[:, None])
        tl.store(orow + 128, acc2 * inv[:, None], mask=rvalid[:, None])
        tl.store(orow + 192, acc3 * inv[:, None], mask=rvalid[:, None])


def prefill_attention(
    q, cache, layout: tq.CacheLayout, block_table, seq_lens, query_start_loc, seed: int, sm_scale: float,
    max_query_len: int, block_p: int | None = None, block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
    decoder: str = "prmt",
):
    """Attention for any batch of requests with any query lengths, straight from the compressed cache.

    q [N, Hq, d]: the batch's query tokens, request i's at rows query_start_loc[i]:query_start_loc[i + 1]
    (int32 [R + 1] on the device, starting at 0 and ending at N); they are the last ones of its
    seq_lens[i] tokens, whose K/V are already in the cache (encode runs first). Causal. -> [N, Hq, d] in
    q's dtype. max_query_len (host side) sizes the grid; nothing is synchronised.
    """
    N, Hq, d = q.shape
    H = layout.num_kv_heads
    _check_attention(Hq, d, cache, layout, "prefill_attention")
    R = block_table.shape[0]
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be int32 [requests, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (R,):
        raise ValueError(f"seq_lens must be int32 [{R}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (R + 1,):
        raise ValueError(f"query_start_loc must be int32 [{R + 1}], got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if decoder not in ("prmt", "gather"):
        raise ValueError(f"decoder must be 'prmt' or 'gather', got {decoder!r}")
    G = Hq // H
    if block_p is None or block_n is None:
        bp, bn = prefill_tile(G, _capability(q.device))
        block_p, block_n = block_p or bp, block_n or bn
    block_m = max(16, triton.next_power_of_2(block_p * G))
    t = _tables(layout.preset, seed, q.device, d)
    qr = torch.matmul(q, t["rt"][q.dtype])
    o_rot = torch.empty(N, Hq, d, dtype=torch.float32, device=q.device)
    if N and R and max_query_len > 0:
        _tq_prefill_kernel[(triton.cdiv(max_query_len, block_p), H, R)](
            qr, qr.stride(0), qr.stride(1), o_rot, o_rot.stride(0), o_rot.stride(1), cache, cache.view(torch.float32),
            block_table, block_table.stride(0), seq_lens, query_start_loc, t["kcb"], t["vcb"],
            layout.block_bytes, layout.v_offset, layout.s_offset, sm_scale * LOG2E * (t["kdelta"] or 1.0),
            t["vdelta"] or 1.0,
            H=H, G=G, PAGE=layout.page, K_BITS=layout.preset.k_bits, V_BITS=layout.preset.v_bits,
            PRMT=decoder == "prmt" and q.is_cuda, ONCE=False, D=d, BLOCK_P=block_p, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps, num_stages=num_stages,
        )
    return torch.matmul(o_rot, t["r"]).to(q.dtype)  # back from the rotated basis: o = o_rot @ R


# ---------------------------------------------------------------------------------------------
# Prefill by dequantize + flash: the backend's default prefill path on CUDA
#
# Prefill is compute-bound (a 2K chunk at 128K context is ~2.2 TFLOP per layer), so decoding the cache
# once into BF16 and handing it to a flash kernel costs only the decode pass: K+V of 128K tokens, 2 KV heads,
# K4V4 is 35 MB read + 268 MB written, ~0.1 ms on an H200 against ~28 ms of attention (lab/results/
# turboquant_prefill_h200.json). The fused `prefill_attention` above decodes every key once per block of
# query positions instead, and its mma.sync/wgmma code is Triton's, not FlashAttention's.


@triton.jit
def _tq_dequant_kernel(
    CACHE, CACHE_F32, BT_ROW, t0, n, K_OUT, V_OUT, stride_oh, KTAB, VTAB, block_bytes, v_offset, s_offset, k_mul, v_mul,
    H: tl.constexpr, PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, PRMT: tl.constexpr,
    D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Tokens [t0, t0 + n) of one sequence, KV head program_id(1): K and V as codebook value x scale in the
    rotated basis, written to K_OUT/V_OUT [H, n, D] (rows i = token t0 + i) in their dtype."""
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(1)
    nmask = i < n
    tok = t0 + i
    blk = tl.load(BT_ROW + tok // PAGE, mask=nmask, other=0).to(tl.int64)
    row = (tok % PAGE) * H + h
    base = blk * block_bytes
    KB: tl.constexpr = K_BITS * D // 8
    VB: tl.constexpr = V_BITS * D // 8
    sidx = (base + s_offset) // 4 + row * 2
    ks = tl.load(CACHE_F32 + sidx, mask=nmask, other=0.0) * k_mul
    vs = tl.load(CACHE_F32 + sidx + 1, mask=nmask, other=0.0) * v_mul
    c64 = tl.arange(0, 64)
    out = h.to(tl.int64) * stride_oh + i.to(tl.int64)[:, None] * D + c64[None, :]
    k0, k1, k2, k3 = _codes(CACHE, tl.multiple_of(base + row * KB, 16), nmask, KTAB, K_BITS, PRMT, False, D)
    ty = K_OUT.dtype.element_ty
    tl.store(K_OUT + out, (k0 * ks[:, None]).to(ty), mask=nmask[:, None])
    tl.store(K_OUT + out + 64, (k1 * ks[:, None]).to(ty), mask=nmask[:, None])
    tl.store(K_OUT + out + 128, (k2 * ks[:, None]).to(ty), mask=nmask[:, None])
    tl.store(K_OUT + out + 192, (k3 * ks[:, None]).to(ty), mask=nmask[:, None])
    v0, v1, v2, v3 = _codes(CACHE, tl.multiple_of(base + v_offset + row * VB, 16), nmask, VTAB, V_BITS, PRMT, False, D)
    tl.store(V_OUT + out, (v0 * vs[:, None]).to(ty), mask=nmask[:, None])
    tl.store(V_OUT + out + 64, (v1 * vs[:, None]).to(ty), mask=nmask[:, None])
    tl.store(V_OUT + out + 128, (v2 * vs[:, None]).to(ty), mask=nmask[:, None])
    tl.store(V_OUT + out + 192, (v3 * vs[:, None]).to(ty), mask=nmask[:, None])


def dequantize_rotated(cache, layout: tq.CacheLayout, block_table_row, t0: int, t1: int, seed: int, dtype,
                       block_n: int = 64, decoder: str = "prmt"):
    """Tokens [t0, t1) of one sequence as (K, V), each [H, t1 - t0, d] in dtype, still in the rotated basis
    (what `turboquant.read_rotated` computes in plain torch; here the codebook values are fp16)."""
    _check_cache(cache, layout)
    if block_table_row.dtype != torch.int32 or block_table_row.dim() != 1:
        raise ValueError(f"block_table_row must be int32 [max_blocks], got {block_table_row.dtype} "
                         f"{tuple(block_table_row.shape)}")
    if not 0 <= t0 <= t1 <= block_table_row.shape[0] * layout.page:
        raise ValueError(f"tokens [{t0}, {t1}) are outside the block table ({block_table_row.shape[0]} blocks)")
    H, d, n = layout.num_kv_heads, layout.head_dim, t1 - t0
    k = torch.empty(H, n, d, dtype=dtype, device=cache.device)
    v = torch.empty_like(k)
    if n:
        t = _tables(layout.preset, seed, cache.device, d)
        _tq_dequant_kernel[(triton.cdiv(n, block_n), H)](
            cache, cache.view(torch.float32), block_table_row, t0, n, k, v, k.stride(0), t["kcb"], t["vcb"],
            layout.block_bytes, layout.v_offset, layout.s_offset, t["kdelta"] or 1.0, t["vdelta"] or 1.0,
            H=H, PAGE=layout.page, K_BITS=layout.preset.k_bits, V_BITS=layout.preset.v_bits,
            PRMT=decoder == "prmt" and cache.is_cuda, D=d, BLOCK_N=block_n, num_warps=4,
        )
    return k, v


def flash_with_lse(q, k, v, sm_scale: float, causal: bool):
    """q [1, Hq, ql, d], k/v [1, H, n, d] (H divides Hq: GQA without repeating K/V) -> (out [1, Hq, ql, d]
    in q's dtype, logsumexp [1, Hq, ql] fp32 of the scaled scores). causal: lower-right aligned (query i
    sees keys up to n - ql + i), which is what this flash op's is_causal means (torch.nn.attention.bias)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=sm_scale)[:2]
    return out, lse


def merge_lse(acc, acc_lse, out, lse):
    """Attention over two disjoint key sets -> over their union, from each one's normalised output
    [..., ql, d] and log-sum-exp [..., ql]; acc None starts the running merge. fp32 throughout."""
    out, lse = out.float(), lse.float()
    if acc is None:
        return out, lse
    m = torch.maximum(acc_lse, lse)
    a, b = torch.exp(acc_lse - m), torch.exp(lse - m)
    return (acc * a[..., None] + out * b[..., None]) / (a + b)[..., None], m + torch.log(a + b)


# Keys decoded per flash call: bounds the BF16 scratch at 2 x 2 heads x 32K x 256 x 2 B = 64 MiB per layer-step
# whatever the context length (256K keys at once would take 512 MiB that vLLM's profiling run never sees).
PREFILL_KV_CHUNK = 32768


def prefill_attention_flash(q, cache, layout: tq.CacheLayout, block_table_row, seq_len: int, seed: int,
                            sm_scale: float, kv_chunk: int = PREFILL_KV_CHUNK, attend=flash_with_lse):
    """One request's ql query tokens q [ql, Hq, d] (the last of its seq_len tokens, all already in the cache),
    causal -> [ql, Hq, d] in q's dtype. The last piece of keys (max(kv_chunk, ql) of them, the chunk's own
    included) goes through `attend` with lower-right causal masking, the keys before it in pieces of at most
    kv_chunk that every query sees whole; the pieces are merged by their log-sum-exp (one piece, one call: a
    sequence of up to kv_chunk keys is exactly the BF16 flash call). All in the rotated basis
    (q . x_hat = scale * (R q) . c); the output is rotated back in q's dtype (R's entries +-1/16 are exact)."""
    ql, Hq, d = q.shape
    if not 0 < ql <= seq_len:
        raise ValueError(f"query length {ql} must be in [1, seq_len={seq_len}]")
    t = _tables(layout.preset, seed, q.device, d)
    rt = t["rt"][q.dtype]
    qr = torch.matmul(q, rt).transpose(0, 1)[None]  # [1, Hq, ql, d]
    last = min(seq_len - ql, max(0, seq_len - kv_chunk))  # first key of the causal piece
    pieces = [(c0, min(last, c0 + kv_chunk), False) for c0 in range(0, last, kv_chunk)] + [(last, seq_len, True)]
    acc = acc_lse = None
    for c0, c1, causal in pieces:
        k, v = dequantize_rotated(cache, layout, block_table_row, c0, c1, seed, q.dtype)
        out, lse = attend(qr, k[None], v[None], sm_scale, causal)
        acc, acc_lse = (out, lse) if len(pieces) == 1 else merge_lse(acc, acc_lse, out, lse)
    return torch.matmul(acc[0].transpose(0, 1).to(q.dtype), rt.T)
