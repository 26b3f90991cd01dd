"""Quality A/B: the same greedy prompts against two endpoints (e.g. BF16 vs INT8 LM head, v2 vs v2-tq).

Per prompt: the fraction of positions where both generated the same token, the first position where they
differ, and the KL divergence KL(A || B) of the top-k next-token distributions at each position *before* the
first divergence (after it the two contexts differ and the distributions are not comparable).

KL from top-k only is an estimate. Each side's top-k leaves a remaining mass r = 1 - sum(top-k probs); tokens
one side lists and the other does not get, on the other side, an equal share min(r / (m + 1), that side's k-th
probability) (m such tokens; a token outside the top-k cannot be likelier than the k-th), and what is left of
r goes to an "everything else" bucket on both sides. With k = the whole vocabulary this is the exact KL; a
larger k gives a tighter estimate.
"""

from __future__ import annotations

import math

import httpx

from onespark import shape
from onespark.bench.client import Endpoint, complete
from onespark.bench.stats import summarize
from onespark.errors import UserError
from onespark.shape import ListOf, MapOf, Nullable, Num, Obj, OneOf, Str

EPS = 1e-12


# What parse_logprobs reads (onespark.shape): chat's logprobs.content entries, or completions' tokens and
# top_logprobs. Log probabilities are finite and at most 0 (a little above, for rounding): math.exp of them is
# taken in topk_kl.
_LOGPROB = Num(hi=1.0, what="a log probability")
_CHAT_LP = Obj({"content": Nullable(ListOf(Obj({"token": Str(), "logprob": _LOGPROB},
                                                {"top_logprobs": Nullable(ListOf(Obj({"token": Str(),
                                                                                      "logprob": _LOGPROB})))})))},
               what="chat logprobs {content: [...]}")
_TEXT_LP = Obj(optional={"tokens": Nullable(ListOf(str)),
                         "top_logprobs": Nullable(ListOf(Nullable(MapOf(_LOGPROB))))},
               what="completions logprobs {tokens, top_logprobs}")
ANSWER = Obj({"choices": ListOf(Obj(optional={"logprobs": Nullable(OneOf(_CHAT_LP, _TEXT_LP))}), min_len=1)},
             what="an answer {choices: [...]}")


def parse_logprobs(response: dict) -> tuple[list[str], list[dict[str, float]]]:
    """(generated tokens, top-k {token: logprob} per position) from a chat or completions response."""
    choice = response["choices"][0]
    lp = choice.get("logprobs")
    if not lp:
        raise ValueError("response has no logprobs: does the server support logprobs / top_logprobs?")
    if "content" in lp:  # chat: [{token, logprob, top_logprobs: [{token, logprob}]}]
        entries = lp["content"] or []
        tokens = [e["token"] for e in entries]
        tops = [{t["token"]: t["logprob"] for t in (e.get("top_logprobs") or [])} for e in entries]
        return tokens, tops
    tokens = list(lp.get("tokens") or [])  # completions: tokens, top_logprobs: [{token: logprob}]
    tops = [dict(t or {}) for t in (lp.get("top_logprobs") or [])]
    return tokens, tops


def topk_kl(a: dict[str, float], b: dict[str, float]) -> float:
    """KL(A || B) in nats from two top-k logprob dicts (see the module docstring for the missing mass)."""
    union = set(a) | set(b)

    def complete_dist(top: dict[str, float]) -> dict[str, float]:
        p = {t: math.exp(lp) for t, lp in top.items()}
        rest = max(0.0, 1.0 - math.fsum(p.values()))
        missing = [t for t in union if t not in p]
        # A token outside this side's top-k is at most as likely as its k-th token: without that cap a flat
        # tail (a small model, or any long tail) hands each missing token a huge share and inflates KL.
        share = min(rest / (len(missing) + 1), min(p.values(), default=rest))
        for t in missing:
            p[t] = share
        p[None] = rest - share * len(missing)  # everything outside the union
        return p

    pa, pb = complete_dist(a), complete_dist(b)
    return math.fsum(pa[t] * math.log(max(pa[t], EPS) / max(pb[t], EPS)) for t in pa if pa[t] > 0)


