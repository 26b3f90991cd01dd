"""The decode kernel's register decoders beyond the 4-bit one (tests/test_turboquant_triton.py has that): the 3-bit
PRMT decoder's PTX and the 8-bit decode-once asm, executed op by op against the reference packing and codebook on
the CPU; on a GPU, every preset decoded pure and decoded once (turboquant_triton.decode_once), at the shipped tiles
and others, against the float64 reference. The PTX cannot run in Triton's interpreter, so the kernel cases need CUDA
(tests/gpu.sh runs this file on the GPU lane)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_triton as tt
from tests.test_turboquant_triton import DECODE_CASES, _run_ptx, assert_rel, decode_case

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("chunk", range(4))
def test_byte3_ptx_decodes_every_code_in_every_position(chunk):
    """Every element of 64 reference-packed rows (tq.pack, 3 bits), taken 4 at a time in a shuffled order (a
    decoder per byte must not care which row or column its 4 bytes come from: 4 columns of one row for the
    scores, 4 tokens of one column for the values), comes out as the fp16 bits of codebook[code]; every code is
    seen in every byte position, for columns whose high bit sits at bit 2 * chunk and at 2 * chunk + 1."""
    want = tq.codebook(3).levels.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    asm = tt._byte3_asm(tq.codebook(3).levels, chunk)
    g = torch.Generator().manual_seed(chunk)
    codes = torch.randint(0, 8, (64, 256), generator=g)
    packed = tq.pack(codes, 3).to(torch.int64)
    assert packed.shape == (64, 96)
    elements = [(r, j) for r in range(64) for j in range(64)]
    seen = set()
    for order in range(2):
        random.Random(order).shuffle(elements)
        for i in range(0, len(elements), 4):
            group = elements[i:i + 4]
            lo = sum(int(packed[r, j]) << (8 * k) for k, (r, j) in enumerate(group))
            hb = sum(int(packed[r, 64 + j % 32]) << (8 * k) for k, (r, j) in enumerate(group))
            up = sum((0xFF if j >= 32 else 0) << (8 * k) for k, (r, j) in enumerate(group))
            o0, o1 = _run_ptx(asm, lo, hb, up)
            got = [o0 & 0xFFFF, o0 >> 16, o1 & 0xFFFF, o1 >> 16]
            cs = [int(codes[r, 64 * chunk + j]) for r, j in group]
            assert got == [int(want[c]) for c in cs], f"chunk {chunk}, elements {group}, codes {cs}"
            seen |= {(k, c, j >= 32) for k, (c, (_, j)) in enumerate(zip(cs, group))}
    assert len(seen) == 4 * 8 * 2


def test_u8_ptx_is_the_shipped_centred_code_for_every_byte_in_every_position():
    """The 8-bit asm turns byte k of its input into the fp16 bits of code - 127.5 (what _u8_centred, the pure path,
    computes, exactly), for all 256 codes in each of the 4 positions beside random neighbours."""
    want = (torch.arange(256, dtype=torch.float64) - 127.5).to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    g = torch.Generator().manual_seed(8)
    for pos in range(4):
        for code in range(256):
            bs = torch.randint(0, 256, (4,), generator=g).tolist()
            bs[pos] = code
            o0, o1 = _run_ptx(tt._U8_ASM.value, sum(b << (8 * k) for k, b in enumerate(bs)))
            assert [o0 & 0xFFFF, o0 >> 16, o1 & 0xFFFF, o1 >> 16] == [int(want[b]) for b in bs], f"bytes {bs}"


def test_byte3_tables_hold_the_codebook():
    """The four table words are the low and high bytes of the 8 fp16 levels, in code order."""
    lev = tq.codebook(3).levels.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    words = [int(x, 16) for x in re.findall(r"mov\.b32 t\d, (0x[0-9a-f]+);", tt._byte3_asm(
        tq.codebook(3).levels, 0))]
    got = [((words[2 + c // 4] >> (8 * (c % 4))) & 0xFF) << 8 | ((words[c // 4] >> (8 * (c % 4))) & 0xFF) for c in range(8)]
    assert got == lev.tolist()
    with pytest.raises(AssertionError, match="8-entry"):
        tt._byte3_asm(tq.codebook(4).levels, 0)


# (preset, once, tile): every preset both ways at its shipped tile; K4V3 also at the tiles it had before and K4V4's
ONCE_CASES = [(name, once, None) for name in tq.PRESETS for once in (False, True)] + [
    ("turboquant_k4v3", True, (64, 2)), ("turboquant_k4v3", False, (32, 4)), ("turboquant_k4v3", True, (128, 4))]


@pytest.mark.skipif(not CUDA, reason="the decoders are PTX: CUDA only (the GPU lane)")
@pytest.mark.parametrize("name,once,tile", ONCE_CASES)
@pytest.mark.parametrize("B,Hq,H,T,lens,page,splits", DECODE_CASES)
def test_decode_pure_and_once_match_the_reference(B, Hq, H, T, lens, page, splits, name, once, tile):
    args, ref = decode_case(name, B, Hq, H, T, lens, page)
    kw = dict(block_n=tile[0], num_warps=tile[1]) if tile else {}
    out = tt.decode_attention(*args, num_splits=splits, once=once, **kw)
    assert_rel(out.float(), ref, 3e-3, f"{name} decode, once={once}, tile {tile}")
    gathers = tt.decode_attention(*args, num_splits=splits, decoder="gather", **kw)
    assert_rel(out.float(), gathers.float(), 2e-3, "PRMT vs gathers")  # the same values, other op order


def test_decode_once_is_chosen_per_gpu_preset_and_q_len():
    """sm_90 (measured): once for 3-bit values at q_len 1 and 8-bit keys at a verify step, else pure; the 3-bit
    q_len-1 tile is 128 keys x 4 warps. mma.sync-only GPUs (their code timed on an H200 with wgmma off): once for
    3-bit values at q_len 1 (the pure decoder spills there with Triton 3.7.1) and at every verify step. CPU
    tensors: pure."""
    p = tq.PRESETS
    h200, spark = (9, 0), (12, 1)
    order = [(n, T) for n in ("turboquant_k4v4", "turboquant_k4v3", "turboquant_k8v4") for T in (1, 3)]
    assert [tt.decode_once(T, h200, p[n]) for n, T in order] == [False, False, True, False, False, True]
    for cap in (spark, (8, 6)):
        assert [tt.decode_once(T, cap, p[n]) for n, T in order] == [False, True, True, True, False, True]
    assert not any(tt.decode_once(T, None, p[n]) for n in p for T in (1, 3))
    assert (tt.decode_block_n(1, h200, 3), tt.decode_num_warps(1, h200, 3)) == (128, 4)
    assert (tt.decode_block_n(3, h200, 3), tt.decode_num_warps(3, h200, 3)) == (64, 4)
    assert (tt.decode_block_n(1, h200, 4), tt.decode_num_warps(1, h200, 4)) == (64, 2)
    assert (tt.decode_block_n(1, spark, 3), tt.decode_block_n(3, spark, 3)) == (32, 16)
