"""Metric definitions and summary statistics. Pure functions: no I/O, no clock.

Per request (all times in seconds from `time.perf_counter()`, tokens from the server's `usage`):
  ttft          = t_first - t_start         first streamed chunk that carries text (answer or reasoning)
  decode_rate   = (n - n_first) / (t_last - t_first)   tokens after the first chunk, over the time they took;
                                            n_first from the server's per-chunk usage, else 1
  e2e_rate      = n / (t_end - t_start)     the published method: completion tokens over wall time,
                                            prefill, HTTP and thinking tokens included
  tpot          = (t_end - t_start - ttft) / (n - 1)    as in vLLM's benchmarks/serve.py
  prefill_rate  = prompt_tokens / ttft
  chunk gaps    = time between consecutive text chunks. With speculative decoding one chunk can carry
                  several tokens, so a chunk gap is not a per-token latency; n comes from `usage` only.
  itl           = per-token inter-token latency: each chunk gap divided by the tokens that chunk brought,
                  counted by the server (vLLM's per-chunk usage); None when the server does not say.
  tokens/chunk  = mean tokens per text chunk (1 without speculative decoding; up to 3 with MTP-2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    """What the client saw of one streamed request."""

    t_start: float
    t_end: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # from the server's usage, never from counting chunks
    chunk_times: list[float] = field(default_factory=list)  # arrival time of each chunk that carried text
    # cumulative completion tokens at each of those chunks, when the server reports them per chunk
    # (vLLM: stream_options.continuous_usage_stats); empty otherwise
    chunk_tokens: list[int] = field(default_factory=list)
    error: str | None = None


def request_metrics(t: RequestTiming) -> dict:
    """Per-request metrics. Anything that cannot be defined is None, never 0."""
    n = t.completion_tokens
    wall = t.t_end - t.t_start
    out: dict = {
        "ok": t.error is None and bool(n) and n > 0,
        "error": t.error,
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": n,
        "latency_s": wall,
        "ttft_s": None,
        "decode_tok_s": None,
        "e2e_tok_s": None,
        "tpot_ms": None,
        "prefill_tok_s": None,
        "chunks": len(t.chunk_times),
        "chunk_gaps_ms": [],
        "itl_ms": [],
        "tokens_per_chunk": None,
    }
    if not out["ok"]:
        if out["error"] is None:
            out["error"] = "server reported no completion tokens in usage"
        return out
    if wall > 0:
        out["e2e_tok_s"] = n / wall
    if t.chunk_times:
        t_first, t_last = t.chunk_times[0], t.chunk_times[-1]
        ttft = t_first - t.t_start
        out["ttft_s"] = ttft
        if t.prompt_tokens and ttft > 0:
            out["prefill_tok_s"] = t.prompt_tokens / ttft
        # Tokens that arrived with the first chunk: vLLM coalesces tokens into one chunk when the client or
        # the API server falls behind (seen on a loaded CPU without any speculative decoding) and MTP sends
        # up to 3 per chunk, so "1" is only the fallback when the server does not count per chunk.
        # cumulative counts only: counts that fall, or pass the usage total, say nothing per token
        counted = len(t.chunk_tokens) == len(t.chunk_times) and \
            all(a <= b for a, b in zip(t.chunk_tokens, t.chunk_tokens[1:])) and t.chunk_tokens[-1] <= n
        first = t.chunk_tokens[0] if counted else 1
        if n > first and t_last > t_first:
            out["decode_tok_s"] = (n - first) / (t_last - t_first)
        if n > 1:
            out["tpot_ms"] = 1000.0 * (wall - ttft) / (n - 1)
        out["chunk_gaps_ms"] = [1000.0 * (b - a) for a, b in zip(t.chunk_times, t.chunk_times[1:])]
        if counted and t.chunk_tokens[-1] > 0:
            out["tokens_per_chunk"] = t.chunk_tokens[-1] / len(t.chunk_tokens)
            for gap, before, now in zip(out["chunk_gaps_ms"], t.chunk_tokens, t.chunk_tokens[1:]):
                k = now - before
                out["itl_ms"] += [gap / k] * k if k > 0 else []
    return out


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def summarize(values: Iterable[float | None], percentiles: Sequence[float] = (50, 90, 99)) -> dict | None:
    """mean, median, sample std (n-1), min, max, percentiles; None values are skipped. None if empty."""
    xs = sorted(float(v) for v in values if v is not None)
    if not xs:
        return None
    n = len(xs)
    mean = math.fsum(xs) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    out = {"n": n, "mean": mean, "median": percentile(xs, 50), "std": std, "min": xs[0], "max": xs[-1]}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(xs, q)
    return out


# Which per-request metrics get summarised, and their unit.
METRICS = {
    "e2e_tok_s": "tok/s",
    "decode_tok_s": "tok/s",
    "ttft_s": "s",
    "tpot_ms": "ms",
    "prefill_tok_s": "tok/s",
    "completion_tokens": "tok",
    "prompt_tokens": "tok",
    "latency_s": "s",
}


def summarize_rows(rows: Sequence[dict]) -> dict:
    """Summaries of every metric over the successful rows, plus pooled chunk gaps."""
    ok = [r for r in rows if r["ok"]]
    out = {m: summarize(r.get(m) for r in ok) for m in METRICS}
    out["chunk_gap_ms"] = summarize(g for r in ok for g in r.get("chunk_gaps_ms", []))
    out["itl_ms"] = summarize(x for r in ok for x in r.get("itl_ms", []))
    out["tokens_per_chunk"] = summarize(r.get("tokens_per_chunk") for r in ok)
    out["requests"] = len(rows)
    out["failed"] = len(rows) - len(ok)
    return out


def welch(mean_a: float, std_a: float, n_a: int, mean_b: float, std_b: float, n_b: int) -> dict:
    """Delta B - A with its standard error (Welch). `significant`: |delta| > 2 SE and both sides had n >= 2.

    Two standard errors is roughly a 95% interval for the difference of two means; with n = 1 on a side the
    noise is unknown, so nothing is called significant.
    """
    delta = mean_b - mean_a
    pct = (100.0 * delta / mean_a) if mean_a else None
    pct = pct if pct is not None and math.isfinite(pct) else None  # A = 5e-324 would make it inf
    out = {"delta": delta, "delta_pct": pct, "se": None, "significant": None}
    if n_a >= 2 and n_b >= 2:
        se = math.sqrt(std_a**2 / n_a + std_b**2 / n_b)
        out["se"] = se
        out["significant"] = abs(delta) > 2 * se
    return out
