"""TurboQuant codec (plain-torch reference): codebooks, rotation, packing, distortion, attention, needle.

References are independent: Max's (1960) Lloyd-Max table for N(0,1), the paper's distortion bound
(Zandieh et al. 2025, "TurboQuant": E|u - u_hat|^2 <= sqrt(3) pi / 2 * 4^-b ~= 2.72 * 4^-b for unit u),
float64 attention on the unquantized data.
"""

from __future__ import annotations

import math

import pytest
import torch

from onespark.kernels import turboquant as tq

PAPER_BOUND = math.sqrt(3) * math.pi / 2  # 2.72


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def unit_vectors(n: int, d: int = 256, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# Codebooks


def test_codebook_4bit_matches_max_gaussian_table():
    # Max (1960), 16 levels for N(0,1): positive half. At d = 256 the coordinate law has slightly
    # lighter tails than N(0,1) (variance 1, kurtosis 3 - 6/(d+2)), so the outer levels sit up to ~1% lower.
    max_table = torch.tensor([0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326], dtype=torch.float64)
    ours = tq.codebook(4).levels[8:]
    assert torch.allclose(ours, max_table, rtol=0.012), (ours, max_table)
    assert abs(tq.codebook(4).mse - 0.009497) / 0.009497 < 0.02  # Max's MSE for 16 levels


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_is_symmetric_sorted_and_under_paper_bound(bits):
    cb = tq.codebook(bits)
    assert len(cb.levels) == 1 << bits and len(cb.bounds) == (1 << bits) - 1
    assert torch.all(cb.levels.diff() > 0) and torch.all(cb.bounds.diff() > 0)
    assert torch.allclose(cb.levels, -cb.levels.flip(0), atol=1e-9)
    assert cb.mse < PAPER_BOUND * 4.0**-bits


def test_codebook_is_deterministic_and_rejects_unsupported_bits():
    a = tq.codebook(3)
    tq.codebook.cache_clear()
    tq._grid.cache_clear()
    b = tq.codebook(3)
    assert torch.equal(a.levels, b.levels)
    with pytest.raises(ValueError, match="1..4 and 8 bits"):
        tq.codebook(5)


def test_8bit_grid_is_uniform_with_mse_best_step():
    cb = tq.codebook(8)
    assert torch.allclose(cb.levels.diff(), torch.full((255,), cb.delta, dtype=torch.float64))
    # granular error delta^2 / 12, plus overload past the last level (~10% at the MSE-best step)
    assert cb.delta**2 / 12 < cb.mse < 1.25 * cb.delta**2 / 12
    # and the step is a local optimum of the MSE
    k = cb.levels / cb.delta
    for f in (0.95, 1.05):
        d = cb.delta * f
        assert tq._mse(k * d, (k[1:] - 0.5) * d) > cb.mse


# ---------------------------------------------------------------------------------------------
# Rotation, packing, layout


def test_rotation_is_orthonormal_seeded_and_exact_in_bf16():
    r = tq.rotation(tq.rotation_seed(5), dtype=torch.float64)
    assert torch.allclose(r @ r.T, torch.eye(256, dtype=torch.float64), atol=1e-12)
    assert torch.equal(r, tq.rotation(tq.rotation_seed(5), dtype=torch.float64))
    assert not torch.equal(r, tq.rotation(tq.rotation_seed(6), dtype=torch.float64))
    assert torch.equal(r.to(torch.bfloat16).double(), r)  # +-1/16: the kernels rotate in the input dtype


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_pack_roundtrip_and_size(bits):
    codes = torch.randint(0, 1 << bits, (7, 3, 256))
    packed = tq.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 3, bits * 32)
    assert torch.equal(tq.unpack(packed, bits), codes)


def test_pack_bit_positions_follow_the_documented_layout():
    # 4 bit: code 8 is level[8] = +|level|, magnitude 0, sign 0: all bits zero
    codes = torch.full((256,), 8, dtype=torch.int64)
    assert int(tq.pack(codes, 4).sum()) == 0
    codes[130] = 5  # B of byte 2 (130 = 128 + 2); negative (5 < 8), magnitude 7 - 5 = 2: bits 4-6, sign bit 3
    codes[2] = 14  # A of byte 2; positive, magnitude 6: bits 0-2, sign bit 7 clear
    assert tq.pack(codes, 4)[2] == (2 << 4) | (1 << 3) | 6 and int(tq.pack(codes, 4).sum()) == (2 << 4) + 8 + 6
    codes[2] = 0  # negative, magnitude 7: and sign bit 7
    assert tq.pack(codes, 4)[2] == (1 << 7) | (2 << 4) | (1 << 3) | 7
    codes = torch.zeros(256, dtype=torch.int64)
    codes[200] = 0b110  # 3 bit: low field 0b10 at byte 200 % 64 = 8 bits 2*(200//64)=6; high bit at byte 200 % 32 = 8, bit 6
    p = tq.pack(codes, 3)
    assert p[8] == 0b10 << 6 and p[64 + 8] == 1 << 6 and int(p.sum()) == (0b10 << 6) + (1 << 6)


