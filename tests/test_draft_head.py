"""The MTP draft's subset head: the kernel path (onespark.kernels.draft_head) against a float64 plain-torch
reference that computes the FULL head and masks it, and the plugin module (patches/draft_head.py) built by
vLLM's own classes in a fresh process.

Lanes, as tests/test_kernels_lm_head.py: with CUDA the kernel tests run here on the GPU; on CPU
`test_interpreter_lane` re-runs this file in a child with TRITON_INTERPRET=1 (fp16/fp32). The plugin probe
(`test_plugin_*`) needs vLLM and runs in the parent only, on both tracks (0.19.1 and 0.32.0).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onespark.kernels import quantize_int8_rows
from onespark.kernels.draft_head import (
    check_ids,
    draft_logits,
    draft_logits_int4,
    draft_logits_ref,
    scatter_subset,
    subset_argmax,
    subset_int4_rows,
    subset_rows,
)
from onespark.kernels.lm_head import dequantize_int4_groups
from tests._compare import assert_close
from tests._interpreter import run_interpreter_lane
from tests._kernel_lane import ACC, CUDA, DEVICE, DTYPES, INTERPRET, P_BITS, kernel_lane

parent_only = pytest.mark.skipif(INTERPRET, reason="not a kernel test: runs in the parent")
HERE = Path(__file__).resolve()


def _marks(*marks):
    """Several marks as one decorator: the plugin-probe tests share four, the MTP-2 server tests four others."""
    def apply(fn):
        for mark in reversed(marks):
            fn = mark(fn)
        return fn

    return apply


# vLLM's classes in a fresh process (the probe fixture), on both tracks
probe_test = _marks(parent_only, pytest.mark.vllm, pytest.mark.vllm032, pytest.mark.timeout(900))
# a real vLLM 0.32.0 server with MTP-2: 0.19.1's CPU build has no speculative decoding
server_test = _marks(parent_only, pytest.mark.vllm, pytest.mark.vllm032_only, pytest.mark.timeout(1500))
N, K = 2053, 200  # vocabulary no power of two, K with a tail past the 32/128 tiles


def _ids(k_sub: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:k_sub].sort().values  # scattered over the vocabulary


def _case(m: int, k_sub: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.02
    q, s = quantize_int8_rows(w)
    x = (torch.randn(m, K, generator=gen) + 0.01).to(dtype)
    return x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), _ids(k_sub, N, seed).to(DEVICE)


def _check(out, x, q, s, ids, what, w4=None):
    ref = draft_logits_ref(x, q, s, ids, acc_dtype=torch.float64, out_dtype=torch.float64, w4=w4)
    if w4 is None:
        abs_sum = draft_logits_ref(x.abs(), q.abs(), s, ids, acc_dtype=torch.float64, out_dtype=torch.float64)
    else:
        w = dequantize_int4_groups(w4[0], w4[1], x.shape[1]).abs().to(torch.float64)
        abs_sum = torch.full_like(ref, float("-inf"))
        abs_sum[:, ids] = x.abs().to(torch.float64) @ w.T
    tol = torch.where(torch.isinf(ref), torch.zeros_like(ref), ref.abs() * 2.0 ** -P_BITS[x.dtype] + abs_sum * ACC)
    assert_close(out, ref, tol, what)  # -inf must be exactly where the reference has it


def _dname(dtype):
    return str(dtype).removeprefix("torch.")


SUBSETS = [pytest.param(1, id="Ksub1"), pytest.param(7, id="Ksub7"), pytest.param(1000, id="Ksub1000"),
           pytest.param(333, id="Ksub333")]  # 333: not a multiple of any BLOCK_N


@kernel_lane
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
@pytest.mark.parametrize("k_sub", SUBSETS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_draft_logits_match_masked_full_head(m, k_sub, dtype):
    x, q, s, ids = _case(m, k_sub, dtype, seed=m * 100 + k_sub)
    w_sub, s_sub = subset_rows(q, s, ids)
    assert w_sub.is_contiguous() and w_sub.shape == (k_sub, K) and s_sub.shape == (k_sub,)
    out = torch.full((m, N), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: unwritten stays NaN
    assert draft_logits(x, w_sub, s_sub, ids, N, out=out) is out
    _check(out, x, q, s, ids, f"draft int8 M={m} Ksub={k_sub} {dtype}")
    # ids mapped back: the full-vocabulary argmax is the subset's argmax, as a vocabulary id
    sub = out[:, ids]
    assert torch.equal(out.argmax(-1), subset_argmax(sub, ids))
    assert bool(torch.isin(out.argmax(-1).cpu(), ids.cpu()).all())  # (planted winners: the next-but-one test)


@kernel_lane
@pytest.mark.parametrize("m", [1, 3, 8])
def test_draft_logits_int4_match_reference(m):
    dtype = DTYPES[0]
    x, q, s, ids = _case(m, 333, dtype, seed=11 + m)
    w4, s4 = subset_int4_rows(q, s, ids)
    out = draft_logits_int4(x, w4, s4, ids, N)
    _check(out, x, q, s, ids, f"draft int4 M={m}", w4=(w4, s4))


@kernel_lane
def test_argmax_maps_back_with_a_clear_winner_and_with_ties():
    """Row i of x has a planted winner: the argmax must be that vocabulary id, and where two subset rows tie
    exactly, both paths take the lower id (ids ascending)."""
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(N, K, generator=gen) * 0.01
    ids = _ids(1000, N, 5)
    winners = ids[torch.tensor([3, 500, 999, 0, 250, 777, 1, 998])]
    x = torch.zeros(8, K)
    for i, t in enumerate(winners.tolist()):
        x[i] = w[t] / w[t].norm() * 4  # x . w_t stands out by ~50 sigma
    w[ids[11]] = w[ids[10]]  # an exact tie inside the subset
    x[7] = w[ids[10]] / w[ids[10]].norm() * 4
    winners[7] = ids[10]
    q, s = quantize_int8_rows(w)
    x, q, s, ids = x.to(dtype).to(DEVICE), q.to(DEVICE), s.to(DEVICE), ids.to(DEVICE)
    w_sub, s_sub = subset_rows(q, s, ids)
    out = draft_logits(x, w_sub, s_sub, ids, N)
    assert out.argmax(-1).tolist() == winners.tolist()
    assert subset_argmax(out[:, ids], ids).tolist() == winners.tolist()


@kernel_lane
def test_a_better_token_outside_the_subset_is_never_drafted():
    dtype = DTYPES[0]
    x, q, s, ids = _case(3, 7, dtype, seed=9)
    full = draft_logits_ref(x, q, s, torch.arange(N, device=DEVICE), acc_dtype=torch.float64)
    outside = full.argmax(-1)
    assert not bool(torch.isin(outside.cpu(), ids.cpu()).all()), "pick a seed whose best tokens lie outside"
    out = draft_logits(x, *subset_rows(q, s, ids), ids, N)
    assert bool(torch.isin(out.argmax(-1).cpu(), ids.cpu()).all())
    assert int(torch.isfinite(out).sum()) == 3 * 7


@pytest.mark.skipif(not CUDA, reason="CUDA graphs: GPU lane")
def test_real_shape_cuda_graph_replay_equals_eager():
    n, k, k_sub = 248_320, 3072, 32_768
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).cuda()
    s = (torch.rand(n, generator=gen) * 1e-3).cuda()
    ids = torch.arange(k_sub, device="cuda") * 7 % n
    ids = ids.sort().values.unique()
    w_sub, s_sub = subset_rows(q, s, ids)
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16).cuda()
    eager = draft_logits(x, w_sub, s_sub, ids, n)
    out = torch.empty_like(eager)
    draft_logits(x, w_sub, s_sub, ids, n, out=out)  # configs chosen outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        draft_logits(x, w_sub, s_sub, ids, n, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_check_ids_refuses_bad_subsets():
    check_ids(torch.tensor([0, 5, 9]), 10)
    for bad, msg in [(torch.tensor([0, 10]), r"in \[0, 10\)"), (torch.tensor([3, 3]), "ascending and unique"),
                     (torch.tensor([4, 2]), "ascending and unique"), (torch.tensor([], dtype=torch.int64), "non-empty"),
                     (torch.tensor([1, 2], dtype=torch.int32), "int64")]:
        with pytest.raises(ValueError, match=msg):
            check_ids(bad, 10)


def test_scatter_subset_writes_only_the_subset():
    sub = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = scatter_subset(sub, torch.tensor([1, 4]), 6)
    inf = float("-inf")
    assert out.tolist() == [[inf, 1.0, inf, inf, 2.0, inf], [inf, 3.0, inf, inf, 4.0, inf]]
    with pytest.raises(ValueError, match=r"shape \(2, 6\)"):
        scatter_subset(sub, torch.tensor([1, 4]), 6, out=torch.empty(2, 5))


# ------------------------------------------------------------------ the plugin's arithmetic on CPU (no vLLM)


@parent_only
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_plugin_cpu_path_matches_reference(m):
    from onespark.patches.draft_head import draft_head_logits

    x, q, s, ids = (t.cpu() for t in _case(m, 333, torch.bfloat16, seed=m))
    w_sub, s_sub = subset_rows(q, s, ids)
    out = draft_head_logits(x, w_sub, s_sub, ids, N)
    _check(out, x, q, s, ids, f"plugin CPU M={m}")
    bias = torch.randn(N)
    with_bias = draft_head_logits(x, w_sub, s_sub, ids, N, bias=bias.to(x.dtype))
    assert torch.isinf(with_bias).sum() == torch.isinf(out).sum()
    empty = draft_head_logits(x, w_sub[:0], s_sub[:0], ids[:0], N)  # a TP rank whose shard holds no subset id
    assert empty.shape == (m, N) and bool(torch.isneginf(empty).all())
    w4, s4 = subset_int4_rows(q, s, ids)
    _check(draft_head_logits(x, w4, s4, ids, N), x, q, s, ids, f"plugin CPU INT4 M={m}", w4=(w4, s4))


@parent_only
def test_plugin_tp2_shards_concatenate_to_the_masked_full_head():
    """TP = 2 without a process group: each rank's head holds [start, end) of the vocabulary (plus padding rows,
    as vLLM's VocabParallelEmbedding lays them out); subset_for_shard maps the global ids to this shard, and the
    two ranks' logits, cut to their real rows and concatenated (what vLLM's gather + padding slice does), are
    the full head's logits masked to the subset."""
    import types

    from onespark.patches.draft_head import draft_head_logits, subset_for_shard

    x, q, s, ids = (t.cpu() for t in _case(3, 333, torch.bfloat16, seed=21))
    half, pad = (N + 1) // 2, 3  # 1027 real rows a shard (the second: 1026), 3 padding rows each
    parts = []
    for rank in range(2):
        start, end = rank * half, min(N, (rank + 1) * half)
        q_shard = torch.zeros(half + pad, K, dtype=torch.int8)
        s_shard = torch.ones(half + pad)
        q_shard[: end - start], s_shard[: end - start] = q[start:end], s[start:end]
        head = types.SimpleNamespace(
            shard_indices=types.SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end),
            num_embeddings_per_partition=half + pad, onespark_w_int8=q_shard, onespark_w_scale=s_shard,
            weight=torch.empty(0))
        w_sub, s_sub, local, n_local = subset_for_shard(head, ids.tolist())
        want = ids[(ids >= start) & (ids < end)] - start
        assert torch.equal(local, want) and n_local == half + pad
        assert torch.equal(w_sub, q_shard[want]) and w_sub.is_contiguous()
        parts.append(draft_head_logits(x, w_sub, s_sub, local, n_local)[:, : end - start])
    _check(torch.cat(parts, dim=1), x, q, s, ids, "TP=2 shards, concatenated")


