"""Upstream vLLM's own TurboQuant decode on the bench's shapes: the baseline a user gets from
`--kv-cache-dtype turboquant_*` (vLLM 0.26.0: vllm/v1/attention/ops/triton_turboquant_{store,decode}.py and the
backend vllm/v1/attention/backends/turboquant_attn.py). Imported from the installed wheel, never copied.

Pairs at (nearly) the same bytes per token and KV head (ours: codes + two fp32 scales; upstream's: codes, an
fp16 key norm, fp16 value scale and zero):
  ours turboquant_k4v4 264 B  <->  upstream turboquant_4bit_nc  262 B  (4-bit Lloyd-Max keys, 4-bit uniform values)
  ours turboquant_k4v3 232 B  <->  upstream turboquant_k3v4_nc  230 B  (the same bytes, split the other way)
  ours turboquant_k8v4 392 B  <->  upstream turboquant_k8v4     388 B  (8-bit keys: ours a grid, upstream's FP8)

The paths timed are upstream's own:
  q_len 1   one triton_turboquant_decode_attention call for the batch, with its 32 fixed KV splits and the
            backend's preallocated buffers (what the backend's _decode_attention does in a CUDA graph);
  q_len 3   an MTP-2 verify step is not a decode for this backend (supports_spec_as_decode=False), so its
            _prefill_attention loops over the requests on the host and runs each one's 3 positions as 3
            decode pseudo-requests with growing seq_lens (each re-reads the cache), into a zeroed output.
            That loop is replayed here in one CUDA graph, which is generous to upstream: vLLM runs it eagerly.
"""

from __future__ import annotations

import torch

PAIRS = {"turboquant_k4v4": "turboquant_4bit_nc", "turboquant_k4v3": "turboquant_k3v4_nc",
         "turboquant_k8v4": "turboquant_k8v4"}


def version() -> str | None:
    """The installed vLLM's version when it carries the TurboQuant ops, else None."""
    try:
        import vllm
        from vllm.v1.attention.ops import triton_turboquant_decode  # noqa: F401
    except ImportError:
        return None
    return vllm.__version__


class Upstream:
    """One upstream TurboQuant cache of `num_blocks` pages, in the backend's layout: allocated
    (num_blocks, Hk, page, slot) and viewed (num_blocks, page, Hk, slot), as forward() transposes it."""

    def __init__(self, preset: str, num_blocks: int, hkv: int, d: int, page: int, hq: int, scale: float,
                 device: str = "cuda"):
        from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
        from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

        self.preset, self.page, self.hq, self.d, self.scale, self.device = preset, page, hq, d, scale, device
        self.cfg = TurboQuantConfig.from_cache_dtype(preset, d)
        self.h = _build_hadamard(d, device)  # the backend's rotation: Pi = Pi^T = H / sqrt(d)
        self.centroids = get_centroids(d, self.cfg.centroid_bits).to(device, torch.float32)
        c = self.centroids.sort().values
        self.midpoints = (c[:-1] + c[1:]) / 2
        self.cache = torch.zeros(num_blocks, hkv, page, self.cfg.slot_size_aligned, dtype=torch.uint8,
                                 device=device).transpose(1, 2)
        self.bytes_per_token_head = self.cfg.key_packed_size + self.cfg.value_packed_size

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, chunk: int = 65536) -> None:
        """k, v [n, Hk, d] into the cache at `slots`, by upstream's store kernel (the backend's _store_kv)."""
        from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

        for i in range(0, k.shape[0], chunk):
            triton_turboquant_store(k[i : i + chunk], v[i : i + chunk], self.cache, slots[i : i + chunk].to(torch.int32),
                                    self.h, self.midpoints, mse_bits=self.cfg.key_mse_bits,
                                    key_packed_size=self.cfg.key_packed_size,
                                    value_quant_bits=self.cfg.effective_value_quant_bits, key_fp8=self.cfg.key_fp8)

    def _decode(self, q, block_table, seq_lens, bufs=None):
        from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention

        mid, out, lse = bufs or (None, None, None)
        return triton_turboquant_decode_attention(
            query=q, kv_cache=self.cache, block_table=block_table, seq_lens=seq_lens, Pi=self.h,
            centroids=self.centroids, scale=self.scale, mse_bits=self.cfg.key_mse_bits,
            key_packed_size=self.cfg.key_packed_size, value_quant_bits=self.cfg.effective_value_quant_bits,
            key_fp8=self.cfg.key_fp8, norm_correction=self.cfg.norm_correction, PiT=self.h,
            mid_o_buf=mid, output_buf=out, lse_buf=lse)

    def buffers(self, batch: int, dtype=torch.bfloat16, splits: int = 32):
        """The backend's workspace for a decode batch (mid_o, output, lse)."""
        dev = self.device
        return (torch.empty(batch, self.hq, splits, self.d + 1, dtype=torch.float32, device=dev),
                torch.empty(batch, self.hq, self.d, dtype=dtype, device=dev),
                torch.empty(batch, self.hq, dtype=torch.float32, device=dev))

    def attend(self, q: torch.Tensor, block_table: torch.Tensor, seq_lens_cpu: list[int], seq_lens: torch.Tensor,
               bufs=None, arange: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, T, Hq, d] (T query positions per request, the last at seq_len - 1) -> [B, T, Hq, d], by the path
        the backend takes for T (module docstring)."""
        B, T = q.shape[:2]
        if T == 1:
            return self._decode(q[:, 0], block_table, seq_lens, bufs)[:, None]
        flat = q.reshape(B * T, self.hq, self.d)
        output = torch.zeros_like(flat)
        if arange is None:
            arange = torch.arange(0, max(seq_lens_cpu) + 1, device=self.device, dtype=seq_lens.dtype)
        for i, L in enumerate(seq_lens_cpu):
            out = self._decode(flat[i * T : (i + 1) * T], block_table[i : i + 1].expand(T, -1), arange[L - T + 1 : L + 1])
            output[i * T : (i + 1) * T] = out.to(flat.dtype)
        return output.view(B, T, self.hq, self.d)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 causal GQA attention of q [T, Hq, d] (the last T positions) over one sequence's k, v [L, Hk, d]."""
    T, hq, d = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    kk = k.double().repeat_interleave(g, 1).transpose(0, 1)  # [Hq, L, d]
    vv = v.double().repeat_interleave(g, 1).transpose(0, 1)
    s = torch.einsum("thd,hld->htl", q.double(), kk) * scale
    visible = torch.arange(L, device=q.device)[None, :] <= (L - T + torch.arange(T, device=q.device))[:, None]
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("htl,hld->thd", s.softmax(-1), vv)
