"""bench/: the pure parts (metric definitions, statistics, /metrics and log parsing, quality KL, writers,
compare, CLI input errors) against independent references. No server; see test_bench_server.py for that."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from onespark.bench import metrics as prom
from onespark.bench import report
from onespark.bench.quality import compare_sequences, parse_logprobs, topk_kl
from onespark.bench.stats import RequestTiming, percentile, request_metrics, summarize, welch
from onespark.cli import main
from onespark.errors import UserError


# ---------------------------------------------------------------- per-request metrics
def test_request_metrics_definitions():
    # 11 tokens (server usage), 6 text chunks: t_start 0, first chunk at 0.5 s, last at 1.5 s, stream end 1.6 s
    t = RequestTiming(t_start=10.0, t_end=11.6, prompt_tokens=200, completion_tokens=11,
                      chunk_times=[10.5, 10.7, 10.9, 11.1, 11.3, 11.5])
    m = request_metrics(t)
    assert m["ok"]
    assert m["ttft_s"] == pytest.approx(0.5)
    assert m["decode_tok_s"] == pytest.approx(10 / 1.0)  # (n - 1) / (t_last - t_first)
    assert m["e2e_tok_s"] == pytest.approx(11 / 1.6)  # the published method: n / wall
    assert m["tpot_ms"] == pytest.approx(1000 * (1.6 - 0.5) / 10)
    assert m["prefill_tok_s"] == pytest.approx(200 / 0.5)
    assert m["chunk_gaps_ms"] == pytest.approx([200.0] * 5)


def test_token_count_comes_from_usage_not_chunks():
    """MTP sends several tokens per chunk: halving the chunks must not halve the rate (the known pitfall)."""
    base = dict(t_start=0.0, t_end=2.0, prompt_tokens=10, completion_tokens=101)
    one_per_chunk = request_metrics(RequestTiming(**base, chunk_times=[0.1 + 0.018 * i for i in range(101)]))
    two_per_chunk = request_metrics(RequestTiming(**base, chunk_times=[0.1 + 0.036 * i for i in range(51)]))
    assert one_per_chunk["e2e_tok_s"] == two_per_chunk["e2e_tok_s"] == pytest.approx(101 / 2.0)
    assert one_per_chunk["decode_tok_s"] == pytest.approx(two_per_chunk["decode_tok_s"])
    assert two_per_chunk["chunks"] == 51


@pytest.mark.parametrize("timing,why", [
    (RequestTiming(0.0, 1.0, error="HTTP 400: too long"), "HTTP 400"),
    (RequestTiming(0.0, 1.0, prompt_tokens=5, completion_tokens=0, chunk_times=[]), "no completion tokens"),
    (RequestTiming(0.0, 1.0, prompt_tokens=5, completion_tokens=None), "no completion tokens"),
], ids=["http-error", "zero-tokens", "no-usage"])
def test_failed_request_has_no_figures(timing, why):
    m = request_metrics(timing)
    assert not m["ok"] and why in m["error"]
    assert m["e2e_tok_s"] is None and m["decode_tok_s"] is None and m["ttft_s"] is None  # never a 0 that looks real


def test_single_token_has_no_decode_rate():
    m = request_metrics(RequestTiming(0.0, 0.3, prompt_tokens=5, completion_tokens=1, chunk_times=[0.2]))
    assert m["ok"] and m["decode_tok_s"] is None and m["tpot_ms"] is None
    assert m["e2e_tok_s"] == pytest.approx(1 / 0.3)


# ---------------------------------------------------------------- statistics
@pytest.mark.parametrize("xs", [[3.0], [1.0, 2.0], [5.5, 1.25, 9.0, 2.0, 7.75, 3.0, 3.0]], ids=["n1", "n2", "n7"])
def test_summarize_matches_statistics_and_numpy(xs):
    s = summarize(xs + [None])
    assert s["n"] == len(xs)
    assert s["mean"] == pytest.approx(statistics.fmean(xs))
    assert s["median"] == pytest.approx(statistics.median(xs))
    assert s["std"] == pytest.approx(statistics.stdev(xs) if len(xs) > 1 else 0.0)
    for q in (50, 90, 99):
        assert s[f"p{q}"] == pytest.approx(float(np.percentile(xs, q)))
    assert summarize([None, None]) is None


def test_percentile_rejects_empty():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_welch_delta_and_noise():
    w = welch(50.0, 2.0, 4, 53.0, 2.0, 4)
    assert w["delta"] == pytest.approx(3.0) and w["delta_pct"] == pytest.approx(6.0)
    assert w["se"] == pytest.approx(math.sqrt(2 * 4 / 4))  # sqrt(s^2/n + s^2/n)
    assert w["significant"] is True  # 3 > 2 * 1.414
    assert welch(50.0, 2.0, 4, 51.0, 2.0, 4)["significant"] is False
    assert welch(50.0, 0.0, 1, 60.0, 0.0, 1)["significant"] is None  # n = 1: noise unknown, nothing claimed


# ---------------------------------------------------------------- /metrics and the server log
def _registry_text(drafts, draft_tokens, accepted, per_pos, engines=("0",)):
    """Real Prometheus exposition text from prometheus_client, with vLLM 0.19.1's names and labels."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    c_drafts = Counter("vllm:spec_decode_num_drafts", "d", labels, registry=reg)
    c_dt = Counter("vllm:spec_decode_num_draft_tokens", "d", labels, registry=reg)
    c_acc = Counter("vllm:spec_decode_num_accepted_tokens", "d", labels, registry=reg)
    c_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "d", labels + ["position"], registry=reg)
    info = Gauge("vllm:cache_config_info", "i", ["block_size", "num_gpu_blocks", "cache_dtype", "engine"],
                 registry=reg)
    for e in engines:
        c_drafts.labels("qwen", e).inc(drafts)
        c_dt.labels("qwen", e).inc(draft_tokens)
        c_acc.labels("qwen", e).inc(accepted)
        for i, v in enumerate(per_pos):
            c_pos.labels("qwen", e, str(i)).inc(v)
        info.labels("16", "22187", 'a "quoted", value', e).set(1)
    return generate_latest(reg).decode()