@parent_only
@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
def test_plugin_shard_without_subset_ids_is_all_neg_inf(int4):
    import types

    from onespark.patches.draft_head import draft_head_logits, subset_for_shard

    q, s = quantize_int8_rows(torch.randn(64, K) * 0.02)
    head = types.SimpleNamespace(
        shard_indices=types.SimpleNamespace(org_vocab_start_index=1000, org_vocab_end_index=1064),
        num_embeddings_per_partition=64, onespark_w_int8=q, onespark_w_scale=s, weight=torch.empty(0))
    w_sub, s_sub, local, n_local = subset_for_shard(head, [1, 2, 999, 1064], int4=int4)  # none in [1000, 1064)
    assert local.numel() == 0 and w_sub.shape[0] == 0 and w_sub.dtype == (torch.uint8 if int4 else torch.int8)
    out = draft_head_logits(torch.randn(2, K).to(torch.bfloat16), w_sub, s_sub, local, n_local)
    assert out.shape == (2, 64) and bool(torch.isneginf(out).all())


# ------------------------------------------------------------------ the plugin with vLLM's classes (fresh process)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """Runs _probe_main (bottom) in a fresh interpreter: vLLM's ParallelLMHead (the plugin's INT8 one),
    LogitsProcessor and EagleProposer._maybe_share_lm_head as the plugin wraps it."""
    from onespark.checkpoint import draft_vocab
    from onespark.checkpoint.tinymodel import write_tiny_model

    root = tmp_path_factory.mktemp("draft-head")
    model = write_tiny_model(root / "tiny", seed=0)
    draft_vocab.write(model, draft_vocab.build(model, size=300))
    bad = write_tiny_model(root / "bad", seed=0)
    doc = draft_vocab.build(bad, size=300)
    doc["tokenizer_sha256"] = "0" * 64
    draft_vocab.write(bad, doc)
    none = write_tiny_model(root / "none", seed=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONESPARK_", "VLLM_PLUGINS"))}
    env.update({"HF_HUB_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    out = root / "probe.json"
    r = subprocess.run([sys.executable, "-m", "tests.test_draft_head", str(out), str(model), str(bad), str(none)],
                       env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and out.is_file(), \
        f"probe failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return json.loads(out.read_text()), r.stderr + r.stdout, json.loads((model / draft_vocab.FILE).read_text())


@probe_test
def test_plugin_gives_the_draft_a_subset_head_and_keeps_the_targets(probe):
    got, log, doc = probe
    r = got["on"]
    assert r["attached"] and r["draft_head"] == "DraftSubsetHead" and r["mtp_shared_head_is_draft_head"]
    assert r["target_head_method"] == "Int8LMHeadMethod" and r["target_head_untouched"]
    assert r["sub_rows"] == 300 and r["sub_is_contiguous"]
    assert r["logits_shape"] == [5, r["vocab"]]
    # the draft's logits through vLLM's LogitsProcessor: the subset's INT8 logits, -inf elsewhere
    assert r["finite_columns"] == sorted(doc["ids"])
    assert r["max_rel_err_vs_ref"] <= 2**-8  # bf16 output rounding
    assert r["argmax_in_subset"] and r["argmax_equals_ref"] and r["top_tokens_equal_argmax"]
    # the target's logits are the full head's, unchanged by the draft's head
    assert r["target_finite_columns"] == r["vocab"] and r["target_equals_before"]
    assert "MTP draft head over a vocabulary subset in use: 300 of" in log
    r4 = got["int4"]  # ONESPARK_DRAFT_INT4=1: the same subset in INT4 groups of 128
    assert r4["attached"] and r4["dtype"] == "torch.uint8" and r4["same_columns"] and r4["argmax_in_subset"]
    assert r4["max_rel_err_vs_ref"] <= 2**-8
    assert "INT4 groups of 128 (ONESPARK_DRAFT_INT4=1)" in log


@probe_test
def test_plugin_switch_file_and_mismatch(probe):
    got, log, _ = probe
    assert got["off"]["attached"] is False and got["off"]["draft_head_is_target_head"]
    assert "ONESPARK_DRAFT_VOCAB=0: the MTP draft shares the target's full LM head" in log
    assert got["no_file"]["attached"] is False and got["no_file"]["draft_head_is_target_head"]
    assert "no onespark-draft-vocab.json beside the checkpoint" in log
    assert "ONESPARK_DRAFT_VOCAB=1 but" in got["no_file_explicit"]["error"]
    assert "onespark draft-vocab MODEL_DIR" in got["no_file_explicit"]["error"]
    assert "was built for another tokenizer.json" in got["mismatch"]["error"]
    assert "ONESPARK_DRAFT_VOCAB=0" in got["mismatch"]["error"]
    assert got["own_head"]["attached"] is False and got["own_head"]["draft_head_kept"]  # EAGLE with its own head
    assert got["pp_missing"]["attached"] is False
    assert got["wrapped_once"]


# ------------------------------------------------------------------ a real vLLM 0.32.0 server with MTP-2 (CPU)
# One server: the real Qwen3.5-MoE architecture (tiny-model --arch qwen3.5-moe, MTP layer agreeing with the
# target) with a draft vocabulary of about half its tokens. vLLM 0.19.1's CPU build has no speculative decoding
# ("spec decode is not supported", v1/worker/cpu_model_runner.py), so this runs on the 0.32.0 track only.
# The "option off" reference is the target itself, teacher-forced on the same server: the prompt plus the
# greedy continuation, re-read in one prefill with prompt_logprobs, must have the continuation as its top-1
# at every position. That is what greedy decoding without the option returns (tests/test_v032_server.py: MTP-2
# greedy == no speculative decoding, 288/288 tokens), without a second server.

SUBSET = 340  # of the tiny tokenizer's 677: the greedy continuations hold tokens on both sides


@pytest.fixture(scope="module")
def subset_server(tmp_path_factory):
    from onespark.checkpoint import draft_vocab
    from onespark.checkpoint.tinymodel import write_tiny_model
    from tests.test_v032_server import CPU_FLAGS, MTP
    from tests.vllm_server import VLLMServer

    model = write_tiny_model(tmp_path_factory.mktemp("draft-server") / "qwen35", seed=0, arch="qwen3.5-moe")
    draft_vocab.write(model, draft_vocab.build(model, size=SUBSET))
    with VLLMServer(model, args=[*CPU_FLAGS, *MTP], startup_timeout_s=900) as srv:
        yield srv, model, set(draft_vocab.load(model)["ids"])


@pytest.fixture(scope="module")
def subset_run(subset_server):
    from tokenizers import Tokenizer

    from tests.test_plugin_server import GEN_TOKENS, PROMPTS
    from tests.test_v032_server import spec_counters

    srv, model, ids = subset_server
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompts = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    before = spec_counters(srv)
    outs = []
    for p in prompts:  # one at a time, greedy
        r = srv.post_json("/v1/completions", {
            "model": srv.model, "prompt": p, "max_tokens": GEN_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True})
        outs.append([int(t.removeprefix("token_id:")) for t in r["choices"][0]["logprobs"]["tokens"]])
    after = spec_counters(srv)
    return srv, ids, prompts, outs, {k: after[k] - before[k] for k in after}


@server_test
def test_server_logs_the_subset_draft_head(subset_server):
    srv, _, ids = subset_server
    log = srv.log_text()
    assert "draft-vocab" in re.search(r"onespark plugin active on vLLM 0\.32\.0: ([^;\n]*)", log).group(1)
    assert re.search(rf"MTP draft head over a vocabulary subset in use: {len(ids)} of \d+ rows", log), log[-3000:]
    assert "Sharing target model lm_head weights with the draft model" in log


@server_test
def test_server_greedy_output_is_the_targets_and_drafts_stay_in_the_subset(subset_run, record_property):
    srv, ids, prompts, outs, c = subset_run
    emitted = [t for o in outs for t in o]
    inside = sum(t in ids for t in emitted)
    summary = (f"draft vocabulary {len(ids)} ids: {c['num_drafts']:.0f} drafts, {c['num_draft_tokens']:.0f} draft "
               f"tokens, {c['num_accepted_tokens']:.0f} accepted; {len(emitted)} tokens emitted, {inside} in the "
               f"subset")
    record_property("draft_subset", summary)
    print(summary)
    # /metrics: vLLM drafted (2 a step) and accepted some drafts
    assert c["num_draft_tokens"] == 2 * c["num_drafts"] > 0 and c["num_accepted_tokens"] > 0, summary
    # Every accepted draft is an emitted token (up to 2 a request drafted past max_tokens, counted but not
    # returned), and a draft can only be a subset token: accepted <= emitted tokens in the subset (+ 2/request).
    # With the full head this MTP layer drafts what the target emits (>= 90% accepted, test_v032_server.py),
    # so the bound fails if the draft is not restricted (emitted tokens outside the subset are 1/3+ of them).
    assert len(emitted) - inside >= len(emitted) // 3, summary
    assert c["num_accepted_tokens"] <= inside + 2 * len(outs), summary
    # Output = the target's greedy chain, tokens outside the subset included: teacher-forced top-1.
    same = total = 0
    for p, o in zip(prompts, outs):
        r = srv.post_json("/v1/completions", {
            "model": srv.model, "prompt": p + o, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
        pos = r["choices"][0]["prompt_logprobs"][len(p):]
        top1 = [int(next(t for t, v in d.items() if v["rank"] == 1)) for d in pos]
        same += sum(a == b for a, b in zip(top1, o))
        total += len(o)
    record_property("draft_subset_teacher_forced", f"{same}/{total}")
    # One prefill vs the decode steps' batch shapes: numerics only (test_v032_server.py uses 0.99 for MTP vs none).
    assert same >= 0.99 * total, f"{same}/{total} greedy tokens are the target's top-1"


# ------------------------------------------------------------------ the CPU lane's launcher


@pytest.mark.skipif(CUDA or INTERPRET, reason="kernel tests run in this process")
def test_interpreter_lane():
    run_interpreter_lane(__file__, timeout_s=1200)


# ------------------------------------------------------------------ the probe (its own process)


def _probe_main(out_path: str, model: str, bad: str, none: str) -> None:
    import socket
    import types

    import vllm.logger

    if hasattr(vllm.logger, "configure_logging"):  # 0.32.0 configures its loggers when an engine starts
        from vllm.config.logging import LoggingConfig

        vllm.logger.configure_logging(LoggingConfig())
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.plugins import load_general_plugins
    from vllm.v1.spec_decode.eagle import EagleProposer

    from onespark.patches import draft_head

    load_general_plugins()  # the entry point: installs the hook (vLLM imported eagle above: wrapped now)
    first = EagleProposer._maybe_share_lm_head
    draft_head.install()
    result = {"wrapped_once": EagleProposer._maybe_share_lm_head is first and first._onespark_draft_head}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    vc = VllmConfig()
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        cfg = json.loads((Path(model) / "config.json").read_text())
        vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
        torch.manual_seed(0)
        w = (torch.randn(vocab, hidden) * 0.05).to(torch.bfloat16)

        def head():
            with torch.device("cpu"):
                h = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16, prefix="lm_head")
            h.weight.data.zero_()  # vocab padding rows, as vLLM loads them
            h.weight.data[:vocab].copy_(w)
            h.quant_method.process_weights_after_loading(h)
            return h

        lp = LogitsProcessor(vocab)
        x = torch.randn(5, hidden).to(torch.bfloat16)

        def case(model_dir: str, env: dict | None = None, own_head: bool = False, pp_missing: bool = False) -> dict:
            target = types.SimpleNamespace(lm_head=torch.nn.Identity() if pp_missing else head())
            layer = torch.nn.Module()
            layer.shared_head = torch.nn.Module()
            layer.shared_head.head = target.lm_head
            draft = torch.nn.Module()
            draft.lm_head = head() if own_head else target.lm_head
            draft.model = torch.nn.Module()
            draft.model.layers = torch.nn.ModuleDict({"0": layer})
            proposer = types.SimpleNamespace(
                model=draft, vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(model=model_dir)))
            own = draft.lm_head
            for k in ("ONESPARK_DRAFT_VOCAB", "ONESPARK_DRAFT_INT4"):
                os.environ.pop(k, None)
            os.environ.update(env or {})
            try:
                attached = draft_head.attach(proposer, target)
            except RuntimeError as e:
                return {"error": str(e)}
            return {"attached": attached, "draft": draft, "target": target, "own": own}

        before = lp(head(), x).float()
        on = case(model)
        draft, target = on["draft"], on["target"]
        ids = json.loads((Path(model) / "onespark-draft-vocab.json").read_text())["ids"]
        logits = lp(draft.lm_head, x).float()
        full = lp(target.lm_head, x).float()
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[ids] = True
        t = target.lm_head
        ref = x.double() @ (t.onespark_w_int8.double() * t.onespark_w_scale.double()[:, None]).T
        ref = ref[:, :vocab].masked_fill(~keep, float("-inf"))
        fin = torch.isfinite(ref)
        result["on"] = {
            "attached": on["attached"], "draft_head": type(draft.lm_head).__name__,
            "mtp_shared_head_is_draft_head": draft.model.layers["0"].shared_head.head is draft.lm_head,
            "target_head_method": type(target.lm_head.quant_method).__name__,
            "target_head_untouched": target.lm_head.onespark_w_int8.shape[0] >= vocab,
            "sub_rows": int(draft.lm_head.onespark_draft_w.shape[0]),
            "sub_is_contiguous": draft.lm_head.onespark_draft_w.is_contiguous(),
            "vocab": vocab, "logits_shape": list(logits.shape),
            "finite_columns": torch.isfinite(logits).all(0).nonzero().flatten().tolist(),
            "max_rel_err_vs_ref": float(((logits[fin] - ref[fin]).abs() / ref[fin].abs().clamp_min(1e-2)).max()),
            "argmax_in_subset": all(t in set(ids) for t in logits.argmax(-1).tolist()),
            "argmax_equals_ref": logits.argmax(-1).tolist() == ref.argmax(-1).tolist(),
            "top_tokens_equal_argmax": lp.get_top_tokens(draft.lm_head, x).tolist() == logits.argmax(-1).tolist(),
            "target_finite_columns": int(torch.isfinite(full).all(0).sum()),
            "target_equals_before": torch.equal(full, before),
        }
        off = case(model, {"ONESPARK_DRAFT_VOCAB": "0"})
        result["off"] = {"attached": off["attached"],
                         "draft_head_is_target_head": off["draft"].lm_head is off["target"].lm_head}
        nf = case(none)
        result["no_file"] = {"attached": nf["attached"],
                             "draft_head_is_target_head": nf["draft"].lm_head is nf["target"].lm_head}
        result["no_file_explicit"] = case(none, {"ONESPARK_DRAFT_VOCAB": "1"})
        result["mismatch"] = case(bad)
        oh = case(model, own_head=True)
        result["own_head"] = {"attached": oh["attached"], "draft_head_kept": oh["draft"].lm_head is oh["own"]}
        i4 = case(model, {"ONESPARK_DRAFT_INT4": "1"})
        h4 = i4["draft"].lm_head
        w4 = dequantize_int4_groups(h4.onespark_draft_w, h4.onespark_draft_scale, hidden).double()
        ref4 = torch.full((x.shape[0], vocab), float("-inf"), dtype=torch.float64)
        ref4[:, ids] = x.double() @ w4.T
        lg4 = lp(h4, x).float()
        fin4 = torch.isfinite(ref4)
        result["int4"] = {
            "attached": i4["attached"], "dtype": str(h4.onespark_draft_w.dtype),
            "same_columns": torch.equal(torch.isfinite(lg4), fin4),
            "max_rel_err_vs_ref": float(((lg4[fin4] - ref4[fin4]).abs() / ref4[fin4].abs().clamp_min(1e-2)).max()),
            "argmax_in_subset": all(t in set(ids) for t in lg4.argmax(-1).tolist()),
        }
        pp = case(model, pp_missing=True)  # a pipeline stage without the head (vLLM's PPMissingLayer)
        result["pp_missing"] = {"attached": pp["attached"]}
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _probe_main(*sys.argv[1:5])
