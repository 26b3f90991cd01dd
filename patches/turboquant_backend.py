"""A vLLM 0.19.1 / 0.32.0 attention backend that reads and writes the TurboQuant KV cache (onespark.kernels.turboquant).

Registered by the plugin as vLLM's `AttentionBackendEnum.CUSTOM` (`register_backend`, vLLM's hook for
out-of-tree backends); a server selects it with `--attention-backend CUSTOM --kv-cache-dtype turboquant_k4v4`
(or `_k4v3`, `_k8v4`). The dtype names and the page size come from patches/turboquant.diff: without that diff
vLLM refuses the dtype names before it gets here. On 0.32.0, patches/turboquant-0.32.0.diff adds the names
(k4v4, k4v3; its k8v4 is vLLM's own) and `customize_spec` below sizes the pages. On the GPU lane's 0.26.0,
patches/turboquant-0.26.0.diff adds the same two names and pages them with vLLM's own TQFullAttentionSpec.

What runs where (one layer, one step):
  cache write     `do_kv_cache_update`: the step's new K/V are encoded into the paged cache, before attention
                  (CUDA: `turboquant_triton.encode`; CPU: `turboquant.encode_reference`).
  decode batches  the leading requests with the same query length T <= 8 (1, or 1 + draft tokens in an MTP
                  verify step; the builder asks vLLM to put decodes first): ONE `decode_attention` call
                  (CPU: the float64 reference); ONESPARK_TQ_DECODE=once|pure overrides its measured choice of
                  decoding each code once per tile or in each warp (`turboquant_triton.decode_once`). K4V4 verify
                  steps on mma.sync-only GPUs (the Spark) go to the CUDA C++ kernel instead when its build is
                  there (`turboquant_cuda`; ONESPARK_TQ_KERNEL=auto|triton|cuda).
  the rest        (prefill, chunked-prefill continuation, whatever follows the decodes): per request,
                  `turboquant_triton.prefill_attention_flash` (the cached sequence, the chunk itself included:
                  it was just written, decoded into BF16 32K keys at a time and attended by FlashAttention-2,
                  causal, pieces merged by log-sum-exp); ONESPARK_TQ_PREFILL=triton makes it ONE fused
                  `prefill_attention` call straight from the codes. Reading the chunk back rather than using
                  its exact K/V makes a token's output independent of how the prompt was chunked. CPU (and
                  ONESPARK_TQ_PREFILL=torch): per request, dequantized and attended in plain torch.
Cache tensor of a layer: uint8 [num_blocks, CacheLayout.block_bytes], one block = block_size tokens.
CUDA graphs: full graphs for uniform batches (UNIFORM_BATCH: every request a decode, or every request an MTP
verify step of the same length), piecewise for the rest. vLLM pads a full-graph batch with requests of query
length 0 and seq_len 0 (slots -1; block-table rows -1 on 0.19.1, the null block on 0.26.0 and 0.32.0, never read
at seq_len 0: as read from each release's gpu_model_runner.py and 0.32.0's model runner V2); they join the one
decode call, where an empty sequence's output is zeros, and the encode skips slot -1. The decode's split grid is sized from the
host-side max_seq_len, which vLLM sets to max_model_len when it captures; each request's own length is split on
the device, so a graph replays correctly at any length.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from onespark.kernels import turboquant as tq
from onespark.patches import choice
from onespark.patches._compat import GPU_LANE_VLLM, tq_cache_rows
from onespark.tracks import SUPPORTED_VLLM, release_of

logger = logging.getLogger("vllm.onespark")
BACKEND_PATH = "onespark.patches.turboquant_backend.TurboQuantBackend"
# Preset names a vLLM release uses for its own TurboQuant (0.32.0: turboquant_k8v4 = FP8 keys + 4-bit values);
# patches/turboquant-0.32.0.diff adds only our other two, so on 0.32.0 this backend serves k4v4 and k4v3.
UPSTREAM_NAMES = {"0.32.0": ("turboquant_k8v4",), "0.26.0": ("turboquant_k8v4",)}
HEAD_DIM = 256  # the Triton kernels' only head size (Qwen3.5's full-attention layers)
# Longest uniform query length served by the decode kernel: MTP verify steps are 1 + num_speculative_tokens
# (3 for the image's MTP-2); longer uniform batches (rare: equal-length prefill chunks) take the prefill path.
MAX_DECODE_QUERY_LEN = 8
# Scores per SDPA call on the plain-torch prefill path (query rows x keys x KV heads): 2^27 = 0.5 GB in fp32.
SCORE_BUDGET = 1 << 27


def install() -> None:
    """Plugin hook: make `--attention-backend CUSTOM` resolve to this backend. Only a class path is
    stored (no memory, no kernel compiled), so servers that do not select it are unaffected."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