def test_spec_decode_acceptance_from_real_prometheus_text():
    before = prom.snapshot(_registry_text(100, 200, 150, [90, 60]))
    after = prom.snapshot(_registry_text(1100, 2200, 1750, [990, 760]))
    d = prom.spec_decode_delta(before, after)
    assert d["drafts"] == 1000 and d["draft_tokens"] == 2000 and d["accepted_tokens"] == 1600
    assert d["acceptance_rate"] == pytest.approx(0.8)
    assert d["mean_acceptance_length"] == pytest.approx(1 + 1600 / 1000)  # vLLM's definition, bonus token included
    assert d["per_position"] == pytest.approx([0.9, 0.7])
    assert after["cache_info"]["num_gpu_blocks"] == "22187"
    assert after["cache_info"]["cache_dtype"] == 'a "quoted", value'  # escaped quotes and commas survive


def test_spec_decode_sums_engines():
    one = prom.snapshot(_registry_text(10, 20, 15, [8, 7]))
    two = prom.snapshot(_registry_text(10, 20, 15, [8, 7], engines=("0", "1")))
    assert two["counters"][prom.SPEC_DRAFTS] == 2 * one["counters"][prom.SPEC_DRAFTS]


def test_no_spec_decoding_is_none_not_zero():
    plain = prom.snapshot('vllm:generation_tokens_total{engine="0",model_name="tiny"} 12.0\n')
    assert prom.spec_decode_delta(plain, plain) is None


def test_bad_metrics_text_is_an_error():
    with pytest.raises(ValueError, match="line 2"):
        prom.parse_prometheus("# HELP x\nthis is not a sample line at all {\n")


def test_server_log_capacity_lines():
    # The exact format strings of vllm/v1/core/kv_cache_utils.py (0.19.1)
    log = ("INFO [kv_cache_utils.py:1319] GPU KV cache size: %s tokens\n" % f"{355_104:,}"
           + "INFO [kv_cache_utils.py:1324] Maximum concurrency for %s tokens per request: %.2fx\n"
           % (f"{262_144:,}", 1.35))
    info = prom.parse_server_log(log)
    assert info == {"kv_cache_tokens": 355_104, "max_model_len": 262_144, "max_concurrency_at_max_model_len": 1.35}
    assert prom.parse_server_log("nothing here") == {}


def test_capacity_matches_the_published_table():
    """The public recipe's table: 355K tokens -> 1 user at 256K; 1.4M tokens (TurboQuant) -> 5 users."""
    assert prom.capacity_estimate(355_000, None, None, 262_144)["users"] == 1
    assert prom.capacity_estimate(1_400_000, None, None, 262_144)["users"] == 5
    # blocks x block size when there is no log; whole blocks per request
    est = prom.capacity_estimate(None, 100, 16, 33)
    assert est["kv_cache_tokens"] == 1600 and est["tokens_per_request"] == 48 and est["users"] == 33
    assert prom.capacity_estimate(None, None, None, 1000)["users"] is None
    with pytest.raises(ValueError):
        prom.capacity_estimate(1000, None, None, 0)


# ---------------------------------------------------------------- quality
def _exact_kl(p, q):
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    return float(np.sum(p * np.log(p / q)))


