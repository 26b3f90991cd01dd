"""The candidate decoders (bench/lab/turboquant_decoders.py): the 3-bit PRMT decoder's PTX, executed op by op against
the reference packing and codebook, and both candidate kernels against the float64 reference and the shipped
kernel. The kernel cases run with CUDA in this process (the PRMT paths) and, without it, in Triton's interpreter in
a child pytest (the interpreter has no inline PTX: there they check that the rebound kernels are the shipped one)."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_triton as tt
from tests._interpreter import run_interpreter_lane
from tests.test_turboquant_triton import DECODE_CASES, _run_ptx, assert_rel, decode_case

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "lab"))
import turboquant_decoders as dec  # noqa: E402  (a lab module)

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
kernel_case = pytest.mark.skipif(not (CUDA or INTERPRET), reason="CPU: runs in the interpreter child (test_interpreter_lane)")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.skipif(INTERPRET, reason="pure Python: runs in the parent")
@pytest.mark.parametrize("chunk", range(4))
def test_byte3_ptx_decodes_every_code_in_every_position(chunk):
    """Every element of 64 reference-packed rows (tq.pack, 3 bits), taken 4 at a time in a shuffled order (a
    decoder per byte must not care which row or column its 4 bytes come from: 4 columns of one row for the
    scores, 4 tokens of one column for the values), comes out as the fp16 bits of codebook[code]; every code is
    seen in every byte position, for columns whose high bit sits at bit 2 * chunk and at 2 * chunk + 1."""
    want = tq.codebook(3).levels.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    asm = dec._byte3_asm(tq.codebook(3).levels, chunk)
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


@pytest.mark.skipif(INTERPRET, reason="pure Python: runs in the parent")
def test_u8_ptx_is_the_shipped_centred_code_for_every_byte_in_every_position():
    """The 8-bit asm turns byte k of its input into the fp16 bits of code - 127.5 (what the shipped _u8_centred
    computes, exactly), for all 256 codes in each of the 4 positions beside random neighbours."""
    want = (torch.arange(256, dtype=torch.float64) - 127.5).to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    g = torch.Generator().manual_seed(8)
    for pos in range(4):
        for code in range(256):
            bs = torch.randint(0, 256, (4,), generator=g).tolist()
            bs[pos] = code
            o0, o1 = _run_ptx(dec._U8_ASM.value, sum(b << (8 * k) for k, b in enumerate(bs)))
            assert [o0 & 0xFFFF, o0 >> 16, o1 & 0xFFFF, o1 >> 16] == [int(want[b]) for b in bs], f"bytes {bs}"


@pytest.mark.skipif(INTERPRET, reason="pure Python: runs in the parent")
def test_byte3_tables_hold_the_codebook():
    """The four table words are the low and high bytes of the 8 fp16 levels, in code order."""
    import re

    lev = tq.codebook(3).levels.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    words = [int(x, 16) for x in re.findall(r"mov\.b32 t\d, (0x[0-9a-f]+);", dec._byte3_asm(
        tq.codebook(3).levels, 0))]
    got = [((words[2 + c // 4] >> (8 * (c % 4))) & 0xFF) << 8 | ((words[c // 4] >> (8 * (c % 4))) & 0xFF) for c in range(8)]
    assert got == lev.tolist()
    with pytest.raises(AssertionError, match="8-entry"):
        dec._byte3_asm(tq.codebook(4).levels, 0)


# (impl, preset, tile): prmt3 on K4V3 at the shipped tile and K4V4's sm_90 one; once on every preset
CANDIDATE_CASES = [("prmt3", "turboquant_k4v3", None), ("prmt3", "turboquant_k4v3", (64, 2))] + [
    ("once", name, None) for name in tq.PRESETS]


@kernel_case
@pytest.mark.parametrize("impl,name,tile", CANDIDATE_CASES)
@pytest.mark.parametrize("B,Hq,H,T,lens,page,splits", DECODE_CASES)
def test_candidate_decode_matches_reference_and_the_shipped_kernel(B, Hq, H, T, lens, page, splits, impl, name, tile):
    if INTERPRET and (tile or name != "turboquant_k4v3"):
        pytest.skip("the interpreter runs the shipped decoders: K4V3 at one tile checks each rebinding")
    args, ref = decode_case(name, B, Hq, H, T, lens, page)
    kw = dict(block_n=tile[0], num_warps=tile[1]) if tile else {}
    out = dec.decode_attention(impl, *args, num_splits=splits, **kw)
    assert_rel(out.float(), ref, 3e-3, f"{name} decode, candidate {impl}")
    shipped = tt.decode_attention(*args, num_splits=splits)
    assert_rel(out.float(), shipped.float(), 2e-3, f"{impl} vs shipped")  # the same values, other op order
    assert tt._tq_decode_kernel not in dec.KERNELS.values(), "the shipped kernel is back after the call"


@pytest.mark.skipif(CUDA or INTERPRET, reason="kernel cases run in this process")
def test_interpreter_lane():
    out = run_interpreter_lane(__file__, timeout_s=900)
    assert f"{2 * len(DECODE_CASES)} passed" in out.splitlines()[-1], out[-2000:]
