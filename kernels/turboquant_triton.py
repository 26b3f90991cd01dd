"""TurboQuant Triton kernels: cache write (encode) and split-KV decode attention, matching turboquant.py.

Decode attention, one program per (sequence, KV head, split):
  * the G = Hq/H query heads of the KV head times the T query positions (16 x 3 for an MTP-2 verify
    step on Qwen3.5-122B) form ONE [BLOCK_M, d] tile, so each compressed K/V tile is read once for
    all of them and every product is a tl.dot (tensor cores);
  * codes are decoded in registers: 4/3-bit through the codebook (a 16/8-entry fp16 table that
    stays in L1), 8-bit by one multiply-add;
  * scores are scaled per key by its stored scale (q . x_hat = scale * (Rq) . c), probabilities per
    value by its scale; online softmax in base 2;
  * a second kernel merges the splits and applies the inverse rotation R^T in its epilogue.
Queries are rotated (and pre-scaled by sm_scale * log2 e) by one small matmul before the launch.
Bytes moved per decode step and KV head: L * (k_bytes + v_bytes + 8), e.g. 264 B/token for K4V4
against 1024 B for BF16. No host syncs: split bounds come from seq_lens on the device, the grid
only from host-known sizes, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import turboquant as tq

LOG2E = 1.4426950408889634
CHUNK = 64  # the head dim is processed as d/64 column chunks of 64


# ---------------------------------------------------------------------------------------------
# Tables shared by both kernels (cached per device)

_TABLES: dict = {}


def _tables(preset: tq.Preset, seed: int, device, d: int = tq.HEAD_DIM):
    key = (preset, seed, str(device), d)
    if key not in _TABLES:
        r = tq.rotation(seed, d, torch.float32, device)
        kcb, vcb = tq.codebook(preset.k_bits), tq.codebook(preset.v_bits)

        def levels(cb):  # fp16 table (8-bit: unused placeholder, decoded arithmetically)
            return cb.levels.to(torch.float16).to(device) if cb.delta == 0 else torch.zeros(1, dtype=torch.float16, device=device)

        def bounds(cb):
            return cb.bounds.to(torch.float32).to(device)

        _TABLES[key] = dict(
            r=r,
            kcb=levels(kcb),
            vcb=levels(vcb),
            kbnd=bounds(kcb),
            vbnd=bounds(vcb),
            klev32=kcb.levels.to(torch.float32).to(device),
            vlev32=vcb.levels.to(torch.float32).to(device),
            kdelta=kcb.delta,
            vdelta=vcb.delta,
        )
    return _TABLES[key]


# ---------------------------------------------------------------------------------------------
# Encode: x [n, H, d] -> codes + scale, written into the paged cache


@triton.jit
def _quantize_rows(
    X, stride_xn, stride_xh, RT, BND, LEV, n0, h, n_tokens,
    BITS: tl.constexpr, DELTA: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Rotate, normalise and quantize BLOCK_T rows; -> codes int32 [BLOCK_T, D], scale fp32 [BLOCK_T]."""
    rows = n0 + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)
    rmask = rows < n_tokens
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_xn + h * stride_xh + cols[None, :], mask=rmask[:, None], other=0.0)
    if x.dtype == tl.bfloat16:
        # fp16 holds every bf16 value in [6e-5, 65504] exactly; K/V stay far inside that range. (Also the
        # interpreter mis-reads bf16 dot operands.) RT entries are +-1/16, exact in fp16: the dot is exact
        # products with fp32 accumulation.
        x = x.to(tl.float32).to(tl.float16)
    xr = tl.dot(x, tl.load(RT + cols[:, None] * D + cols[None, :]))
    xf = x.to(tl.float32)
    norm = tl.sqrt(tl.sum(xf * xf, 1))
    safe = tl.where(norm > 0, norm, 1.0)
    z = xr * (tl.sqrt(D * 1.0) / safe)[:, None]
    if DELTA > 0:  # uniform grid, bounds at (i - 2^(b-1) + 1) delta: code = #bounds below z, as the reference
        half: tl.constexpr = ((1 << BITS) - 1) / 2
        code = tl.ceil(z / DELTA + (half - 0.5))
        code = tl.minimum(tl.maximum(code, 0.0), (1 << BITS) - 1.0).to(tl.int32)
        c = (code.to(tl.float32) - half) * DELTA
    else:  # binary search over the 2^b - 1 sorted bounds: code = #bounds below z
        code = tl.zeros([BLOCK_T, D], dtype=tl.int32)
        step: tl.constexpr = 1 << (BITS - 1)
        for i in tl.static_range(BITS):
            cand = code + (step >> i)
            code = tl.where(z > tl.load(BND + cand - 1), cand, code)
        c = tl.load(LEV + code)
    cn = tl.sqrt(tl.sum(c * c, 1))
    scale = norm / cn
    return code, scale


