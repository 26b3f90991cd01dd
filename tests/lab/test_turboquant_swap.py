"""The candidate transposed TurboQuant decode kernel (lab/turboquant_swap.py) against the float64
reference and the shipped kernel, on the shipped kernel's awkward shapes (partial tiles and pages, scattered
blocks, empty splits, causal verify rows). With CUDA in this process; without it in Triton's interpreter, in a
child pytest (test_interpreter_lane), as tests/test_turboquant_triton.py does."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_triton as tt
from tests._interpreter import run_interpreter_lane
from tests.test_turboquant_triton import DECODE_CASES, SEED, assert_rel, decode_case, paged

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab"))
import turboquant_swap  # noqa: E402  (a lab module)

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
kernel_case = pytest.mark.skipif(not (CUDA or INTERPRET), reason="CPU: runs in the interpreter child (test_interpreter_lane)")
DEV = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@kernel_case
@pytest.mark.parametrize("name", list(tq.PRESETS))
@pytest.mark.parametrize("B,Hq,H,T,lens,page,splits", DECODE_CASES)
def test_swap_decode_matches_reference_and_the_shipped_kernel(name, B, Hq, H, T, lens, page, splits):
    args, ref = decode_case(name, B, Hq, H, T, lens, page)
    out = turboquant_swap.decode_attention_swap(*args, num_splits=splits, block_n=16 if INTERPRET else 64)
    assert_rel(out.float(), ref, 3e-3, f"{name} swap decode")
    shipped = tt.decode_attention(*args, num_splits=splits)
    assert_rel(out.float(), shipped.float(), 2e-3, f"{name} swap vs shipped")  # the same sums, other order


@kernel_case
def test_swap_decode_padded_graph_rows_and_nan_workspace(monkeypatch):
    """Requests of length 0 (vLLM's full-graph padding) and splits past a sequence's end write only m and l; the
    merge never reads their accumulators, so a NaN-filled workspace cannot leak into the output."""
    lay = tq.CacheLayout(tq.PRESETS["turboquant_k4v4"], num_kv_heads=2, page=16)
    lens = [40, 0]
    bt, nb = paged([40, 1], 16, seed=3)
    cache = lay.empty(nb)
    r = tq.rotation(SEED)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(40, 2, 256, generator=g), torch.randn(40, 2, 256, generator=g)
    tq.encode_reference(k, v, tq.seq_slots(bt[0], 40, 16), cache, lay, r)
    q = torch.randn(2, 32, 3, 256, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan"))
                        if kw.get("dtype") == torch.float32 else real_empty(*a, **kw))
    out = turboquant_swap.decode_attention_swap(q.to(DEV, torch.float16), cache.to(DEV), lay, bt.to(DEV),
                                                seq_lens.to(DEV), SEED, 1 / 16, 256, num_splits=8, block_n=16)
    monkeypatch.undo()
    ref = tq.decode_attention_reference(q[:1], cache, lay, bt[:1], seq_lens[:1], r, 1 / 16)
    assert_rel(out[:1].float(), ref, 3e-3, "swap decode, live request beside padding")
    assert torch.equal(out[1].float().cpu(), torch.zeros(32, 3, 256)), "a padded request's rows are zeros"


@pytest.mark.skipif(CUDA or INTERPRET, reason="kernel cases run in this process")
def test_interpreter_lane():
    out = run_interpreter_lane(__file__, timeout_s=900)
    assert " skipped" not in out.splitlines()[-1], out[-2000:]
