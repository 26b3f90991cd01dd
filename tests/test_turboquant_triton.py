"""TurboQuant Triton kernels against the plain-torch reference (kernels/turboquant.py).

With CUDA the cases run on the GPU in this process. Without it they run in Triton's interpreter, which
must be on before the kernels are decorated (triton.jit reads TRITON_INTERPRET then) and must not be
switched on for the whole pytest process (other modules use Triton too): `test_interpreter_lane` re-runs
this file in a child pytest with TRITON_INTERPRET=1 and fails with the child's report; in the parent the
kernel cases skip. Shapes are small and awkward: odd sequence lengths that leave partial tiles and pages,
scattered blocks, skipped slots, empty splits.
"""

from __future__ import annotations

import importlib.util
import operator
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_triton as tt
from tests._interpreter import run_interpreter_lane

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
kernel_case = pytest.mark.skipif(not (CUDA or INTERPRET), reason="CPU: runs in the interpreter child (test_interpreter_lane)")
DEV = "cuda" if CUDA else "cpu"
# the interpreter's numpy calls warn on every scalar index: noise, not a finding
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SEED = tq.rotation_seed(7)


def assert_rel(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str):
    """Relative Frobenius error with a readable failure: NaN/inf, worst element and where."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    bad = ~torch.isfinite(out)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite values, first at {bad.nonzero()[0].tolist()}"
    err = float((out - ref).norm() / ref.norm())
    diff = (out - ref).abs()
    where = list(divmod(int(diff.argmax()), 1))[0]
    idx = torch.unravel_index(torch.tensor(where), diff.shape)
    assert err < tol, f"{what}: rel err {err:.3g} >= {tol}; worst |diff| {float(diff.max()):.3g} at {[int(i) for i in idx]}"


def paged(lens, page, num_blocks_extra=3, seed=0):
    """A block table with scattered (permuted) blocks for sequences of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lens]
    nb = sum(need) + num_blocks_extra
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i : i + n]
        i += n
    return bt, nb


# ---------------------------------------------------------------------------------------------
# Encode


ENCODE_CASES = [
    pytest.param(name, dtype, n, H, id=f"{name[11:]}-{str(dtype)[6:]}-N{n}-H{H}")
    for name in tq.PRESETS
    for dtype, n, H in ((torch.float32, 37, 2), (torch.float16, 19, 3), (torch.bfloat16, 11, 2))
]


@kernel_case
@pytest.mark.parametrize("name,dtype,n,H", ENCODE_CASES)
def test_encode_matches_reference(name, dtype, n, H):
    lay = tq.CacheLayout(tq.PRESETS[name], num_kv_heads=H, page=16)
    g = torch.Generator().manual_seed(n)
    k = (torch.randn(n, H, 256, generator=g) * 3).to(dtype)
    v = torch.randn(n, H, 256, generator=g).to(dtype)
    k[2] = 0  # a zero vector: scale 0, no NaN
    slots = torch.randperm(6 * 16, generator=g)[:n]
    slots[5] = -1  # padding token: must write nothing
    ref = lay.empty(6)
    tq.encode_reference(k.float(), v.float(), slots, ref, lay, tq.rotation(SEED))
    out = lay.empty(6, device=DEV)
    tt.encode(k.to(DEV), v.to(DEV), slots.to(DEV), out, lay, SEED)
    out = out.cpu()
    kept = slots[slots >= 0]
    kc, ks, vc, vs = tq.read_reference(out, lay, kept)
    rkc, rks, rvc, rvs = tq.read_reference(ref, lay, kept)
    # Codes may differ only where z sits on a boundary to within fp32 rounding of the rotation
    # (the reference rotates in float64): allow 1 in 2000 codes, each off by one level.
    for got, want, what in ((kc, rkc, "K codes"), (vc, rvc, "V codes")):
        mism = got != want
        assert mism.float().mean() < 5e-4, f"{what}: {int(mism.sum())} of {mism.numel()} codes differ"
        assert ((got - want).abs() <= 1).all(), f"{what}: a code off by more than one level"
    assert_rel(ks, rks, 1e-5, "K scales")
    assert_rel(vs, rvs, 1e-5, "V scales")
    if int(slots[2]) >= 0:  # the zero vector: scale exactly 0 (decodes to 0), no NaN
        assert ks[kept.tolist().index(int(slots[2]))].abs().sum() == 0
    # nothing written outside the kept tokens' rows (padding slot -1 and unused slots stay zero)
    assert not out[~touched(lay, kept, 6)].any()