def test_topk_kl_is_exact_with_the_whole_vocabulary():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(7))
    q = rng.dirichlet(np.ones(7))
    a = {f"t{i}": math.log(x) for i, x in enumerate(p)}
    b = {f"t{i}": math.log(x) for i, x in enumerate(q)}
    assert topk_kl(a, b) == pytest.approx(_exact_kl(p, q), rel=1e-9, abs=1e-12)
    assert topk_kl(a, a) == pytest.approx(0.0, abs=1e-12)


def test_topk_kl_with_disjoint_lists_is_positive_and_finite():
    a = {"x": math.log(0.7), "y": math.log(0.2)}
    b = {"z": math.log(0.6), "y": math.log(0.3)}
    kl = topk_kl(a, b)
    assert 0 < kl < 10 and math.isfinite(kl)


def test_compare_sequences():
    lp = {"a": -0.1}
    same = compare_sequences(list("abcd"), [lp] * 4, list("abcd"), [lp] * 4)
    assert same["identical_token_frac"] == 1.0 and same["first_divergence"] is None and same["kl_mean"] == 0.0
    div = compare_sequences(list("abcd"), [lp] * 4, list("abxd"), [lp] * 4)
    assert div["first_divergence"] == 2 and div["identical_token_frac"] == pytest.approx(0.75)
    assert div["kl_positions"] == 3  # positions 0..2 share their context; 3 does not
    short = compare_sequences(list("ab"), [lp] * 2, list("abc"), [lp] * 3)
    assert short["first_divergence"] == 2 and short["identical_token_frac"] == pytest.approx(2 / 3)


def test_parse_logprobs_chat_and_completions():
    chat = {"choices": [{"logprobs": {"content": [
        {"token": "token_id:5", "logprob": -0.1, "top_logprobs": [{"token": "token_id:5", "logprob": -0.1},
                                                                  {"token": "token_id:9", "logprob": -2.5}]}]}}]}
    toks, tops = parse_logprobs(chat)
    assert toks == ["token_id:5"] and tops == [{"token_id:5": -0.1, "token_id:9": -2.5}]
    comp = {"choices": [{"logprobs": {"tokens": ["a", "b"], "top_logprobs": [{"a": -0.2}, {"b": -0.3}]}}]}
    assert parse_logprobs(comp) == (["a", "b"], [{"a": -0.2}, {"b": -0.3}])
    with pytest.raises(ValueError, match="no logprobs"):
        parse_logprobs({"choices": [{"logprobs": None}]})


# ---------------------------------------------------------------- writers and compare
def _summary(mean, std, n):
    return {"n": n, "mean": mean, "median": mean, "std": std, "min": mean, "max": mean, "p50": mean, "p90": mean,
            "p99": mean}


def _result(e2e_mean, e2e_std, n=4, failed=0):
    g = {"group": "Q&A", "max_tokens": 256, "summary": {
        "e2e_tok_s": _summary(e2e_mean, e2e_std, n), "decode_tok_s": _summary(e2e_mean * 1.1, e2e_std, n),
        "ttft_s": _summary(0.1, 0.01, n), "prefill_tok_s": None, "completion_tokens": _summary(256, 0, n),
        "prompt_tokens": _summary(20, 0, n), "tpot_ms": None, "latency_s": None, "chunk_gap_ms": None,
        "requests": n, "failed": 0}}
    return {"kind": "onespark-bench", "schema_version": report.SCHEMA_VERSION, "created_utc": "2026-01-01T00:00:00Z",
            "hardware": "test", "model": "m", "endpoint": "http://x", "command": "onespark bench",
            "failed_requests": failed,
            "suites": {"published": {"groups": [g], "rows": [], "spec_decode": None, "cross_class": {
                "e2e_tok_s": _summary(e2e_mean, 0.0, 1), "decode_tok_s": None, "classes_measured": 1}}}}


def test_compare_finds_deltas_and_noise():
    rows = report.compare(_result(50.0, 1.0), _result(55.0, 1.0))
    e2e = next(r for r in rows if r["group"] == "Q&A" and r["metric"] == "e2e_tok_s")
    assert e2e["delta"] == pytest.approx(5.0) and e2e["significant"] is True
    cross = next(r for r in rows if r["group"] == "cross-class")
    assert cross["significant"] is None  # one value per side: no noise estimate, no verdict
    text = report.compare_table(rows, "a.json", "b.json")
    assert "beyond noise" in text and "n<2" in text
    # a group name with a pipe (a class named by the user) stays in its column of the markdown table
    piped = [dict(r, group="Q|A") for r in rows]
    md = report.compare_table(piped, "a.json", "b.json", md=True).splitlines()
    assert all(ln.replace("\\|", "").count("|") == 10 for ln in md[2:]), md


