"""Two candidate decoders for the TurboQuant decode kernel, each the shipped kernel with one part swapped.

Not shipped and not yet timed (written 2026-12-04 with no device time left; `bench/lab/turboquant.py` times them
beside the shipped kernel as the sweep's `impl=prmt3` and `impl=once` rows). Static counts:
bench/results/turboquant_sass.json (sm_90) and turboquant_sass_sm121.json (the Spark's sm_121), from
`bench/lab/turboquant_sass.py`.

`prmt3`: 3-bit codes by PRMT byte lookups in registers. The shipped kernel gathers each 3-bit value from the
8-entry fp16 table: a load per value, in the load's layout, which Triton then takes through shared memory into the
mma operand layout (K4V3 takes 1.6-3.0x K4V4's time at 32K-256K on an H200 for 12% fewer bytes:
turboquant_h200.json at e81c79e). The 8 fp16 levels fit one PRMT table pair and a 3-bit code is a PRMT selector as
it stands, so no sign trick is needed. Per 4 values (one 32-bit word of each plane): 2 ops take the low 2 bits, 6
the high bit (it sits one place up for coordinates 32-63 of each 64: a per-byte mask, loop-invariant, picks it), 3
make the selector, 4 PRMT look up and pair: 15 ops, no memory access.

`once`: every code decoded once per tile. The shipped decoders are marked pure, so Triton may recompute them in
the mma operand layout of each warp that needs the value: with the warps split over the tile's query rows, every
warp decodes every key. That is the Spark's verify tile (mma.sync, 64 rows x 16 keys, 4 warps over the rows: each
key decoded 4 times) and, less so, the H200's 16-row tile (2 warps). Marked not pure, the decode stays where the
bytes are loaded, once per value, and Triton moves the fp16 values into the operand layout through shared memory.
The asm is the same; only what the compiler may do with it changes. It applies to `prmt3`'s 3-bit decoder too, and
8-bit codes (plain Triton arithmetic as shipped, recomputed per warp the same way) get an asm of the same math.

Each kernel is the shipped @triton.jit source compiled with some of its globals swapped (`_rebind`), so the rest
is the shipped code, not a copy of it.
"""

from __future__ import annotations

import contextlib
import types

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_triton as tt


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


# 8-bit codes: code - 127.5 in fp16, as the shipped _u8_centred computes it (fp16 bits 0x6000 | (b << 1) are
# 512 + b, and 512 + b - 639.5 is exact), as two byte spreads, a shift, an OR and a half-pair subtract per 2 values.
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
_B3_0 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 0))
_B3_1 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 1))
_B3_2 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 2))
_B3_3 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 3))