def test_bytes_per_token_per_preset():
    got = {name: p.bytes_per_token_head() for name, p in tq.PRESETS.items()}
    assert got == {"turboquant_k4v4": 264, "turboquant_k4v3": 232, "turboquant_k8v4": 392}
    lay = tq.CacheLayout(tq.PRESETS["turboquant_k4v3"], num_kv_heads=2, page=16)
    assert lay.block_bytes == 16 * 2 * 232
    assert lay.v_offset == 16 * 2 * 128 and lay.s_offset == 16 * 2 * (128 + 96) and lay.s_offset % 16 == 0


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="unknown TurboQuant preset 'turboquant_k2v2'"):
        tq.get_preset("turboquant_k2v2")
    with pytest.raises(ValueError, match="head_dim"):
        tq.CacheLayout(tq.PRESETS[tq.DEFAULT_PRESET], 2, 16, head_dim=96)
    with pytest.raises(ValueError, match="page"):
        tq.CacheLayout(tq.PRESETS[tq.DEFAULT_PRESET], 2, 0)


# ---------------------------------------------------------------------------------------------
# Distortion (Monte Carlo, 4000 unit vectors: the estimate's relative std is ~2%)

BITS_PRESET = [3, 4, 8]


@pytest.mark.parametrize("bits", BITS_PRESET)
def test_mse_distortion_of_unit_vectors(bits):
    u = unit_vectors(4000, seed=bits)
    r = tq.rotation(11, dtype=torch.float64)
    codes, scale = tq.quantize(u, r, bits)
    err = ((tq.dequantize(codes, scale, r, bits) - u) ** 2).sum(-1).mean().item()
    if bits == 8:
        # uniform grid, not Lloyd-Max: its own error delta^2/12 (~2x the Lloyd-Max 8-bit error; 1e-4 absolute)
        assert err < 1.2 * tq.codebook(8).mse
    else:
        assert err < PAPER_BOUND * 4.0**-bits
        # the length fix (scale = |x| / |c|) must not cost more than a few % over plain Lloyd-Max
        assert err < 1.05 * tq.codebook(bits).mse