def touched(lay: tq.CacheLayout, slots: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Mask of the cache bytes that the given slots own (K row, V row, two scales, per head)."""
    m = torch.zeros(num_blocks, lay.block_bytes, dtype=torch.bool)
    for slot in slots.tolist():
        blk, off = divmod(slot, lay.page)
        for h in range(lay.num_kv_heads):
            row = off * lay.num_kv_heads + h
            m[blk, row * lay.k_bytes : (row + 1) * lay.k_bytes] = True
            m[blk, lay.v_offset + row * lay.v_bytes : lay.v_offset + (row + 1) * lay.v_bytes] = True
            m[blk, lay.s_offset + row * 8 : lay.s_offset + row * 8 + 8] = True
    return m


def test_encode_refuses_mismatched_shapes():
    lay = tq.CacheLayout(tq.PRESETS[tq.DEFAULT_PRESET], num_kv_heads=2, page=16)
    with pytest.raises(ValueError, match="do not match the layout"):
        tt.encode(torch.randn(3, 4, 256), torch.randn(3, 4, 256), torch.arange(3), lay.empty(1), lay, SEED)
    k = torch.randn(3, 2, 256)
    with pytest.raises(ValueError, match="slot_mapping must be int32/int64"):
        tt.encode(k, k, torch.arange(3.0), lay.empty(1), lay, SEED)
    other = tq.CacheLayout(tq.PRESETS["turboquant_k8v4"], num_kv_heads=2, page=16)
    with pytest.raises(ValueError, match="cache must be a contiguous uint8"):  # a cache made for another preset
        tt.encode(k, k, torch.arange(3), other.empty(1), lay, SEED)


# ---------------------------------------------------------------------------------------------
# Decode attention


DECODE_CASES = [
    # (B, Hq, H, T, lens, page, splits)
    pytest.param(1, 4, 2, 1, [70], 24, 1, id="B1-G2-T1-L70-P24-S1"),  # a page that is no power of two
    pytest.param(3, 32, 2, 3, [5, 37, 100], 16, 3, id="B3-G16-T3-L5.37.100-S3"),
    pytest.param(2, 32, 2, 1, [129, 1], 32, 4, id="B2-G16-T1-L129.1-S4-emptysplits"),
    pytest.param(1, 6, 3, 3, [3], 16, 2, id="B1-G2-T3-L3-causal-only"),
]


def decode_case(name, B, Hq, H, T, lens, page, dtype=torch.float16):
    """A DECODE_CASES shape filled by the reference encoder: (the decode kernels' positional arguments on DEV,
    queries in `dtype`; the float64 reference attention)."""
    lay = tq.CacheLayout(tq.PRESETS[name], num_kv_heads=H, page=page)
    bt, nb = paged(lens, page, seed=len(lens))
    cache = lay.empty(nb)
    r = tq.rotation(SEED)
    g = torch.Generator().manual_seed(sum(lens))
    for b, n in enumerate(lens):
        k, v = torch.randn(n, H, 256, generator=g) * 2, torch.randn(n, H, 256, generator=g)
        tq.encode_reference(k, v, tq.seq_slots(bt[b], n, page), cache, lay, r)
    q = torch.randn(B, Hq, T, 256, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = tq.decode_attention_reference(q, cache, lay, bt, seq_lens, r, 1 / 16)
    args = (q.to(DEV, dtype), cache.to(DEV), lay, bt.to(DEV), seq_lens.to(DEV), SEED, 1 / 16, max(lens))
    return args, ref


@kernel_case
@pytest.mark.parametrize("name", list(tq.PRESETS))
@pytest.mark.parametrize("B,Hq,H,T,lens,page,splits", DECODE_CASES)
def test_decode_attention_matches_reference(name, B, Hq, H, T, lens, page, splits):
    args, ref = decode_case(name, B, Hq, H, T, lens, page)
    out = tt.decode_attention(*args, num_splits=splits)
    # fp16 queries, probabilities and codebook values in the dots, fp32 accumulation: ~1e-3.
    assert_rel(out.float(), ref, 3e-3, f"{name} decode")


@kernel_case
@pytest.mark.parametrize("block_n", [16, 64])
def test_decode_4bit_decoders_match_reference(block_n):
    """Both 4-bit decoders (PRMT byte lookups on the GPU, L1 gathers; the interpreter has only gathers)
    agree with the reference, at a tile size that leaves a partial last tile."""
    lay = tq.CacheLayout(tq.PRESETS["turboquant_k4v4"], num_kv_heads=2, page=16)
    bt, nb = paged([77], 16)
    cache = lay.empty(nb)
    r = tq.rotation(SEED)
    g = torch.Generator().manual_seed(11)
    tq.encode_reference(torch.randn(77, 2, 256, generator=g), torch.randn(77, 2, 256, generator=g),
                        tq.seq_slots(bt[0], 77, 16), cache, lay, r)
    q = torch.randn(1, 8, 1, 256, generator=g)
    ref = tq.decode_attention_reference(q, cache, lay, bt, torch.tensor([77]), r, 1 / 16)
    args = (cache.to(DEV), lay, bt.to(DEV), torch.tensor([77], dtype=torch.int32, device=DEV), SEED, 1 / 16, 77)
    for decoder in ("prmt", "gather"):
        out = tt.decode_attention(q.to(DEV, torch.float16), *args, block_n=block_n, decoder=decoder)
        assert_rel(out.float(), ref, 3e-3, f"decoder={decoder} block_n={block_n}")


@kernel_case
@pytest.mark.parametrize("block_m,lazy", [(16, False), (32, True), (None, True), (16, True)])
def test_decode_row_tiles_and_lazy_rescale_match_reference(block_m, lazy):
    """A verify step's 48 rows split over 16- or 32-row tiles (programs that each read the KV head's codes),
    and the conditional rescale, against float64. Key 70 of request 0 leans towards KV head 0's queries: its
    tile raises most rows' running max by ~7 in base 2 (10.6 against 3.6 on average), past the rescale's step
    of 4 (the rescale branch), and the tiles after it raise it by little (the skip branch)."""
    lay = tq.CacheLayout(tq.PRESETS["turboquant_k4v4"], num_kv_heads=2, page=16)
    lens = [100, 37]
    bt, nb = paged(lens, 16, seed=5)
    cache = lay.empty(nb)
    r = tq.rotation(SEED)
    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, 32, 3, 256, generator=g)
    for b, n in enumerate(lens):
        k, v = torch.randn(n, 2, 256, generator=g), torch.randn(n, 2, 256, generator=g)
        if b == 0:
            k[70] = q[0, :16].mean((0, 1)) * 24
        tq.encode_reference(k, v, tq.seq_slots(bt[b], n, 16), cache, lay, r)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = tq.decode_attention_reference(q, cache, lay, bt, seq_lens, r, 1 / 16)
    out = tt.decode_attention(q.to(DEV, torch.float16), cache.to(DEV), lay, bt.to(DEV), seq_lens.to(DEV), SEED,
                              1 / 16, max(lens), num_splits=1, block_n=16, block_m=block_m, lazy=lazy)
    assert_rel(out.float(), ref, 3e-3, f"block_m={block_m} lazy={lazy}")


def test_decode_refuses_a_bad_row_tile():
    lay = tq.CacheLayout(tq.PRESETS[tq.DEFAULT_PRESET], num_kv_heads=2, page=16)
    q = torch.randn(1, 32, 3, 256)
    args = (lay.empty(1), lay, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), SEED, 1 / 16, 1)
    for bad in (8, 24, 128):
        with pytest.raises(ValueError, match=r"block_m must be a power of two in \[16, 64\]"):
            tt.decode_attention(q, *args, block_m=bad)


_PTX_ALU = {"and.b32": operator.and_, "or.b32": operator.or_, "xor.b32": operator.xor, "shr.b32": operator.rshift,
            "shl.b32": operator.lshift}  # the two-operand PTX ops the decoders use


def _run_ptx(asm: str, *inputs: int) -> tuple[int, int]:
    """Execute a decoder's PTX (the handful of b32 ops it uses) on 32-bit inputs $2, $3, ...: -> ($0, $1)."""
    regs = {f"${2 + i}": x for i, x in enumerate(inputs)}
    val = lambda a: regs[a] if a in regs else int(a, 0)  # noqa: E731
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *a = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in a]
        if op.startswith("sub") and op.endswith(".f16x2"):  # half by half, rounded to fp16 (exact here)
            half = lambda v, k: np.array([(v >> (16 * k)) & 0xFFFF], np.uint16).view(np.float16)[0]  # noqa: E731
            r = sum(int(np.array([half(a[0], k) - half(a[1], k)], np.float16).view(np.uint16)[0]) << (16 * k)
                    for k in range(2))
        elif op == "prmt.b32":
            src = a[0] | (a[1] << 32)
            out = 0
            for i in range(4):
                sel = (a[2] >> (4 * i)) & 0xF
                byte = (src >> (8 * (sel & 7))) & 0xFF
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
            r = out
        elif op == "mov.b32":
            r = a[0]
        else:
            r = _PTX_ALU[op](a[0], a[1])
        regs[d] = r & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("high", [False, True], ids=["A", "B"])