def test_markdown_and_console_tables():
    r = _result(51.6, 0.4)
    md = report.markdown(r)
    assert "| class | max tok | n | e2e tok/s (published method)" in md
    assert "51.6 ± 0.4" in md and "**test |" in md
    assert "51.6 ± 0.4" in report.console(r)


def test_write_atomic_and_load(tmp_path):
    path = tmp_path / "sub" / "r.json"
    report.write_atomic(path, json.dumps(_result(1.0, 0.1)))
    assert report.load_result(str(path))["model"] == "m"
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temp file left behind
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not JSON"):
        report.load_result(str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(UserError, match="not an `onespark bench` result"):
        report.load_result(str(tmp_path / "other.json"))
    with pytest.raises(UserError, match="cannot read"):
        report.load_result(str(tmp_path / "missing.json"))


def test_cli_compare(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_result(50.0, 1.0)))
    b.write_text(json.dumps(_result(55.0, 1.0)))
    assert main(["bench", "compare", str(a), str(b), "--markdown"]) == 0
    assert "| published | Q&A | e2e_tok_s | 50.000 | 55.000 | 5.000 | 10.0 |" in capsys.readouterr().out
    b.write_text(json.dumps(_result(55.0, 1.0, failed=2)))
    assert main(["bench", "compare", str(a), str(b)]) == 1
    assert "2 failed requests" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "r.png"
    assert report.plot(_result(50.0, 1.0), path)
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 500


