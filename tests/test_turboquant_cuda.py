"""The CUDA C++ TurboQuant decode kernel (kernels/turboquant_decode.cuh, built by kernels/turboquant_cuda.py) against
the float64 reference and the Triton kernel, on a GPU (tests/gpu.sh runs this file; it builds the extension once,
for TORCH_CUDA_ARCH_LIST when the lane sets it). tests/test_kernels_compile_cuda.py compiles the kernel itself for
sm_90 and sm_121 on the CPU lane and tests the build's CLI; tests/test_turboquant_backend.py the backend's choice
of kernel."""

from __future__ import annotations

import shutil

import pytest
import torch

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_cuda as tc
from onespark.kernels import turboquant_triton as tt
from tests.test_turboquant_triton import assert_rel, decode_case

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
K4V4 = tq.PRESETS["turboquant_k4v4"]

CASES = [
    # (Hq, H, T, lens, page, splits, q dtype, stages)
    pytest.param(32, 2, 3, [300, 77], 16, None, torch.bfloat16, 2, id="G16-T3-verify-bf16"),
    pytest.param(32, 2, 1, [4096, 1001], 16, None, torch.bfloat16, 2, id="G16-T1-4096"),
    pytest.param(32, 2, 3, [4096, 1001], 16, 64, torch.float16, 3, id="G16-T3-64splits-stages3"),
    pytest.param(32, 2, 2, [1000, 333], 48, 5, torch.float16, 2, id="G16-T2-page48"),  # 3 groups per page
    pytest.param(32, 2, 4, [129, 4], 32, 7, torch.bfloat16, 3, id="G16-T4-64rows-emptysplits"),
    pytest.param(16, 2, 3, [65, 3], 16, 3, torch.float16, 2, id="G8-T3-24rows-causal-only"),
    pytest.param(4, 1, 1, [2, 1], 16, 1, torch.bfloat16, 2, id="G4-T1-padded-rows"),
]


def case(Hq, H, T, lens, page, dtype):
    """One request per length, K4V4 (tests/test_turboquant_triton.decode_case): kernel arguments, float64 reference."""
    return decode_case("turboquant_k4v4", len(lens), Hq, H, T, lens, page, dtype)


@pytest.mark.parametrize("Hq,H,T,lens,page,splits,dtype,stages", CASES)
def test_cuda_decode_matches_reference_and_the_triton_kernel(Hq, H, T, lens, page, splits, dtype, stages):
    """Odd lengths (partial steps and pages), scattered blocks, splits that are empty or end mid-step, a page of 3
    16-key groups, 24 and 64 query rows, padded rows, bf16 and fp16 queries, both pipeline depths."""
    args, ref = case(Hq, H, T, lens, page, dtype)
    out = tc.decode_attention(*args, num_splits=splits, stages=stages)
    assert out.dtype == dtype and out.shape == args[0].shape
    # fp16 queries, probabilities and codebook values in the dots, fp32 accumulation, as the Triton kernel: ~1e-3;
    # bf16 queries and outputs add ~2^-8 per element (3.8e-3 and 4.1e-3 seen on an H200 for both kernels)
    bf16 = dtype == torch.bfloat16
    assert_rel(out.float(), ref, 8e-3 if bf16 else 3e-3, "cuda decode")
    triton_out = tt.decode_attention(*args, num_splits=splits)
    assert_rel(out.float(), triton_out.float(), 2e-3 if bf16 else 1e-3, "cuda against triton")


def test_an_empty_request_gives_zeros_and_a_graph_replays_other_lengths():
    """vLLM pads a captured batch with seq_len-0 requests: their output is zeros. The split grid comes from the
    host-side max_seq_len, so one captured call serves any lengths up to it."""
    args, _ = case(32, 2, 3, [700, 40], 16, torch.bfloat16)
    q, cache, lay, bt, seq_lens, seed, scale, _ = args
    out = torch.empty_like(q)
    lens = torch.tensor([0, 40], dtype=torch.int32, device="cuda")
    tc.decode_attention(q, cache, lay, bt, lens, seed, scale, 700, out=out)  # compile and size outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tc.decode_attention(q, cache, lay, bt, lens, seed, scale, 700, out=out)
    for now in ([0, 40], [700, 3]):
        lens.copy_(torch.tensor(now, dtype=torch.int32))
        graph.replay()
        want = tt.decode_attention(q, cache, lay, bt, lens, seed, scale, 700)
        if now[0] == 0:
            assert not out[0].any() and torch.isfinite(out).all()
        assert_rel(out.float(), want.float(), 1e-3, f"graph replay at lengths {now}")


def test_unsupported_inputs_are_refused_in_one_line():
    args, _ = case(32, 2, 3, [40], 16, torch.bfloat16)
    q, cache, lay, bt, seq_lens, seed, scale, n = args
    k4v3 = tq.CacheLayout(tq.PRESETS["turboquant_k4v3"], num_kv_heads=2, page=16)
    with pytest.raises(ValueError, match="K4V4 with at most 64 query rows"):
        tc.decode_attention(q, k4v3.empty(cache.shape[0], "cuda"), k4v3, bt, seq_lens, seed, scale, n)
    with pytest.raises(ValueError, match="at most 64 query rows"):
        tc.decode_attention(q.repeat(1, 1, 2, 1), cache, lay, bt, seq_lens, seed, scale, n)  # 16 x 6 rows
    odd = tq.CacheLayout(K4V4, num_kv_heads=2, page=24)
    with pytest.raises(ValueError, match="multiple of 16 keys, got 24"):
        tc.decode_attention(q, odd.empty(4, "cuda"), odd, bt, seq_lens, seed, scale, n)


def test_a_build_is_loaded_only_for_the_sources_torch_and_arch_list_it_was_made_for(tmp_path, monkeypatch):
    """available() reads the stamp beside the build (no compiler runs): a copy of this process's build with its
    stamp is available; with a stamp for other sources, or none, it is not."""
    tc.module()
    copy = tmp_path / "build"
    # the build as it stands; another xdist worker may be writing its stamp's temp file beside it right now
    shutil.copytree(tc.build_dir(), copy, ignore=shutil.ignore_patterns("*.tmp"))
    monkeypatch.setenv("ONESPARK_CUDA_BUILD", str(copy))
    assert tc.available()
    (copy / "sources.sha256").write_text("0" * 64 + "\n")
    assert not tc.available()
    (copy / "sources.sha256").unlink()
    assert not tc.available()