def test_byte_decoder_ptx_decodes_every_code_in_every_position(high):
    """The inline PTX, executed op by op here, turns 4 code bytes of the reference's packing (turboquant.pack;
    byte k: coordinates k = A_k and 128 + k = B_k) into the fp16 bits of level[code] of A_0..A_3 (or, high,
    B_0..B_3), in the order the kernel's pack=4 elementwise call hands them back. Every code in every position
    beside random neighbours, and 2,000 random inputs."""
    want = tq.codebook(4).levels.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    asm = tt._byte_asm(tq.codebook(4).levels, high=high)
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (16 * 8 + 2000, 8), generator=g)
    for c in range(16):
        for pos in range(8):
            codes[c * 8 + pos, pos] = c
    row = torch.full((len(codes), 256), 8, dtype=torch.int64)
    row[:, 0:4], row[:, 128:132] = codes[:, :4], codes[:, 4:]  # A_0..3 = coordinates 0..3, B_0..3 = 128..131
    words = tq.pack(row, 4)[:, :4].to(torch.int64)
    for cs, w in zip(codes.tolist(), (words << torch.arange(0, 32, 8)).sum(1).tolist()):
        o0, o1 = _run_ptx(asm, w)
        got = [o0 & 0xFFFF, o0 >> 16, o1 & 0xFFFF, o1 >> 16]
        assert got == [int(want[c]) for c in (cs[4:] if high else cs[:4])], f"codes {cs}, bytes {w:#010x}"