def test_a_plot_that_fails_to_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """A full disk mid-savefig: the error goes up (the CLI makes it one line), no temp file is left beside the
    results, and an earlier PNG of that name is kept whole."""
    from matplotlib.figure import Figure

    def half_written(self, fname, **kw):
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    path = tmp_path / "r.png"
    path.write_bytes(b"earlier")
    monkeypatch.setattr(Figure, "savefig", half_written)
    with pytest.raises(OSError):
        report.plot(_result(50.0, 1.0), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.png"] and path.read_bytes() == b"earlier"


# ---------------------------------------------------------------- CLI input errors (no server needed)
# (--runs 0, --top-k 0, --concurrency 0, --capacity-max-tokens 0: the parser's range check, exit 2,
# tests/test_untrusted_input.py's NUMBERS)
@pytest.mark.parametrize("argv,message", [
    (["--suite", "nope"], "unknown suite nope"),
    (["--base-url", "localhost:8000"], "is not an http(s) URL"),
    (["--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9/v1/models"),
    (["--api", "completions", "--no-think"], "--no-think works through the chat template"),
    (["--suite", "capacity", "--server-log", "/nonexistent/server.log"], "cannot read --server-log"),
    (["--suite", "quality", "--classes", "Q&A,Poetry"], "unknown class Poetry"),
], ids=["suite", "url", "unreachable", "no-think", "server-log", "class"])
def test_cli_bad_input(argv, message, tmp_path, capsys):
    assert main(["bench", *argv, "--out", str(tmp_path), "--no-progress"]) == 1
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written for a run that never started


def test_size_lists_accept_k_suffix():
    from onespark.options import sizes

    assert sizes(0)("0, 4k,16K,100") == [0, 4096, 16384, 100]
    for bad in ("4x", "0,nan", "-4k"):
        with pytest.raises(Exception, match="comma-separated whole numbers of at least 0"):
            sizes(0)(bad)
    with pytest.raises(Exception, match="of at least 1"):
        sizes(1)("1,0")


def test_text_chunks_include_reasoning_and_skip_role_and_usage():
    from onespark.bench.client import _chunk_has_text

    assert not _chunk_has_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert _chunk_has_text({"choices": [{"delta": {"reasoning": "Let me think"}}]})  # vLLM 0.19 thinking
    assert _chunk_has_text({"choices": [{"delta": {"reasoning_content": "hm"}}]})  # older vLLM
    assert _chunk_has_text({"choices": [{"delta": {"content": "Hi"}}]})
    assert _chunk_has_text({"choices": [{"text": "Hi", "index": 0}]})  # /v1/completions
    assert not _chunk_has_text({"choices": [], "usage": {"completion_tokens": 3}})


def test_per_chunk_token_counts_give_itl_and_exact_decode():
    """vLLM's per-chunk usage: 7 tokens in 4 chunks (2, 2, 1, 2), as MTP or a busy server sends them."""
    t = RequestTiming(t_start=0.0, t_end=1.7, prompt_tokens=9, completion_tokens=7,
                      chunk_times=[1.0, 1.2, 1.3, 1.6], chunk_tokens=[2, 4, 5, 7])
    m = request_metrics(t)
    assert m["tokens_per_chunk"] == pytest.approx(7 / 4)
    assert m["itl_ms"] == pytest.approx([100.0, 100.0, 100.0, 150.0, 150.0])  # each gap over its chunk's tokens
    assert m["decode_tok_s"] == pytest.approx((7 - 2) / 0.6)  # the first chunk's 2 tokens are not decode time
    assert m["tpot_ms"] == pytest.approx(1000 * (1.7 - 1.0) / 6)  # vLLM serve.py's definition, unchanged
    # Without per-chunk counts: one token assumed in the first chunk, no per-token latency claimed.
    m2 = request_metrics(RequestTiming(0.0, 1.7, 9, 7, chunk_times=[1.0, 1.2, 1.3, 1.6]))
    assert m2["decode_tok_s"] == pytest.approx(6 / 0.6) and m2["itl_ms"] == [] and m2["tokens_per_chunk"] is None


def test_compare_records_checks_settings_and_prompts():
    from onespark.bench.quality import compare_records

    lp = [{"token_id:1": -0.1}]
    a = {"top_k": 5, "max_tokens": 8, "rows": [{"group": "Q&A", "prompt": "p", "tokens": ["token_id:1"],
                                                 "top_logprobs": lp}]}
    same = compare_records(a, a)
    assert same["all_identical"] and same["rows"][0]["kl_mean"] == 0.0
    with pytest.raises(ValueError, match="different settings"):
        compare_records(a, {**a, "top_k": 10})
    with pytest.raises(ValueError, match="share no prompt"):
        compare_records(a, {**a, "rows": [{**a["rows"][0], "prompt": "other"}]})


def test_topk_kl_does_not_inflate_a_flat_tail():
    """700 tokens, one peak, a flat tail, two nearly equal distributions (like BF16 vs INT8 heads): the top-20
    sets differ in the tail. Tokens missing from one side's top-k must not get more than its k-th probability."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 0.3, 700)
    logits[5] += 5
    p = np.exp(logits) / np.exp(logits).sum()
    q2 = np.exp(logits + rng.normal(0, 0.01, 700))
    q = q2 / q2.sum()

    def top(x, k=20):
        return {f"t{i}": math.log(x[i]) for i in np.argsort(-x)[:k]}

    exact = _exact_kl(p, q)
    assert set(top(p)) != set(top(q))  # the case that matters
    assert topk_kl(top(p), top(q)) < 2 * exact  # was ~1e3 x exact with an uncapped share of the rest


def test_topk_kl_estimate_on_recorded_server_distributions():
    """Real next-token distributions recorded from the vLLM CPU server (tiny model, whole 677-token vocabulary,
    BF16 vs INT8 LM head: lab/results/cpu-tiny-*-head-greedy.json): the top-20 estimate against exact KL."""
    from pathlib import Path

    results = Path(__file__).resolve().parent.parent / "lab" / "results"
    a = report.load_result(str(results / "cpu-tiny-bf16-head-greedy.json"))["quality"]["record"]["rows"]
    b = report.load_result(str(results / "cpu-tiny-int8-head-greedy.json"))["quality"]["record"]["rows"]
    exact, est = [], []
    for ra, rb in zip(a, b):
        assert ra["tokens"] == rb["tokens"]  # greedy output unchanged by the INT8 head
        for pa, pb in zip(ra["top_logprobs"], rb["top_logprobs"]):
            assert math.fsum(math.exp(v) for v in pa.values()) == pytest.approx(1.0, abs=1e-5)  # whole vocabulary
            exact.append(topk_kl(pa, pb))

            def top20(d):
                return dict(sorted(d.items(), key=lambda kv: -kv[1])[:20])

            est.append(topk_kl(top20(pa), top20(pb)))
    ratio = math.fsum(est) / math.fsum(exact)
    assert 0 < math.fsum(exact) / len(exact) < 1e-3  # an INT8 head is a small change
    assert 0.3 < ratio < 1.5, ratio  # measured 0.62: the tail the top-20 cannot see


def test_compare_capacity_counts():
    def cap(tokens):
        est = [{"context": 262144, **metrics_estimate(tokens)}]
        return {**_result(50.0, 1.0), "suites": {"capacity": {"estimates": est, "rows": [], "groups": []}}}

    def metrics_estimate(tokens):
        return prom.capacity_estimate(tokens, None, None, 262144)

    rows = report.compare(cap(355_000), cap(1_400_000))  # the recipe's v2 vs v2-tq
    users = next(r for r in rows if r["metric"] == "users")
    assert (users["a"], users["b"], users["delta"]) == (1, 5, 4)
    assert "a count: no noise" in report.compare_table(rows, "v2.json", "v2-tq.json")


# ---------------------------------------------------------------- capacity load: sampling under a slow /metrics
@pytest.mark.parametrize("late_runs", [1, 3])
def test_capacity_load_sees_the_load_when_metrics_is_slower_than_the_run(late_runs):
    """A scripted server whose /metrics answers after every stream has finished, for the first `late_runs` loads
    (CI saw this on a busy 2-core machine). Polling alone then records only the idle state; the sample taken once all
    streams have their first token still sees all of them running, but only an answer before the first stream ends
    proves it, so the load runs again, at most three times, and says so when no run proved it."""
    import asyncio

    import httpx

    from onespark.bench.client import Endpoint, make_client
    from onespark.bench.suites import Progress, Runner, Settings

    streams, running, started = 4, 0, 0

    async def completion():
        nonlocal running, started
        running += 1
        started += 1
        for i in range(1, 6):
            await asyncio.sleep(0.05)
            chunk = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 300, "completion_tokens": i}}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        running -= 1  # here, not in a finally: the transport closes a finished stream's generator late
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": len(json.loads(request.content)["prompt"].split())})
        if request.url.path == "/metrics":
            now = running  # the state when the request arrives, delivered after the run is over while loads are late
            await asyncio.sleep(0.6 if started <= late_runs * streams else 0)
            return httpx.Response(200, text=f"{prom.RUNNING}{{engine=\"0\"}} {now}\n"
                                            f"{prom.KV_USAGE}{{engine=\"0\"}} {0.01 * now}\n"
                                            f"{prom.WAITING}{{engine=\"0\"}} 0\n")
        assert request.url.path == "/v1/completions"
        return httpx.Response(200, content=completion())

    async def go():
        ep = Endpoint("http://scripted", model="m", api="completions")
        async with make_client(ep, concurrency=streams, transport=httpx.MockTransport(handler)) as client:
            runner = Runner(client, ep, Settings(capacity_max_tokens=5), None, Progress(False))
            return await runner._load(streams, 40)

    rows, load = asyncio.run(go())
    attempts = min(late_runs + 1, Runner.LOAD_ATTEMPTS)
    assert load["attempts"] == attempts and len(rows) == attempts * streams
    assert sorted({r["run"] for r in rows}) == list(range(attempts))
    assert all(r["ok"] and r["completion_tokens"] == 5 for r in rows)
    assert load["samples_after_all_started"] >= 1
    assert load["peak_running"] == streams and load["peak_kv_usage"] == pytest.approx(0.04)
    if late_runs < Runner.LOAD_ATTEMPTS:  # the second run's answers came in time
        assert load["samples_under_load"] >= 1 and load["note"] is None
    else:  # every answer came after the first stream ended: nothing proves it was read under load, and it says so
        assert load["samples_under_load"] == 0 and "--capacity-max-tokens" in load["note"]


def test_capacity_load_counts_only_answers_that_came_while_every_stream_ran():
    from onespark.bench.suites import _load_summary

    def sample(t, running, after):
        return {"t": t, "kv_usage": 0.01 * running, "running": running, "waiting": 0, "after_all_started": after}

    samples = [sample(1.0, 0, False), sample(2.0, 4, True), sample(3.5, 0, False)]
    load = _load_summary(4, 300, samples, first_end=3.0)
    assert (load["samples_under_load"], load["peak_running"], load["note"]) == (1, 4, None)
    assert load["users_at_context_measured"] == 100  # 4 running at 4% of the cache
    late = _load_summary(4, 300, samples, first_end=1.5)
    assert late["samples_under_load"] == 0 and late["note"]


def test_error_cause_names_the_first_exception_not_the_engines_closing_line():
    from onespark.bench.metrics import error_cause

    log = ("(EngineCore pid=1) ERROR 12-03 18:53:49 [core.py:1330] ValueError: Unknown TurboQuant cache dtype: 'auto'\n"
           "    raise RuntimeError(\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert error_cause(log) == "ValueError: Unknown TurboQuant cache dtype: 'auto'"
    assert error_cause("RuntimeError: Engine core initialization failed.\n") is None
    assert error_cause("INFO all fine\n") is None


def test_capacity_table_says_when_the_load_ran_again():
    load = {"streams": 4, "context": 300, "peak_kv_usage": 0.04, "peak_running": 4, "users_at_context_measured": 100,
            "attempts": 2, "note": None}
    suite = {"estimates": [], "server_log": {}, "load": load}
    _, _, rows = report._capacity_table(suite, {})
    assert rows[-1][-1] == "measured: 4 streams, peak 4 running, run 2 times"
    _, _, rows = report._capacity_table({**suite, "load": {**load, "attempts": 1}}, {})
    assert rows[-1][-1] == "measured: 4 streams, peak 4 running"


# ---------------------------------------------------------------- hostile answers: numbers past what was measured
def _scripted(handler):
    """An Endpoint and a client on an httpx.MockTransport(handler), for one async test body."""
    import httpx

    from onespark.bench.client import Endpoint, make_client

    ep = Endpoint("http://scripted", model="m")
    return ep, make_client(ep, transport=httpx.MockTransport(handler))


def _sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("completion,why", [
    (10**400, "not a token count"),  # valid JSON; n / wall would raise OverflowError in request_metrics
    (2_000_000_000, "more than the max_tokens 8 the request asked for"),  # 2e9 per-token latencies: a memory bomb
], ids=["past-float", "past-max-tokens"])
def test_usage_counts_no_server_can_mean_fail_the_request_alone(completion, why):
    import asyncio

    import httpx

    from onespark.bench.client import plain_request, stream_request

    text = {"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion}}
    answer = {"choices": [{"index": 0, "message": {"content": "hi"}}], "usage": usage["usage"]}

    def handler(request):
        streamed = json.loads(request.content).get("stream")
        return httpx.Response(200, content=_sse(text, usage) if streamed else json.dumps(answer).encode())

    async def go():
        ep, client = _scripted(handler)
        async with client:
            return [await stream_request(client, ep, "hi", 8), await plain_request(client, ep, "hi", 8)]

    for timing in asyncio.run(go()):
        m = request_metrics(timing)  # must not raise
        assert not m["ok"] and why in m["error"], m["error"]


def test_per_chunk_counts_that_are_not_cumulative_give_no_itl():
    """A chunk count that falls back and jumps again would expand each jump into that many latencies."""
    t = RequestTiming(0.0, 1.0, prompt_tokens=5, completion_tokens=4, chunk_times=[0.1, 0.2, 0.3, 0.4],
                      chunk_tokens=[1, 10**6, 1, 4])
    m = request_metrics(t)
    assert m["ok"] and m["itl_ms"] == [] and m["tokens_per_chunk"] is None
    assert m["decode_tok_s"] == pytest.approx(3 / 0.3)  # the fallback: one token with the first chunk


@pytest.mark.parametrize("count", [-10**9, 10**400, 2.5, True], ids=["negative", "past-float", "float", "bool"])
def test_tokenize_count_that_is_no_count_is_as_if_absent(count):
    """A negative count sized the depth filler at billions of words (MemoryError after a minute, seen)."""
    import asyncio

    import httpx

    from onespark.bench.client import count_prompt_tokens

    async def go():
        ep, client = _scripted(lambda request: httpx.Response(200, content=b'{"count": %s}' % json.dumps(count).encode()))
        async with client:
            return await count_prompt_tokens(client, ep, "hi")

    assert asyncio.run(go()) is None


def test_metrics_nan_and_inf_are_left_out_not_reported():
    zero = prom.snapshot(_registry_text(0, 0, 0, [0, 0]))
    nan = prom.snapshot(f"{prom.SPEC_DRAFTS} 10\n{prom.SPEC_DRAFT_TOKENS} 20\n{prom.SPEC_ACCEPTED} NaN\n")
    assert prom.SPEC_ACCEPTED not in nan["counters"]
    assert prom.spec_decode_delta(zero, nan) is None  # not an acceptance of 0 or NaN
    from onespark.bench.suites import _load_summary

    def sample(usage, running):
        return {"t": 1.0, "kv_usage": usage, "running": running, "waiting": 0, "after_all_started": True}

    for usage, running in ((float("nan"), 3.0), (0.5, float("inf")), (1e-320, 3.0), (-0.5, 3.0)):
        load = _load_summary(3, 300, [sample(usage, running)], first_end=2.0)  # int(nan) raised ValueError
        assert load["users_at_context_measured"] is None, (usage, running)


def test_acceptance_without_draft_tokens_prints_a_dash():
    """drafts counted but no draft tokens (a server's counters out of step): the rate is None, not a TypeError."""
    before = prom.snapshot(_registry_text(0, 0, 0, [0]))
    after = prom.snapshot(_registry_text(10, 0, 5, [5]))
    d = prom.spec_decode_delta(before, after)
    assert d["acceptance_rate"] is None and d["mean_acceptance_length"] == 1.5
    assert report._accept(d) == "1.50 (-)"


@pytest.mark.parametrize("log", [
    "GPU KV cache size: ,,, tokens\n",
    "GPU KV cache size: " + "1" * 5000 + " tokens\n",  # past int()'s digit limit
    "Maximum concurrency for 1,000 tokens per request: ...x\n",
    "Maximum concurrency for 1,000 tokens per request: " + "9" * 400 + "x\n",  # float inf
], ids=["commas", "5000-digits", "dots", "float-inf"])
def test_server_log_numbers_that_are_not_numbers_are_not_read(log):
    assert prom.parse_server_log(log) == {}


def test_capacity_with_cache_info_labels_that_are_no_count():
    import asyncio

    import httpx

    from onespark.bench.suites import Progress, Runner, Settings

    text = (f'{prom.CACHE_INFO}{{block_size="inf",num_gpu_blocks="-5"}} 1.0\n'
            f'{prom.KV_USAGE}{{engine="0"}} NaN\n')

    async def go():
        ep, client = _scripted(lambda request: httpx.Response(200, text=text))
        async with client:
            return await Runner(client, ep, Settings(capacity_contexts=[4096]), None, Progress(False)).capacity()

    cap = asyncio.run(go())  # int(float("inf")) raised OverflowError
    assert cap["num_gpu_blocks"] is None and cap["block_size"] is None
    assert cap["estimates"] == [{"context": 4096, "kv_cache_tokens": None, "users": None, "source": None}]


@pytest.mark.parametrize("mean,std", [(50.0, 1e200), (1e308, 1.0), (-5.0, 1.0), (float("nan"), 1.0)])
def test_compare_refuses_statistics_no_run_measures(tmp_path, mean, std):
    """std 1e200 overflowed Welch's std**2 (a traceback); means of +-1e308 printed a delta of inf."""
    from onespark.bench.cli import _compare

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_result(50.0, 1.0)))
    b.write_text(json.dumps(_result(mean, std)))
    with pytest.raises(UserError, match=r"b\.json: suites\.published\.groups\[0\]\.summary\.e2e_tok_s\.(mean|std)"):
        _compare(type("Args", (), {"a": str(a), "b": str(b), "markdown": False})())


def test_welch_percentage_of_a_denormal_mean_is_none_not_inf():
    assert welch(5e-324, 0.0, 2, 1.0, 0.0, 2)["delta_pct"] is None


@pytest.mark.parametrize("headers,why", [
    ({"x-onespark-compressor-ms": "nan"}, "x-onespark-compressor-ms: 'nan'"),
    ({"x-onespark-compressor-ms": "inf"}, "x-onespark-compressor-ms: 'inf'"),
    ({"x-onespark-tokens-removed": "-7"}, "x-onespark-tokens-removed: '-7'"),
    ({"x-onespark-tokens-removed": "9" * 400}, "x-onespark-tokens-removed"),
    ({}, "usage is"),  # with the usage below: 10**400 prompt tokens
], ids=["nan", "inf", "negative", "past-float", "huge-usage"])
def test_compression_headers_and_usage_that_are_no_measurement(headers, why):
    import asyncio

    import httpx

    from onespark.bench import compression

    usage = {"prompt_tokens": 10**400 if not headers else 5, "completion_tokens": 1}
    sse = _sse({"choices": [{"delta": {"content": "80412"}}]}, {"choices": [], "usage": usage})

    async def go():
        ep, client = _scripted(lambda request: httpx.Response(200, headers=headers, content=sse))
        async with client:
            return await compression._request(client, ep, "p", 3, {"rate": 0.5})

    row = asyncio.run(go())
    assert not row["ok"] and why in row["error"], row["error"]
    g = compression._group("needle", 8, [dict(row, arm=arm, correct=None) for arm in ("off", "on")])
    json.dumps(g, allow_nan=False)  # no NaN or Infinity into the result file


@pytest.mark.parametrize("url,why", [("http://[::1", "is not a valid URL"), ("http://h:port", "is not a valid URL"),
                                     ("http://:80", "names no host")])
def test_endpoint_url_httpx_cannot_use_is_one_error(url, why):
    from onespark.bench.client import Endpoint

    with pytest.raises(UserError, match=f"--b-base-url '.*' {why}"):
        Endpoint(url, flag="--b-base-url")


def test_an_error_answer_is_read_no_further_than_its_message():
    """A 500 whose body never ends (a hostile or broken server) was read whole into memory to show 300
    characters of it; now the read stops there."""
    import asyncio

    import httpx

    from onespark.bench.client import Endpoint, stream_request

    sent = []

    async def body():
        for _ in range(10_000):  # 640 MiB, were it read whole
            sent.append(1)
            yield b"x" * 65536

    transport = httpx.MockTransport(lambda request: httpx.Response(500, content=body()))

    async def one():
        async with httpx.AsyncClient(transport=transport, base_url="http://standin") as c:
            return await stream_request(c, Endpoint("http://standin", model="m"), "hi", 4)

    t = asyncio.run(one())
    assert t.error == "HTTP 500: " + "x" * 300
    assert len(sent) < 4, len(sent)
