"""INT8 / INT4 LM-head kernels against float64 plain-torch references.

Two lanes run the same kernel tests:
  * CUDA present: in this process, on the GPU (bf16 and fp16, the real configs).
  * CPU only: Triton's interpreter must be on before the kernels are *decorated* (triton.jit reads
    TRITON_INTERPRET at import of onespark.kernels.lm_head), and switching it on for the whole pytest
    process would also change every other module that uses Triton. So `test_interpreter_lane`
    re-runs this file in a child pytest with TRITON_INTERPRET=1 (fp16 and fp32: the interpreter
    computes bf16 wrongly) and fails with the child's report; in the parent the kernel tests skip.
Quantizer tests need no Triton and run in the parent. On a GPU host without the test venv (the
H200 used for bench/results), with onespark importable: python -P -m pytest tests/test_kernels_lm_head.py
(-P keeps the repository root, whose onespark/ lacks the kernels mapping, off sys.path).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from onespark.kernels import (
    int4_gemv,
    int4_gemv_ref,
    int8_gemv,
    int8_gemv_ref,
    lm_head,
    quantize_int4_groups,
    quantize_int8_rows,
)
from tests._compare import assert_close
from tests._interpreter import run_interpreter_lane
from tests._kernel_lane import ACC, CUDA, DEVICE, DTYPES, INTERPRET, P_BITS, kernel_lane


def _tol(ref64: torch.Tensor, abs_sum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ref64.abs() * 2.0 ** -P_BITS[dtype] + abs_sum * ACC + 1e-30


def _rand_x(m, k, dtype, gen, device=DEVICE):
    # Random, never zero: zeros hide unwritten outputs and wrong indexing.
    x = torch.randn(m, k, generator=gen, dtype=torch.float32).add_(0.01)
    return x.to(dtype).to(device)


def _int8_case(m, n, k, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    q, s = quantize_int8_rows(w)
    x = _rand_x(m, k, dtype, gen, device)
    return x, q.to(device), s.to(device)


def _check_int8(x, q, s, out, what, folded=None):
    """folded: the large-M path multiplies weights rounded to x's dtype (q * s, one rounding each,
    <= 2^-P of the weight), so its bound adds 2^-P of sum|x w|. By default: whether M is in its bucket."""
    ref = int8_gemv_ref(x, q, s, acc_dtype=torch.float64, out_dtype=torch.float64)
    abs_sum = int8_gemv_ref(x.abs(), q.abs(), s.abs(), acc_dtype=torch.float64, out_dtype=torch.float64)
    tol = _tol(ref, abs_sum, x.dtype)
    if folded is None:
        folded = lm_head._bucket(x.shape[0]) == 8192
    if folded:
        tol = tol + abs_sum * 2.0 ** -P_BITS[x.dtype]
    assert_close(out, ref, tol, what)


def _dname(dtype):
    return str(dtype).removeprefix("torch.")


SHAPES = [  # (M, N, K): awkward on purpose: odd M, N no power of two, K with a tail
    pytest.param(1, 333, 200, id="M1-N333-K200"),
    pytest.param(3, 333, 200, id="M3-N333-K200"),
    pytest.param(7, 130, 256, id="M7-N130-K256"),
    pytest.param(17, 333, 72, id="M17-N333-K72"),
    pytest.param(100, 130, 200, id="M100-N130-K200"),
    pytest.param(300, 257, 96, id="M300-N257-K96"),
    pytest.param(600, 130, 72, id="M600-N130-K72"),
]


@kernel_lane
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_matches_fp64_reference(m, n, k, dtype):
    x, q, s = _int8_case(m, n, k, dtype, seed=m * 1000 + n + k)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: unwritten stays NaN
    assert int8_gemv(x, q, s, out=out) is out
    _check_int8(x, q, s, out, f"int8 M={m} N={n} K={k} {dtype}")
    _check_int8(x, q, s, int8_gemv(x, q, s), f"int8 (own out) M={m} N={n} K={k} {dtype}")


@kernel_lane
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int4_matches_fp64_reference(m, n, k, dtype):
    gen = torch.Generator().manual_seed(7 + m + n + k)
    w = torch.randn(n, k, generator=gen) * 0.02
    q, s = quantize_int4_groups(w)
    q, s = q.to(DEVICE), s.to(DEVICE)
    x = _rand_x(m, k, dtype, gen)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    int4_gemv(x, q, s, out=out)
    ref = int4_gemv_ref(x, q, s, acc_dtype=torch.float64, out_dtype=torch.float64)
    w_abs = lm_head.dequantize_int4_groups(q, s, k).abs().to(torch.float64)
    abs_sum = x.abs().to(torch.float64) @ w_abs.T
    assert_close(out, ref, _tol(ref, abs_sum, dtype), f"int4 M={m} N={n} K={k} {dtype}")


@kernel_lane
def test_strided_x_and_output_view_leave_neighbours_alone():
    dtype = DTYPES[0]
    m, n, k = 5, 200, 96
    x_full, q, s = _int8_case(2 * m, n, 2 * k, dtype, seed=3)
    x = x_full[::2, 1::2]  # row stride 4K, column stride 2
    q = q[:, :k].contiguous()
    canvas = torch.full((m, n + 24), 12345.0, dtype=dtype, device=DEVICE)
    out = canvas[:, 8 : 8 + n]  # row stride n + 24: the store must stay inside its columns
    int8_gemv(x, q, s, out=out)
    _check_int8(x, q, s, out, "int8 strided x / output view")
    assert bool((canvas[:, :8] == 12345.0).all()) and bool((canvas[:, 8 + n :] == 12345.0).all()), (
        "int8_gemv wrote outside its output view"
    )
    g = torch.Generator().manual_seed(4)
    q4, s4 = quantize_int4_groups(torch.randn(n, k, generator=g) * 0.02)
    q4, s4 = q4.to(DEVICE), s4.to(DEVICE)
    canvas.fill_(12345.0)
    int4_gemv(x, q4, s4, out=out)
    ref = int4_gemv_ref(x, q4, s4, acc_dtype=torch.float64, out_dtype=torch.float64)
    abs_sum = x.abs().double() @ lm_head.dequantize_int4_groups(q4, s4, k).abs().double().T
    assert_close(out, ref, _tol(ref, abs_sum, dtype), "int4 strided x / output view")
    assert bool((canvas[:, :8] == 12345.0).all()) and bool((canvas[:, 8 + n :] == 12345.0).all())


@kernel_lane
def test_nan_in_x_reaches_only_its_row():
    dtype = DTYPES[0]
    x, q, s = _int8_case(4, 150, 64, dtype, seed=5)
    x[2, 17] = float("nan")
    out = int8_gemv(x, q, s)
    assert bool(out[2].isnan().all()), "a NaN in x row 2 must make all of output row 2 NaN"
    assert not bool(out[[0, 1, 3]].isnan().any()), "a NaN in row 2 leaked into other rows"
    # and the helper never lets NaN pass where the reference is finite
    ref = int8_gemv_ref(x, q, s, acc_dtype=torch.float64, out_dtype=torch.float64)
    ref[2] = 0.0
    with pytest.raises(AssertionError, match="NaN in actual 150"):
        assert_close(out, ref, 1.0, "nan check")


@kernel_lane
def test_empty_and_bad_inputs():
    dtype = DTYPES[0]
    x, q, s = _int8_case(3, 40, 32, dtype, seed=6)
    assert int8_gemv(x[:0], q, s).shape == (0, 40)
    with pytest.raises(ValueError, match="K = 31"):
        int8_gemv(x[:, :31], q, s)
    with pytest.raises(ValueError, match="int8"):
        int8_gemv(x, q.to(torch.int16), s)
    with pytest.raises(ValueError, match="scale must be fp32"):
        int8_gemv(x, q, s.half())
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        int8_gemv(x.to(torch.float64), q, s)
    with pytest.raises(ValueError, match="out must be"):
        int8_gemv(x, q, s, out=torch.empty(3, 41, dtype=dtype, device=DEVICE))
    q4, s4 = quantize_int4_groups(torch.randn(40, 32))
    with pytest.raises(ValueError, match="do not fit"):
        int4_gemv(x[:, :16].contiguous(), q4.to(DEVICE), torch.cat([s4, s4], 1).to(DEVICE))


# ------------------------------------------------------------------ quantizers (plain torch, parent lane)


def test_import_touches_no_gpu():
    # vLLM imports the plugin (and so these kernels) in processes that must not create a CUDA context.
    code = "import torch, onespark.kernels; assert not torch.cuda.is_initialized(), 'CUDA initialised at import'"
    # -P: the installed package, not a checkout's onespark/ folder in the working directory (the GPU lane)
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_quantize_int8_rows_round_trip():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1001, 77, generator=g) * 0.05).to(torch.bfloat16)
    w[5] = 0  # an all-zero row
    q, s = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (1001,)
    assert q.is_contiguous()
    w32 = w.float()
    assert torch.equal(s, torch.maximum(w32.amax(1), -w32.amin(1)) / 127)
    assert int(q.abs().max()) == 127 and bool((q[5] == 0).all()) and float(s[5]) == 0.0
    nonzero = s > 0
    assert bool((q[nonzero].abs().amax(1) == 127).all()), "each nonzero row must use the full range"
    err = (q.float() * s[:, None] - w32).abs()
    # half a step, plus fp32 rounding of q * s - w (|q * s| < 128 s)
    assert bool((err <= s[:, None] * (0.5 + 1e-5)).all()), f"max err {(err / s[:, None].clamp_min(1e-30)).max()} steps"


def test_quantize_leaves_the_weight_untouched():
    # an fp32 weight once came back divided by its scales: the chunk was a view, not a copy
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(300, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
        before = w.clone()
        quantize_int8_rows(w)
        quantize_int4_groups(w)
        assert torch.equal(w, before), dtype


def test_quantize_chunks_bound_peak_memory():
    # the only large temporary is one fp32 chunk of ceil(N/32) rows: 6.25% of a BF16 weight
    w = torch.empty(248_320, 1, dtype=torch.bfloat16)
    rows = [j - i for i, j in lm_head._row_chunks(w)]
    assert sum(rows) == 248_320 and max(rows) * 4 <= 0.0625 * 248_320 * 2 + 4


def test_quantize_rejects_nan_and_bad_shapes():
    w = torch.randn(70, 16)
    w[66, 3] = float("inf")
    with pytest.raises(ValueError, match="row 66"):
        quantize_int8_rows(w)
    with pytest.raises(ValueError, match="row 66"):
        quantize_int4_groups(w)
    with pytest.raises(ValueError, match="2-D"):
        quantize_int8_rows(torch.randn(3))
    with pytest.raises(ValueError, match="floating point"):
        quantize_int8_rows(torch.ones(3, 3, dtype=torch.int32))


def test_quantize_int4_groups_round_trip_and_layout():
    g = torch.Generator().manual_seed(1)
    k = 300  # two full groups and a tail of 44
    w = torch.randn(50, k, generator=g) * 0.03
    w[7, 128:256] = 0  # an all-zero group
    q, s = quantize_int4_groups(w)
    assert q.dtype == torch.uint8 and q.shape == (50, 3 * 64) and s.dtype == torch.float16 and s.shape == (50, 3)
    lo, hi = (q & 0xF).view(50, 3, 64), (q >> 4).view(50, 3, 64)
    assert int(torch.cat([lo, hi]).min()) >= 1 and int(torch.cat([lo, hi]).max()) <= 15  # q + 8, q in [-7, 7]
    # byte j of a group holds element j (low nibble) and element j + 64 (high nibble)
    vals = torch.cat([lo, hi], dim=2).float() - 8  # [50, 3, 128]
    assert bool((vals.view(50, -1)[:, k:] == 0).all()), "the K tail must be padded with q = 0"
    dq = lm_head.dequantize_int4_groups(q, s, k)
    torch.testing.assert_close(dq, (vals * s.float()[:, :, None]).view(50, -1)[:, :k], rtol=0, atol=0)
    assert float(s[7, 1]) == 0.0 and bool((dq[7, 128:256] == 0).all())
    sg = s.float().repeat_interleave(128, dim=1)[:, :k]
    assert bool(((dq - w).abs() <= sg * 0.5 * (1 + 1e-3) + 1e-12).all())


# ------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_dname)
@pytest.mark.parametrize("kind,bucket", sorted(lm_head._CONFIGS))
def test_every_shipped_config(kind, bucket, dtype):
    # Each config is its own compiled kernel: check them all (and the small-shared-memory fallbacks),
    # not just the one autotuning picks.
    m = {16: 5, 32: 29, 64: 50, 128: 100, 512: 300, 8192: 600}[bucket]
    n, k = 1000, 3072  # K = the real head's; N with a tail for every BLOCK_N
    gen = torch.Generator().manual_seed(bucket)
    w = torch.randn(n, k, generator=gen) * 0.02
    x = _rand_x(m, k, dtype, gen)
    small = lm_head._SMALL_SMEM_CONFIGS.get((kind, bucket))
    for cfg in lm_head._CONFIGS[(kind, bucket)] + ([small] if small else []):
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        if kind == "int8":
            q, s = (t.cuda() for t in quantize_int8_rows(w))
            lm_head._launch_int8(x, q, s, out, cfg)
            _check_int8(x, q, s, out, f"int8 {cfg} M={m} {dtype}", folded=cfg[0] == "cublas")
        else:
            q, s = (t.cuda() for t in quantize_int4_groups(w))
            lm_head._launch_int4(x, q, s, out, cfg)
            ref = int4_gemv_ref(x, q, s, acc_dtype=torch.float64, out_dtype=torch.float64)
            abs_sum = x.abs().double() @ lm_head.dequantize_int4_groups(q, s, k).abs().double().T
            assert_close(out, ref, _tol(ref, abs_sum, dtype), f"int4 {cfg} M={m} {dtype}")


@pytest.mark.gpu
def test_real_shape_bf16_no_recompile_and_cuda_graph():
    n, k = 248_320, 3_072
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    q, s = quantize_int8_rows(w)
    del w
    for m in (1, 3, 16, 300):
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16) + 0.01
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        int8_gemv(x, q, s, out=out)
        _check_int8(x, q, s, out, f"real shape M={m}")
    # a new M in a bucket already compiled must not compile again
    compiled = sum(len(c[0]) for c in lm_head._int8_mm_kernel.device_caches.values())
    int8_gemv(torch.randn(2, k, device="cuda", dtype=torch.bfloat16), q, s)
    int8_gemv(torch.randn(299, k, device="cuda", dtype=torch.bfloat16), q, s)
    assert sum(len(c[0]) for c in lm_head._int8_mm_kernel.device_caches.values()) == compiled
    # capture in a CUDA graph, replay on new inputs
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(3, n, device="cuda", dtype=torch.bfloat16)
    int8_gemv(x, q, s, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int8_gemv(x, q, s, out=out)
    x.copy_(torch.randn(3, k, device="cuda", dtype=torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check_int8(x, q, s, out, "CUDA-graph replay M=3")


# ------------------------------------------------------------------ the CPU lane's launcher


@pytest.mark.skipif(CUDA or INTERPRET, reason="kernel tests run in this process")
def test_interpreter_lane():
    run_interpreter_lane(__file__, timeout_s=1200)
