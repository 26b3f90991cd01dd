"""Every Triton kernel, launched as the host code launches it, compiles for the H200 (sm_90) and for the DGX
Spark's GB10 (sm_121) with the ptxas in the Triton wheel: no GPU needed (tests/_aot.py).

What a CPU test can say about a GPU it does not have, and what these assert:
  * the code builds for the target at all (no instruction the target lacks: sm_121 has mma.sync only, no
    wgmma or tcgen05);
  * the shared memory each launch requests fits the target's per-block limit (GB10: 99 KB), so a Spark never
    meets an out-of-resources launch on a config we ship;
  * on sm_121 the TurboQuant attention tiles chosen for it do not spill registers: that is how they were
    chosen (turboquant_triton.decode_block_n, prefill_tile), since no Spark has timed them.
Resource figures are printed (pytest -s) for the record. The CUDA C++ decode kernel (kernels/turboquant_decode.cuh)
gets the same checks from nvcc: tests/test_kernels_compile_cuda.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from onespark.kernels import lm_head
from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_triton as tt
from tests._aot import captured_launches, compile_for

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for GPUs, not interpreted")

SPARK, H200 = 121, 90
SMEM_LIMIT = {SPARK: 101376, H200: 232448}  # opt-in shared memory per block, bytes (sm_120/121: 99 KB; sm_90: 227 KB)
CAPABILITY = {SPARK: (12, 1), H200: (9, 0)}


def _check_instructions(c, arch: int) -> None:
    if arch == SPARK:
        assert "wgmma" not in c.ptx and "tcgen05" not in c.ptx, f"{c.name}: instructions sm_121 does not have"


def _check_target(c, arch: int) -> None:
    assert c.shared <= SMEM_LIMIT[arch], f"{c.name}: {c.shared} B of shared memory > the sm_{arch} limit"
    _check_instructions(c, arch)


def _turboquant_launches(preset: str, arch: int, monkeypatch) -> list:
    """The launches one layer's step makes with the Qwen3.5 shape: encode (decode step and prefill chunk),
    decode (T = 1 and an MTP-2 verify step), merge, prefill (fused, and the flash path's decode into BF16);
    tiles as chosen for this GPU."""
    monkeypatch.setattr(tt, "_capability", lambda device: CAPABILITY[arch])
    lay = tq.CacheLayout(tq.PRESETS[preset], num_kv_heads=2, page=16)
    cache = lay.empty(64)
    bt, sl = torch.zeros(1, 64, dtype=torch.int32), torch.tensor([1000], dtype=torch.int32)
    with captured_launches() as launches:
        for n in (1, 300):  # block_t 4 and 16
            kv = torch.randn(n, 2, 256, dtype=torch.bfloat16)
            tt.encode(kv, kv, torch.arange(n), cache, lay, seed=7)
        for T in (1, 3):
            tt.decode_attention(torch.randn(1, 32, T, 256, dtype=torch.bfloat16), cache, lay, bt, sl, 7, 1 / 16, 1000)
        tt.prefill_attention(torch.randn(40, 32, 256, dtype=torch.bfloat16), cache, lay, bt, sl,
                             torch.tensor([0, 40], dtype=torch.int32), 7, 1 / 16, 40)
        tt.dequantize_rotated(cache, lay, bt[0], 0, 1000, 7, torch.bfloat16)  # the default prefill path's decode
    return launches


@pytest.mark.parametrize("arch", [SPARK, H200], ids=["sm121", "sm90"])
@pytest.mark.parametrize("preset", list(tq.PRESETS))
def test_turboquant_kernels_build_for_the_spark_and_the_h200(preset, arch, monkeypatch):
    launches = _turboquant_launches(preset, arch, monkeypatch)
    names = [launch.kernel.fn.__name__ for launch in launches]
    assert names.count("_tq_decode_kernel") == 2 and names.count("_tq_prefill_kernel") == 1, names
    assert names.count("_tq_dequant_kernel") == 1 and names.count("_tq_merge_kernel") == 2, names
    for launch in launches:
        # the host ran on CPU tensors; on a GPU the 4-bit codes are decoded by the PRMT path
        prmt = {"PRMT": True} if "PRMT" in launch.kwargs else {}
        c = compile_for(launch, arch, **prmt)
        print(f"sm_{arch} {preset} {c.name}: {c.registers} registers, {c.spill_stack} B spilled, {c.shared} B shared")
        _check_target(c, arch)
        if arch == SPARK and c.name in ("_tq_decode_kernel", "_tq_prefill_kernel", "_tq_dequant_kernel"):
            assert c.spill_stack == 0, f"{c.name} spills {c.spill_stack} B per thread on sm_121 at its chosen tile"
        if c.name == "_tq_merge_kernel":  # and every MERGES setting at the most splits there may be
            for how, (most, warps, fwht) in ((k, v) for k, v in tt.MERGES.items() if v):
                big = compile_for(launch, arch, S_BLOCK=most, S_ML=tt.MAX_SPLITS, FWHT=fwht, num_warps=warps)
                print(f"sm_{arch} {preset} merge {how} at {tt.MAX_SPLITS} splits: {big.registers} registers, "
                      f"{big.spill_stack} B spilled")
                assert big.spill_stack == 0, f"the merge ({how}) spills on sm_{arch}"
            assert c.spill_stack == 0, f"the merge spills on sm_{arch}"


def test_the_h200_verify_tile_spills_on_the_spark(monkeypatch):
    """Why the Spark gets its own tile: the one the H200 sweep picked (64 keys for a verify step) spills on
    sm_121. If a later Triton stops spilling here, revisit decode_block_n."""
    launches = _turboquant_launches(tq.DEFAULT_PRESET, H200, monkeypatch)
    verify = [launch for launch in launches if launch.kernel.fn.__name__ == "_tq_decode_kernel"][1]
    assert verify.kwargs["BLOCK_N"] == 64 and verify.kwargs["T"] == 3
    c = compile_for(verify, SPARK, PRMT=True)
    print(f"sm_{SPARK} {tq.DEFAULT_PRESET} with the H200 verify tile {c.name}: {c.registers} registers, "
          f"{c.spill_stack} B spilled, {c.shared} B shared")
    assert c.spill_stack > 0


def test_the_spark_code_compiles_for_the_h200_with_wgmma_off(monkeypatch):
    """lab/turboquant_tiles.py --mma-sync times the Spark's decode code on an H200: with Triton's
    DISABLE_MMA_V3=1 (part of its cache key) the sm_90 build of the Spark's verify tile has no wgmma and the
    same mma.sync and PRMT counts as the sm_121 build; without it, sm_90 takes wgmma."""
    launches = _turboquant_launches(tq.DEFAULT_PRESET, SPARK, monkeypatch)
    verify = [launch for launch in launches if launch.kernel.fn.__name__ == "_tq_decode_kernel"][1]
    spark = compile_for(verify, SPARK, PRMT=True).ptx
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    h200 = compile_for(verify, H200, PRMT=True).ptx
    assert "wgmma" not in h200
    assert [h200.count(op) for op in ("mma.sync", "prmt")] == [spark.count(op) for op in ("mma.sync", "prmt")]
    monkeypatch.delenv("DISABLE_MMA_V3")
    assert "wgmma" in compile_for(verify, H200, PRMT=True).ptx


LM_HEAD_BUCKETS = [(kind, b) for kind in ("int8", "int4") for b in (16, 32, 64, 128, 512, 8192)]


@pytest.mark.parametrize("arch", [SPARK, H200], ids=["sm121", "sm90"])
@pytest.mark.parametrize("kind,bucket", LM_HEAD_BUCKETS, ids=[f"{k}-M{b}" for k, b in LM_HEAD_BUCKETS])
def test_lm_head_configs_build_and_one_fits_every_gpu(kind, bucket, arch):
    """Each bucket's candidate configs for this GPU (as _pick would try them) compile, and the first one that
    the GPU accepts fits its shared memory: a Spark serving the INT8 head never runs out of configs."""
    n, k, m = 1024, 3072, min(bucket, 64)  # N and K divisible like the real head's (248,320 x 3,072)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    fitting = []
    for cfg in lm_head._candidates(kind, bucket, x.element_size(), SMEM_LIMIT[arch]):
        with captured_launches() as launches:
            if kind == "int8":
                w, scale = lm_head.quantize_int8_rows(torch.randn(n, k))
                lm_head._launch_int8(x, w, scale, out, cfg)
            else:
                w, scale = lm_head.quantize_int4_groups(torch.randn(n, k))
                lm_head._launch_int4(x, w, scale, out, cfg)
        assert launches, f"{cfg} launched no Triton kernel"
        built = [compile_for(launch, arch) for launch in launches]
        for c in built:
            print(f"sm_{arch} {kind} M<={bucket} {cfg}: {c.name} {c.registers} registers, {c.spill_stack} B spilled, "
                  f"{c.shared} B shared")
            _check_instructions(c, arch)
        if all(c.shared <= SMEM_LIMIT[arch] for c in built):
            fitting.append(cfg)
    assert fitting, f"no {kind} config for M <= {bucket} fits sm_{arch}'s {SMEM_LIMIT[arch]} B of shared memory"