@pytest.mark.parametrize("bits", BITS_PRESET)
def test_inner_product_distortion(bits):
    # After the random rotation the error direction is uniform, so E <y, x - x_hat>^2 = |y|^2 E|x - x_hat|^2 / d;
    # for unit x that is <= 2.72 * 4^-b |y|^2 / d (the MSE bound), here checked with y independent of x.
    u = unit_vectors(4000, seed=20 + bits)
    y = torch.randn(4000, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    r = tq.rotation(12, dtype=torch.float64)
    codes, scale = tq.quantize(u, r, bits)
    diff = ((tq.dequantize(codes, scale, r, bits) - u) * y).sum(-1)
    per = (diff**2 / (y * y).sum(-1)).mean().item() * 256
    bound = 1.2 * tq.codebook(8).mse if bits == 8 else PAPER_BOUND * 4.0**-bits
    assert per < bound * 1.1  # 1.1: Monte Carlo spread of a 4000-sample mean of squares
    assert abs(diff.mean().item()) < 4 * diff.std().item() / math.sqrt(4000)  # no bias beyond noise


def test_zero_vector_encodes_to_zero():
    r = tq.rotation(3)
    x = torch.zeros(2, 256)
    x[1, 7] = 2.0
    codes, scale = tq.quantize(x, r, 4)
    assert scale[0] == 0 and not torch.isnan(scale).any()
    xh = tq.dequantize(codes, scale, r, 4)
    assert torch.all(xh[0] == 0)
    assert xh[1].norm().item() == pytest.approx(2.0, rel=1e-6)  # length preserved


# ---------------------------------------------------------------------------------------------
# Paged cache and attention


# Attention-output relative error vs float64 on unquantized data, L = 4096, 16 query heads, sm_scale 1/16.
# Measured on this reference (2026-11-30): random 0.137 / 0.207 / 0.095, outlier 0.300 / 0.334 / 0.093,
# neardup 0.095 / 0.181 / 0.095 for K4V4 / K4V3 / K8V4. Limits are those + 15% (a regression guard), and
# every preset must keep the ordering K8V4 <= K4V4 <= K4V3 that its bit budget implies.
ATTN_LIMITS = {
    "random": (0.16, 0.24, 0.11),
    "outlier": (0.35, 0.39, 0.11),
    "neardup": (0.11, 0.21, 0.11),
}


@pytest.mark.parametrize("kind", list(ATTN_LIMITS))
def test_attention_output_error_vs_unquantized(kind):
    k, v, q = tq.structured_kv(kind, 4096)
    r = tq.rotation(tq.rotation_seed(0), dtype=torch.float64)
    ref = tq.attention_reference(q[:, None], k[:, None], v[:, None], 1 / 16)
    errs = []
    for p, limit in zip(tq.PRESETS.values(), ATTN_LIMITS[kind]):
        kc, ks = tq.quantize(k, r, p.k_bits)
        vc, vs = tq.quantize(v, r, p.v_bits)
        out = tq.attention_reference(q[:, None], tq.dequantize(kc, ks, r, p.k_bits)[:, None], tq.dequantize(vc, vs, r, p.v_bits)[:, None], 1 / 16)
        errs.append(rel_err(out, ref))
        assert errs[-1] < limit, (kind, p.name, errs[-1])
    assert errs[2] <= errs[0] * 1.02 <= errs[1] * 1.02, errs


def test_paged_cache_roundtrip_scattered_blocks_and_skipped_slots():
    lay = tq.CacheLayout(tq.PRESETS["turboquant_k4v3"], num_kv_heads=3, page=16)
    cache = lay.empty(10)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(50, 3, 256, generator=g), torch.randn(50, 3, 256, generator=g)
    slots = torch.randperm(160, generator=g)[:50]
    slots[[4, 9]] = -1
    r = tq.rotation(77)
    tq.encode_reference(k, v, slots, cache, lay, r)
    kept = slots >= 0
    kc, ks, vc, vs = tq.read_reference(cache, lay, slots[kept])
    kc2, ks2 = tq.quantize(k[kept], r, 4)
    vc2, vs2 = tq.quantize(v[kept], r, 3)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and torch.equal(ks, ks2) and torch.equal(vs, vs2)
    # skipped tokens wrote nothing: every byte outside the 48 written (token, head) rows is still 0
    touched = torch.zeros_like(cache, dtype=torch.bool)
    for s in slots[kept].tolist():
        blk, off = divmod(s, 16)
        for h in range(3):
            row = off * 3 + h
            touched[blk, row * lay.k_bytes : (row + 1) * lay.k_bytes] = True
            touched[blk, lay.v_offset + row * lay.v_bytes : lay.v_offset + (row + 1) * lay.v_bytes] = True
            touched[blk, lay.s_offset + row * 8 : lay.s_offset + row * 8 + 8] = True
    assert not cache[~touched].any()


def needle_case(L: int, seed: int, d: int = 256):
    """L keys with outlier channels (x10); a needle at a random position; 32 distractors at cosine 0.95 to it.
    The query is the needle's direction. -> keys [L, d], needle index, query [d]."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, d, generator=g)
    k[:, :8] *= 10
    pos = int(torch.randint(0, L, (1,), generator=g))
    needle = torch.randn(d, generator=g)  # no outlier channels: the query must find it by content
    k[pos] = needle
    near = torch.randint(0, L, (32,), generator=g)
    near = near[near != pos]
    u = needle / needle.norm()
    noise = torch.randn(len(near), d, generator=g)
    noise -= (noise @ u)[:, None] * u  # orthogonal to the needle
    noise *= needle.norm() / noise.norm(dim=-1, keepdim=True)
    k[near] = 0.95 * needle + math.sqrt(1 - 0.95**2) * noise  # same length, cosine 0.95
    return k, pos, u


@pytest.mark.parametrize("name", list(tq.PRESETS))
def test_needle_stays_top1_8k(name):
    p = tq.PRESETS[name]
    r = tq.rotation(tq.rotation_seed(3), dtype=torch.float64)
    for seed in range(3):
        k, pos, q = needle_case(8192, seed)
        codes, scale = tq.quantize(k, r, p.k_bits)
        scores = tq.dequantize(codes, scale, r, p.k_bits) @ q.double()
        exact = k.double() @ q.double()
        assert int(scores.argmax()) == pos == int(exact.argmax())
