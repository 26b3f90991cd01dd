"""The benchmark suites: published, depth, concurrency, capacity. Each returns a plain dict (JSON-ready).

Rows: one per request, with the metrics of `stats.request_metrics` plus suite, group, run and `warmup`.
Warm-up requests are kept in the result, flagged, and left out of every summary.
Speculative-decoding acceptance comes from /metrics counter deltas around the measured requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources

import httpx

from onespark.bench import metrics as prom
from onespark.bench.client import Endpoint, count_prompt_tokens, get_text, plain_request, stream_request
from onespark.bench.stats import request_metrics, summarize, summarize_rows
from onespark.errors import UserError

SUITES = ("published", "depth", "concurrency", "capacity", "compression")

DEPTH_TASK = "\n\nThe text above is filler. Ignore it and write a long story about a lighthouse keeper."


@dataclass
class Settings:
    runs: int = 3
    warmup: int = 1
    max_tokens_cap: int | None = None  # caps every class's max_tokens (small runs, tests)
    classes: list[str] | None = None  # published classes to run; None = all five
    depths: list[int] = field(default_factory=lambda: [0, 4096, 16384, 65536, 131072, 262144])
    depth_max_tokens: int = 128
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    concurrency_max_tokens: int = 256
    capacity_contexts: list[int] = field(default_factory=lambda: [32768, 131072, 262144])
    capacity_streams: int = 0  # > 0: also load the server with this many streams and watch /metrics
    capacity_context: int = 4096  # context of each of those streams
    capacity_max_tokens: int = 64
    server_log: str | None = None  # a file with the server's start-up log (e.g. `docker logs NAME > f`)
    # compression (onespark.bench.compression): prompt lengths, the rate asked of the proxy, new tokens
    compression_lengths: list[int] = field(default_factory=lambda: [8192, 16384, 32768, 65536])
    compression_rate: float = 0.5
    compression_min_tokens: int = 1024
    compression_max_tokens: int = 32
    seed: int = 0

    def check(self) -> None:
        if self.runs < 1:
            raise UserError("--runs must be at least 1")
        if self.warmup < 0:
            raise UserError("--warmup must be 0 or more")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise UserError("--max-tokens must be at least 1")
        for flag, n in (("--depth-max-tokens", self.depth_max_tokens),
                        ("--concurrency-max-tokens", self.concurrency_max_tokens),
                        ("--capacity-max-tokens", self.capacity_max_tokens)):
            if n < 1:
                raise UserError(f"{flag} must be at least 1")
        if any(d < 0 for d in self.depths):
            raise UserError("--depths must be 0 or more")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise UserError("--concurrency needs levels of at least 1, e.g. 1,2,4,8")
        if not self.compression_lengths or not 0 < self.compression_rate <= 1:
            raise UserError("--compression-lengths needs lengths and --compression-rate a fraction in (0, 1]")
        if any(c < 1 for c in self.capacity_contexts) or self.capacity_context < 1:
            raise UserError("capacity context lengths must be positive")
        if self.classes:
            known = [c["name"] for c in published_classes()["classes"]]
            unknown = [c for c in self.classes if c not in known]
            if unknown:
                raise UserError(f"unknown class {', '.join(unknown)}: choose from {', '.join(known)}")
        if self.server_log:
            try:
                with open(self.server_log, "rb"):
                    pass
            except OSError as e:  # say so before any request is sent
                raise UserError(f"cannot read --server-log {self.server_log}: {e.strerror}") from e


def published_classes() -> dict:
    return json.loads(resources.files("onespark.bench").joinpath("prompts/published.json").read_text())


class Progress:
    """tqdm over the requests of one suite; a no-op when disabled."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def start(self, desc: str, total: int) -> None:
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", leave=True, dynamic_ncols=True)

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _load_summary(streams: int, context: int, samples: list[dict], first_end: float | None = None) -> dict:
    """The capacity load's /metrics samples: peaks, and the users a full cache holds at that load.

    `first_end` is when the first stream finished: a sample answered before it was read while every stream ran.
    One answered later may have been read after the run (the server's event loop queues /metrics behind the
    streams' chunks: CI's busy 2-core machine saw every sample idle with 128 new tokens), so the summary counts
    the ones that prove the load and says so when none does."""
    under_load = sum(s["after_all_started"] and (first_end is None or s["t"] <= first_end) for s in samples)
    usage = [s["kv_usage"] for s in samples if s["kv_usage"] is not None]
    running = [s["running"] for s in samples if s["running"] is not None]
    peak_usage = max(usage) if usage else None
    peak_running = max(running) if running else None
    users = None
    if (peak_usage or 0) > 0 and (peak_running or 0) > 0:
        # KV share per running request at the peak, extrapolated to a full cache.
        ratio = peak_running / peak_usage
        users = int(ratio) if math.isfinite(ratio) else None  # a usage of 1e-320 is no measurement
    return {"streams": streams, "context": context, "samples": len(samples),
            "samples_after_all_started": sum(s["after_all_started"] for s in samples),
            "samples_under_load": under_load,
            "peak_kv_usage": peak_usage, "peak_running": peak_running,
            "peak_waiting": max((s["waiting"] or 0) for s in samples) if samples else None,
            "users_at_context_measured": users,
            "note": None if under_load else "no /metrics answer came while every stream ran: the peak may miss "
                                            "the load; raise --capacity-max-tokens"}


