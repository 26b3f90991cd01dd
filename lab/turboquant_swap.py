"""A candidate TurboQuant decode kernel with the products transposed ("swap AB"): keys are the tile's M side.

Not shipped and not yet timed (written 2026-12-04 without device time left; `lab/turboquant.py` times it
beside the shipped kernel as the sweep's `impl=swap` rows). The shipped kernel (kernels/turboquant_triton.py)
computes S = Q K^T with the 16-48 query rows as M, so the decoded K and V tiles are the B operand of every
product: on sm_90 Triton stores each decoded tile to shared memory for wgmma (64 keys x 256 dims x 2 B, K and V:
64 KB a tile), and the verify step pads 48 rows to 64. Here

    S^T [keys, rows] = K [keys, dims] @ Q^T [dims, rows]       K decoded in registers: the A operand
    O^T [dims, rows] += V^T [dims, keys] @ P^T [keys, rows]     V decoded transposed: the A operand

so the decoded codes never leave registers (wgmma and mma.sync both take A from registers); what goes through
shared memory is Q^T (loop-invariant) and P^T (64 x 64 x 2 B = 8 KB a tile). On mma.sync parts (the Spark's
sm_121) the warps split M, the keys, so each warp decodes only its own keys. The costs: the softmax reduces
over the keys, which span warps (a cross-warp max and sum per tile), and the epilogue writes the workspace
transposed (once per program). Same cache layout, workspace and merge as the shipped kernel: the outputs match
it to rounding (tests/test_turboquant_swap.py, in Triton's interpreter, against the float64 reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onespark.kernels import turboquant as tq
from onespark.kernels import turboquant_triton as tt


@triton.jit
def _codes_t(CACHE, ptr, nmask, TAB, BITS: tl.constexpr, PRMT: tl.constexpr, D: tl.constexpr):
    """Codebook values of one code row per token, transposed: four fp16 [64, BLOCK_N] chunks (row j of chunk a
    is coordinate 64a + j). The shipped kernel's _codes with the axes swapped: the same bytes, the same
    per-byte decode."""
    j = tl.arange(0, 64)[:, None]
    rows = CACHE + ptr[None, :]
    m = nmask[None, :]
    if BITS == 4:  # a byte holds coordinates i (low half: A) and 128 + i (high half: B)
        b0 = tl.load(rows + j, mask=m, other=0)
        b1 = tl.load(rows + 64 + j, mask=m, other=0)
        if PRMT:
            c0 = tl.inline_asm_elementwise(tt._BYTE_LO, "=r,=r,r", [b0], dtype=tl.float16, is_pure=True, pack=4)
            c2 = tl.inline_asm_elementwise(tt._BYTE_HI, "=r,=r,r", [b0], dtype=tl.float16, is_pure=True, pack=4)
            c1 = tl.inline_asm_elementwise(tt._BYTE_LO, "=r,=r,r", [b1], dtype=tl.float16, is_pure=True, pack=4)
            c3 = tl.inline_asm_elementwise(tt._BYTE_HI, "=r,=r,r", [b1], dtype=tl.float16, is_pure=True, pack=4)
        else:
            b0, b1 = b0.to(tl.int32), b1.to(tl.int32)
            c0 = tl.load(TAB + tt._sm_code(b0 & 7, b0 >> 7))
            c2 = tl.load(TAB + tt._sm_code((b0 >> 4) & 7, (b0 >> 3) & 1))
            c1 = tl.load(TAB + tt._sm_code(b1 & 7, b1 >> 7))
            c3 = tl.load(TAB + tt._sm_code((b1 >> 4) & 7, (b1 >> 3) & 1))
    elif BITS == 8:
        c0 = tt._u8_centred(tl.load(rows + j, mask=m, other=0))
        c1 = tt._u8_centred(tl.load(rows + 64 + j, mask=m, other=0))
        c2 = tt._u8_centred(tl.load(rows + 128 + j, mask=m, other=0))
        c3 = tt._u8_centred(tl.load(rows + 192 + j, mask=m, other=0))
    else:  # 3 bit: the low plane (2 bits x 4 per byte) and the high plane (1 bit x 8 per byte, byte j % 32)
        lo = tl.load(rows + j, mask=m, other=0).to(tl.int32)
        hb = tl.load(rows + D // 4 + j % 32, mask=m, other=0).to(tl.int32)
        sh = j // 32
        c0 = tl.load(TAB + ((lo & 3) | (((hb >> sh) & 1) << 2)))
        c1 = tl.load(TAB + (((lo >> 2) & 3) | (((hb >> (2 + sh)) & 1) << 2)))
        c2 = tl.load(TAB + (((lo >> 4) & 3) | (((hb >> (4 + sh)) & 1) << 2)))
        c3 = tl.load(TAB + (((lo >> 6) & 3) | (((hb >> (6 + sh)) & 1) << 2)))
    return c0, c1, c2, c3


@triton.jit
def _tq_decode_swap_kernel(
    Q, stride_qb, stride_qh, stride_qt, CACHE, CACHE_F32, BLOCK_TABLE, stride_bt, SEQ_LENS,
    KTAB, VTAB, WS_ACC, WS_ML, num_splits, block_bytes, v_offset, s_offset, k_mul, v_mul,
    H: tl.constexpr, G: tl.constexpr, T: tl.constexpr, PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    PRMT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tl.static_assert(D == 256)  # four 64-dimension chunks
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    L = tl.load(SEQ_LENS + b)
    per = tl.cdiv(tl.cdiv(L, num_splits), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(L, start + per)

    # tile columns (the shipped kernel's rows): r = g * T + t, query head h*G + g at position t
    r = tl.arange(0, BLOCK_M)
    rvalid = r < G * T
    t = r % T
    qcol = Q + b.to(tl.int64) * stride_qb + (h * G + r // T) * stride_qh + t * stride_qt
    j = tl.arange(0, 64)[:, None]
    qm = rvalid[None, :]
    qt0 = tl.load(qcol[None, :] + j, mask=qm, other=0.0).to(tl.float16)  # Q^T chunks [64 dims, BLOCK_M]
    qt1 = tl.load(qcol[None, :] + 64 + j, mask=qm, other=0.0).to(tl.float16)
    qt2 = tl.load(qcol[None, :] + 128 + j, mask=qm, other=0.0).to(tl.float16)
    qt3 = tl.load(qcol[None, :] + 192 + j, mask=qm, other=0.0).to(tl.float16)
    last = L - T + t  # the last key each column may see (causal within an MTP verify step)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    z = tl.zeros([64, BLOCK_M], tl.float32)
    acc0, acc1, acc2, acc3 = z, z, z, z  # O^T chunks [64 dims, BLOCK_M]
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_bt
    KB: tl.constexpr = K_BITS * D // 8
    VB: tl.constexpr = V_BITS * D // 8
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        nmask = tok < end
        blk = tl.load(bt_row + tok // PAGE, mask=nmask, other=0).to(tl.int64)
        row = (tok % PAGE) * H + h
        base = blk * block_bytes
        krow = tl.multiple_of(base + row * KB, 16)
        vrow = tl.multiple_of(base + v_offset + row * VB, 16)
        sidx = (base + s_offset) // 4 + row * 2
        ks = tl.load(CACHE_F32 + sidx, mask=nmask, other=0.0) * k_mul
        vs = tl.load(CACHE_F32 + sidx + 1, mask=nmask, other=0.0) * v_mul

        k0, k1, k2, k3 = tt._codes(CACHE, krow, nmask, KTAB, K_BITS, PRMT, False, D)  # [BLOCK_N, 64] each
        s = tl.dot(k0, qt0)
        s = tl.dot(k1, qt1, s)
        s = tl.dot(k2, qt2, s)
        s = tl.dot(k3, qt3, s)  # S^T [BLOCK_N, BLOCK_M]
        s = s * ks[:, None]
        s = tl.where(nmask[:, None] & (tok[:, None] <= last[None, :]), s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a column with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        pv = (p * vs[:, None]).to(tl.float16)  # P^T [BLOCK_N, BLOCK_M]
        v0, v1, v2, v3 = _codes_t(CACHE, vrow, nmask, VTAB, V_BITS, PRMT, D)  # [64, BLOCK_N] each
        acc0 = tl.dot(v0, pv, acc0 * alpha[None, :])
        acc1 = tl.dot(v1, pv, acc1 * alpha[None, :])
        acc2 = tl.dot(v2, pv, acc2 * alpha[None, :])
        acc3 = tl.dot(v3, pv, acc3 * alpha[None, :])
        m_i = m_new

    # the shipped kernel's workspace: row ws of D fp32 per tile row; an empty split writes only m and l
    ws = (bh.to(tl.int64) * num_splits + split) * BLOCK_M + r
    wcol = ws[None, :] * D + j
    amask = (rvalid & (start < end))[None, :]
    tl.store(WS_ACC + wcol, acc0, mask=amask)
    tl.store(WS_ACC + wcol + 64, acc1, mask=amask)
    tl.store(WS_ACC + wcol + 128, acc2, mask=amask)
    tl.store(WS_ACC + wcol + 192, acc3, mask=amask)
    tl.store(WS_ML + ws * 2, m_i, mask=rvalid)
    tl.store(WS_ML + ws * 2 + 1, l_i, mask=rvalid)


def decode_attention_swap(
    q, cache, layout: tq.CacheLayout, block_table, seq_lens, seed: int, sm_scale: float, max_seq_len: int,
    num_splits: int | None = None, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
    decoder: str = "prmt", waves: int = 4, out=None,
):
    """tt.decode_attention with the transposed kernel: the same arguments and result."""
    B, Hq, T, d = q.shape
    H = layout.num_kv_heads
    tt._check_attention(Hq, d, cache, layout, "decode_attention_swap")
    G = Hq // H
    block_m = max(16, triton.next_power_of_2(G * T))
    t = tt._tables(layout.preset, seed, q.device, d)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = tt.num_splits_for(B, H, max_seq_len, block_n, sms, waves)
    qr = torch.matmul(q, t["rt"][q.dtype])
    k_mul = sm_scale * tt.LOG2E * (t["kdelta"] or 1.0)
    v_mul = t["vdelta"] or 1.0
    ws_acc = torch.empty(B * H * num_splits * block_m * d, dtype=torch.float32, device=q.device)
    ws_ml = torch.empty(B * H * num_splits * block_m * 2, dtype=torch.float32, device=q.device)
    _tq_decode_swap_kernel[(B * H, num_splits)](
        qr, qr.stride(0), qr.stride(1), qr.stride(2), cache, cache.view(torch.float32), block_table, block_table.stride(0),
        seq_lens, t["kcb"], t["vcb"], ws_acc, ws_ml, num_splits,
        layout.block_bytes, layout.v_offset, layout.s_offset, k_mul, v_mul,
        H=H, G=G, T=T, PAGE=layout.page, K_BITS=layout.preset.k_bits, V_BITS=layout.preset.v_bits,
        PRMT=decoder == "prmt" and q.is_cuda, D=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        num_stages=num_stages,
    )
    if out is None:
        out = torch.empty_like(q)
    return tt.merge(ws_acc, ws_ml, t, out, B, H, G, T, block_m, num_splits)
