"""TurboQuant KV cache codec: the plain-torch reference (the Triton kernels in turboquant_triton.py match it).

Each token's key (and value) vector of one KV head, x in R^d (d = head_dim = 256), is stored as
    codes = Q( sqrt(d) * R x / |x| )      R = H diag(s) / sqrt(d): a randomized Hadamard rotation,
    scale = |x| / |c|                      c = codebook[codes], so the reconstruction has x's length,
and read back as x_hat = scale * R^T c. After the rotation every coordinate of sqrt(d) R x/|x| follows
the same law whatever x is (that of sqrt(d) times one coordinate of a uniform point on the unit
sphere: density ~ (1 - z^2/d)^((d-3)/2), close to N(0,1) at d = 256), so one scalar codebook per
bit width, optimal for that law (Lloyd-Max), serves every layer, head and token. 8-bit codes use
the MSE-best *uniform* grid instead: it decodes with one multiply-add (no table), and at 8 bits it
is already ~100x below the 4-bit error.

Attention never needs x_hat itself: q . x_hat = scale * (R q) . c and sum_t p_t v_hat_t =
R^T sum_t (p_t scale_t) c_t, so the kernel rotates the queries once, works on codebook values
and applies R^T once to the output.

Presets (name = the vLLM --kv-cache-dtype):
    turboquant_k4v4   4-bit keys, 4-bit values       264 B / token / KV head  (BF16: 1024 B)
    turboquant_k4v3   4-bit keys, 3-bit values (3.5) 232 B
    turboquant_k8v4   8-bit keys, 4-bit values       392 B
(each includes 8 B of scales: one fp32 for K, one for V).

Cache layout of one attention layer: uint8 [num_blocks, block_bytes]; block = PAGE tokens:
    [K codes: PAGE x H x k_bytes][V codes: PAGE x H x v_bytes][scales: PAGE x H x 2 fp32]
Code rows are multiples of 16 bytes (wide loads), the scales live apart, nothing is padded to a
power of two. Packing of one row (coordinate i of the rotated vector -> byte, bits):
    4 bit: byte i % 128 holds coordinates i (A, i < 128) and i + 128 (B) in sign-magnitude form: the 16
           Lloyd-Max levels are symmetric, level[7 - m] = -level[8 + m], so a code is a sign (code < 8) and a
           magnitude index m = 0..7. Byte = m(A) at bits 0-2, sign(B) at bit 3, m(B) at bits 4-6, sign(A) at
           bit 7: the order the GPU decoder wants (turboquant_triton._byte_asm: the magnitudes are PRMT
           selectors after one mask, each sign one byte spread away from its fp16 sign bit).
    3 bit: 64-byte plane of 2-bit fields: byte i % 64, bits 2*(i // 64)
           + 32-byte plane of high bits:  byte i % 32, bit i // 32      (96 bytes in all)
    8 bit: byte i
Rotation seeds: layer L uses seed SEED_BASE + L (rotation_seed); the same R serves K, V and Q.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

HEAD_DIM = 256
SEED_BASE = 0x7155_0000
SCALE_BYTES = 8  # one fp32 scale for K and one for V, per token per KV head
BF16_BYTES_PER_TOKEN_HEAD = 2 * 2 * HEAD_DIM  # K and V, 2 bytes each: the baseline


@dataclass(frozen=True)
class Preset:
    name: str  # the vLLM kv-cache-dtype name
    k_bits: int
    v_bits: int

    def k_bytes(self, d: int = HEAD_DIM) -> int:
        return self.k_bits * d // 8

    def v_bytes(self, d: int = HEAD_DIM) -> int:
        return self.v_bits * d // 8

    def bytes_per_token_head(self, d: int = HEAD_DIM) -> int:
        return self.k_bytes(d) + self.v_bytes(d) + SCALE_BYTES


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("turboquant_k4v4", 4, 4),  # the default
        Preset("turboquant_k4v3", 4, 3),  # ~3.5 bits: keys steer the softmax, so they keep 4 bits
        Preset("turboquant_k8v4", 8, 4),
    )
}
DEFAULT_PRESET = "turboquant_k4v4"
SUPPORTED_BITS = (3, 4, 8)


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown TurboQuant preset {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True)
class CacheLayout:
    """Byte layout of one layer's paged cache (see the module docstring)."""

    preset: Preset
    num_kv_heads: int
    page: int  # tokens per block
    head_dim: int = HEAD_DIM

    def __post_init__(self):
        if self.head_dim % 64 or self.head_dim & (self.head_dim - 1):
            raise ValueError(f"head_dim must be a power of two >= 64, got {self.head_dim}")
        if self.page < 1 or self.num_kv_heads < 1:
            raise ValueError(f"page and num_kv_heads must be >= 1, got {self.page}, {self.num_kv_heads}")

    @property
    def k_bytes(self) -> int:
        return self.preset.k_bytes(self.head_dim)

    @property
    def v_bytes(self) -> int:
        return self.preset.v_bytes(self.head_dim)

    @property
    def v_offset(self) -> int:  # byte offset of the V region inside a block
        return self.page * self.num_kv_heads * self.k_bytes

    @property
    def s_offset(self) -> int:  # byte offset of the scale region (4-aligned: code rows are multiples of 16)
        return self.page * self.num_kv_heads * (self.k_bytes + self.v_bytes)

    @property
    def block_bytes(self) -> int:
        return self.page * self.num_kv_heads * self.preset.bytes_per_token_head(self.head_dim)

    def empty(self, num_blocks: int, device="cpu") -> torch.Tensor:
        return torch.zeros(num_blocks, self.block_bytes, dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------------------
# Rotation


def rotation_seed(layer_idx: int) -> int:
    return SEED_BASE + layer_idx


@functools.lru_cache(maxsize=8)
def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotation(seed: int, d: int = HEAD_DIM, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """R = H diag(s) / sqrt(d), orthonormal; rotate row vectors with x @ R.T, undo with y @ R.
    Entries are +-1/sqrt(d): exact in fp16/bf16 for d = 256 (+-1/16)."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1
    r = _hadamard(d) * signs[None, :] / math.sqrt(d)
    return r.to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# Codebooks, computed at import cost (~10 ms) in float64 on a fine grid: deterministic.


@functools.lru_cache(maxsize=1)
def _grid(d: int = HEAD_DIM):
    """Cumulative integrals of the coordinate law's density f, z f and z^2 f on a fine grid."""
    z = torch.linspace(-12.0, 12.0, 240_001, dtype=torch.float64)
    logf = 0.5 * (d - 3) * torch.log1p(-(z * z) / d).clamp(min=-700)
    f = torch.exp(logf - logf.max())
    dz = z[1] - z[0]

    def cum(y):
        c = torch.zeros_like(y)
        c[1:] = torch.cumsum((y[1:] + y[:-1]) * 0.5 * dz, 0)
        return c

    F, G, H = cum(f), cum(z * f), cum(z * z * f)
    total = F[-1]
    return z, F / total, G / total, H / total


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    x = x.clamp(xp[0], xp[-1])
    i = torch.searchsorted(xp, x).clamp(1, len(xp) - 1)
    w = (x - xp[i - 1]) / (xp[i] - xp[i - 1])
    return fp[i - 1] + w * (fp[i] - fp[i - 1])


def _interval_moments(bounds: torch.Tensor):
    """Per cell (between consecutive boundaries, outer ones at +-inf): mass, first and second moment."""
    z, F, G, H = _grid()
    edges = torch.cat([z[:1], bounds, z[-1:]])
    f, g, h = (_interp(edges, z, t) for t in (F, G, H))
    return f.diff(), g.diff(), h.diff()


def _mse(levels: torch.Tensor, bounds: torch.Tensor) -> float:
    m0, m1, m2 = _interval_moments(bounds)
    return float((m2 - 2 * levels * m1 + levels * levels * m0).sum())


@dataclass(frozen=True)
class Codebook:
    bits: int
    levels: torch.Tensor  # float64 [2^bits], ascending, in units of the N(0,1)-like coordinate z
    bounds: torch.Tensor  # float64 [2^bits - 1]: code = number of bounds below z
    mse: float  # E (z - level)^2 per coordinate = E |u - u_hat|^2 for a unit vector u (before length fix)
    delta: float  # uniform grids only (8 bit): level(code) = (code - (2^bits - 1)/2) * delta; else 0


@functools.lru_cache(maxsize=None)
def codebook(bits: int) -> Codebook:
    if bits == 8:
        return _uniform_codebook(bits)
    if not 1 <= bits <= 4:
        raise ValueError(f"TurboQuant codebooks exist for 1..4 and 8 bits, not {bits}")
    n = 1 << bits
    z, F, _, _ = _grid()
    # start from the normal quantiles' cell centres; Lloyd's iteration converges to the optimum
    # for a log-concave density (Fleischer), here in a few hundred steps.
    levels = _interp((torch.arange(n, dtype=torch.float64) + 0.5) / n, F, z)
    for _ in range(2000):
        bounds = (levels[1:] + levels[:-1]) / 2
        m0, m1, _ = _interval_moments(bounds)
        new = m1 / m0
        if float((new - levels).abs().max()) < 1e-13:
            levels = new
            break
        levels = new
    bounds = (levels[1:] + levels[:-1]) / 2
    return Codebook(bits, levels, bounds, _mse(levels, bounds), 0.0)


def _uniform_codebook(bits: int) -> Codebook:
    n = 1 << bits
    k = torch.arange(n, dtype=torch.float64) - (n - 1) / 2

    def mse(delta):
        return _mse(k * delta, (k[1:] - 0.5) * delta)

    lo, hi = 0.5 / n, 16.0 / n  # golden-section search for the MSE-best step
    phi = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
        if mse(a) < mse(b):
            hi = b
        else:
            lo = a
    delta = (lo + hi) / 2
    return Codebook(bits, k * delta, (k[1:] - 0.5) * delta, mse(delta), delta)


# ---------------------------------------------------------------------------------------------
# Quantize / pack (reference)


def quantize(x: torch.Tensor, r: torch.Tensor, bits: int):
    """x [..., d] -> (codes int64 [..., d], scale float32 [...]). Computed in float64."""
    d = x.shape[-1]
    cb = codebook(bits)
    x = x.to(torch.float64)
    norm = x.norm(dim=-1)
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    z = (x @ r.to(torch.float64).T) * (math.sqrt(d) / safe)[..., None]
    codes = torch.searchsorted(cb.bounds.to(z.device), z.contiguous())
    c = cb.levels.to(z.device)[codes]
    scale = norm / c.norm(dim=-1)
    return codes, scale.to(torch.float32)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, r: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of quantize up to the codebook error: float64 [..., d]."""
    c = codebook(bits).levels.to(codes.device)[codes]
    return (c * scale.to(torch.float64)[..., None]) @ r.to(torch.float64)


def _pack4(c: torch.Tensor) -> torch.Tensor:
    """int64 codes [..., d] -> int64 bytes [..., d/2] in the sign-magnitude layout (module docstring)."""
    neg, mag = (c < 8).to(torch.int64), torch.where(c < 8, 7 - c, c - 8)
    h = c.shape[-1] // 2
    return mag[..., :h] | (neg[..., h:] << 3) | (mag[..., h:] << 4) | (neg[..., :h] << 7)


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    """int64 bytes [..., d/2] -> codes [..., d]: the inverse of _pack4."""
    def code(mag, neg):
        return torch.where(neg == 1, 7 - mag, 8 + mag)

    return torch.cat([code(p & 7, p >> 7), code((p >> 4) & 7, (p >> 3) & 1)], -1)

def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., d] (0 <= code < 2^bits) -> uint8 [..., bits*d/8] in the layout of the module docstring."""
    d = codes.shape[-1]
    c = codes.to(torch.int64)
    if bits == 8:
        out = c
    elif bits == 4:
        out = _pack4(c)
    elif bits == 3:
        lo = c & 3
        q = d // 4
        low = sum(lo[..., m * q : (m + 1) * q] << (2 * m) for m in range(4))
        hi = c >> 2
        e = d // 8
        high = sum(hi[..., m * e : (m + 1) * e] << m for m in range(8))
        out = torch.cat([low, high], -1)
    else:
        raise ValueError(f"pack supports {SUPPORTED_BITS} bits, not {bits}")
    return out.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, d: int = HEAD_DIM) -> torch.Tensor:
    p = packed.to(torch.int64)
    if bits == 8:
        return p
    if bits == 4:
        return _unpack4(p)
    if bits == 3:
        q, e = d // 4, d // 8
        low, high = p[..., :q], p[..., q : q + e]
        lo = torch.cat([(low >> (2 * m)) & 3 for m in range(4)], -1)
        hi = torch.cat([(high >> m) & 1 for m in range(8)], -1)
        return lo | (hi << 2)
    raise ValueError(f"unpack supports {SUPPORTED_BITS} bits, not {bits}")


# ---------------------------------------------------------------------------------------------
# Paged cache (reference): write, read back, attention


def _slot_parts(slots: torch.Tensor, layout: CacheLayout):
    return slots // layout.page, slots % layout.page


def encode_reference(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor, layout: CacheLayout, r: torch.Tensor
) -> None:
    """Write k, v [num_tokens, H, d] into cache at slot_mapping [num_tokens] (slot < 0: skip, as in vLLM)."""
    keep = slot_mapping >= 0
    k, v, slots = k[keep], v[keep], slot_mapping[keep].to(torch.int64)
    kc, ks = quantize(k, r, layout.preset.k_bits)
    vc, vs = quantize(v, r, layout.preset.v_bits)
    kp, vp = pack(kc, layout.preset.k_bits), pack(vc, layout.preset.v_bits)
    blk, off = _slot_parts(slots, layout)
    H = layout.num_kv_heads
    dev = cache.device
    row = off[:, None] * H + torch.arange(H, device=dev)[None, :]  # [n, H]
    kcols = row[..., None] * layout.k_bytes + torch.arange(layout.k_bytes, device=dev)
    vcols = layout.v_offset + row[..., None] * layout.v_bytes + torch.arange(layout.v_bytes, device=dev)
    bb = blk[:, None, None]
    cache[bb.expand_as(kcols), kcols] = kp
    cache[bb.expand_as(vcols), vcols] = vp
    scales = cache.view(torch.float32)  # [num_blocks, block_bytes / 4]
    scol = layout.s_offset // 4 + row * 2
    scales[blk[:, None].expand_as(scol), scol] = ks
    scales[blk[:, None].expand_as(scol), scol + 1] = vs


def read_reference(cache: torch.Tensor, layout: CacheLayout, slots: torch.Tensor):
    """-> (k codes, k scale, v codes, v scale) for the given slots: [n, H, d] int64 and [n, H] float32."""
    blk, off = _slot_parts(slots.to(torch.int64), layout)
    H, dev = layout.num_kv_heads, cache.device
    row = off[:, None] * H + torch.arange(H, device=dev)[None, :]
    kcols = row[..., None] * layout.k_bytes + torch.arange(layout.k_bytes, device=dev)
    vcols = layout.v_offset + row[..., None] * layout.v_bytes + torch.arange(layout.v_bytes, device=dev)
    bb = blk[:, None, None]
    kc = unpack(cache[bb.expand_as(kcols), kcols], layout.preset.k_bits, layout.head_dim)
    vc = unpack(cache[bb.expand_as(vcols), vcols], layout.preset.v_bits, layout.head_dim)
    scales = cache.view(torch.float32)
    scol = layout.s_offset // 4 + row * 2
    b2 = blk[:, None].expand_as(scol)
    return kc, scales[b2, scol], vc, scales[b2, scol + 1]


def seq_slots(block_table_row: torch.Tensor, seq_len: int, page: int) -> torch.Tensor:
    t = torch.arange(seq_len, device=block_table_row.device)
    return block_table_row[t // page].to(torch.int64) * page + t % page


def dequantize_cache(cache, layout: CacheLayout, block_table_row, seq_len: int, r):
    """-> k_hat, v_hat float64 [seq_len, H, d] of one sequence."""
    kc, ks, vc, vs = read_reference(cache, layout, seq_slots(block_table_row.to(cache.device), seq_len, layout.page))
    return dequantize(kc, ks, r, layout.preset.k_bits), dequantize(vc, vs, r, layout.preset.v_bits)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Decode/verify attention in float64. q [Hq, T, d], k/v [L, H, d]. Query position t (of T, the
    last T tokens of the sequence) sees keys 0 .. L-T+t (an MTP verify step is causal among its T)."""
    Hq, T, d = q.shape
    L, H, _ = k.shape
    g = Hq // H
    q = q.to(torch.float64)
    kk = k.to(torch.float64).repeat_interleave(g, dim=1).permute(1, 0, 2)  # [Hq, L, d]
    vv = v.to(torch.float64).repeat_interleave(g, dim=1).permute(1, 0, 2)
    s = (q @ kk.transpose(1, 2)) * sm_scale  # [Hq, T, L]
    allowed = torch.arange(L, device=q.device)[None, :] <= (L - T + torch.arange(T, device=q.device))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ vv


def decode_attention_reference(q, cache, layout: CacheLayout, block_table, seq_lens, r, sm_scale: float):
    """q [B, Hq, T, d] -> float64 [B, Hq, T, d]: attention over the dequantized paged cache."""
    outs = []
    for b in range(q.shape[0]):
        L = int(seq_lens[b])
        k, v = dequantize_cache(cache, layout, block_table[b], L, r)
        outs.append(attention_reference(q[b], k, v, sm_scale))
    return torch.stack(outs)


# ---------------------------------------------------------------------------------------------
# Prefill in plain torch: the backend's CPU path and its ONESPARK_TQ_PREFILL=torch fallback on GPUs


def read_rotated(cache, layout: CacheLayout, block_table_row, seq_len: int, levels, dtype, chunk: int = 16384):
    """One sequence's K and V as codebook values times per-token scale, still in the rotated basis:
    [H, seq_len, d] each, in dtype. levels: the (K, V) codebook levels, fp32 on the cache's device. Whole
    blocks are gathered `chunk` tokens at a time, bounding the int64 codes unpack makes (~64 MB for 2 heads)."""
    H, d, P = layout.num_kv_heads, layout.head_dim, layout.page
    kcb, vcb = levels
    k = torch.empty(H, seq_len, d, dtype=dtype, device=cache.device)
    v = torch.empty_like(k)
    for t0 in range(0, seq_len, chunk):
        t1 = min(seq_len, t0 + chunk)
        b0, b1 = t0 // P, -(-t1 // P)
        blocks = cache[block_table_row[b0:b1].long()]  # [nb, block_bytes]: whole blocks, one gather
        nb, lo, hi = b1 - b0, t0 - b0 * P, t1 - b0 * P
        kp = blocks[:, : layout.v_offset].reshape(nb * P, H, layout.k_bytes)[lo:hi]
        vp = blocks[:, layout.v_offset : layout.s_offset].reshape(nb * P, H, layout.v_bytes)[lo:hi]
        sc = blocks[:, layout.s_offset :].contiguous().view(torch.float32).view(nb * P, H, 2)[lo:hi]
        k[:, t0:t1] = (kcb[unpack(kp, layout.preset.k_bits, d)] * sc[..., 0:1]).transpose(0, 1).to(dtype)
        v[:, t0:t1] = (vcb[unpack(vp, layout.preset.v_bits, d)] * sc[..., 1:2]).transpose(0, 1).to(dtype)
    return k, v


def prefill_attention_sdpa(q, cache, layout: CacheLayout, block_table_row, seq_len: int, r, levels, sm_scale: float,
                           dtype, score_budget: int = 1 << 27):
    """One request's ql query tokens q [ql, Hq, d] (the last of its seq_len, K/V already in the cache),
    causal -> fp32 [ql, Hq, d]. Dequantize (read_rotated), then torch SDPA in the rotated basis
    (q . x_hat = scale * (R q) . c) and rotate the output back once. SDPA with an explicit mask takes its math
    path, which materializes rows x keys scores (85 GiB at 129K keys, head_dim 256, on an H200), so query rows
    go in blocks of at most score_budget scores."""
    ql, Hq, d = q.shape
    H = layout.num_kv_heads
    G = Hq // H
    kc, vc = read_rotated(cache, layout, block_table_row, seq_len, levels, dtype)  # [H, L, d]
    # the G query heads of a KV head become query rows (row = position * G + g): K/V are never repeated G
    # times, and a block of rows covers consecutive positions
    qr = (q.to(torch.float32) @ r.T).to(dtype).view(ql, H, G, d).transpose(0, 1).reshape(H, ql * G, d)
    o = torch.empty_like(qr)
    step = max(1, score_budget // (H * seq_len * G)) * G  # rows: whole positions
    for r0 in range(0, ql * G, step):
        r1 = min(ql * G, r0 + step)
        end = seq_len - ql + (r1 - 1) // G + 1  # keys the block's last position sees
        t = torch.arange(r0, r1, device=q.device) // G
        allowed = torch.arange(end, device=q.device)[None, :] <= (seq_len - ql + t)[:, None]
        o[:, r0:r1] = torch.nn.functional.scaled_dot_product_attention(
            qr[:, r0:r1], kc[:, :end], vc[:, :end], attn_mask=allowed, scale=sm_scale)
    return o.view(H, ql, G, d).transpose(0, 1).reshape(ql, Hq, d).to(torch.float32) @ r


# ---------------------------------------------------------------------------------------------
# Synthetic attention data: what tests/test_turboquant.py's error limits and lab/turboquant_quality.py's
# report (bench/results/turboquant_quality.json) are measured on. Here, beside the reference, because both use it
# and neither may import the other (a test never imports a lab script).


def structured_kv(kind: str, L: int = 4096, seed: int = 0, d: int = HEAD_DIM):
    """K, V [L, d] and queries [16, d] (fp32, CPU) for: random; outlier channels (8 channels x20 + a shared
    offset, as LLM keys show); near-duplicate keys (64 prototypes + 5% noise, queries aligned with prototypes)."""
    g = torch.Generator().manual_seed(seed)
    k, v, q = (torch.randn(n, d, generator=g) for n in (L, L, 16))
    if kind == "outlier":
        k[:, :8] *= 20
        k += 3 * torch.randn(d, generator=g)
        q[:, :8] *= 3
    elif kind == "neardup":
        base = torch.randn(64, d, generator=g)
        k = base[torch.randint(0, 64, (L,), generator=g)] + 0.05 * torch.randn(L, d, generator=g)
        q = 1.5 * base[:16]
    elif kind != "random":
        raise ValueError(f"unknown kind {kind!r}: random, outlier or neardup")
    return k, v, q
