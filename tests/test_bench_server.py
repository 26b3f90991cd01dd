"""`onespark bench` against a real vLLM 0.19.1 OpenAI server on CPU serving the tiny model (one shared
session server, see tests/conftest.py). Small sizes: a few tokens per request, depths of a few hundred.

Independent references: the server's own /metrics counters (generated tokens, request latency, prefix-cache
hits, KV cache blocks), its start-up log, and plain non-streamed requests timed here with urllib."""

from __future__ import annotations

import asyncio
import json
import math
import re
import statistics
import time
import urllib.request

import httpx
import pytest

from onespark.bench.client import Endpoint, make_client
from onespark.bench.quality import run_ab
from onespark.cli import main

pytestmark = pytest.mark.vllm


def _bench(srv, tmp_path, *argv, name="r", progress=False) -> tuple[int, dict]:
    rc = main(["bench", "--base-url", srv.base_url, "--out", str(tmp_path), "--name", name,
               "--hardware", "CPU test, tiny model", *([] if progress else ["--no-progress"]), *argv])
    path = tmp_path / f"{name}.json"
    return rc, json.loads(path.read_text()) if path.exists() else {}


def _timed_plain_request(srv, prompt: str, max_tokens: int) -> tuple[int, float]:
    """The published method, done independently: one non-streamed request, completion tokens / wall time."""
    body = json.dumps({"model": srv.model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(srv.base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        resp = json.loads(r.read())
    return resp["usage"]["completion_tokens"], time.perf_counter() - t0


def test_published_suite(vllm_server, tmp_path):
    srv = vllm_server
    rc, res = _bench(srv, tmp_path, "--suite", "published", "--runs", "2", "--warmup", "1", "--max-tokens", "32")
    assert rc == 0
    assert res["schema_version"] == 1 and res["model"] == srv.model and res["server_version"] == "0.19.1"
    assert res["failed_requests"] == 0 and res["hardware"] == "CPU test, tiny model"
    pub = res["suites"]["published"]
    rows = pub["rows"]
    assert len(rows) == 3 * 5 and sum(r["warmup"] for r in rows) == 5
    for r in rows:
        assert r["ok"] and 1 <= r["completion_tokens"] <= 32
        assert r["e2e_tok_s"] == pytest.approx(r["completion_tokens"] / r["latency_s"])
        # The server's per-chunk counts add up to its final usage (chunks may carry several tokens even
        # without speculative decoding when the API server falls behind: never count chunks).
        assert r["tokens_per_chunk"] * r["chunks"] == pytest.approx(r["completion_tokens"])
        assert len(r["itl_ms"]) < r["completion_tokens"]  # one latency per token after the first chunk
    for g in pub["groups"]:
        assert g["summary"]["e2e_tok_s"]["n"] == 2  # warm-up excluded
    # The server counted the same tokens and requests, and never saw more time than the client did.
    assert pub["tokens_check"]["server_generation_tokens"] == pub["tokens_check"]["client_usage_completion_tokens"]
    assert pub["server"]["requests"] == 15
    assert 0 < pub["server"]["e2e_latency_sum_s"] <= sum(r["latency_s"] for r in rows)
    assert pub["spec_decode"] is None  # the tiny server runs no speculative decoding: reported as off, not 0
    # The same prompts sent plainly (non-streamed, as the published script does) give the same token counts.
    from onespark.bench.suites import published_classes

    for c in published_classes()["classes"]:
        n, _ = _timed_plain_request(srv, c["prompt"], 32)
        measured = [r for r in rows if r["group"] == c["name"] and not r["warmup"]]
        assert {r["completion_tokens"] for r in measured} == {n}  # greedy: same tokens, counted the same
    assert pub["cross_class"]["e2e_tok_s"]["mean"] == pytest.approx(
        sum(g["summary"]["e2e_tok_s"]["mean"] for g in pub["groups"]) / 5)
    md = (tmp_path / "r.md").read_text()
    assert "CPU test, tiny model" in md and "| cross-class |" in md
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "r.png").shape[1] > 500


def test_depth_suite(vllm_server, tmp_path):
    rc, res = _bench(vllm_server, tmp_path, "--suite", "depth", "--depths", "0,128,384,2000",
                     "--depth-max-tokens", "4", "--runs", "2", "--warmup", "1")
    assert rc == 0
    d = res["suites"]["depth"]
    assert [g["group"] for g in d["groups"]] == [0, 128, 384]
    assert d["skipped"] and d["skipped"][0]["depth"] == 2000 and "max_model_len 1024" in d["skipped"][0]["reason"]
    for g in d["groups"][1:]:
        assert abs(g["summary"]["prompt_tokens"]["mean"] - g["group"]) <= 16  # sized with the server's /tokenize
    assert all(r["completion_tokens"] == 4 for r in d["rows"])  # ignore_eos: equal decode lengths
    # Each request starts with its own nonce: the prefix cache finds nothing to reuse.
    assert d["server"]["prefix_cache_queries"] > 700 and d["server"]["prefix_cache_hits"] == 0
    assert d["tokens_check"]["server_generation_tokens"] == d["tokens_check"]["client_usage_completion_tokens"]


def test_concurrency_suite(vllm_server, tmp_path):
    rc, res = _bench(vllm_server, tmp_path, "--suite", "concurrency", "--concurrency", "1,2",
                     "--concurrency-max-tokens", "8", "--runs", "2", "--warmup", "1")
    assert rc == 0
    c = res["suites"]["concurrency"]
    assert len(c["rows"]) == 1 + 2 * 1 + 2 * 2
    assert all(r["completion_tokens"] == 8 for r in c["rows"])
    two = next(g for g in c["groups"] if g["group"] == 2)
    assert two["aggregate_tok_s"]["n"] == 2 and two["summary"]["decode_tok_s"]["n"] == 4
    rounds = []
    for run in (0, 1):  # aggregate, recomputed from the rows: all streams' tokens over the round's wall time
        rr = [r for r in c["rows"] if r["group"] == 2 and r["run"] == run and not r["warmup"]]
        rounds.append(sum(r["completion_tokens"] for r in rr)
                      / (max(r["t_end"] for r in rr) - min(r["t_start"] for r in rr)))
    assert two["aggregate_tok_s"]["mean"] == pytest.approx(sum(rounds) / 2)
    assert c["server"]["requests"] == len(c["rows"])


def test_capacity_suite(vllm_server, tmp_path):
    srv = vllm_server
    rc, res = _bench(srv, tmp_path, "--suite", "capacity", "--server-log", str(srv.log_path),
                     "--capacity-streams", "4", "--capacity-context", "300", "--capacity-max-tokens", "640")
    assert rc == 0
    cap = res["suites"]["capacity"]
    log = cap["server_log"]
    # Two sources must agree for a model with one KV-cache group: the log's tokens and blocks x block size.
    assert log["kv_cache_tokens"] == cap["num_gpu_blocks"] * cap["block_size"]
    at_max = next(e for e in cap["estimates"] if e["context"] == res["max_model_len"])
    assert at_max["users"] == math.floor(log["max_concurrency_at_max_model_len"])
    load = cap["load"]
    # One sample is taken once every stream has its first token; 640 new tokens keep all four running long enough
    # for its answer to come back before the first one ends (CI, 2 busy cores: 128 were over first), which the
    # result proves with samples_under_load, so the peak saw the load. When a run's answers all came late anyway
    # (CI once: vLLM's API server answered /metrics only after the engine's queued outputs), the load ran again.
    assert load["samples_after_all_started"] >= 1 and load["samples_under_load"] >= 1 and load["note"] is None
    assert load["peak_running"] >= 1 and 0 < load["peak_kv_usage"] < 1
    assert len(cap["rows"]) == 4 * load["attempts"]
    assert all(r["ok"] and r["completion_tokens"] == 640 for r in cap["rows"])


def test_quality_ab(vllm_server):
    srv = vllm_server
    prompts = [("Q&A", "What are the main differences between TCP and UDP? Be concise."), ("Math", "7823 * 4519?")]

    async def go(extra_b: dict | None):
        ep_a = Endpoint(srv.base_url, model=srv.model)
        ep_b = Endpoint(srv.base_url, model=srv.model, extra_body=extra_b or {})
        async with make_client(ep_a) as ca, make_client(ep_b) as cb:
            return await run_ab(ep_a, ep_b, ca, cb, prompts, 12, 5)

    same = asyncio.run(go(None))
    assert same["all_identical"] and same["identical_token_frac"]["min"] == 1.0
    assert same["kl_mean"]["max"] < 1e-3  # same server, same weights: only batch-order rounding
    # B forced onto another first token: the comparison must see the divergence at position 0.
    first = same["rows"][0]
    plain = srv.post_json("/v1/chat/completions", {
        "model": srv.model, "messages": [{"role": "user", "content": prompts[0][1]}], "max_tokens": 1,
        "temperature": 0, "logprobs": True, "return_tokens_as_token_ids": True})
    tok = int(plain["choices"][0]["logprobs"]["content"][0]["token"].split(":")[1])
    forced = asyncio.run(go({"logit_bias": {str(tok + 1): 100}}))
    assert forced["rows"][0]["first_divergence"] == 0 and forced["rows"][0]["identical_token_frac"] < 1
    assert first["tokens_a"] == 12


def test_quality_cli(vllm_server, tmp_path):
    rc, res = _bench(vllm_server, tmp_path, "--suite", "quality", "--b-base-url", vllm_server.base_url,
                     "--classes", "Math", "--max-tokens", "6")
    assert rc == 0 and res["quality"]["all_identical"] and len(res["quality"]["rows"]) == 1
    assert "quality A/B" in (tmp_path / "r.md").read_text()


def test_failed_requests_exit_nonzero(vllm_server, tmp_path, capsys):
    # 5000 new tokens cannot fit the server's max_model_len 1024: vLLM answers 400 for every request.
    rc, res = _bench(vllm_server, tmp_path, "--suite", "concurrency", "--concurrency", "1",
                     "--concurrency-max-tokens", "5000", "--runs", "1", "--warmup", "0")
    assert rc == 1
    assert "1 of 1 requests failed" in capsys.readouterr().err
    assert res["failed_requests"] == 1
    g = res["suites"]["concurrency"]["groups"][0]
    assert g["summary"]["e2e_tok_s"] is None and g["aggregate_tok_s"] is None  # no zeros posing as results


def test_wrong_model_name(vllm_server, tmp_path, capsys):
    rc, _ = _bench(vllm_server, tmp_path, "--model", "nope")
    assert rc == 1 and "model 'nope' is not served" in capsys.readouterr().err


def test_completions_api(vllm_server, tmp_path):
    """--api completions: the same suites over /v1/completions (prompt text, logprobs as a count)."""
    rc, res = _bench(vllm_server, tmp_path, "--api", "completions", "--suite", "published,quality",
                     "--b-base-url", vllm_server.base_url, "--classes", "Q&A,Math", "--runs", "1", "--max-tokens", "6")
    assert rc == 0
    pub = res["suites"]["published"]
    assert len(pub["rows"]) == 2 * 2 and all(r["ok"] for r in pub["rows"])
    assert pub["tokens_check"]["server_generation_tokens"] == pub["tokens_check"]["client_usage_completion_tokens"]
    assert res["quality"]["all_identical"] and res["quality"]["rows"][0]["kl_positions"] >= 1


def test_nothing_measured_is_an_error(vllm_server, tmp_path, capsys):
    rc, res = _bench(vllm_server, tmp_path, "--suite", "depth", "--depths", "5000", "--runs", "1")
    assert rc == 1 and "nothing measured in depth" in capsys.readouterr().err
    assert res["suites"]["depth"]["skipped"][0]["depth"] == 5000


def test_compare_two_real_results_and_progress(vllm_server, tmp_path, capsys):
    for name in ("a", "b"):
        rc, _ = _bench(vllm_server, tmp_path, "--suite", "published", "--classes", "Math", "--runs", "2",
                       "--max-tokens", "4", name=name, progress=True)
        assert rc == 0
    err = capsys.readouterr().err
    assert "published: 100%" in err and "3/3" in err  # tqdm: 1 warm-up + 2 runs, on stderr
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"published\s+Math\s+e2e_tok_s", out) and "cross-class" in out


def test_published_no_stream_is_the_scripts_method(vllm_server, tmp_path):
    rc, res = _bench(vllm_server, tmp_path, "--suite", "published", "--no-stream", "--classes", "Code",
                     "--runs", "2", "--max-tokens", "32")
    assert rc == 0 and res["settings"]["stream"] is False
    rows = [r for r in res["suites"]["published"]["rows"] if not r["warmup"]]
    assert all(r["ttft_s"] is None and r["decode_tok_s"] is None for r in rows)  # not measurable: not faked
    from onespark.bench.suites import published_classes

    n, _ = _timed_plain_request(vllm_server, published_classes()["classes"][1]["prompt"], 32)
    assert {r["completion_tokens"] for r in rows} == {n}
    assert all(r["e2e_tok_s"] == pytest.approx(r["completion_tokens"] / r["latency_s"]) for r in rows)
    server = res["suites"]["published"]["server"]
    assert server["requests"] == 3 and 0 < server["e2e_latency_sum_s"] <= sum(r["latency_s"] for r in res["suites"]["published"]["rows"])
    assert "non-streamed" in (tmp_path / "r.md").read_text()


class TimingTransport(httpx.AsyncBaseTransport):
    """Times every HTTP exchange at the transport: request handed to the socket layer -> body fully read.
    Independent of the bench's own clock readings, and of how it parses the stream."""

    def __init__(self):
        self.inner = httpx.AsyncHTTPTransport()
        self.records: list[dict] = []

    async def handle_async_request(self, request):
        rec = {"path": request.url.path, "body": json.loads(request.content) if request.content else None,
               "t_send": time.perf_counter(), "t_done": None}
        self.records.append(rec)
        resp = await self.inner.handle_async_request(request)
        inner = resp.stream

        class Stream(httpx.AsyncByteStream):
            async def __aiter__(self):
                async for part in inner:
                    yield part
                rec["t_done"] = time.perf_counter()

            async def aclose(self):
                if rec["t_done"] is None:
                    rec["t_done"] = time.perf_counter()
                await inner.aclose()

        return httpx.Response(resp.status_code, headers=resp.headers, stream=Stream(), extensions=resp.extensions,
                              request=request)

    async def aclose(self):
        await self.inner.aclose()


def test_published_figure_matches_transport_timing(vllm_server):
    """The published-method figure, recomputed from an independent timing of the very same requests."""
    from onespark.bench.suites import Progress, Runner, Settings, published_classes

    srv = vllm_server
    ep = Endpoint(srv.base_url, model=srv.model)
    transport = TimingTransport()

    async def go():
        async with make_client(ep, transport=transport) as client:
            runner = Runner(client, ep, Settings(runs=2, warmup=1, max_tokens_cap=16), 1024, Progress(False))
            return await runner.published()

    pub = asyncio.run(go())
    prompts = {c["name"]: c["prompt"] for c in published_classes()["classes"]}
    chats = [r for r in transport.records if r["path"] == "/v1/chat/completions"]
    assert len(chats) == len(pub["rows"]) == 15
    by_class: dict[str, list[tuple[float, float]]] = {}  # tok/s of each timed run: (transport, bench)
    walls, gaps = [], []
    for row, rec in zip(pub["rows"], chats):  # one stream, in order
        assert rec["body"]["messages"][0]["content"] == prompts[row["group"]]  # the same request
        assert rec["body"]["max_tokens"] == row["max_tokens"]
        wall = rec["t_done"] - rec["t_send"]
        # the bench's window (one perf_counter, this process) encloses the transport's and no other exchange: a
        # bench that timed its /tokenize calls, a /v1/models probe or another request fails here, however fast
        assert row["t_start"] <= rec["t_send"] < rec["t_done"] <= row["t_end"]
        assert row["latency_s"] == pytest.approx(row["t_end"] - row["t_start"])
        inside = [r["path"] for r in transport.records
                  if r is not rec and r["t_send"] < row["t_end"] and (r["t_done"] or math.inf) > row["t_start"]]
        assert not inside, f"{row['group']}: the bench timed {inside} with its request"
        walls.append(wall)
        gaps.append(row["latency_s"] - wall)
        if not row["warmup"]:
            by_class.setdefault(row["group"], []).append((row["completion_tokens"] / wall,
                                                          row["completion_tokens"] / row["latency_s"]))
    # ... and only by the time it takes to enter and leave it; the median leaves out the odd scheduling hiccup of a
    # busy 2-core CI machine (one row 150 ms late on 2026-12-05, the others not)
    assert statistics.median(gaps) < 0.05 + 0.05 * statistics.median(walls), gaps

    def figure(i):  # the published method: per class the mean over timed runs, then the mean over classes
        return statistics.mean(statistics.mean(r[i] for r in runs) for runs in by_class.values())

    mean = pub["cross_class"]["e2e_tok_s"]["mean"]
    assert mean == pytest.approx(figure(1), rel=1e-9)  # from the bench's own latencies, exactly
    assert mean == pytest.approx(figure(0), rel=0.1)  # from the transport's: one hiccup in 10 timed rows moves it ~4%


def test_quality_recorded_then_compared(vllm_server, tmp_path, capsys):
    """One Spark cannot hold two 122B servers: record A, then B, and compare the two results later."""
    for name in ("qa", "qb"):
        rc, res = _bench(vllm_server, tmp_path, "--suite", "quality", "--classes", "Q&A,Math", "--max-tokens", "6",
                         name=name)
        assert rc == 0 and [len(r["tokens"]) for r in res["quality"]["record"]["rows"]] == [6, 6]
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "qa.json"), str(tmp_path / "qb.json")]) == 0
    out = capsys.readouterr().out
    assert "quality A/B" in out and re.search(r"Q&A\s+6/6\s+100.0%\s+none", out)


def test_no_think_and_depth_with_template_kwargs(vllm_server, tmp_path):
    """--no-think goes to the server as chat_template_kwargs (requests and /tokenize sizing alike)."""
    rc, res = _bench(vllm_server, tmp_path, "--no-think", "--suite", "published,depth", "--classes", "Math",
                     "--depths", "200", "--depth-max-tokens", "4", "--runs", "1", "--max-tokens", "4")
    assert rc == 0 and res["settings"]["no_think"] is True
    assert abs(res["suites"]["depth"]["groups"][0]["summary"]["prompt_tokens"]["mean"] - 200) <= 16