def compare_sequences(tokens_a: list[str], tops_a: list[dict], tokens_b: list[str], tops_b: list[dict]) -> dict:
    n_max = max(len(tokens_a), len(tokens_b))
    n_min = min(len(tokens_a), len(tokens_b))
    first_div = next((i for i in range(n_min) if tokens_a[i] != tokens_b[i]), None)
    if first_div is None and len(tokens_a) != len(tokens_b):
        first_div = n_min  # one stopped earlier
    same = sum(1 for i in range(n_min) if tokens_a[i] == tokens_b[i])
    upto = n_min if first_div is None else first_div
    # position first_div itself still has identical contexts: its distributions are comparable too
    kl_positions = range(min(upto + (first_div is not None), n_min, len(tops_a), len(tops_b)))
    kls = [topk_kl(tops_a[i], tops_b[i]) for i in kl_positions if tops_a[i] and tops_b[i]]
    return {
        "tokens_a": len(tokens_a),
        "tokens_b": len(tokens_b),
        "identical_token_frac": same / n_max if n_max else 1.0,
        "first_divergence": first_div,  # None: identical
        "kl_mean": math.fsum(kls) / len(kls) if kls else None,
        "kl_max": max(kls) if kls else None,
        "kl_positions": len(kls),
    }


async def record(ep: Endpoint, client: httpx.AsyncClient, prompts: list[tuple[str, str]], max_tokens: int,
                 top_k: int, progress=None) -> dict:
    """Greedy generations with top-k logprobs from one endpoint, prompt by prompt: half of an A/B.

    Kept in the result JSON, so two servers that cannot run side by side (two 122B servers do not fit in one
    Spark) are compared later with `onespark bench compare A.json B.json`.
    """
    # chat: logprobs is a flag and top_logprobs the count; completions: logprobs is the count
    lp = {"logprobs": True, "top_logprobs": top_k} if ep.api == "chat" else {"logprobs": top_k}
    extra = {**lp, "return_tokens_as_token_ids": True}
    rows = []
    for name, prompt in prompts:
        answer = await complete(client, ep, prompt, max_tokens, dict(extra))
        shape.check(answer, ANSWER, f"{ep.base_url}: the answer to prompt {name!r}",
                    "quality needs a server that returns top_logprobs (vLLM does)")
        try:
            tokens, tops = parse_logprobs(answer)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:  # an answer of another shape
            raise UserError(f"{ep.base_url}: the answer to prompt {name!r} carries no usable logprobs ({e}): "
                            f"quality needs a server that returns top_logprobs (vLLM does)") from None
        rows.append({"group": name, "prompt": prompt, "tokens": tokens, "top_logprobs": tops})
        if progress is not None:
            progress.step()
    return {"rows": rows, "top_k": top_k, "max_tokens": max_tokens, "api": ep.api}


def compare_records(a: dict, b: dict) -> dict:
    """The A/B figures from two recordings of the same prompts (matched by name and prompt text)."""
    if (a["top_k"], a["max_tokens"]) != (b["top_k"], b["max_tokens"]):
        raise ValueError(f"recorded with different settings: top_k {a['top_k']} vs {b['top_k']}, "
                         f"max_tokens {a['max_tokens']} vs {b['max_tokens']}")
    rows_b = {(r["group"], r["prompt"]): r for r in b["rows"]}
    rows = []
    for ra in a["rows"]:
        rb = rows_b.get((ra["group"], ra["prompt"]))
        if rb is not None:
            rows.append({"group": ra["group"], **compare_sequences(ra["tokens"], ra["top_logprobs"], rb["tokens"],
                                                                   rb["top_logprobs"])})
    if not rows:
        raise ValueError("the two recordings share no prompt")
    kl_all = [r["kl_mean"] for r in rows if r["kl_mean"] is not None]
    return {
        "rows": rows,
        "identical_token_frac": summarize(r["identical_token_frac"] for r in rows),
        "all_identical": all(r["first_divergence"] is None for r in rows),
        "first_divergence_min": min((r["first_divergence"] for r in rows if r["first_divergence"] is not None),
                                    default=None),
        "kl_mean": summarize(kl_all),
        "top_k": a["top_k"],
        "max_tokens": a["max_tokens"],
    }


async def run_ab(ep_a: Endpoint, ep_b: Endpoint, client_a: httpx.AsyncClient, client_b: httpx.AsyncClient,
                 prompts: list[tuple[str, str]], max_tokens: int, top_k: int, progress=None) -> dict:
    """Both halves live, one endpoint after the other, then the comparison."""
    rec_a = await record(ep_a, client_a, prompts, max_tokens, top_k, progress)
    rec_b = await record(ep_b, client_b, prompts, max_tokens, top_k, progress)
    return {**compare_records(rec_a, rec_b), "record_a": rec_a, "record_b": rec_b}