# ONESPARK_TQ_PREFILL, the prefill path on CUDA: "flash" (Triton decodes the cache into BF16 32K keys at a time,
# torch's FlashAttention attends, pieces merged by log-sum-exp), "triton" (the fused kernel that attends straight
# from the codes) or "torch" (plain torch: dequantize, then SDPA in blocks of rows). docs/concepts/turboquant.md has
# their H200 times.
# ONESPARK_TQ_DECODE, how the decode kernel decodes codes on CUDA: "auto" (turboquant_triton.decode_once, the
# H200-timed choice per GPU, preset and q_len; on a Spark once at verify steps and for 3-bit values at q_len 1, as
# the Spark's code ranked on an H200 with wgmma off: no Spark has timed it),
# "once" (each code decoded once per tile, values to the mma operands through shared memory) or "pure" (decoded in
# each warp that needs it). To time the other choice on a Spark: `onespark serve --tq --env ONESPARK_TQ_DECODE=pure`.
DECODE_ONCE = {"auto": None, "once": True, "pure": False}
# ONESPARK_TQ_KERNEL, which kernel serves decode steps on CUDA: "auto" (turboquant_cuda.chosen: the CUDA C++ kernel at
# K4V4 verify steps on mma.sync-only GPUs such as the Spark, where it took 1.26-2.27x less time than the Triton
# kernel's Spark code on an H200 (lab/results/turboquant_cuda_h200_mma_sync.json), and every K4V4 step on sm_90
# (H100, H200: less time at 14-15 of 16 cases, kernels/turboquant_cuda.py says where); Triton elsewhere, and wherever no build of it is found: one warning line says how to build
# it), "triton" (always Triton) or "cuda" (the CUDA kernel at every K4V4 decode step; built on first use if missing).


@functools.lru_cache(maxsize=None)
def _say_decode_kernel(T: int, device: str, cuda: bool, switch: str) -> None:  # once per process and choice
    # the builder's start-up line names Triton (prefill, encode); this one names what serves the decode steps
    logger.info("onespark: TurboQuant decode steps of %d query position(s) on %s: %s kernel (ONESPARK_TQ_KERNEL=%s)",
                T, device, "CUDA C++" if cuda else "Triton", switch)


@functools.lru_cache(maxsize=None)
def _warn_no_cuda_build(where: str) -> None:  # once per process and build folder
    logger.warning("onespark: no build of the CUDA TurboQuant decode kernel in %s for this torch: Triton serves verify "
                   "steps (build it: python -m onespark.kernels.turboquant_cuda --build)", where)


def _vllm_release() -> str | None:
    import vllm

    # a shipped track or the GPU lane's 0.26.0; None under the kernel lane's vLLM stand-in
    return release_of(getattr(vllm, "__version__", ""), (*SUPPORTED_VLLM, GPU_LANE_VLLM))


