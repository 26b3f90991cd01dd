"""The compression suite (`onespark bench --suite compression --base-url http://127.0.0.1:8001`, issue 27): the
same long prompt twice through `onespark compress serve`, compression off (A) and on (B), for two tasks:

    needle  one fact ("The access code for vault 417 is 80412.") at a seeded depth of filler prose; the question
            asks for it back
    rag     numbered documents, one of which holds the answer (a year); the question names that document's topic

at --compression-lengths (default 8K, 16K, 32K, 64K prompt tokens, estimated; the server's usage.prompt_tokens
is what the rows record). Per request: TTFT and end-to-end latency (client clock), prompt tokens (the server's
usage: A minus B is what compression saved the model), tokens removed and the compressor's time (the proxy's
X-Onespark-* headers, in its tokenizer's tokens), the answer, whether it holds the expected fact, and for B
whether it is A's answer (agreement, after trimming and case folding). Greedy (temperature 0), so a
disagreement is the compression's doing.
"""

from __future__ import annotations

import json
import math
import random
import time

import httpx

from onespark.bench.client import Endpoint, error_text, is_count
from onespark.bench.stats import summarize
from onespark.errors import UserError
from onespark.serving.compress import VIA

FIELD, STATUS, REMOVED, MS = "onespark_compress", "x-onespark-compression", "x-onespark-tokens-removed", \
    "x-onespark-compressor-ms"
TASKS = ("needle", "rag")
WORDS_PER_TOKEN = 0.75  # English prose in Qwen's tokenizer, roughly: the length is an estimate, usage is the record
SUBJECTS = ["the harbour", "the old mill", "a river barge", "the north road", "the council", "a night market",
            "the lighthouse", "the archive", "a winter fair", "the rail yard", "the orchard", "a small school"]
VERBS = ["was repaired after", "stayed busy during", "changed hands before", "was mapped during", "closed for",
         "grew quickly after", "was rebuilt during", "drew visitors through"]
TIMES = ["the long storm", "the spring floods", "the census", "the strike", "the fire", "the summer festival",
         "the bridge works", "the first snow"]
TOPICS = ["glass museum", "tram depot", "clock tower", "paper mill", "salt works", "observatory", "opera house",
          "botanical garden", "ferry terminal", "printing press"]


def _sentence(rng: random.Random) -> str:
    return (f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(TIMES)}, and people in "
            f"{rng.choice(SUBJECTS)} still speak of it.")


