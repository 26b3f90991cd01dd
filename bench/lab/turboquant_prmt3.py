"""A candidate 3-bit decoder for the TurboQuant decode kernel: PRMT byte lookups, as the 4-bit codes have.

Not shipped and not yet timed (written 2026-12-04 with no device time left; `bench/lab/turboquant.py` times it
beside the shipped kernel as the sweep's `impl=prmt3` rows, K4V3). The shipped kernel decodes 3-bit values by a
gather per value from the 8-entry fp16 table (`_codes`, BITS == 3): a global load each, and values that arrive
in the load's layout, so Triton takes them through shared memory into the mma operand layout. In sm_90 machine
code that loop issues 12,016 warp instructions per 64 keys at q_len 1 (816 shared stores, 552 loads, 192
barriers) against 5,388 for K4V4 (bench/results/turboquant_sass.json at fe5a10b), and K4V3 decode takes 1.7-2.5x
K4V4's time on an H200 for 12% fewer bytes.

Here each value is looked up in registers: the 8 fp16 levels fit one PRMT source pair (8 low bytes, 8 high
bytes), and a 3-bit code is a PRMT byte selector as it stands, so no sign trick is needed. Per 4 values (one
32-bit word of each plane): 2 ops take the low 2 bits, 6 the high bit (the bit sits one place up for
coordinates 32-63 of each 64: a per-byte mask, loop-invariant, picks it), 3 make the selector, 4 PRMT look up
and pair: 15 ops, no memory access, and the values are made in whatever layout the product wants (the decoder
is per byte, like the 4-bit one).

The kernel is the shipped one with `_codes` replaced (`_rebind`: the shipped @triton.jit source, its globals
copied and the named ones swapped), so everything else is the shipped code, not a copy of it.
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


_B3_0 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 0))
_B3_1 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 1))
_B3_2 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 2))
_B3_3 = tl.constexpr(_byte3_asm(tq.codebook(3).levels, 3))


@triton.jit
def _codes(CACHE, ptr, nmask, TAB, BITS: tl.constexpr, PRMT: tl.constexpr, D: tl.constexpr):
    """The shipped _codes, with 3-bit codes decoded by PRMT on the GPU (the interpreter keeps the gathers)."""
    if BITS == 3 and PRMT:
        j = tl.arange(0, 64)
        lo = tl.load(CACHE + ptr[:, None] + j[None, :], mask=nmask[:, None], other=0)
        hb = tl.load(CACHE + ptr[:, None] + D // 4 + (j % 32)[None, :], mask=nmask[:, None], other=0)
        up = tl.broadcast_to(tl.where(j >= 32, 255, 0).to(tl.uint8)[None, :], lo.shape)
        c0 = tl.inline_asm_elementwise(_B3_0, "=r,=r,r,r,r", [lo, hb, up], dtype=tl.float16, is_pure=True, pack=4)
        c1 = tl.inline_asm_elementwise(_B3_1, "=r,=r,r,r,r", [lo, hb, up], dtype=tl.float16, is_pure=True, pack=4)
        c2 = tl.inline_asm_elementwise(_B3_2, "=r,=r,r,r,r", [lo, hb, up], dtype=tl.float16, is_pure=True, pack=4)
        c3 = tl.inline_asm_elementwise(_B3_3, "=r,=r,r,r,r", [lo, hb, up], dtype=tl.float16, is_pure=True, pack=4)
    else:
        c0, c1, c2, c3 = tt._codes(CACHE, ptr, nmask, TAB, BITS, PRMT, D)
    return c0, c1, c2, c3


def _rebind(fn: JITFunction, **names) -> JITFunction:
    """`fn`'s source compiled with the globals `names` swapped in: the shipped kernel calling a candidate part."""
    py = fn.fn
    new = types.FunctionType(py.__code__, {**py.__globals__, **names}, py.__name__, py.__defaults__, py.__closure__)
    new.__doc__, new.__qualname__, new.__annotations__ = py.__doc__, py.__qualname__, py.__annotations__
    return triton.jit(new)


_KERNEL = _rebind(tt._tq_decode_kernel, _attend_tile=_rebind(tt._attend_tile, _codes=_codes))


@contextlib.contextmanager
def _kernel_swapped():
    """tt.decode_attention launching the candidate kernel; its host code (tiles, splits, checks) is the shipped."""
    shipped = tt._tq_decode_kernel
    tt._tq_decode_kernel = _KERNEL
    try:
        yield
    finally:
        tt._tq_decode_kernel = shipped


def decode_attention_prmt3(*args, **kwargs):
    """tt.decode_attention (same arguments) with the candidate 3-bit decoder."""
    with _kernel_swapped():
        return tt.decode_attention(*args, **kwargs)