class Runner:
    def __init__(self, client: httpx.AsyncClient, ep: Endpoint, settings: Settings, max_model_len: int | None,
                 progress: Progress):
        self.client, self.ep, self.s, self.max_model_len, self.progress = client, ep, settings, max_model_len, progress
        self.rng = random.Random(settings.seed)
        self._measured_from: dict | None = None

    async def metrics(self) -> dict | None:
        text = await get_text(self.client, "/metrics")
        try:
            return prom.snapshot(text) if text else None
        except ValueError:  # not Prometheus text (a proxy's page): no server-side check, as without /metrics
            return None

    async def warmup_done(self) -> None:
        self._measured_from = await self.metrics()

    async def one(self, prompt: str, max_tokens: int, extra: dict | None = None,
                  on_first_token: Callable[[], None] | None = None, **labels) -> dict:
        if self.ep.stream:
            timing = await stream_request(self.client, self.ep, prompt, max_tokens, extra=extra,
                                          on_first_token=on_first_token)
        else:
            timing = await plain_request(self.client, self.ep, prompt, max_tokens, extra=extra)
        row = {**labels, "max_tokens": max_tokens, **request_metrics(timing), "t_start": timing.t_start,
               "t_end": timing.t_end}
        self.progress.step()
        return row

    def _cap(self, max_tokens: int) -> int:
        return min(max_tokens, self.s.max_tokens_cap) if self.s.max_tokens_cap else max_tokens

    async def _with_server_check(self, name: str, body) -> dict:
        """Run a suite body; record spec-decode acceptance and the server's own token count around it."""
        before = await self.metrics()
        self._measured_from = None  # set by the body once its warm-up requests are done
        result = await body()
        after = await self.metrics()
        result["suite"] = name
        start = self._measured_from or before
        # acceptance over the measured requests only, like every other figure
        result["spec_decode"] = prom.spec_decode_delta(start, after) if start and after else None
        client_tokens = sum(r["completion_tokens"] or 0 for r in result["rows"] if r["ok"])
        result["tokens_check"] = {
            "client_usage_completion_tokens": client_tokens,
            # Equal to the client's sum when nothing else used the server meanwhile.
            "server_generation_tokens": prom.counter_delta(before, after, prom.GENERATION_TOKENS)
            if before and after else None,
        }
        if before and after:
            result["server"] = {
                # vLLM's own view of the same interval: a check on the client, and on prefix-cache reuse
                "requests": prom.counter_delta(before, after, prom.E2E_COUNT),
                "e2e_latency_sum_s": prom.counter_delta(before, after, prom.E2E_SUM),
                "prefix_cache_queries": prom.counter_delta(before, after, prom.PREFIX_QUERIES),
                "prefix_cache_hits": prom.counter_delta(before, after, prom.PREFIX_HITS),
            }
        return result

    # ---------------------------------------------------------------- compression
    async def compression(self) -> dict:
        from onespark.bench import compression

        return await self._with_server_check("compression", lambda: compression.run(self))

    # ---------------------------------------------------------------- published
    async def published(self) -> dict:
        spec = published_classes()
        classes = spec["classes"]
        if self.s.classes:
            known = {c["name"] for c in classes}
            unknown = [c for c in self.s.classes if c not in known]
            if unknown:
                raise UserError(f"unknown class {', '.join(unknown)}: choose from {', '.join(sorted(known))}")
            classes = [c for c in classes if c["name"] in self.s.classes]

        async def body() -> dict:
            rows, per_class_spec = [], {}
            self.progress.start("published", (self.s.warmup + self.s.runs) * len(classes))
            try:
                for run in range(self.s.warmup + self.s.runs):
                    warm = run < self.s.warmup
                    if run == self.s.warmup:
                        await self.warmup_done()
                    for c in classes:
                        before = None if warm else await self.metrics()
                        row = await self.one(c["prompt"], self._cap(c["max_tokens"]), group=c["name"],
                                             run=run - self.s.warmup if not warm else run, warmup=warm)
                        rows.append(row)
                        if before is not None:
                            after = await self.metrics()
                            d = prom.spec_decode_delta(before, after) if after else None
                            if d:
                                acc = per_class_spec.setdefault(c["name"], {"drafts": 0.0, "draft_tokens": 0.0,
                                                                            "accepted_tokens": 0.0})
                                for k in acc:
                                    acc[k] += d[k]
            finally:
                self.progress.close()
            groups = []
            for c in classes:
                measured = [r for r in rows if r["group"] == c["name"] and not r["warmup"]]
                g = {"group": c["name"], "max_tokens": self._cap(c["max_tokens"]), "summary": summarize_rows(measured)}
                sd = per_class_spec.get(c["name"])
                if sd:
                    g["spec_decode"] = {
                        **sd,
                        "acceptance_rate": sd["accepted_tokens"] / sd["draft_tokens"] if sd["draft_tokens"] else None,
                        "mean_acceptance_length": 1 + sd["accepted_tokens"] / sd["drafts"] if sd["drafts"] else None,
                    }
                groups.append(g)
            # The published single figure: the mean over classes of each class's mean end-to-end rate.
            class_means = {g["group"]: g["summary"]["e2e_tok_s"]["mean"] for g in groups if g["summary"]["e2e_tok_s"]}
            class_decode = {g["group"]: g["summary"]["decode_tok_s"]["mean"]
                            for g in groups if g["summary"]["decode_tok_s"]}
            cross = {
                "e2e_tok_s": summarize(class_means.values()),
                "decode_tok_s": summarize(class_decode.values()),
                "classes_measured": len(class_means),
            }
            return {"rows": rows, "groups": groups, "cross_class": cross, "source": spec["source"]}

        return await self._with_server_check("published", body)

    # ---------------------------------------------------------------- depth
    async def _filler_prompt(self, target: int, seed: int) -> tuple[str, int | None]:
        """A prompt of about `target` tokens: numbered nonsense words after a per-request nonce.

        The nonce comes first, so no two requests share even their first KV block: vLLM's prefix cache chains
        block hashes from the start and cannot reuse anything. Sized with the server's /tokenize when offered.
        """
        rng = random.Random(seed)
        syll = ["ka", "lo", "mi", "ra", "te", "su", "no", "ve", "di", "pa", "gu", "shi", "bo", "ze", "ty"]

        def text(n_words: int) -> str:
            words = ("".join(rng.choice(syll) for _ in range(rng.randint(2, 3))) for _ in range(n_words))
            return " ".join(words)

        base_count = await count_prompt_tokens(self.client, self.ep, "Document 0000000000. " + DEPTH_TASK)
        if target == 0 or (base_count is not None and target <= base_count):
            return "", base_count
        per_word = 2.5  # first guess; refined from the server's count
        n_words = max(1, int((target - (base_count or 0)) / per_word))
        body = text(n_words)
        count = None
        for _ in range(4):
            count = await count_prompt_tokens(self.client, self.ep, "Document 0000000000. " + body + DEPTH_TASK)
            if count is None or base_count is None:
                break
            if abs(count - target) <= max(8, target // 200):
                break
            per_word = max(0.5, (count - base_count) / n_words)
            n_words = max(1, int((target - base_count) / per_word))
            rng.seed(seed)
            body = text(n_words)
        return body, count

    async def depth(self) -> dict:
        depths = sorted(set(self.s.depths))
        max_tokens = self._cap(self.s.depth_max_tokens)
        extra = {"ignore_eos": True}  # vLLM: generate exactly max_tokens, so decode is timed over equal lengths

        async def body() -> dict:
            rows, groups, skipped = [], [], []
            usable = []
            for d in depths:
                if self.max_model_len is not None and d + max_tokens > self.max_model_len:
                    # 256K on a server started with --max-model-len 262144 still leaves room for a few
                    # tokens short of it: measure there instead of skipping the deepest point.
                    clamped = self.max_model_len - max_tokens - 64
                    if clamped > (usable[-1] if usable else 0) and d <= self.max_model_len:
                        usable.append(clamped)
                    else:
                        skipped.append({"depth": d, "reason": f"depth + {max_tokens} new tokens > max_model_len "
                                                              f"{self.max_model_len}"})
                else:
                    usable.append(d)
            self.progress.start("depth", self.s.warmup + self.s.runs * len(usable))
            try:
                for w in range(self.s.warmup if usable else 0):
                    prompt = f"Document {self.rng.randrange(10**10):010d}. {DEPTH_TASK}"
                    rows.append(await self.one(prompt, max_tokens, extra, group=0, run=w, warmup=True))
                await self.warmup_done()
                for d in usable:
                    filler, counted = await self._filler_prompt(d, self.s.seed + d)
                    for run in range(self.s.runs):
                        prompt = f"Document {self.rng.randrange(10**10):010d}. {filler}{DEPTH_TASK}"
                        rows.append(await self.one(prompt, max_tokens, extra, group=d, run=run, warmup=False))
                    measured = [r for r in rows if r["group"] == d and not r["warmup"]]
                    groups.append({"group": d, "tokenized_prompt": counted, "summary": summarize_rows(measured)})
            finally:
                self.progress.close()
            return {"rows": rows, "groups": groups, "skipped": skipped, "max_tokens": max_tokens}

        return await self._with_server_check("depth", body)

    # ---------------------------------------------------------------- concurrency
    async def concurrency(self) -> dict:
        levels = sorted(set(self.s.concurrency))
        max_tokens = self._cap(self.s.concurrency_max_tokens)
        extra = {"ignore_eos": True}
        task = published_classes()["classes"][1]["prompt"]  # the Code prompt: long, ordinary output

        async def round_(c: int, run: int, warm: bool) -> list[dict]:
            prompts = [f"Request {self.rng.randrange(10**10):010d}. {task}" for _ in range(c)]
            return list(await asyncio.gather(*(self.one(p, max_tokens, extra, group=c, run=run, stream=i,
                                                        warmup=warm) for i, p in enumerate(prompts))))

        async def body() -> dict:
            rows, groups = [], []
            self.progress.start("concurrency", sum(levels[0] for _ in range(self.s.warmup))
                                + sum(c * self.s.runs for c in levels))
            try:
                for w in range(self.s.warmup):
                    rows += await round_(levels[0], w, True)
                await self.warmup_done()
                for c in levels:
                    aggregates = []
                    for run in range(self.s.runs):
                        rr = await round_(c, run, False)
                        rows += rr
                        ok = [r for r in rr if r["ok"]]
                        if len(ok) == len(rr):
                            span = max(r["t_end"] for r in rr) - min(r["t_start"] for r in rr)
                            aggregates.append(sum(r["completion_tokens"] for r in rr) / span)
                    measured = [r for r in rows if r["group"] == c and not r["warmup"]]
                    groups.append({"group": c, "summary": summarize_rows(measured),
                                   # all streams' tokens over the round's wall time (first start to last end)
                                   "aggregate_tok_s": summarize(aggregates)})
            finally:
                self.progress.close()
            return {"rows": rows, "groups": groups, "max_tokens": max_tokens}

        return await self._with_server_check("concurrency", body)

    # ---------------------------------------------------------------- capacity
    async def capacity(self) -> dict:
        log_info = {}
        if self.s.server_log:
            try:
                with open(self.s.server_log, encoding="utf-8", errors="replace") as f:
                    log_info = prom.parse_server_log(f.read())
            except OSError as e:
                raise UserError(f"cannot read --server-log {self.s.server_log}: {e.strerror}") from e
            if not log_info:
                raise UserError(f"--server-log {self.s.server_log} has no 'GPU KV cache size' line: pass the "
                                "server's start-up log (e.g. `docker logs vllm-qwen35 > server.log`)")

        async def body() -> dict:
            snap = await self.metrics()
            info = snap["cache_info"] if snap else {}

            def as_int(v):  # a label is text: "16", "16.0", or anything ("inf" overflows int())
                try:
                    n = int(float(v))
                except (TypeError, ValueError, OverflowError):
                    return None
                return n if n > 0 else None

            blocks, block_size = as_int(info.get("num_gpu_blocks")), as_int(info.get("block_size"))
            estimates = []
            for ctx in sorted(set(self.s.capacity_contexts + ([self.max_model_len] if self.max_model_len else []))):
                est = prom.capacity_estimate(log_info.get("kv_cache_tokens"), blocks, block_size, ctx)
                estimates.append({"context": ctx, **est})
            rows, load = [], None
            if self.s.capacity_streams > 0:
                rows, load = await self._load(self.s.capacity_streams, self.s.capacity_context)
            return {"rows": rows, "groups": [], "server_log": log_info, "num_gpu_blocks": blocks,
                    "block_size": block_size, "kv_cache_dtype": info.get("cache_dtype"), "estimates": estimates,
                    "load": load}

        return await self._with_server_check("capacity", body)

    LOAD_ATTEMPTS = 3

    async def _load(self, streams: int, context: int) -> tuple[list[dict], dict]:
        """The load, run again (at most LOAD_ATTEMPTS in all) while no /metrics answer proves it was read under load.

        vLLM's API server can answer /metrics only after the run: its output handler (0.19.1's
        v1/engine/async_llm.py) awaits an asyncio.Queue that returns at once while engine outputs wait in it, so it
        does not yield to the event loop when the engine outpaces the API process (CI's busy 2-core machine, the
        tiny model). Another run usually lands; every attempt's rows are kept."""
        max_tokens = self._cap(self.s.capacity_max_tokens)
        if self.max_model_len is not None and context + max_tokens > self.max_model_len:
            raise UserError(f"--capacity-context {context} + {max_tokens} new tokens exceeds the server's "
                            f"max_model_len {self.max_model_len}: lower it")
        filler, _ = await self._filler_prompt(context, self.s.seed + 7)
        rows: list[dict] = []
        for attempt in range(self.LOAD_ATTEMPTS):
            more, load = await self._load_once(streams, context, max_tokens, filler, attempt)
            rows += more
            if load["samples_under_load"]:
                break
        return rows, {**load, "attempts": attempt + 1}

    async def _load_once(self, streams: int, context: int, max_tokens: int, filler: str,
                         attempt: int) -> tuple[list[dict], dict]:
        """`streams` concurrent requests of `context` tokens (`filler`); /metrics sampled while they run."""
        samples: list[dict] = []
        done, all_started = asyncio.Event(), asyncio.Event()
        started = 0

        def first_token() -> None:
            nonlocal started
            started += 1
            if started == streams:
                all_started.set()

        async def sample(after_all_started: bool) -> None:
            snap = await self.metrics()
            if snap:
                c = snap["counters"]
                samples.append({"t": time.perf_counter(), "kv_usage": c.get(prom.KV_USAGE),
                                "running": c.get(prom.RUNNING), "waiting": c.get(prom.WAITING),
                                "after_all_started": after_all_started})

        async def poll() -> None:
            while not done.is_set():
                await sample(False)
                try:
                    await asyncio.wait_for(done.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass

        async def at_full_load() -> None:
            # Polling alone can miss the load: on a busy 2-core CPU server one /metrics round trip can outlast a
            # short run (CI saw 2 samples, both idle). So one more sample is taken, beside the poller, the
            # moment every stream has its first token and all of them are known to be running.
            await all_started.wait()
            await sample(True)

        self.progress.start("capacity", streams)
        poller, full = asyncio.create_task(poll()), asyncio.create_task(at_full_load())
        try:
            rows = list(await asyncio.gather(*(
                self.one(f"Document {self.rng.randrange(10**10):010d}. {filler}{DEPTH_TASK}", max_tokens,
                         {"ignore_eos": True}, on_first_token=first_token, group=context, run=attempt, stream=i,
                         warmup=False)
                for i in range(streams))))
        finally:
            done.set()
            if not all_started.is_set():  # a stream failed before its first token, or a non-streamed endpoint
                full.cancel()
            self.progress.close()
            for r in await asyncio.gather(poller, full, return_exceptions=True):
                if isinstance(r, Exception):  # a cancelled sampler is a BaseException: expected, not raised
                    raise r
        ends = [r["t_end"] for r in rows if r.get("ok")]
        return rows, _load_summary(streams, context, samples, min(ends) if ends else None)