def test_byte_decoder_tables_hold_the_codebook_magnitudes():
    """The PRMT decoder's immediates are the low/high bytes of fp16 |level[8 + m]|, m = 0..7, and the
    codebook is symmetric in fp16 (what the decoder relies on)."""
    lev = tq.codebook(4).levels.to(torch.float16)
    assert torch.equal(lev[:8], -lev[8:].flip(0))
    asm = tt._byte_asm(tq.codebook(4).levels, high=False)
    words = [int(x, 16) for x in __import__("re").findall(r"mov\.b32 t\d, (0x[0-9a-f]+);", asm)]
    bits = lev[8:].view(torch.int16).to(torch.int64) & 0xFFFF
    got = [((words[2 + m // 4] >> (8 * (m % 4))) & 0xFF) << 8 | ((words[m // 4] >> (8 * (m % 4))) & 0xFF) for m in range(8)]
    assert got == bits.tolist()
    with pytest.raises(ValueError, match="decoder must be"):
        tt.decode_attention(torch.randn(1, 2, 1, 256), tq.CacheLayout(tq.PRESETS["turboquant_k4v4"], 1, 16).empty(1),
                            tq.CacheLayout(tq.PRESETS["turboquant_k4v4"], 1, 16), torch.zeros(1, 1, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32), SEED, 1 / 16, 1, decoder="lut")


@kernel_case
@pytest.mark.parametrize("T", [1, 3])
def test_decode_in_a_graph_sized_grid_with_padded_requests(T, monkeypatch):
    """A full CUDA graph's batch: the split grid sized for max_model_len (4,096 here: 16 splits, of which a
    short sequence fills 1-3) and a padded request of seq_len 0 on the null block. The real requests match the
    reference, the padded one is exactly 0, and no empty split's workspace is read: it starts as NaN."""
    lay = tq.CacheLayout(tq.PRESETS[tq.DEFAULT_PRESET], num_kv_heads=2, page=16)
    lens = [45, 0, 130]
    bt, nb = paged([45, 16, 130], 16, seed=T)
    bt[1] = 0
    bt = torch.nn.functional.pad(bt, (0, 256 - bt.shape[1]))  # a table as wide as max_model_len / page
    cache = lay.empty(nb)
    g = torch.Generator().manual_seed(11)
    r = tq.rotation(SEED)
    for b, n in enumerate(lens):
        tq.encode_reference(torch.randn(n, 2, 256, generator=g), torch.randn(n, 2, 256, generator=g),
                            tq.seq_slots(bt[b], n, 16), cache, lay, r)
    q = torch.randn(len(lens), 32, T, 256, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = tq.decode_attention_reference(q, cache, lay, bt, seq_lens, r, 1 / 16)
    empty = torch.empty
    monkeypatch.setattr(tt.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    out = tt.decode_attention(q.to(DEV, torch.float16), cache.to(DEV), lay, bt.to(DEV), seq_lens.to(DEV), SEED,
                              1 / 16, 4096, num_splits=16)
    monkeypatch.undo()
    assert (out[1] == 0).all(), "a padded request (seq_len 0) did not come out as zeros"
    assert_rel(out[[0, 2]].float(), ref[[0, 2]], 3e-3, "real requests in a graph-sized grid")


@kernel_case
def test_decode_split_count_does_not_change_the_result():
    lay = tq.CacheLayout(tq.PRESETS[tq.DEFAULT_PRESET], num_kv_heads=2, page=16)
    bt, nb = paged([200], 16)
    cache = lay.empty(nb)
    g = torch.Generator().manual_seed(3)
    tq.encode_reference(torch.randn(200, 2, 256, generator=g), torch.randn(200, 2, 256, generator=g),
                        tq.seq_slots(bt[0], 200, 16), cache, lay, tq.rotation(SEED))
    q = torch.randn(1, 32, 1, 256, generator=g).to(DEV)
    args = (cache.to(DEV), lay, bt.to(DEV), torch.tensor([200], dtype=torch.int32, device=DEV), SEED, 1 / 16, 200)
    one = tt.decode_attention(q, *args, num_splits=1).float()
    for s in (2, 7):
        # same math; only the fp16 rounding of probabilities (relative to each split's max) moves: ~1e-4
        assert_rel(tt.decode_attention(q, *args, num_splits=s).float(), one, 1e-3, f"{s} splits vs 1")


@kernel_case
@pytest.mark.parametrize("splits", [3, 16, 70, 130, 256])
def test_every_merge_matches_the_reference_over_one_or_several_split_loads(splits):
    """Each MERGES setting (the Hadamard transform, 64 splits a load; R's entries, 16) gives the float64
    reference's attention, and all agree to fp32 rounding (sums in another order) before the output's rounding, at
    split counts of one load, exactly one full load, loads and a rest, an H100's batch-1 grid (~130, many splits
    empty here: their never-written sums are read and dropped) and the most there may be."""
    args, ref = decode_case("turboquant_k4v4", 2, 8, 2, 3, [300, 77], 16)
    outs = {how: tt.decode_attention(*args, num_splits=splits, merge_how=how).float() for how in tt.MERGES}
    for how, out in outs.items():
        assert_rel(out, ref, 3e-3, f"merge {how}, {splits} splits")
        assert_rel(out, outs["matrix"], 2e-3, f"merge {how} vs matrix, {splits} splits")
    with pytest.raises(ValueError, match="merge must be one of"):
        tt.decode_attention(*args, merge_how="hadamard")
    with pytest.raises(ValueError, match=r"num_splits must be in \[1, 256\]"):
        tt.decode_attention(*args, num_splits=257)


MERGE_CANDIDATES = [d for d in sorted((Path(__file__).resolve().parents[1] / "lab" /
                                      "turboquant_merge_candidates").glob("*.diff"))
                    if "+++ b/kernels/turboquant_triton.py" in d.read_text()]


def candidate_module(diff: Path, tmp_path: Path):
    """kernels/turboquant_triton.py with a candidate's hunks for it, loaded as a module of onespark.kernels beside
    the shipped one (its relative imports resolve to the shipped package); the checkout is never patched."""
    root, rel = Path(__file__).resolve().parents[1], "kernels/turboquant_triton.py"
    for touched in {line[6:] for line in diff.read_text().splitlines() if line.startswith("+++ b/")}:
        (tmp_path / touched).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / touched, tmp_path / touched)
    # patch(1), not git: the GPU lane's host runs this test too, and has patch (lab/turboquant_merge_ab.sh)
    r = subprocess.run(["patch", "-s", "-p1", "-d", str(tmp_path), "-i", str(diff)], capture_output=True, text=True)
    assert r.returncode == 0, f"{diff.name} does not apply: {r.stdout}{r.stderr}"
    name = f"onespark.kernels._candidate_{diff.stem}"
    spec = importlib.util.spec_from_file_location(name, tmp_path / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@kernel_case
@pytest.mark.parametrize("splits", [3, 130])
@pytest.mark.parametrize("diff", MERGE_CANDIDATES, ids=lambda d: d.stem)
def test_each_merge_candidate_matches_the_reference(diff, splits, tmp_path):
    """A merge candidate in lab/turboquant_merge_candidates/ reaches a GPU with its indexing checked: each of
    its MERGES settings gives the float64 reference's attention at a verify step, at one load of splits and at an
    H100's batch-1 grid (many splits empty: never-written sums read and dropped)."""
    cand = candidate_module(diff, tmp_path)
    args, ref = decode_case("turboquant_k4v4", 2, 8, 2, 3, [300, 77], 16)
    for how in cand.MERGES:
        assert_rel(cand.decode_attention(*args, num_splits=splits, merge_how=how).float(), ref, 3e-3,
                   f"{diff.stem}: merge {how}, {splits} splits")


def test_decode_refuses_bad_shapes():
    lay = tq.CacheLayout(tq.PRESETS[tq.DEFAULT_PRESET], num_kv_heads=2, page=16)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    sl = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not divide"):
        tt.decode_attention(torch.randn(1, 3, 1, 256), lay.empty(1), lay, bt, sl, SEED, 1 / 16, 1)
    with pytest.raises(ValueError, match="head_dim 256"):
        tt.decode_attention(torch.randn(1, 4, 1, 128), lay.empty(1), lay, bt, sl, SEED, 1 / 16, 1)
    q = torch.randn(1, 4, 1, 256)
    with pytest.raises(ValueError, match="block_table must be int32"):
        tt.decode_attention(q, lay.empty(1), lay, bt.long(), sl, SEED, 1 / 16, 1)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        tt.decode_attention(q, lay.empty(1), lay, bt, sl.long(), SEED, 1 / 16, 1)
    with pytest.raises(ValueError, match="exceeds the block table"):
        tt.decode_attention(q, lay.empty(1), lay, bt, sl, SEED, 1 / 16, 17)
    with pytest.raises(ValueError, match="cache must be a contiguous uint8"):
        tt.decode_attention(q, lay.empty(1).float(), lay, bt, sl, SEED, 1 / 16, 1)


@kernel_case
def test_encode_then_decode_end_to_end_vs_unquantized():
    """The whole path (Triton encode -> Triton decode) against float64 attention on the original K/V:
    the error is the codec's, as measured by the reference (~0.14 for K4V4 on random data)."""
    lay = tq.CacheLayout(tq.PRESETS[tq.DEFAULT_PRESET], num_kv_heads=2, page=16)
    L = 96
    bt, nb = paged([L], 16)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(L, 2, 256, generator=g), torch.randn(L, 2, 256, generator=g)
    q = torch.randn(1, 32, 1, 256, generator=g)
    cache = lay.empty(nb, device=DEV)
    tt.encode(k.to(DEV), v.to(DEV), tq.seq_slots(bt[0], L, 16).to(DEV), cache, lay, SEED)
    out = tt.decode_attention(q.to(DEV), cache, lay, bt.to(DEV), torch.tensor([L], dtype=torch.int32, device=DEV), SEED, 1 / 16, L)
    exact = tq.attention_reference(q[0], k, v, 1 / 16)[None]
    via_ref = tq.decode_attention_reference(q, cache.cpu(), lay, bt, torch.tensor([L]), tq.rotation(SEED), 1 / 16)
    assert_rel(out.float(), via_ref, 3e-3, "kernel vs reference codec")
    err = float((out.double().cpu() - exact).norm() / exact.norm())
    assert 0.02 < err < 0.2, err  # a real 4-bit error, neither zero (nothing quantized) nor broken


# ---------------------------------------------------------------------------------------------
# Prefill attention (varlen, causal, straight from the cache)


PREFILL_CASES = [
    # (Hq, H, [(query len, sequence len) per request], page, block_p)
    # a fresh prompt, a continuation chunk deep in a sequence, one decode-like token, an empty request
    pytest.param(32, 2, [(7, 7), (13, 90), (1, 40), (0, 5)], 16, None, id="G16-mixed-P16"),
    pytest.param(6, 3, [(21, 50), (5, 5)], 24, 3, id="G2-H3-P24-bp3"),  # positions split across blocks
]


def _prefill_case(name, Hq, H, reqs, page, seed):
    lay = tq.CacheLayout(tq.PRESETS[name], num_kv_heads=H, page=page)
    lens = [L for _, L in reqs]
    bt, nb = paged(lens, page, seed=seed)
    cache = lay.empty(nb)
    g = torch.Generator().manual_seed(seed)
    for b, n in enumerate(lens):
        k, v = torch.randn(n, H, 256, generator=g) * 2, torch.randn(n, H, 256, generator=g)
        tq.encode_reference(k, v, tq.seq_slots(bt[b], n, page), cache, lay, tq.rotation(SEED))
    qsl = torch.tensor([0] + [sum(ql for ql, _ in reqs[: i + 1]) for i in range(len(reqs))], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), Hq, 256, generator=g)
    return lay, cache, bt, torch.tensor(lens, dtype=torch.int32), qsl, q


@kernel_case
@pytest.mark.parametrize("name", list(tq.PRESETS))
@pytest.mark.parametrize("Hq,H,reqs,page,block_p", PREFILL_CASES)
def test_prefill_attention_matches_reference(name, Hq, H, reqs, page, block_p):
    lay, cache, bt, seq_lens, qsl, q = _prefill_case(name, Hq, H, reqs, page, seed=len(reqs) + page)
    out = tt.prefill_attention(q.to(DEV, torch.float16), cache.to(DEV), lay, bt.to(DEV), seq_lens.to(DEV), qsl.to(DEV),
                               SEED, 1 / 16, max(ql for ql, _ in reqs), block_p=block_p)
    assert out.shape == q.shape and out.dtype == torch.float16
    r = tq.rotation(SEED)
    for i, (ql, L) in enumerate(reqs):  # each request: its ql positions are the last of its L tokens
        if ql == 0:
            continue
        s, e = int(qsl[i]), int(qsl[i + 1])
        ref = tq.decode_attention_reference(q[s:e].transpose(0, 1)[None], cache, lay, bt[i : i + 1],
                                            seq_lens[i : i + 1], r, 1 / 16)[0].transpose(0, 1)
        assert_rel(out[s:e].float(), ref, 3e-3, f"{name} prefill request {i} (q_len {ql}, seq_len {L})")


@kernel_case
def test_prefill_equals_decode_at_the_same_positions():
    """A request's last T positions give the same output from the prefill kernel as from the decode
    kernel (what keeps a token's result independent of how the batch was formed)."""
    lay, cache, bt, seq_lens, qsl, q = _prefill_case(tq.DEFAULT_PRESET, 32, 2, [(3, 61)], 16, seed=9)
    args = (cache.to(DEV), lay, bt.to(DEV), seq_lens.to(DEV))
    pre = tt.prefill_attention(q.to(DEV, torch.float16), *args, qsl.to(DEV), SEED, 1 / 16, 3)
    dec = tt.decode_attention(q.to(DEV, torch.float16).transpose(0, 1)[None], *args, SEED, 1 / 16, 61, num_splits=1)
    assert_rel(pre.float(), dec[0].transpose(0, 1).float(), 2e-3, "prefill vs decode kernel")


@triton.jit
def _u8_centred_probe(X, Y):
    i = tl.arange(0, 256)
    tl.store(Y + i, tt._u8_centred(tl.load(X + i)).to(tl.float32))


@kernel_case
def test_u8_centred_is_exact():
    """The 8-bit decode gives code - 127.5 exactly for every code (fp16 arithmetic, constants included)."""
    x = torch.arange(256, dtype=torch.uint8, device=DEV)
    y = torch.empty(256, device=DEV)
    _u8_centred_probe[(1,)](x, y)
    assert torch.equal(y.cpu(), torch.arange(256, dtype=torch.float32) - 127.5)


@kernel_case
@pytest.mark.parametrize("name", list(tq.PRESETS))
@pytest.mark.parametrize("t0,t1", [(0, 90), (37, 61), (61, 61)])
def test_dequantize_rotated_matches_read_rotated(name, t0, t1):
    """The Triton decode into BF16 equals turboquant.read_rotated (fp32 levels) to BF16 rounding, for a
    token range that starts and ends inside pages, and an empty range."""
    lay, cache, bt, seq_lens, _, _ = _prefill_case(name, 4, 2, [(1, 90)], 16, seed=3)
    levels = tuple(tq.codebook(b).levels.to(torch.float32) for b in (lay.preset.k_bits, lay.preset.v_bits))
    kr, vr = tq.read_rotated(cache, lay, bt[0], 90, levels, torch.float32)
    k, v = tt.dequantize_rotated(cache.to(DEV), lay, bt[0].to(DEV), t0, t1, SEED, torch.bfloat16)
    assert k.shape == v.shape == (2, t1 - t0, 256) and k.dtype == torch.bfloat16
    # one BF16 ulp (2^-7 relative: Triton's interpreter truncates fp32 -> bf16, the GPU rounds to nearest) plus the
    # fp16 codebook (2^-11); a wrong code, scale or coordinate is off by the value itself
    for what, got, ref in (("K", k, kr[:, t0:t1]), ("V", v, vr[:, t0:t1])):
        err = (got.double().cpu() - ref.double()).abs()
        assert bool((err <= (2 ** -7 + 2 ** -11) * ref.double().abs() + 1e-6).all()), f"{what}: worst |diff| {float(err.max()):.3g}"


def _attend_float64(q, k, v, sm_scale, causal):
    """flash_with_lse in float64 on any device: GQA by repeating K/V, lower-right causal."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * sm_scale
    if causal:
        ql, n = q.shape[2], k.shape[2]
        s = s.masked_fill(torch.arange(n)[None, :] > (n - ql + torch.arange(ql))[:, None], float("-inf"))
    return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)


@kernel_case
@pytest.mark.parametrize("name", list(tq.PRESETS))
@pytest.mark.parametrize("ql,L,kv_chunk", [(7, 7, 4), (13, 90, 16), (1, 40, 7), (30, 61, 1000)],
                         ids=["fresh", "continuation", "one-token", "one-piece"])
def test_prefill_flash_path_matches_reference(name, ql, L, kv_chunk):
    """Dequantize + attend in pieces merged by log-sum-exp = attention over the whole cached sequence (float64
    reference); the attend step here is a float64 stand-in for the flash op (CUDA only; the GPU lane runs it)."""
    lay, cache, bt, seq_lens, _, q = _prefill_case(name, 32, 2, [(ql, L)], 16, seed=L + ql)
    attend = tt.flash_with_lse if CUDA else _attend_float64
    out = tt.prefill_attention_flash(q.to(DEV, torch.bfloat16), cache.to(DEV), lay, bt[0].to(DEV), L, SEED, 1 / 16,
                                     kv_chunk=kv_chunk, attend=attend)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    ref = tq.decode_attention_reference(q.transpose(0, 1)[None], cache, lay, bt, seq_lens, tq.rotation(SEED),
                                        1 / 16)[0].transpose(0, 1)
    # BF16 queries and decoded K/V (~2^-9 each, normwise less; the interpreter truncates to BF16: twice that); a
    # wrong piece, mask or merge is off by O(0.1)
    assert_rel(out.float(), ref, 1.5e-2 if INTERPRET else 8e-3, f"{name} flash prefill (q_len {ql}, seq_len {L}, pieces of {kv_chunk})")


def test_merge_lse_is_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = torch.randn(1, 2, 11, 8, generator=g), torch.randn(1, 2, 11, 8, generator=g)
    whole = _attend_float64(q, k, v, 0.3, False)
    acc = lse = None
    for a, b in ((0, 3), (3, 4), (4, 11)):
        acc, lse = tt.merge_lse(acc, lse, *_attend_float64(q, k[:, :, a:b], v[:, :, a:b], 0.3, False))
    assert torch.allclose(acc.double(), whole[0], atol=1e-6) and torch.allclose(lse.double(), whole[1], atol=1e-6)


def test_prefill_refuses_bad_shapes():
    lay = tq.CacheLayout(tq.PRESETS[tq.DEFAULT_PRESET], num_kv_heads=2, page=16)
    bt, sl, qsl = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(1, 4, 256)
    with pytest.raises(ValueError, match="do not divide"):
        tt.prefill_attention(torch.randn(1, 3, 256), lay.empty(1), lay, bt, sl, qsl, SEED, 1 / 16, 1)
    with pytest.raises(ValueError, match="head_dim 256"):
        tt.prefill_attention(torch.randn(1, 4, 128), lay.empty(1), lay, bt, sl, qsl, SEED, 1 / 16, 1)
    with pytest.raises(ValueError, match="query_start_loc must be int32 \\[2\\]"):
        tt.prefill_attention(q, lay.empty(1), lay, bt, sl, qsl.long(), SEED, 1 / 16, 1)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        tt.prefill_attention(q, lay.empty(1), lay, bt, sl.long(), qsl, SEED, 1 / 16, 1)
    with pytest.raises(ValueError, match="cache must be a contiguous uint8"):
        tt.prefill_attention(q, lay.empty(1).float(), lay, bt, sl, qsl, SEED, 1 / 16, 1)


@pytest.mark.skipif(CUDA or INTERPRET, reason="kernel cases run in this process")
def test_interpreter_lane():
    """Every kernel case in Triton's interpreter, on the 0.19.1 track only: what it checks (the kernels' indexing
    and arithmetic, run in numpy) is the same source on both tracks, and it was this file's dearest test on the
    0.32.0 track (264 s of a cold 2-core lane); there Triton 3.7.1's compile of every kernel is
    tests/test_kernels_compile.py's."""
    from tests.conftest import vllm_track

    if vllm_track() == "0.32.0":
        pytest.skip("the interpreter lane runs on the 0.19.1 track (its docstring)")
    out = run_interpreter_lane(__file__, timeout_s=1500)
    # every kernel case runs in the interpreter; the one skip allowed is a candidate test with no candidate diff for
    # this file (lab/turboquant_merge_candidates/ may hold only header changes): it has no case to run
    skipped = re.search(r"(\d+) skipped", out.splitlines()[-1])
    empty = sum(int(n) for n in re.findall(r"^SKIPPED \[(\d+)\] .*got empty parameter set", out, flags=re.M))
    assert (int(skipped.group(1)) if skipped else 0) == empty, out[-2000:]