@triton.jit
def _store_codes(CACHE, row_base, code, BITS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, rmask):
    """Pack codes [BLOCK_T, D] into the row layout of turboquant.py and store at row_base [BLOCK_T] (int64)."""
    if BITS == 8:
        tl.store(CACHE + row_base[:, None] + tl.arange(0, D)[None, :], code.to(tl.uint8), mask=rmask[:, None])
    elif BITS == 4:
        lo, hi = tl.split(tl.permute(tl.reshape(code, [BLOCK_T, 2, D // 2]), [0, 2, 1]))
        tl.store(CACHE + row_base[:, None] + tl.arange(0, D // 2)[None, :], (lo | (hi << 4)).to(tl.uint8), mask=rmask[:, None])
    else:  # 3 bit: 2-bit plane (4 fields of d/4 coords) + high-bit plane (8 fields of d/8 coords)
        c4 = tl.permute(tl.reshape(code & 3, [BLOCK_T, 2, 2, D // 4]), [0, 3, 1, 2])  # [..., m // 2, m % 2]
        e0, e1 = tl.split(c4)  # m even / odd
        m0, m2 = tl.split(e0)
        m1, m3 = tl.split(e1)
        low = m0 | (m1 << 2) | (m2 << 4) | (m3 << 6)
        tl.store(CACHE + row_base[:, None] + tl.arange(0, D // 4)[None, :], low.to(tl.uint8), mask=rmask[:, None])
        c8 = tl.permute(tl.reshape(code >> 2, [BLOCK_T, 2, 2, 2, D // 8]), [0, 4, 1, 2, 3])  # bit m = 4a+2b+c
        a0, a1 = tl.split(c8)  # c = 0 / 1
        b00, b01 = tl.split(a0)  # (c=0, b=0/1)
        b10, b11 = tl.split(a1)
        h0, h4 = tl.split(b00)  # (c, b) = (0, 0): a = 0 / 1 -> m = 0 / 4
        h2, h6 = tl.split(b01)
        h1, h5 = tl.split(b10)
        h3, h7 = tl.split(b11)
        high = h0 | (h1 << 1) | (h2 << 2) | (h3 << 3) | (h4 << 4) | (h5 << 5) | (h6 << 6) | (h7 << 7)
        tl.store(CACHE + row_base[:, None] + D // 4 + tl.arange(0, D // 8)[None, :], high.to(tl.uint8), mask=rmask[:, None])


@triton.jit
def _tq_encode_kernel(
    K, V, stride_kn, stride_kh, stride_vn, stride_vh, SLOTS, CACHE, CACHE_F32, RT,
    KBND, KLEV, VBND, VLEV, n_tokens, block_bytes, v_offset, s_offset,
    H: tl.constexpr, PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    K_DELTA: tl.constexpr, V_DELTA: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_T
    h = tl.program_id(1)
    rows = n0 + tl.arange(0, BLOCK_T)
    slot = tl.load(SLOTS + rows, mask=rows < n_tokens, other=-1).to(tl.int64)
    rmask = slot >= 0  # vLLM marks padded tokens with slot -1
    blk = tl.where(rmask, slot // PAGE, 0)
    row = (tl.where(rmask, slot % PAGE, 0)) * H + h  # row of this (token, head) inside its block
    base = blk * block_bytes
    kcode, kscale = _quantize_rows(K, stride_kn, stride_kh, RT, KBND, KLEV, n0, h, n_tokens, K_BITS, K_DELTA, D, BLOCK_T)
    _store_codes(CACHE, base + row * (K_BITS * D // 8), kcode, K_BITS, D, BLOCK_T, rmask)
    vcode, vscale = _quantize_rows(V, stride_vn, stride_vh, RT, VBND, VLEV, n0, h, n_tokens, V_BITS, V_DELTA, D, BLOCK_T)
    _store_codes(CACHE, base + v_offset + row * (V_BITS * D // 8), vcode, V_BITS, D, BLOCK_T, rmask)
    sidx = (base + s_offset) // 4 + row * 2
    tl.store(CACHE_F32 + sidx, kscale, mask=rmask)
    tl.store(CACHE_F32 + sidx + 1, vscale, mask=rmask)


def _check_cache(cache: torch.Tensor, layout: tq.CacheLayout):
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != layout.block_bytes or not cache.is_contiguous():
        raise ValueError(
            f"cache must be a contiguous uint8 [num_blocks, {layout.block_bytes}] tensor for {layout.preset.name} "
            f"with {layout.num_kv_heads} KV heads and page {layout.page} (CacheLayout.empty makes one); "
            f"got {cache.dtype} {tuple(cache.shape)}"
        )


def encode(k, v, slot_mapping, cache, layout: tq.CacheLayout, seed: int, block_t: int = 16):
    """Write k, v [num_tokens, H, d] (fp16/bf16; fp32 in the interpreter) into the paged cache."""
    n, H, d = k.shape
    if v.shape != k.shape or H != layout.num_kv_heads or d != layout.head_dim:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the layout (H={layout.num_kv_heads}, d={layout.head_dim})")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dimension")
    if slot_mapping.shape != (n,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{n}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    _check_cache(cache, layout)
    if n == 0:
        return
    t = _tables(layout.preset, seed, k.device, d)
    rt = t["r"].T.contiguous().to(torch.float32 if k.dtype == torch.float32 else torch.float16)
    grid = (triton.cdiv(n, block_t), H)
    _tq_encode_kernel[grid](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slot_mapping, cache, cache.view(torch.float32), rt,
        t["kbnd"], t["klev32"], t["vbnd"], t["vlev32"], n, layout.block_bytes, layout.v_offset, layout.s_offset,
        H=H, PAGE=layout.page, K_BITS=layout.preset.k_bits, V_BITS=layout.preset.v_bits,
        K_DELTA=t["kdelta"], V_DELTA=t["vdelta"], D=d, BLOCK_T=block_t,
    )


# ---------------------------------------------------------------------------------------------
# Decode attention


@triton.jit
def _load_chunk(CACHE, row_ptr, nmask, CB, A: tl.constexpr, BITS: tl.constexpr, DELTA: tl.constexpr, D: tl.constexpr):
    """Codebook values of rotated coordinates [64A, 64A + 64) for BLOCK_N tokens: fp16 [BLOCK_N, 64].
    row_ptr [BLOCK_N] int64: byte offset of each token's code row."""
    j = tl.arange(0, 64)
    if BITS == 8:
        b = tl.load(CACHE + row_ptr[:, None] + (A * 64 + j)[None, :], mask=nmask[:, None], other=0)
        out = ((b.to(tl.float32) - 127.5) * DELTA).to(tl.float16)
    elif BITS == 4:
        b = tl.load(CACHE + row_ptr[:, None] + ((A % 2) * 64 + j)[None, :], mask=nmask[:, None], other=0).to(tl.int32)
        out = tl.load(CB + ((b >> (4 * (A // 2))) & 15))
    else:  # 3 bit
        lo = tl.load(CACHE + row_ptr[:, None] + j[None, :], mask=nmask[:, None], other=0).to(tl.int32)
        hb = tl.load(CACHE + row_ptr[:, None] + D // 4 + (j % 32)[None, :], mask=nmask[:, None], other=0).to(tl.int32)
        code = ((lo >> (2 * A)) & 3) | (((hb >> (2 * A + j[None, :] // 32)) & 1) << 2)
        out = tl.load(CB + code)
    return out


@triton.jit
def _tq_decode_kernel(
    Q, stride_qb, stride_qh, stride_qt, CACHE, CACHE_F32, BLOCK_TABLE, stride_bt, SEQ_LENS, KCB, VCB, WS_ACC, WS_ML,
    num_splits, block_bytes, v_offset, s_offset,
    H: tl.constexpr, G: tl.constexpr, T: tl.constexpr, PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    K_DELTA: tl.constexpr, V_DELTA: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tl.static_assert(D == 256)  # four 64-column chunks below
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    L = tl.load(SEQ_LENS + b)
    per = tl.cdiv(tl.cdiv(L, num_splits), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(L, start + per)

    # tile rows: r = g * T + t (query head h*G + g, position t)
    r = tl.arange(0, BLOCK_M)
    g = r // T
    t = r % T
    rvalid = r < G * T
    qrow = Q + b.to(tl.int64) * stride_qb + (h * G + g) * stride_qh + t * stride_qt
    c64 = tl.arange(0, 64)
    q0 = tl.load(qrow[:, None] + c64[None, :], mask=rvalid[:, None], other=0.0)
    q1 = tl.load(qrow[:, None] + 64 + c64[None, :], mask=rvalid[:, None], other=0.0)
    q2 = tl.load(qrow[:, None] + 128 + c64[None, :], mask=rvalid[:, None], other=0.0)
    q3 = tl.load(qrow[:, None] + 192 + c64[None, :], mask=rvalid[:, None], other=0.0)
    last = L - T + t  # last key position each row may see (causal within an MTP verify step)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, 64], tl.float32)
    acc1 = tl.zeros([BLOCK_M, 64], tl.float32)
    acc2 = tl.zeros([BLOCK_M, 64], tl.float32)
    acc3 = tl.zeros([BLOCK_M, 64], tl.float32)
    KB: tl.constexpr = K_BITS * D // 8
    VB: tl.constexpr = V_BITS * D // 8
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        nmask = tok < end
        blk = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_bt + tok // PAGE, mask=nmask, other=0).to(tl.int64)
        row = (tok % PAGE) * H + h
        base = blk * block_bytes
        krow = base + row * KB
        vrow = base + v_offset + row * VB
        sidx = (base + s_offset) // 4 + row * 2
        ks = tl.load(CACHE_F32 + sidx, mask=nmask, other=0.0)
        vs = tl.load(CACHE_F32 + sidx + 1, mask=nmask, other=0.0)

        s = tl.dot(q0, tl.trans(_load_chunk(CACHE, krow, nmask, KCB, 0, K_BITS, K_DELTA, D)))
        s += tl.dot(q1, tl.trans(_load_chunk(CACHE, krow, nmask, KCB, 1, K_BITS, K_DELTA, D)))
        s += tl.dot(q2, tl.trans(_load_chunk(CACHE, krow, nmask, KCB, 2, K_BITS, K_DELTA, D)))
        s += tl.dot(q3, tl.trans(_load_chunk(CACHE, krow, nmask, KCB, 3, K_BITS, K_DELTA, D)))
        s = s * ks[None, :]
        s = tl.where(nmask[None, :] & (tok[None, :] <= last[:, None]), s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = (p * vs[None, :]).to(tl.float16)
        acc0 = acc0 * alpha[:, None] + tl.dot(pv, _load_chunk(CACHE, vrow, nmask, VCB, 0, V_BITS, V_DELTA, D))
        acc1 = acc1 * alpha[:, None] + tl.dot(pv, _load_chunk(CACHE, vrow, nmask, VCB, 1, V_BITS, V_DELTA, D))
        acc2 = acc2 * alpha[:, None] + tl.dot(pv, _load_chunk(CACHE, vrow, nmask, VCB, 2, V_BITS, V_DELTA, D))
        acc3 = acc3 * alpha[:, None] + tl.dot(pv, _load_chunk(CACHE, vrow, nmask, VCB, 3, V_BITS, V_DELTA, D))
        m_i = m_new

    ws = (bh.to(tl.int64) * num_splits + split) * BLOCK_M
    wrow = (ws + r)[:, None] * D + c64[None, :]
    tl.store(WS_ACC + wrow, acc0)
    tl.store(WS_ACC + wrow + 64, acc1)
    tl.store(WS_ACC + wrow + 128, acc2)
    tl.store(WS_ACC + wrow + 192, acc3)
    tl.store(WS_ML + (ws + r) * 2, m_i)
    tl.store(WS_ML + (ws + r) * 2 + 1, l_i)


@triton.jit
def _tq_merge_kernel(
    WS_ACC, WS_ML, R, OUT, stride_ob, stride_oh, stride_ot, num_splits,
    H: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Merge the splits of one (sequence, KV head) and write output columns [64C, 64C + 64): out = o_rot @ R."""
    bh = tl.program_id(0)
    C = tl.program_id(1)
    b = bh // H
    h = bh % H
    r = tl.arange(0, BLOCK_M)
    c64 = tl.arange(0, 64)
    base = bh.to(tl.int64) * num_splits * BLOCK_M
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(num_splits):
        m_all = tl.maximum(m_all, tl.load(WS_ML + (base + s * BLOCK_M + r) * 2))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    for s in range(num_splits):
        ml = WS_ML + (base + s * BLOCK_M + r) * 2
        l_all += tl.exp2(tl.load(ml) - m_safe) * tl.load(ml + 1)
    inv_l = 1.0 / tl.where(l_all > 0, l_all, 1.0)
    out = tl.zeros([BLOCK_M, 64], tl.float32)
    for a in tl.static_range(4):
        o = tl.zeros([BLOCK_M, 64], tl.float32)
        for s in range(num_splits):
            w = tl.exp2(tl.load(WS_ML + (base + s * BLOCK_M + r) * 2) - m_safe)
            o += w[:, None] * tl.load(WS_ACC + (base + s * BLOCK_M + r)[:, None] * D + a * 64 + c64[None, :])
        o = o * inv_l[:, None]
        rblk = tl.load(R + (a * 64 + c64)[:, None] * D + C * 64 + c64[None, :])
        out += tl.dot(o, rblk, input_precision="ieee")
    g = r // T
    t = r % T
    optr = OUT + b.to(tl.int64) * stride_ob + (h * G + g) * stride_oh + t * stride_ot
    tl.store(optr[:, None] + C * 64 + c64[None, :], out.to(OUT.dtype.element_ty), mask=(r < G * T)[:, None])


def num_splits_for(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Enough (sequence, head, split) programs to fill the GPU twice over, each with >= 4 tiles of work.
    Depends only on host-known sizes, so a CUDA graph captured for max_seq_len stays valid."""
    want = triton.cdiv(2 * num_sms, batch * num_kv_heads)
    most = max(1, triton.cdiv(max_seq_len, 4 * block_n))
    return max(1, min(want, most, 256))


def rotate_queries(q: torch.Tensor, r: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [B, Hq, T, d] -> fp16 R q * sm_scale * log2(e) (the kernel's softmax is base 2)."""
    return ((q.to(torch.float32) @ r.T) * (sm_scale * LOG2E)).to(torch.float16)


def decode_attention(
    q, cache, layout: tq.CacheLayout, block_table, seq_lens, seed: int, sm_scale: float, max_seq_len: int,
    num_splits: int | None = None, block_n: int = 32, num_warps: int | None = None, num_stages: int = 2, out=None,
):
    """q [B, Hq, T, d] -> out [B, Hq, T, d] (q's dtype). seq_lens [B] int32 on the device (no sync);
    max_seq_len: a host-side upper bound that sizes the split grid."""
    B, Hq, T, d = q.shape
    H = layout.num_kv_heads
    if d != layout.head_dim or d != 256:
        raise ValueError(f"decode_attention supports head_dim 256 (the layout has {layout.head_dim}, q has {d})")
    if Hq % H:
        raise ValueError(f"{Hq} query heads do not divide into {H} KV heads")
    _check_cache(cache, layout)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be int32 [{B}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be int32 [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_table.shape[1] * layout.page < max_seq_len:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table ({block_table.shape[1]} blocks of {layout.page})")
    G = Hq // H
    block_m = max(16, triton.next_power_of_2(G * T))
    t = _tables(layout.preset, seed, q.device, d)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = num_splits_for(B, H, max_seq_len, block_n, sms)
    qr = rotate_queries(q, t["r"], sm_scale)
    ws_acc = torch.empty(B * H * num_splits * block_m * d, dtype=torch.float32, device=q.device)
    ws_ml = torch.empty(B * H * num_splits * block_m * 2, dtype=torch.float32, device=q.device)
    if num_warps is None:
        num_warps = 8 if block_m >= 64 else 4
    _tq_decode_kernel[(B * H, num_splits)](
        qr, qr.stride(0), qr.stride(1), qr.stride(2), cache, cache.view(torch.float32), block_table, block_table.stride(0),
        seq_lens, t["kcb"], t["vcb"], ws_acc, ws_ml, num_splits, layout.block_bytes, layout.v_offset, layout.s_offset,
        H=H, G=G, T=T, PAGE=layout.page, K_BITS=layout.preset.k_bits, V_BITS=layout.preset.v_bits,
        K_DELTA=t["kdelta"], V_DELTA=t["vdelta"], D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )
    if out is None:
        out = torch.empty_like(q)
    _tq_merge_kernel[(B * H, d // 64)](
        ws_acc, ws_ml, t["r"], out, out.stride(0), out.stride(1), out.stride(2), num_splits,
        H=H, G=G, T=T, D=d, BLOCK_M=block_m, num_warps=4,
    )
    return out