def filler(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of plain prose (sentences from the lists above)."""
    words, out = int(tokens * WORDS_PER_TOKEN), []
    while words > 0:
        s = _sentence(rng)
        out.append(s)
        words -= len(s.split())
    return " ".join(out)


def needle(tokens: int, seed: int) -> tuple[str, str]:
    """(prompt, expected answer): a fact at a seeded depth of prose, then the question after a blank line."""
    rng = random.Random(seed)
    vault, code = rng.randrange(100, 1000), str(rng.randrange(10000, 100000))
    before = filler(rng, int(tokens * rng.uniform(0.1, 0.9)))
    after = filler(rng, tokens - int(len(before.split()) / WORDS_PER_TOKEN))
    fact = f"The access code for vault {vault} is {code}."
    return (f"{before} {fact} {after}\n\nWhat is the access code for vault {vault}? Answer with the code only.",
            code)


def rag(tokens: int, seed: int) -> tuple[str, str]:
    """(prompt, expected answer): documents of ~500 tokens, one holding the year a place opened."""
    rng = random.Random(seed)
    n = max(2, tokens // 500)
    topic, year, at = rng.choice(TOPICS), str(rng.randrange(1850, 2000)), rng.randrange(n)
    docs = []
    for i in range(n):
        body = filler(rng, 480)
        if i == at:
            body += f" The {topic} opened in {year}."
        docs.append(f"Document {i + 1}:\n{body}")
    return ("\n\n".join(docs) + f"\n\nIn which year did the {topic} open? Answer with the year only.", year)


async def check_proxy(client: httpx.AsyncClient, ep: Endpoint) -> None:
    """The suite's A/B needs `onespark compress serve` at --base-url: pointed at vLLM itself, both arms would run
    uncompressed and be reported as an A/B. The proxy says itself on every answer (Via); one line, before any
    suite runs, when it does not."""
    try:
        r = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise UserError(f"{ep.base_url}/v1/models: {type(e).__name__}: {e}") from None
    if VIA.split()[-1] not in r.headers.get("via", ""):
        raise UserError(f"--base-url {ep.base_url} is not `onespark compress serve` (its answers carry no "
                        f"'Via: {VIA}'): --suite compression measures through the proxy; point --base-url at it, "
                        "e.g. http://127.0.0.1:8001")


class Malformed(ValueError):
    """A stream chunk of the wrong shape: the request fails with this reason, the run goes on."""


def _chunk(data: str) -> tuple[str, bool, dict | None]:
    """(the answer text a chunk carries, whether it carries any generated text, thinking included: TTFT; its
    usage counts or None); a chunk of the wrong shape is Malformed."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise Malformed(f"a stream chunk is not JSON: {data[:80]!r}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("choices", []), list):
        raise Malformed(f"a stream chunk is not an object with a list of choices: {data[:80]!r}")
    text, any_text = "", False
    for c in doc.get("choices") or []:
        delta = c.get("delta") if isinstance(c, dict) else None
        delta = delta if isinstance(delta, dict) else {}
        content = delta.get("content")
        text += content if isinstance(content, str) else ""
        # vLLM streams thinking as `reasoning` (0.19) or `reasoning_content`: generated tokens all the same
        any_text = any_text or any(isinstance(delta.get(k), str) and delta[k]
                                   for k in ("content", "reasoning", "reasoning_content"))
    usage = doc.get("usage")
    if usage is None:
        return text, any_text, None
    counts = {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens")} if isinstance(usage, dict) else {}
    if not counts or not all(is_count(v) for v in counts.values()):
        raise Malformed(f"usage is {json.dumps(usage)[:80]}, not token counts")
    return text, any_text, counts


def _norm(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .")


async def _request(client: httpx.AsyncClient, ep: Endpoint, prompt: str, max_tokens: int, field) -> dict:
    """One streamed chat request, with the text and the proxy's compression headers."""
    body = {"model": ep.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **ep.extra_body}
    if field is not None:
        body[FIELD] = field
    row = {"ok": False, "error": None, "ttft_s": None, "latency_s": None, "prompt_tokens": None,
           "completion_tokens": None, "text": "", "status": None, "tokens_removed": None, "compressor_ms": None}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            row["status"] = r.headers.get(STATUS)
            for key, header, kind in (("tokens_removed", REMOVED, int), ("compressor_ms", MS, float)):
                try:
                    row[key] = kind(r.headers[header]) if header in r.headers else None
                    if row[key] is not None and not (math.isfinite(row[key]) and row[key] >= 0):
                        raise ValueError  # nan, inf or below 0: no count and no duration, and NaN is no JSON
                except (ValueError, OverflowError):  # OverflowError: an integer too large for math.isfinite
                    row[key] = None
                    row["error"] = f"{header}: {r.headers[header][:40]!r} is not a number of 0 or more"
            if r.status_code != 200:
                row["error"] = f"HTTP {r.status_code}: {await error_text(r)}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    text, generated, usage = _chunk(line[5:].strip())
                    if generated and row["ttft_s"] is None:
                        row["ttft_s"] = time.perf_counter() - t0
                    row["text"] += text
                    if usage:
                        row.update(usage)
    except Malformed as e:
        row["error"] = f"malformed answer: {e}"
    except httpx.HTTPError as e:
        row["error"] = f"{type(e).__name__}: {e}"
    row["latency_s"] = time.perf_counter() - t0
    row["ok"] = row["error"] is None and bool(row["completion_tokens"])
    if row["error"] is None and not row["ok"]:
        row["error"] = "no completion tokens in usage"
    return row


def _mean(rows: list[dict], key: str) -> dict | None:
    return summarize(r[key] for r in rows if r["ok"] and r[key] is not None)


async def run(runner) -> dict:
    """The suite's body (Runner.compression wraps it in the server check)."""
    s, ep, client = runner.s, runner.ep, runner.client
    max_tokens = runner._cap(s.compression_max_tokens)
    field = {"rate": s.compression_rate, "min_tokens": s.compression_min_tokens}
    points = [(task, n) for n in s.compression_lengths for task in TASKS]
    skipped = [{"task": t, "length": n, "reason": f"{n} + {max_tokens} tokens exceed max_model_len "
                f"{runner.max_model_len}"} for t, n in points
               if runner.max_model_len is not None and n + max_tokens > runner.max_model_len]
    points = [p for p in points if not any(k["task"] == p[0] and k["length"] == p[1] for k in skipped)]
    rows, groups = [], []
    runner.progress.start("compression", 2 * (s.warmup + s.runs) * len(points))
    try:
        for task, n in points:
            mine = []
            for run in range(s.warmup + s.runs):
                warm = run < s.warmup
                prompt, expected = (needle if task == "needle" else rag)(n, s.seed + 1000 * run + n)
                pair = {}
                for arm, f in (("off", None), ("on", field)):
                    row = await _request(client, ep, prompt, max_tokens, f)
                    row.update(suite="compression", group=f"{task}-{n}", task=task, length=n, arm=arm,
                               run=run if warm else run - s.warmup, warmup=warm,
                               correct=expected in row["text"] if row["ok"] else None)
                    pair[arm] = row
                    runner.progress.step()
                if pair["off"]["ok"] and pair["on"]["ok"]:
                    pair["on"]["agrees"] = _norm(pair["on"]["text"]) == _norm(pair["off"]["text"])
                rows += pair.values()
                if not warm:
                    mine += pair.values()
            groups.append(_group(task, n, mine))
    finally:
        runner.progress.close()
    return {"rows": rows, "groups": groups, "skipped": skipped, "rate": s.compression_rate,
            "max_tokens": max_tokens}


def _group(task: str, n: int, rows: list[dict]) -> dict:
    off, on = [r for r in rows if r["arm"] == "off"], [r for r in rows if r["arm"] == "on"]
    agree = [r["agrees"] for r in on if r.get("agrees") is not None]
    out = {"group": f"{task}-{n}", "task": task, "length": n,
           "compressed": sum(r["status"] == "compressed" for r in on), "requests": len(on)}
    for arm, rs in (("off", off), ("on", on)):
        for key in ("ttft_s", "latency_s", "prompt_tokens"):
            out[f"{key}_{arm}"] = _mean(rs, key)
        ok = [r["correct"] for r in rs if r["correct"] is not None]
        out[f"accuracy_{arm}"] = sum(ok) / len(ok) if ok else None
    out["tokens_removed"] = _mean(on, "tokens_removed")
    out["compressor_ms"] = _mean(on, "compressor_ms")
    out["agreement"] = sum(agree) / len(agree) if agree else None
    return out


def table(s: dict, result: dict):
    """(title, headers, rows) for the console and Markdown reports."""
    def m(x, digits=2):
        return "-" if not x else f"{x['mean']:.{digits}f}"

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    headers = ["task", "prompt tok off/on", "removed (proxy)", "compressor ms", "TTFT s off/on", "e2e s off/on",
               "correct off/on", "agreement"]
    rows = [[g["group"], f"{m(g['prompt_tokens_off'], 0)}/{m(g['prompt_tokens_on'], 0)}", m(g["tokens_removed"], 0),
             m(g["compressor_ms"], 0), f"{m(g['ttft_s_off'])}/{m(g['ttft_s_on'])}",
             f"{m(g['latency_s_off'])}/{m(g['latency_s_on'])}",
             f"{pct(g['accuracy_off'])}/{pct(g['accuracy_on'])}", pct(g["agreement"])] for g in s["groups"]]
    rows += [[f"{k['task']}-{k['length']}", "skipped", k["reason"], "", "", "", "", ""] for k in s.get("skipped", [])]
    return (f"compression: A/B through onespark compress serve, rate {s['rate']:g}, {s['max_tokens']} new tokens, "
            "greedy", headers, rows)