@triton.jit
def _asm1(src: tl.constexpr, a, PURE: tl.constexpr):
    """A decoder asm over pack=4 bytes of `a` -> fp16; PURE lets Triton recompute it in any layout (the shipped way)."""
    if PURE:
        out = tl.inline_asm_elementwise(src, "=r,=r,r", [a], dtype=tl.float16, is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(src, "=r,=r,r", [a], dtype=tl.float16, is_pure=False, pack=4)
    return out


@triton.jit
def _asm3(src: tl.constexpr, a, b, c, PURE: tl.constexpr):
    """_asm1 for a decoder of three byte inputs."""
    if PURE:
        out = tl.inline_asm_elementwise(src, "=r,=r,r,r,r", [a, b, c], dtype=tl.float16, is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(src, "=r,=r,r,r,r", [a, b, c], dtype=tl.float16, is_pure=False, pack=4)
    return out


@triton.jit
def _codes3(CACHE, ptr, nmask, D: tl.constexpr, PURE: tl.constexpr):
    """3-bit codes of BLOCK_N rows by PRMT: four fp16 [BLOCK_N, 64] chunks (coordinates 64a + j)."""
    j = tl.arange(0, 64)
    lo = tl.load(CACHE + ptr[:, None] + j[None, :], mask=nmask[:, None], other=0)
    hb = tl.load(CACHE + ptr[:, None] + D // 4 + (j % 32)[None, :], mask=nmask[:, None], other=0)
    up = tl.broadcast_to(tl.where(j >= 32, 255, 0).to(tl.uint8)[None, :], lo.shape)
    c0 = _asm3(_B3_0, lo, hb, up, PURE)
    c1 = _asm3(_B3_1, lo, hb, up, PURE)
    c2 = _asm3(_B3_2, lo, hb, up, PURE)
    c3 = _asm3(_B3_3, lo, hb, up, PURE)
    return c0, c1, c2, c3


@triton.jit
def _nibbles_once(CACHE, ptr, nmask, HALF: tl.constexpr):
    """The shipped 4-bit PRMT decoder (tt._nibbles), not pure: decoded once, where the bytes are loaded."""
    b = tl.load(CACHE + ptr[:, None] + (HALF * 64 + tl.arange(0, 64))[None, :], mask=nmask[:, None], other=0)
    return _asm1(tt._BYTE_LO, b, False), _asm1(tt._BYTE_HI, b, False)


@triton.jit
def _codes8_once(CACHE, ptr, nmask):
    """8-bit codes of BLOCK_N rows, code - 127.5, decoded once where loaded: four fp16 [BLOCK_N, 64] chunks."""
    row = CACHE + ptr[:, None] + tl.arange(0, 64)[None, :]
    c0 = _asm1(_U8_ASM, tl.load(row, mask=nmask[:, None], other=0), False)
    c1 = _asm1(_U8_ASM, tl.load(row + 64, mask=nmask[:, None], other=0), False)
    c2 = _asm1(_U8_ASM, tl.load(row + 128, mask=nmask[:, None], other=0), False)
    c3 = _asm1(_U8_ASM, tl.load(row + 192, mask=nmask[:, None], other=0), False)
    return c0, c1, c2, c3


@triton.jit
def _codes_prmt3(CACHE, ptr, nmask, TAB, BITS: tl.constexpr, PRMT: tl.constexpr, D: tl.constexpr):
    """The shipped _codes, with 3-bit codes decoded by PRMT on the GPU (the interpreter keeps the gathers)."""
    if BITS == 3 and PRMT:
        c0, c1, c2, c3 = _codes3(CACHE, ptr, nmask, D, True)
    else:
        c0, c1, c2, c3 = tt._codes(CACHE, ptr, nmask, TAB, BITS, PRMT, D)
    return c0, c1, c2, c3


@triton.jit
def _codes_once(CACHE, ptr, nmask, TAB, BITS: tl.constexpr, PRMT: tl.constexpr, D: tl.constexpr):
    """_codes_prmt3 with every decoder an asm that is not pure: each code decoded once per tile."""
    if BITS == 3 and PRMT:
        c0, c1, c2, c3 = _codes3(CACHE, ptr, nmask, D, False)
    elif BITS == 4 and PRMT:
        c0, c2 = _nibbles_once(CACHE, ptr, nmask, 0)
        c1, c3 = _nibbles_once(CACHE, ptr, nmask, 1)
    elif BITS == 8 and PRMT:
        c0, c1, c2, c3 = _codes8_once(CACHE, ptr, nmask)
    else:
        c0, c1, c2, c3 = tt._codes(CACHE, ptr, nmask, TAB, BITS, PRMT, D)
    return c0, c1, c2, c3


def _rebind(fn: JITFunction, **names) -> JITFunction:
    """`fn`'s source compiled with the globals `names` swapped in: the shipped kernel calling a candidate part."""
    py = fn.fn
    new = types.FunctionType(py.__code__, {**py.__globals__, **names}, py.__name__, py.__defaults__, py.__closure__)
    new.__doc__, new.__qualname__, new.__annotations__ = py.__doc__, py.__qualname__, py.__annotations__
    return triton.jit(new)


KERNELS = {name: _rebind(tt._tq_decode_kernel, _attend_tile=_rebind(tt._attend_tile, _codes=codes))
           for name, codes in (("prmt3", _codes_prmt3), ("once", _codes_once))}


@contextlib.contextmanager
def _kernel_swapped(kernel: JITFunction):
    """tt.decode_attention launching `kernel`; its host code (tiles, splits, checks) is the shipped."""
    shipped = tt._tq_decode_kernel
    tt._tq_decode_kernel = kernel
    try:
        yield
    finally:
        tt._tq_decode_kernel = shipped


def decode_attention(impl: str, *args, **kwargs):
    """tt.decode_attention (same arguments) with candidate `impl` ("prmt3" or "once")."""
    with _kernel_swapped(KERNELS[impl]):
        return tt.decode_attention(*args, **kwargs)