def layer_index(layer_name: str) -> int:
    """'language_model.model.layers.11.self_attn.attn' -> 11 (the rotation seed's layer number)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", layer_name)
    if m is None:
        raise ValueError(f"TurboQuant: cannot find the layer number ('layers.N.') in the layer name {layer_name!r}")
    return int(m.group(1))


def layout_for(cache_dtype_str: str, num_kv_heads: int, head_size: int, block_size: int) -> tq.CacheLayout:
    if cache_dtype_str not in tq.PRESETS:
        raise ValueError(
            f"the TurboQuant attention backend (--attention-backend CUSTOM) needs --kv-cache-dtype "
            f"{' | '.join(tq.PRESETS)}, got {cache_dtype_str!r}; for any other KV-cache dtype use another "
            f"--attention-backend (e.g. FLASHINFER)"
        )
    return tq.CacheLayout(tq.PRESETS[cache_dtype_str], num_kv_heads, block_size, head_size)


class TurboQuantBackend(AttentionBackend):
    accept_output_buffer = True
    forward_includes_kv_cache_update = False  # vLLM calls do_kv_cache_update before forward
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(tq.PRESETS)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM maps the name back to AttentionBackendEnum[name]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):  # 0.32.0 passes the spec
        # The layout takes any page; 16-multiples are what the hybrid GDN model's page unification produces.
        return [MultipleOf(16)]

    @classmethod
    def customize_spec(cls, spec):
        """vLLM 0.32.0 (turboquant-0.32.0.diff): the page size is the backend's. Bytes per token and KV head of
        the preset (the layout of onespark.kernels.turboquant); 0.19.1 never calls this (its diff sizes pages)."""
        import dataclasses

        cache_dtype = spec.kv_quant_mode.name.lower()  # the diff's KVQuantMode.TURBOQUANT_K4V4 -> turboquant_k4v4
        if cache_dtype not in tq.PRESETS or spec.state_content_bytes is not None:
            return spec
        per_token_head = tq.PRESETS[cache_dtype].bytes_per_token_head(spec.head_size)
        return dataclasses.replace(spec, state_content_bytes=per_token_head)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_DIM]

    @staticmethod
    def get_impl_cls():
        return TurboQuantImpl

    @staticmethod
    def get_builder_cls():
        return TurboQuantMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        # One byte row per block; its size equals TurboQuantAttentionSpec.page_size_bytes (the diff).
        return (num_blocks, layout_for(cache_dtype_str, num_kv_heads, head_size, block_size).block_bytes)

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False


@dataclass
class TurboQuantMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    seq_lens: torch.Tensor  # [num_reqs] int32, device, including this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, device
    slot_mapping: torch.Tensor
    # The first num_decodes requests have decode_query_len (T <= MAX_DECODE_QUERY_LEN) query tokens each: one
    # decode-kernel call. The rest (prefills, continuations, anything else) take the prefill path.
    num_decodes: int
    decode_query_len: int
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] host
    prefill_query_start_loc: torch.Tensor | None  # [num_reqs - num_decodes + 1] device, from 0 at the first prefill token
    max_prefill_query_len: int
    # host copy of the prefill requests' seq_lens (one sync per step that has prefills; the flash path sizes its
    # calls with them); None without prefills
    prefill_seq_lens_cpu: list[int] | None = None


class TurboQuantMetadataBuilder(AttentionMetadataBuilder[TurboQuantMetadata]):
    # full graphs of decode and MTP verify batches (vLLM 0.26.0 on the H200 while this was NEVER: a 35B decode step
    # 3.2x v2's, all attention and GDN ops eager: lab/results/vllm_step_h200_35b_tq_c207b19.json)
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Ask vLLM to put decodes (1 + draft tokens) at the front of each batch, as its GDN layers do: they
        # then form one decode-kernel call even in a step that also carries a prefill chunk.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        logger.info("onespark: TurboQuant attention backend serves %d layers (%s kernels, block_size %s)",
                    len(layer_names), "Triton" if torch.device(device).type == "cuda" else "plain-torch reference",
                    getattr(kv_cache_spec, "block_size", "?"))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TurboQuantMetadata:
        m = common_attn_metadata
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1]
        q_lens = (qsl[1:] - qsl[:-1]).tolist()
        T = q_lens[0] if q_lens and 0 < q_lens[0] <= MAX_DECODE_QUERY_LEN else 0
        nd = 0
        while T and nd < m.num_reqs and q_lens[nd] == T:  # the leading run of equal short queries
            nd += 1
        if nd and all(n == 0 for n in q_lens[nd:]) and m.num_actual_tokens >= m.num_reqs * T:
            nd = m.num_reqs  # a full graph's padding (query length 0, seq_len 0): zeros from the decode call
        prefill_qsl = prefill_lens = None
        if nd < m.num_reqs:
            prefill_qsl = m.query_start_loc[nd: m.num_reqs + 1] - nd * T
            prefill_lens = m.seq_lens[nd: m.num_reqs].tolist()
        return TurboQuantMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_reqs=m.num_reqs,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens[: m.num_reqs],
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping,
            num_decodes=nd,
            decode_query_len=T,  # 0 exactly when nd is 0: a leading T > 0 makes nd >= 1
            query_start_loc_cpu=qsl,
            prefill_query_start_loc=prefill_qsl,
            max_prefill_query_len=max(q_lens[nd:], default=0),
            prefill_seq_lens_cpu=prefill_lens,
        )


class TurboQuantImpl(AttentionImpl[TurboQuantMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, **extra) -> None:
        fix = "serve this model with --kv-cache-dtype auto (and without --attention-backend CUSTOM)"
        # layer_idx is information only (Qwen3-Next passes it with dual-chunk attention, refused by its config)
        extra = {k: v for k, v in extra.items() if k != "layer_idx" and v is not None}
        unsupported = {
            f"head_dim {head_size} (the kernels support {HEAD_DIM})": head_size != HEAD_DIM,
            "sliding-window attention": sliding_window is not None,
            "ALiBi": alibi_slopes is not None,
            "logits soft-capping": logits_soft_cap not in (None, 0),
            f"attention type {attn_type!r} (decoder only)": attn_type != AttentionType.DECODER,
            f"KV-cache sharing with {kv_sharing_target_layer_name!r}": kv_sharing_target_layer_name is not None,
            f"attention arguments {sorted(extra)} (e.g. sinks, dual-chunk attention)": bool(extra),
        }
        bad = [what for what, is_bad in unsupported.items() if is_bad]
        if bad:
            raise ValueError(f"TurboQuant KV cache does not support {', '.join(bad)}: {fix}")
        release = _vllm_release()
        if kv_cache_dtype in UPSTREAM_NAMES.get(release, ()):
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is vLLM {release}'s own TurboQuant layout, not "
                             f"onespark's: use turboquant_k4v4 or turboquant_k4v3 with --attention-backend CUSTOM, "
                             f"or drop --attention-backend CUSTOM for vLLM's own backend")
        self.preset = layout_for(kv_cache_dtype, 1, head_size, 16).preset  # validates the dtype name
        self.kv_cache_dtype = kv_cache_dtype
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.attn_type = attn_type
        self._prefill_path = choice("ONESPARK_TQ_PREFILL")  # values: patches/__init__.py's TQ_CHOICES
        self._decode_once = DECODE_ONCE[choice("ONESPARK_TQ_DECODE")]
        self._kernel = choice("ONESPARK_TQ_KERNEL")
        self._kernel_for: dict[tuple[int, str], bool] = {}
        if self._kernel == "cuda" and (self.preset.k_bits, self.preset.v_bits) != (4, 4):
            raise ValueError(f"ONESPARK_TQ_KERNEL=cuda: the CUDA decode kernel reads turboquant_k4v4 only, not "
                             f"{kv_cache_dtype}: use ONESPARK_TQ_KERNEL=auto or triton")
        self._seed: int | None = None
        self._rotation: dict[str, torch.Tensor] = {}
        self._codebooks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- helpers ---------------------------------------------------------------------------------

    def _layout(self, kv_cache: torch.Tensor) -> tq.CacheLayout:
        per_token = self.num_kv_heads * self.preset.bytes_per_token_head(self.head_size)
        if kv_cache.dim() != 2 or kv_cache.dtype != torch.uint8 or kv_cache.shape[1] % per_token:
            raise ValueError(f"TurboQuant cache must be uint8 [blocks, k*{per_token}], got {kv_cache.dtype} "
                             f"{tuple(kv_cache.shape)}: was patches/turboquant.diff applied to this vLLM?")
        return tq.CacheLayout(self.preset, self.num_kv_heads, kv_cache.shape[1] // per_token, self.head_size)

    def _seed_of(self, layer) -> int:
        if self._seed is None:  # the impl is built before vLLM names it; the layer knows its name
            self._seed = tq.rotation_seed(layer_index(layer.layer_name))
        return self._seed

    def _r(self, seed: int, device) -> torch.Tensor:
        key = str(device)
        if key not in self._rotation:
            self._rotation[key] = tq.rotation(seed, self.head_size, torch.float32, device)
        return self._rotation[key]

    def _levels(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V codebook levels on `device`, copied there once (not per request and layer)."""
        key = str(device)
        if key not in self._codebooks:
            self._codebooks[key] = tuple(tq.codebook(b).levels.to(device, torch.float32)
                                         for b in (self.preset.k_bits, self.preset.v_bits))
        return self._codebooks[key]

    # -- vLLM entry points ------------------------------------------------------------------------

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if kv_cache.numel() == 0:  # profiling run before the cache exists
            return
        kv_cache = tq_cache_rows(kv_cache)
        layout, seed = self._layout(kv_cache), self._seed_of(layer)
        n = slot_mapping.shape[0]  # key/value may carry padding tokens beyond the slots
        if kv_cache.is_cuda:
            from onespark.kernels import turboquant_triton as tt

            tt.encode(key[:n], value[:n], slot_mapping, kv_cache, layout, seed)
        else:
            tq.encode_reference(key[:n], value[:n], slot_mapping, kv_cache, layout, self._r(seed, kv_cache.device))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        assert output is not None, "accept_output_buffer: vLLM passes the output tensor"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("TurboQuant attention does not fuse output quantization")
        if attn_metadata is None or kv_cache.numel() == 0:  # profiling run
            return output.fill_(0)
        md: TurboQuantMetadata = attn_metadata
        kv_cache = tq_cache_rows(kv_cache)
        layout, seed = self._layout(kv_cache), self._seed_of(layer)
        if md.num_decodes:
            self._decode(query, kv_cache, layout, seed, md, output)
        if md.num_decodes < md.num_reqs:
            if kv_cache.is_cuda and self._prefill_path == "flash":
                self._prefill_flash(query, kv_cache, layout, seed, md, output)
            elif kv_cache.is_cuda and self._prefill_path == "triton":
                self._prefill(query, kv_cache, layout, seed, md, output)
            else:
                self._prefill_reference(query, kv_cache, layout, seed, md, output)
        return output

    def _decode(self, query, kv_cache, layout, seed, md: TurboQuantMetadata, output) -> None:
        B, T = md.num_decodes, md.decode_query_len
        q = query[: B * T].view(B, T, self.num_heads, self.head_size).transpose(1, 2)  # [B, Hq, T, d]
        if kv_cache.is_cuda and self._cuda_kernel(T, q.device):
            from onespark.kernels import turboquant_cuda as tc

            o = tc.decode_attention(q, kv_cache, layout, md.block_table[:B], md.seq_lens[:B], seed, self.scale,
                                    md.max_seq_len)
        elif kv_cache.is_cuda:
            from onespark.kernels import turboquant_triton as tt

            o = tt.decode_attention(q, kv_cache, layout, md.block_table[:B], md.seq_lens[:B], seed, self.scale,
                                    md.max_seq_len, once=self._decode_once)
        else:
            o = tq.decode_attention_reference(q, kv_cache, layout, md.block_table[:B], md.seq_lens[:B],
                                              self._r(seed, kv_cache.device), self.scale)
        output[: B * T].copy_(o.transpose(1, 2).reshape(B * T, self.num_heads, self.head_size))

    def _cuda_kernel(self, T: int, device) -> bool:
        """Whether the CUDA decode kernel serves this decode call (ONESPARK_TQ_KERNEL): decided once
        per query length and device (the build check hashes the kernel's sources; not per layer-step)."""
        key = (T, str(device))
        if key not in self._kernel_for:
            self._kernel_for[key] = self._choose_cuda_kernel(T, device)
            _say_decode_kernel(T, str(device), self._kernel_for[key], self._kernel)
        return self._kernel_for[key]

    def _choose_cuda_kernel(self, T: int, device) -> bool:
        from onespark.kernels import turboquant_cuda as tc
        from onespark.kernels import turboquant_triton as tt

        if not tc.supports(self.preset, self.num_heads, self.num_kv_heads, T, self.head_size):
            return False
        if self._kernel != "auto":
            return self._kernel == "cuda"
        if not tc.chosen(T, tt._capability(device), self.preset):
            return False
        if tc.available():
            return True
        _warn_no_cuda_build(str(tc.build_dir()))
        return False

    def _prefill(self, query, kv_cache, layout, seed, md: TurboQuantMetadata, output) -> None:
        """Every request after the decodes, in one Triton call straight from the compressed cache."""
        from onespark.kernels import turboquant_triton as tt

        # the step's tokens end at the last request's, not at num_actual_tokens: rows past it (padding) are
        # not this backend's to write
        nd, t0, t1 = md.num_decodes, md.num_decodes * md.decode_query_len, int(md.query_start_loc_cpu[-1])
        o = tt.prefill_attention(query[t0:t1].view(t1 - t0, self.num_heads, self.head_size), kv_cache, layout,
                                 md.block_table[nd:], md.seq_lens[nd:], md.prefill_query_start_loc, seed, self.scale,
                                 md.max_prefill_query_len)
        output[t0:t1].copy_(o)

    def _prefill_flash(self, query, kv_cache, layout, seed, md: TurboQuantMetadata, output) -> None:
        """Each request after the decodes: its cache decoded into BF16 and attended by FlashAttention."""
        from onespark.kernels import turboquant_triton as tt

        qsl = md.query_start_loc_cpu.tolist()
        for j, i in enumerate(range(md.num_decodes, md.num_reqs)):
            s, e = qsl[i], qsl[i + 1]
            if e > s:
                output[s:e] = tt.prefill_attention_flash(query[s:e].view(e - s, self.num_heads, self.head_size),
                                                         kv_cache, layout, md.block_table[i],
                                                         md.prefill_seq_lens_cpu[j], seed, self.scale)

    def _prefill_reference(self, query, kv_cache, layout, seed, md: TurboQuantMetadata, output) -> None:
        """CPU, or a GPU with ONESPARK_TQ_PREFILL=torch: per request, `turboquant.prefill_attention_sdpa`
        (dequantize the sequence from the cache, then torch SDPA in blocks of query rows), causal."""
        r, levels = self._r(seed, kv_cache.device), self._levels(kv_cache.device)
        # fp32 on CPU (the reference lane checks it tightly); the model's dtype on GPUs (SDPA kernels)
        dtype = torch.float32 if not query.is_cuda else query.dtype
        qsl = md.query_start_loc_cpu.tolist()
        seq_lens = md.seq_lens.tolist()  # a device sync on GPUs: this fallback path only
        for i in range(md.num_decodes, md.num_reqs):
            s, e = qsl[i], qsl[i + 1]
            if e > s:
                o = tq.prefill_attention_sdpa(query[s:e], kv_cache, layout, md.block_table[i], seq_lens[i], r, levels,
                                              self.scale, dtype, SCORE_BUDGET)
                output[s:e].copy_(o.to(output.dtype))
