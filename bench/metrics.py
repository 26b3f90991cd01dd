"""Read what vLLM 0.19.1 says about itself: Prometheus `/metrics` text and the server log. Pure functions.

Metric names are vLLM 0.19.1's (vllm/v1/spec_decode/metrics.py `SpecDecodingProm`, vllm/v1/metrics/loggers.py);
prometheus_client exposes each Counter `X` as `X_total`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
KV_USAGE = "vllm:kv_cache_usage_perc"  # gauge, a fraction in [0, 1] despite the name
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"  # tokens looked up in the prefix cache
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # tokens found there
E2E_SUM = "vllm:e2e_request_latency_seconds_sum"  # histogram: server-side request latency, summed
E2E_COUNT = "vllm:e2e_request_latency_seconds_count"
CACHE_INFO = "vllm:cache_config_info"  # gauge = 1, the CacheConfig as labels (num_gpu_blocks, block_size, ...)


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample of the Prometheus text format, through prometheus_client's parser
    (the library vLLM writes /metrics with). Sample names stay as written: a Counter's `X_total`, a histogram's
    `X_sum` and `X_count`."""
    try:
        return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
                for s in family.samples]
    except ValueError as e:
        raise ValueError(_bad_line(text) or f"/metrics is not Prometheus text: {e}") from None


def _bad_line(text: str) -> str | None:
    """The first sample line that does not parse on its own, named by number: the parser's own message says
    what is wrong but not where."""
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            return f"/metrics line {lineno} is not a Prometheus sample: {line[:120]!r}"
    return None


_SUMMED = {SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED, GENERATION_TOKENS, PROMPT_TOKENS, REQUEST_SUCCESS,
           KV_USAGE, RUNNING, WAITING, PREFIX_QUERIES, PREFIX_HITS, E2E_SUM, E2E_COUNT}


def snapshot(text: str) -> dict:
    """The counters and gauges the benchmark uses, summed over engines (and models) where that is meaningful."""
    totals: dict[str, float] = defaultdict(float)
    per_pos: dict[int, float] = defaultdict(float)
    cache_info: dict[str, str] = {}
    seen: set[str] = set()
    for name, labels, value in parse_prometheus(text):
        seen.add(name)
        if not math.isfinite(value):  # the format allows NaN and +Inf; no counter or gauge read here is either
            continue
        if name == SPEC_ACCEPTED_PER_POS:
            per_pos[int(labels.get("position", "0"))] += value
        elif name == CACHE_INFO:
            cache_info = {k: v for k, v in labels.items()}
        elif name in _SUMMED:
            totals[name] += value
    return {
        "counters": dict(totals),
        "accepted_per_pos": [per_pos[i] for i in sorted(per_pos)],
        "cache_info": cache_info,
        "spec_decode": SPEC_DRAFTS in seen,
    }


def spec_decode_delta(before: dict, after: dict) -> dict | None:
    """Acceptance over the interval between two snapshots; None when the server runs no speculative decoding.

    acceptance_rate       = accepted / drafted tokens
    mean_acceptance_length = 1 + accepted / drafts      (tokens per target forward pass, bonus token included;
                                                         vLLM's own definition, SpecDecodingProm docstring)
    per_position          = accepted at draft position i / drafts
    """
    if not (before.get("spec_decode") and after.get("spec_decode")):
        return None
    b, a = before["counters"], after["counters"]
    if not all(k in c for c in (b, a) for k in (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED)):
        return None  # one left out (a NaN sample is): a delta from a missing counter would be a made-up figure
    drafts = a.get(SPEC_DRAFTS, 0.0) - b.get(SPEC_DRAFTS, 0.0)
    draft_tokens = a.get(SPEC_DRAFT_TOKENS, 0.0) - b.get(SPEC_DRAFT_TOKENS, 0.0)
    accepted = a.get(SPEC_ACCEPTED, 0.0) - b.get(SPEC_ACCEPTED, 0.0)
    pos_b, pos_a = before["accepted_per_pos"], after["accepted_per_pos"]
    per_pos_acc = [pa - (pos_b[i] if i < len(pos_b) else 0.0) for i, pa in enumerate(pos_a)]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else None,
        "per_position": [x / drafts for x in per_pos_acc] if drafts > 0 else None,
    }


def counter_delta(before: dict, after: dict, name: str) -> float:
    return after["counters"].get(name, 0.0) - before["counters"].get(name, 0.0)


_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_MAX_CONC = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def parse_server_log(text: str) -> dict:
    """KV-cache capacity lines vLLM 0.19.1 logs at start-up (vllm/v1/core/kv_cache_utils.py). Last one wins."""
    out: dict = {}
    for m in _KV_TOKENS.finditer(text):
        tokens = _number(m.group(1), int)
        if tokens is not None:
            out["kv_cache_tokens"] = tokens
    for m in _MAX_CONC.finditer(text):
        length, concurrency = _number(m.group(1), int), _number(m.group(2), float)
        if length is not None and concurrency is not None:
            out["max_model_len"], out["max_concurrency_at_max_model_len"] = length, concurrency
    return out


def _number(text: str, kind: type) -> int | float | None:
    """A log line's number ("1,234", "2.5"), or None for one that is not (",", "1.2.3", 5000 digits, inf)."""
    try:
        value = kind(text.replace(",", ""))
    except ValueError:
        return None
    return value if 0 <= value < 2**53 else None  # inf (a 400-digit float) fails too


_CAUSE = re.compile(r"^(?:.*\] )?((?:\w+\.)*\w*(?:Error|Exception): .+)$", re.M)


def error_cause(text: str) -> str | None:
    """The first exception line of a vLLM log that failed, without its logger prefix: the root cause, not the
    engine's closing "Engine core initialization failed" (which a log tail keeps and the cause scrolls out of)."""
    for m in _CAUSE.finditer(text):
        if "Engine core initialization failed" not in m.group(1):
            return m.group(1).strip()
    return None


def capacity_estimate(kv_cache_tokens: int | None, num_gpu_blocks: int | None, block_size: int | None,
                      context_len: int) -> dict:
    """Concurrent users that fit at `context_len` tokens each, from the KV cache size.

    Prefers the log's token count (vLLM divides blocks among KV-cache groups for hybrid models); falls back to
    blocks x block size from /metrics, which over-counts when the model has several KV-cache groups.
    Each request holds whole blocks, so it needs ceil(context / block) blocks.
    """
    if context_len <= 0:
        raise ValueError("context length must be positive")
    source, tokens = None, None
    if kv_cache_tokens:
        source, tokens = "server log", kv_cache_tokens
    elif num_gpu_blocks and block_size:
        source, tokens = "/metrics cache_config_info (blocks x block_size)", num_gpu_blocks * block_size
    if tokens is None:
        return {"kv_cache_tokens": None, "users": None, "source": None}
    if block_size:
        per_request = math.ceil(context_len / block_size) * block_size
    else:
        per_request = context_len
    return {"kv_cache_tokens": tokens, "users": tokens // per_request, "tokens_per_request": per_request,
            "source": source}
