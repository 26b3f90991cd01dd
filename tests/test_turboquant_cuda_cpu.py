"""The CUDA TurboQuant decode kernel's source run on the CPU (tests/_cuda_cpu.py: g++, each CTA's threads as fibers,
mma.sync / ldmatrix / prmt / cp.async / barriers emulated from the PTX ISA) against the float64 reference: the
shipped header on the GPU test's cases (tests/test_turboquant_cuda.py), and each candidate variant in
lab/turboquant_cuda_candidates/, so a variant reaches a GPU with its indexing and barriers already checked.
The emulation is shown to catch what it is for: a missing barrier, a wrong index, a barrier some threads skip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from onespark.kernels import turboquant_cuda as tc
from tests import _cuda_cpu as cc
from tests.test_turboquant_cuda import CASES, case
from tests.test_turboquant_triton import assert_rel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CANDIDATES = cc.HEADER_CANDIDATES  # the CUDA kernel's candidates and the merge candidates that change it
SPLITS = 4  # where a GPU case lets the occupancy decide


def tol(dtype) -> float:  # as tests/test_turboquant_cuda.py: bf16 queries add ~2^-8 per element
    return 8e-3 if dtype == torch.bfloat16 else 3e-3


def run(lib, Hq, H, T, lens, page, splits, dtype, stages):
    args, ref = case(Hq, H, T, lens, page, dtype)
    return cc.decode_attention(lib, *args, num_splits=splits or SPLITS, stages=stages), ref


@pytest.fixture(scope="module")
def shipped():
    return cc.build()


@pytest.mark.parametrize("Hq,H,T,lens,page,splits,dtype,stages", CASES)
def test_the_shipped_kernel_matches_float64_on_the_cpu(shipped, Hq, H, T, lens, page, splits, dtype, stages):
    out, ref = run(shipped, Hq, H, T, lens, page, splits, dtype, stages)
    assert_rel(out, ref, tol(dtype), "cuda decode on the cpu")


def patched(diff: Path, tmp_path: Path) -> str:
    try:
        return cc.patched_header([diff], tmp_path)
    except ValueError as e:
        pytest.fail(str(e))


@pytest.mark.parametrize("diff", CANDIDATES, ids=lambda p: p.stem)
def test_each_candidate_variant_matches_float64_on_the_cpu(diff, tmp_path):
    """The verify step with bf16 queries, 64 rows with empty splits, padded rows and a page of 3 key groups, at
    both pipeline depths among them."""
    lib = cc.build(patched(diff, tmp_path))
    for p in (CASES[0], CASES[3], CASES[4], CASES[6]):
        Hq, H, T, lens, page, splits, dtype, stages = p.values
        out, ref = run(lib, Hq, H, T, lens, page, splits, dtype, stages)
        assert_rel(out, ref, tol(dtype), f"{diff.stem}, case {p.id}")


MUTATIONS = {  # one line of the shipped header changed: each must fail the check
    "no-barrier-before-the-step-maximum": (
        "        if (c == 0) red[w * M * 16 + 16 * m + g + 8 * rh] = mx;\n      }\n    __syncthreads();",
        "        if (c == 0) red[w * M * 16 + 16 * m + g + 8 * rh] = mx;\n      }\n"),
    "wrong-output-column": ("const int col = 4 * (2 * c + e) + 32 * w + (n & 3)",
                            "const int col = 4 * (2 * c + e) + 32 * w + (n & 1)"),
    "one-stage-too-few-waited-for": ("cp_wait<STAGES - 2>();", "cp_wait<STAGES - 1>();"),
    "a-barrier-warp-0-skips": ("  __syncthreads();  // every warp is past its last read of red",
                               "  if (w) __syncthreads();"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_the_cpu_check_catches_a_broken_kernel(name):
    old, new = MUTATIONS[name]
    source = cc.HEADER.read_text()
    assert source.count(old) == 1, f"the mutation {name} no longer matches the header: update MUTATIONS"
    lib = cc.build(source.replace(old, new))
    try:
        out, ref = run(lib, *CASES[0].values)
    except RuntimeError as e:  # the emulation stopped the CTA
        assert "deadlock" in str(e)
        return
    with pytest.raises(AssertionError):
        assert_rel(out, ref, tol(torch.bfloat16), name)


def test_the_split_grid_fills_the_gpu_with_splits_of_at_least_8_steps():
    """num_splits_for: one wave of CTAs (an H100 holds 132 x 3 of the one-query kernel), splits of >= 8 steps of 64
    keys, at most 256 (the merge's cap)."""
    slots = 132 * 3
    assert tc.num_splits_for(1, 2, 32768, slots, 1) == 64  # 512 keys each (4 steps: 128 splits, 5-8% slower)
    assert tc.num_splits_for(1, 2, 65536, slots, 1) == 128
    assert tc.num_splits_for(1, 2, 131072, slots, 1) == 198  # the wave bounds it
    assert tc.num_splits_for(8, 2, 262144, slots, 1) == 24
    assert tc.num_splits_for(1, 2, 100, slots, 1) == 1
    assert tc.num_splits_for(1, 1, 1 << 24, 1 << 12, 1) == 256


def test_a_server_grid_leaves_the_splits_past_a_short_request_empty(shipped):
    """A server's CUDA graphs size the grid for max_model_len: 64 splits here. A 1,000-key request still runs splits
    of at least 8 steps of 64 keys (the kernel's MIN_SPLIT, num_splits_for's floor), so splits 0 and 1 hold its keys
    and the other 62 are empty (m = -inf: the merge stops at the live prefix); the result is float64's."""
    args, ref = case(32, 2, 3, [1000], 16, torch.float16)
    m = []
    out = cc.decode_attention(shipped, *args, num_splits=64, split_max=m)
    assert_rel(out, ref, tol(torch.float16), "a 1,000-key request on a 64-split grid")
    live = (m[0] > float("-inf")).all(dim=(0, 2))
    assert live.tolist() == [True, True] + [False] * 62, f"live splits {live.nonzero().flatten().tolist()}, want [0, 1]"
