"""The Spark model: single-stream decode tok/s on one DGX Spark (GB10), estimated from vLLM decode steps measured on
a Hopper GPU and calibrated against every published one-Spark figure for Qwen3.5-122B-A10B (and its 35B sibling).

  onespark bench spark-model [--steps spark_steps_GPU.json] [--write bench/results/spark_model.json]

A Spark step = bytes it reads / BW  +  k x (the GPU's step time - the GPU's bytes / the GPU's bandwidth)
tok/s        = tokens a step (an input: the acceptance a source published) / the Spark step

Bytes come from the shapes, by part (routed and shared experts, attention and GDN projections, routers, LM head,
KV cache, GDN states, the drafter's weights and head). Three parameters are fitted on the published points:
`bw` (the GB10's effective bandwidth), `k` (its time beyond bytes over the GPU's: what its smaller, latency-bound
kernels cost) and `rho` (how far the tokens of one verify step route to different experts: 1 = independent, as
separate requests; drafted tokens follow one another, so fewer distinct experts are read). `rho` is found on a
grid, `bw` and `k` by least squares in closed form (relative errors), so a fit has one answer. Each published
point is also estimated from a fit without it (leave-one-out); the band quoted with every estimate is the
root-mean-square of those leave-one-out errors.

Everything here is an estimate; no Spark ran it. Every input names its source.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import math
from pathlib import Path

from onespark.errors import UserError
from onespark.model import qwen35, specs

# The GPU's own bandwidth for the split into bytes and the time beyond them: a device-to-device copy measured on
# each card (read + write counted), as the step benchmark used it.
GPU_BW = {"h200": 4.3e12, "h100": 3.0e12}
SPARK_PEAK_BW = 273e9  # the GB10's LPDDR5x, published: the fitted `bw` is read against it
KV_BYTES = {"auto": 1024, "turboquant_k4v4": 264}  # per token and KV head at head_dim 256: BF16 K+V; K4V4 codes
DRAFT_VOCAB_ROWS = 32768  # the MTP draft's vocabulary subset (onespark draft-vocab's default size)
SHORT_CTX = 8192  # up to here a step's time beyond bytes is taken from the 1K measurement
GOAL_TOK_S = 65.0  # issue 57's target for the 122B at 1K context
E2E = "e2e: tokens / wall time, prefill included (albond's bench_qwen35.sh)"
DECODE = "decode only"


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one engine step of one request reads: the model and the techniques on."""

    model: str = "qwen3.5-122b-a10b"
    fp8_shared: bool = True
    int8_head: bool = True
    drafter: str | None = None  # None, "mtp" or "dflash"
    draft_tokens: int = 0
    draft_subset: bool = False  # the MTP draft's 32K-row INT8 head
    mtp_expert_bits: int | None = None  # None: as the release stores them (122B: 16, 35B: 4)
    kv: str = "auto"
    ctx: int = 1024
    requests: int = 1  # a batch of one-token requests (how a verify's q_len is measured on the GPU)

    @property
    def q(self) -> int:
        """Tokens each request sends through the target in one step: 1, or a verify of 1 + drafts."""
        return 1 + self.draft_tokens


# ---- bytes a step --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _tc(model: str) -> dict:
    tc = dict(specs.get(model).text)
    tc["layer_types"] = qwen35.layer_types(tc)
    return tc


def _int4(n: float) -> float:
    return n * (0.5 + 2 / 128)  # AutoRound INT4: half a byte + a 16-bit scale per group of 128


def _sixteen_bit(prefix: str) -> bool:
    """Linear layers the Intel AutoRound releases keep 16-bit beside the INT4 ones (onespark.checkpoint.synth's
    quantization_config): routers, the GDN layers' in_proj_a/b, mtp.fc, and the MTP layer's shared expert."""
    return bool(qwen35.INT4_ALWAYS_16BIT.search(prefix)) or prefix.endswith(("in_proj_a", "in_proj_b")) \
        or prefix == "mtp.fc" or (prefix.startswith("mtp.") and ".shared_expert." in prefix)


def distinct_experts(e: int, k: int, requests: int, q: int, rho: float) -> float:
    """Expected distinct routed experts a layer reads: `requests` independent requests of q tokens, each verify
    token after the first counting as rho of an independent token (rho = 1: every token picks its k at random)."""
    return e * (1 - (1 - k / e) ** (requests * (1 + (q - 1) * rho)))


@functools.lru_cache(maxsize=None)
def _sizes(model: str) -> dict:
    """The model's linear layers summed by how a step reads them (parameters, or bytes where the format is
    fixed): computed once per model from onespark.model.qwen35's module list."""
    tc = _tc(model)
    z = dict.fromkeys(("per_expert", "shared", "lm_head", "lm_head_rows", "router", "dense", "mtp_fixed_16",
                       "mtp_fixed_q", "mtp_per_expert"), 0.0)
    for m in qwen35.language_modules({"text_config": tc}):
        if not isinstance(m, qwen35.Linear):
            continue
        n = m.out * m.inp
        if ".mlp.experts." in m.prefix:
            z["per_expert"] += _int4(n) if ".layers.0.mlp.experts.0." in m.prefix else 0
        elif ".shared_expert." in m.prefix:
            z["shared"] += n
        elif m.prefix == "lm_head":
            z["lm_head"], z["lm_head_rows"] = n, m.out
        elif qwen35.INT4_ALWAYS_16BIT.search(m.prefix):
            z["router"] += 2 * n
        else:
            z["dense"] += 2 * n if _sixteen_bit(m.prefix) else _int4(n)
    for m in qwen35.mtp_modules({"text_config": tc}):
        if not isinstance(m, qwen35.Linear):
            continue
        n = m.out * m.inp
        if ".mlp.experts." in m.prefix:
            z["mtp_per_expert"] += n if ".mlp.experts.0." in m.prefix else 0
        else:
            z["mtp_fixed_16" if _sixteen_bit(m.prefix) else "mtp_fixed_q"] += n
    return z


def target_bytes(s: Setup, rho: float) -> dict:
    """Bytes the target reads (and GDN states written) in one step, by part: the weights once, whatever the
    tokens; routed experts by the distinct ones; per request its KV cache and, for its GDN layers, the state read
    once and written after each verify position (vLLM keeps one per position, so a rejection can roll back)."""
    tc, z = _tc(s.model), _sizes(s.model)
    layers = tc["num_hidden_layers"]
    attn = tc["layer_types"].count("full_attention")
    state = tc["linear_num_value_heads"] * tc["linear_key_head_dim"] * tc["linear_value_head_dim"] * 4  # fp32
    return {
        "routed_experts": z["per_expert"] * layers * distinct_experts(
            tc["num_experts"], tc["num_experts_per_tok"], s.requests, s.q, rho),
        "shared_experts": z["shared"] * (1 + 4 / (128 * 128)) if s.fp8_shared else 2 * z["shared"],
        "attention_and_gdn": z["dense"],
        "router": z["router"],
        "lm_head": z["lm_head"] + 4 * z["lm_head_rows"] if s.int8_head else 2 * z["lm_head"],
        "kv_cache": attn * KV_BYTES[s.kv] * tc["num_key_value_heads"] * s.ctx * s.requests,
        "gdn_state": (layers - attn) * state * (1 + s.q) * s.requests,
    }


def drafter_bytes(s: Setup, rho: float) -> float:
    """Bytes the drafter reads in one step. MTP: n passes of its one decoder layer (the first over the q tokens
    just verified, the others over one) and of its head (the target's, or the 32K-row subset); DFlash: one
    parallel pass over its ~1.6 GB of weights (spec.dflash.size_gb, published) and the target's head once."""
    if s.drafter is None:
        return 0.0
    spec, tc, z = specs.get(s.model), _tc(s.model), _sizes(s.model)
    h, v = tc["hidden_size"], tc["vocab_size"]
    head = (v * h + 4 * v) if s.int8_head else 2 * v * h
    if s.drafter == "dflash":
        return spec.dflash.size_gb * 1e9 + head
    if s.draft_subset:
        head = DRAFT_VOCAB_ROWS * (h + 4) + 4 * DRAFT_VOCAB_ROWS  # rows, row scales, ids
    fixed = 2 * z["mtp_fixed_16"] + z["mtp_fixed_q"] * (2 if spec.mtp_dtype == "bf16" else 0.5 + 2 / 128)
    bits = s.mtp_expert_bits or (16 if spec.mtp_dtype == "bf16" else 4)
    per_expert = z["mtp_per_expert"] * (2 if bits == 16 else 0.5 + 2 / 128)
    e, k = tc["num_experts"], tc["num_experts_per_tok"]
    experts = distinct_experts(e, k, s.requests, s.q, rho) + (s.draft_tokens - 1) * distinct_experts(e, k, s.requests, 1, 1)
    kv = KV_BYTES["auto"] * tc["num_key_value_heads"] * s.ctx * s.requests  # its one attention layer
    return s.draft_tokens * (fixed + head + kv) + experts * per_expert


def step_bytes(s: Setup, rho: float) -> dict:
    parts = target_bytes(s, rho)
    parts["drafter"] = drafter_bytes(s, rho)
    parts["total"] = sum(parts.values())
    return parts


# ---- GPU step times ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Step:
    """A decode step measured inside vLLM 0.26.0 (real shapes, dummy weights, CUDA graphs, batch of `requests`)."""

    setup: Setup
    ms: float
    gpu: str
    commit: str
    attention: str  # the backend of the target's attention layers


_122B, _35B = "qwen3.5-122b-a10b", "qwen3.5-35b-a3b"
_STOCK = {"fp8_shared": False, "int8_head": False}
_MTP2 = {"drafter": "mtp", "draft_tokens": 2}
_K4V4 = {"kv": "turboquant_k4v4"}
# The committed step times (vLLM 0.26.0 on one H200; median of 64 steps; docs/status.md, "vLLM on a GPU"). MTP-2
# rows: random weights accept no drafts, so each is one verify of 3 tokens and the drafter's 2 passes.
STEPS = (
    Step(Setup(_122B, **_STOCK), 6.263, "h200", "222ae6e", "TRITON_ATTN"),
    Step(Setup(_122B, **_STOCK, requests=4), 6.813, "h200", "222ae6e", "TRITON_ATTN"),
    Step(Setup(_122B, **_STOCK, ctx=32768), 8.320, "h200", "222ae6e", "TRITON_ATTN"),
    Step(Setup(_122B), 6.237, "h200", "a907969", "TRITON_ATTN"),
    Step(Setup(_122B, requests=4), 6.506, "h200", "a907969", "TRITON_ATTN"),
    Step(Setup(_122B, ctx=32768), 8.299, "h200", "a907969", "TRITON_ATTN"),
    Step(Setup(_122B, **_MTP2), 8.19, "h200", "e1593ff", "FLASH_ATTN"),
    Step(Setup(_122B, **_MTP2, ctx=32768), 12.93, "h200", "e1593ff", "FLASH_ATTN"),
    Step(Setup(_122B, **_MTP2, ctx=131072), 11.28, "h200", "e1593ff", "FLASH_ATTN"),
    Step(Setup(_122B, **_MTP2, **_K4V4), 8.348, "h200", "e1593ff", "CUSTOM (onespark TurboQuant)"),
    Step(Setup(_122B, **_MTP2, **_K4V4, ctx=32768), 8.962, "h200", "e1593ff", "CUSTOM (onespark TurboQuant)"),
    Step(Setup(_122B, **_MTP2, **_K4V4, ctx=131072), 10.029, "h200", "e1593ff", "CUSTOM (onespark TurboQuant)"),
    Step(Setup(_35B, **_STOCK), 4.366, "h200", "31d0a36", "TRITON_ATTN"),
    Step(Setup(_35B), 4.085, "h200", "31d0a36", "TRITON_ATTN"),
    Step(Setup(_35B, requests=4), 4.455, "h200", "31d0a36", "TRITON_ATTN"),
    Step(Setup(_35B, **_MTP2), 10.396, "h200", "e1593ff", "TRITON_ATTN"),
)


def _read_json(flag: str, path: str, name: str):
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"cannot read {flag} {path}: {e.strerror}") from e
    except ValueError as e:
        raise UserError(f"{flag} {path} is not JSON ({e}): give a {name} result") from e


def load_steps(path: str) -> tuple[Step, ...]:
    """A tests/gpu_vllm/spark_steps.py result: the product configuration's decode step at batch 1..13 (the
    verify proxy) on its card."""
    data = _read_json("--steps", path, "spark_steps_<gpu>.json")
    if not isinstance(data, dict) or data.get("gpu") not in GPU_BW or not isinstance(data.get("engines"), list):
        raise UserError(f"--steps {path}: not a spark_steps result of a known GPU ({', '.join(GPU_BW)}): give the "
                        "JSON tests/gpu_vllm/spark_steps.py wrote")
    cold = next((e for e in data["engines"] if e.get("name") == "cold"), {})
    out = []
    for p in cold.get("points", []):
        if isinstance(p, dict) and isinstance(p.get("batch"), int) and isinstance(p.get("step_ms"), (int, float)):
            out.append(Step(Setup(_122B, ctx=int(p.get("ctx", 1024)), requests=p["batch"]), float(p["step_ms"]),
                            data["gpu"], str(data.get("git_sha", "?"))[:7], "TRITON_ATTN"))
    if not out:
        raise UserError(f"--steps {path}: its cold engine measured no point (see its `error`)")
    return tuple(out)


def beyond_bytes_ms(step: Step, rho: float = 1.0) -> float:
    """The GPU's time beyond its bytes: the step less its bytes at the card's copy bandwidth (at least 0)."""
    return max(step.ms - 1e3 * step_bytes(step.setup, rho)["total"] / GPU_BW[step.gpu], 0.0)


def _find(steps, **want) -> Step | None:
    """The step measured with these setup fields (and no drafter unless asked); None where none was."""
    want = {"drafter": None, "draft_tokens": 0, "kv": "auto", "ctx": 1024, "requests": 1} | want
    hits = [s for s in steps if all(getattr(s.setup, k) == v for k, v in want.items() if k != "flags")]
    flags = want.get("flags")
    return next((s for s in hits if (s.setup.fp8_shared, s.setup.int8_head) == flags), hits[0] if hits else None)


def target_beyond_ms(steps, model: str, q: int, flags: tuple[bool, bool]) -> tuple[float, str]:
    """The target's time beyond bytes at q tokens a step: measured as a decode step of q one-token requests where
    that batch ran; else interpolated in q between the batches that ran (held beyond the largest)."""
    runs = {}
    for s in steps:
        st = s.setup
        if st.model == model and st.drafter is None and st.ctx == 1024 and st.kv == "auto":
            if st.requests not in runs or (st.fp8_shared, st.int8_head) == flags:
                runs[st.requests] = s
    if not runs:
        raise UserError(f"no decode step of {model} to scale")
    if q in runs:
        s = runs[q]
        return beyond_bytes_ms(s), f"{s.gpu} {s.commit}: batch {q}"
    lo = max((b for b in runs if b < q), default=min(runs))
    hi = min((b for b in runs if b > q), default=max(runs))
    x_lo, x_hi = beyond_bytes_ms(runs[lo]), beyond_bytes_ms(runs[hi])
    x = x_lo if hi == lo else x_lo + (x_hi - x_lo) * (q - lo) / (hi - lo)
    return x, f"{runs[lo].gpu}: batches {lo}..{hi}, interpolated at {q}" if hi != lo else f"{runs[lo].gpu}: batch {lo}, held"


def beyond_ms(steps, s: Setup) -> tuple[float, str, Step | None]:
    """The GPU time beyond bytes that stands for this setup's step, where it comes from, and the step measured in
    this very setup (model, drafter, cache, context) if one was; the FP8/INT8 switches change bytes, not this."""
    flags = (s.fp8_shared, s.int8_head)
    same = _find(steps, model=s.model, drafter=s.drafter, draft_tokens=s.draft_tokens, kv=s.kv, ctx=s.ctx, flags=flags)
    if same is not None:
        return beyond_bytes_ms(same), f"{same.gpu} {same.commit} ({same.attention})", same
    if 1024 < s.ctx <= SHORT_CTX:  # attention is a small part of a step this short: the 1K time stands for it
        x, src, _ = beyond_ms(steps, dataclasses.replace(s, ctx=1024))
        return x, src + f" (1K measured, used at {s.ctx})", None
    if s.drafter is None or s.ctx != 1024 or s.kv != "auto":
        raise UserError(f"no GPU step stands for {s}: measure it (tests/gpu_vllm/spark_steps.py)")
    x_t, src = target_beyond_ms(steps, s.model, s.q, flags)
    mtp2 = _find(steps, model=s.model, drafter="mtp", draft_tokens=2)
    x3, _ = target_beyond_ms(steps, s.model, 3, flags)
    per_pass = max(beyond_bytes_ms(mtp2) - x3, 0.0) / 2 if mtp2 else 0.0
    if s.drafter == "mtp":
        return x_t + s.draft_tokens * per_pass, f"target {src} + {s.draft_tokens} MTP passes (from MTP-2)", None
    # DFlash: one pass of 6 decoder layers and the head: the MTP pass (1 layer and the head) + 5 layers of the
    # target's q = 1 time beyond bytes (num_hidden_layers of it)
    x1, _ = target_beyond_ms(steps, s.model, 1, flags)
    layers = _tc(s.model)["num_hidden_layers"]
    return x_t + per_pass + 5 * x1 / layers, f"target {src} + one DFlash pass (estimated from its 6 layers)", None


# ---- published points ----------------------------------------------------------------------------------------

ALBOND = "albond/DGX_Spark_Qwen3.5-122B-A10B-AR-INT4 README, Results table (vLLM 0.19.1, FlashInfer, one Spark)"
ENTRPI = "Entrpi/qwen3.5-122B-A10B-on-spark README and docs/FINDINGS.md (vLLM 0.23, one Spark, c=1)"
MTP1_ACCEPT = ("1.95: MTP-1 accepts 95% (albond's NVIDIA developer-forum thread 'Qwen3.5-122B-A10B on single Spark: "
               "up to 51 tok/s', which reports 38.4 as MTP-1; the README's 'What didn't work' says the same)")
MTP2_ACCEPT = ("2.71 = 1 + 0.95 + 0.95 x 0.80: MTP-1's 95% (forum thread) and '~80% acceptance rate on position 2' "
               "(albond README, Optimization 3), read as conditional; not published as a mean")


@dataclasses.dataclass(frozen=True)
class Point:
    """A published single-stream tok/s on one Spark, with what it ran and its tokens a step (an input)."""

    source: str
    config: str
    setup: Setup
    tok_s: float
    tokens_per_step: float
    tokens_source: str
    harness: str
    in_fit: bool = True
    note: str = ""


def _dflash(n: int, **kw) -> Setup:
    return Setup(drafter="dflash", draft_tokens=n, **kw)


POINTS = (
    Point(ALBOND, "stock: INT4, BF16 shared experts and head", Setup(**_STOCK), 28.3, 1.0, "no drafter", E2E),
    Point(ALBOND, "hybrid (FP8 shared experts)", Setup(int8_head=False), 30.8, 1.0, "no drafter", E2E),
    Point(ALBOND, "hybrid + MTP-1 (v1)", Setup(int8_head=False, drafter="mtp", draft_tokens=1), 38.4, 1.95,
          MTP1_ACCEPT, E2E, note="the README's table labels this row MTP-2; its text and the forum thread say MTP-1"),
    Point(ALBOND, "v2: hybrid + MTP-2 + INT8 head", Setup(**_MTP2), 51.0, 2.71, MTP2_ACCEPT, E2E),
    Point(ALBOND, "v2-tq (albond's TurboQuant)", Setup(**_MTP2, **_K4V4), 39.0, 2.71, MTP2_ACCEPT, E2E, in_fit=False,
          note="not reproducible here: albond's TurboQuant is another implementation (3.5-bit cache, Triton attention "
               "in place of FlashInfer, piecewise CUDA graphs: the README's -22%), never measured by this project; "
               "the estimate is onespark's K4V4 in full graphs"),
    Point("albond README ('the same stack ... 112 tok/s'); adrianpuiu/DGX_Spark_Qwen3.5-35B-A3B-Optimized: 112.8",
          "35B: INT4 + INT8 head + MTP-2 (no hybrid)", Setup(_35B, fp8_shared=False, **_MTP2), 112.0, 2.71,
          MTP2_ACCEPT + "; the 35B's own acceptance is not published: the 122B's is assumed", E2E),
    Point(ENTRPI, "base: plain INT4, no speculative decoding", Setup(**_STOCK), 28.2, 1.0, "no drafter", DECODE),
    Point(ENTRPI, "hybrid + INT8 head, no speculative decoding", Setup(), 36.0, 1.0, "no drafter", DECODE),
    Point(ENTRPI, "MTP-2, plain INT4 (Hermes agent turns)", Setup(**_STOCK, **_MTP2, ctx=6144), 39.9, 2.88,
          "2.88: MTP-2's acceptance length on the same Hermes turns (Entrpi docs/FINDINGS.md, section 2)", DECODE,
          note="README: '~40 tok/s Hermes'; ~6K-token tool-call contexts"),
    Point(ENTRPI, "DFlash n=12, plain INT4", _dflash(12, **_STOCK), 53.7, 6.5,
          "6.5: the acceptance length Entrpi's README gives for this run ('albond-bench e2e (6.5)')", E2E),
    Point(ENTRPI, "DFlash n=12 + hybrid + INT8 head (INT8 head shared by the drafter)", _dflash(12), 59.0, 6.4,
          "6.4: the acceptance length Entrpi's README gives for this run ('albond-bench (acc 6.4)')", E2E),
    # Published beside those, not in the fit: checks the fit never saw.
    Point(ENTRPI, "hybrid only, no speculative decoding", Setup(int8_head=False), 30.4, 1.0, "no drafter", DECODE,
          in_fit=False, note="held out: FINDINGS.md's lever table"),
    Point(ENTRPI, "INT8 head only, no speculative decoding", Setup(fp8_shared=False), 32.7, 1.0, "no drafter",
          DECODE, in_fit=False, note="held out: FINDINGS.md's lever table"),
    Point(ENTRPI, "MTP-2, plain INT4 (prose)", Setup(**_STOCK, **_MTP2), 33.7, 2.24, "2.24 (FINDINGS.md, section 2)",
          DECODE, in_fit=False, note="held out: the workload bank"),
    Point(ENTRPI, "MTP-2, plain INT4 (code)", Setup(**_STOCK, **_MTP2), 40.5, 2.77, "2.77 (FINDINGS.md, section 2)",
          DECODE, in_fit=False, note="held out: the workload bank"),
    Point(ENTRPI, "DFlash n=12, plain INT4 (code)", _dflash(12, **_STOCK), 54.5, 5.4, "5.4 (FINDINGS.md, section 2)",
          DECODE, in_fit=False, note="held out: the workload bank"),
    Point(ENTRPI, "DFlash n=12, plain INT4 (Hermes agent turns)", _dflash(12, **_STOCK, ctx=6144), 81.0, 8.66,
          "8.66 (FINDINGS.md, section 2)", DECODE, in_fit=False, note="held out: the workload bank ('~81')"),
)


# ---- the fit -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Fit:
    bw: float  # bytes/s
    k: float
    rho: float


def spark_ms(fit: Fit, s: Setup, x_ms: float) -> float:
    return 1e3 * step_bytes(s, fit.rho)["total"] / fit.bw + fit.k * x_ms


def _ls(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """min over a > 0, k >= 0 of sum (a u + k v - 1)^2 (relative errors of the step time): the two normal
    equations, else k = 0. Returns (a, k, the sum)."""
    suu = sum(u * u for u, _, _ in rows)
    svv = sum(v * v for _, v, _ in rows)
    suv = sum(u * v for u, v, _ in rows)
    su, sv = sum(u for u, _, _ in rows), sum(v for _, v, _ in rows)
    det = suu * svv - suv * suv
    a, k = ((su * svv - sv * suv) / det, (sv * suu - su * suv) / det) if det > 1e-18 else (0.0, -1.0)
    if k < 0 or a <= 0:
        a, k = su / suu, 0.0
    return a, k, sum((a * u + k * v - 1) ** 2 for u, v, _ in rows)


def fit_points(obs: list[tuple[Setup, float, float]]) -> Fit:
    """The parameters that fit (setup, GPU time beyond bytes in ms, observed Spark step in ms) best: rho on a grid
    of 0.01 and then to 0.0005 around the best, bw and k in closed form at each rho."""
    def at(rho):
        rows = [(step_bytes(s, rho)["total"] / (t * 1e-3), x / t, t) for s, x, t in obs]
        a, k, err = _ls(rows)
        return err, Fit(bw=1 / a, k=k, rho=rho)

    best = min((at(r / 100) for r in range(1, 101)), key=lambda x: x[0])
    lo = best[1].rho
    best = min((at(max(min(lo + d / 2000, 1.0), 0.0005)) for d in range(-20, 21)), key=lambda x: x[0])
    return best[1]


def observed(p: Point) -> float:
    """The Spark step the published figure implies, in ms: tokens a step / tok/s."""
    return 1e3 * p.tokens_per_step / p.tok_s


def calibrate(steps) -> dict:
    """The fit on every point marked in_fit, each point's estimate from it, and each fitted point's estimate from
    a fit without it."""
    xs = {p: beyond_ms(steps, p.setup)[0] for p in POINTS}
    fitted = [p for p in POINTS if p.in_fit]
    fit = fit_points([(p.setup, xs[p], observed(p)) for p in fitted])
    rows = []
    for p in POINTS:
        est = p.tokens_per_step / (spark_ms(fit, p.setup, xs[p]) / 1e3)
        if p.in_fit:
            loo_fit = fit_points([(q.setup, xs[q], observed(q)) for q in fitted if q is not p])
            loo = p.tokens_per_step / (spark_ms(loo_fit, p.setup, xs[p]) / 1e3)
        else:
            loo = est  # the fit never saw it
        rows.append((p, est, loo))
    errs = [(loo - p.tok_s) / p.tok_s for p, _, loo in rows if p.in_fit]
    band = math.sqrt(sum(e * e for e in errs) / len(errs))
    return {"fit": fit, "rows": rows, "band": band, "x": xs}


# ---- the configurations --------------------------------------------------------------------------------------

def dflash_tokens(n: int, at12: float = 6.4) -> float:
    """Tokens a step of DFlash with n drafts from the one published length at n = 12 (Entrpi, albond's bench):
    a constant chance a of accepting each next draft, so tokens = (1 - a^(n+1)) / (1 - a); a solved at n = 12."""
    lo, hi = 0.0, 0.9999
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if (1 - a ** 13) / (1 - a) < at12 else (lo, a)
    return (1 - a ** (n + 1)) / (1 - a)


SUBSET_ACCEPT = MTP2_ACCEPT + "; assumed unchanged by the subset (a token outside it cannot be drafted: not measured)"
INT4_ACCEPT = MTP2_ACCEPT + "; assumed unchanged by INT4 experts (the 35B release's MTP layer is INT4: not measured)"
CONFIGS = (  # (name, setup, tokens a step, its source, safe as a default: why not, or "")
    ("v2: MTP-2 (albond's composition, full draft head)", Setup(**_MTP2), 2.71, MTP2_ACCEPT, ""),
    ("v2 + draft vocabulary subset", Setup(**_MTP2, draft_subset=True), 2.71, SUBSET_ACCEPT, ""),
    ("v2 + MTP layer's experts at 4 bits", Setup(**_MTP2, mtp_expert_bits=4), 2.71, INT4_ACCEPT,
     "no step writes INT4 MTP experts yet"),
    ("v2 + subset + MTP experts at 4 bits", Setup(**_MTP2, draft_subset=True, mtp_expert_bits=4), 2.71, INT4_ACCEPT,
     "no step writes INT4 MTP experts yet"),
    *((f"DFlash n={n} + hybrid + INT8 head", _dflash(n), round(dflash_tokens(n), 2),
       "6.4 at n=12 (Entrpi README, albond's bench)" if n == 12 else
       f"{dflash_tokens(n):.2f}: from 6.4 at n=12 by a constant per-draft acceptance (an assumption; only n=12 is "
       "published)", "the drafter has no public pinned revision (docs/guides/tracks.md); not served on a GB10 here")
      for n in (6, 8, 10, 12)),
    *((f"v2 at {c // 1024}K (BF16 cache)", Setup(**_MTP2, ctx=c), 2.71, MTP2_ACCEPT, "") for c in (32768, 131072)),
    *((f"v2-tq at {c // 1024}K (TurboQuant K4V4)", Setup(**_MTP2, **_K4V4, ctx=c), 2.71, MTP2_ACCEPT, "")
      for c in (1024, 32768, 131072)),
)


def configuration(steps, fit: Fit, band: float, name: str, s: Setup, tokens: float, source: str, unsafe: str) -> dict:
    x, x_src, measured = beyond_ms(steps, s)
    ms = spark_ms(fit, s, x)
    tok_s = tokens / (ms / 1e3)
    gpu_ms = measured.ms if measured else 1e3 * step_bytes(s, 1.0)["total"] / GPU_BW["h200"] + x
    return {
        "config": name, "context": s.ctx,
        "gpu": f"{measured.gpu} {measured.commit}" if measured else "h200 (composed: " + x_src + ")",
        "step_ms_gpu": round(gpu_ms, 2), "gpu_step_measured": measured is not None,
        "gb_per_step": round(step_bytes(s, fit.rho)["total"] / 1e9, 2), "spark_ms_estimate": round(ms, 1),
        "tokens_per_step": tokens, "tokens_per_step_source": source, "estimate_tok_s": round(tok_s, 1),
        "band_tok_s": round(tok_s * band, 1), "safe_default": not unsafe, "not_default_because": unsafe or None,
        "goal_tokens_per_step": round(GOAL_TOK_S * ms / 1e3, 2),
        "goal_gb_per_step": round(max(tokens / GOAL_TOK_S * 1e3 - fit.k * x, 0) * fit.bw / 1e12, 2),
    }


def choose_default(rows: list[dict], band: float) -> dict:
    """The fastest safe configuration at 1K if it beats v2 by more than the band; else v2."""
    v2 = rows[0]
    safe = [r for r in rows if r["safe_default"] and r["context"] == 1024 and "v2-tq" not in r["config"]]
    best = max(safe, key=lambda r: r["estimate_tok_s"])
    pick = best if best["estimate_tok_s"] > v2["estimate_tok_s"] * (1 + band) else v2
    return {"config": pick["config"], "estimate_tok_s": pick["estimate_tok_s"], "band_tok_s": pick["band_tok_s"],
            "beats_v2_by_pct": round(100 * (pick["estimate_tok_s"] / v2["estimate_tok_s"] - 1), 1),
            "band_pct": round(100 * band, 1), "goal_tok_s": GOAL_TOK_S,
            "goal_met_by": [r["config"] for r in rows if r["context"] == 1024 and r["estimate_tok_s"] >= GOAL_TOK_S]}


# ---- engine starts ----------------------------------------------------------------------------------------------

# What the GPU run cannot give for the Spark's start: its SSD's read rate and how its CPU compares with the GPU
# host's for vLLM's start-up work (Dynamo tracing, Inductor and Triton code generation, ptxas, CUDA-graph capture:
# single-threaded Python and compiler work). Both are assumptions, given as ranges: NVIDIA publishes no read rate
# for the Spark's NVMe SSD (a PCIe NVMe drive reads 3-7 GB/s sequentially), and the GB10's Cortex-X925 cores are
# taken as 0.8-1.5x the GPU host's time on that work. On the Spark the checkpoint is read from the SSD at every
# start: the engine takes 0.82 of the 128 GB for itself, so the page cache cannot keep 71 GB of safetensors.
SPARK_DISK_GB_S = (3.0, 7.0)
SPARK_CPU_TIME = (0.8, 1.5)
START_PHASES = ("model_load_s", "compile_s", "compile_cache_load_s", "profiling_s", "graph_capture_s",
                "init_engine_s")


def load_start(path: str) -> dict:
    """A tests/gpu_vllm/spark_steps.py start result (spark_start_<gpu>.json): both engines' start-up, checked."""
    data = _read_json("--start", path, "spark_start_<gpu>.json")
    engines = data.get("engines") if isinstance(data, dict) else None
    if data is None or not isinstance(engines, list) or data.get("gpu") not in GPU_BW:
        raise UserError(f"--start {path}: not a spark_steps start result of a known GPU ({', '.join(GPU_BW)}): "
                        "give the JSON tests/gpu_vllm/spark_steps.py run --cold-batches 1,13 wrote")
    got = {e.get("name"): e for e in engines if isinstance(e, dict)}
    for name in ("cold", "restart"):
        e = got.get(name, {})
        if not isinstance(e.get("startup_s"), (int, float)) or not isinstance(e.get("phases"), dict):
            raise UserError(f"--start {path}: its {name} engine has no start-up time "
                            f"({str(e.get('error', 'missing'))[:200]}): run it again")
    return data


def starts(data: dict, model: str = _122B) -> list[dict]:
    """Each engine's start on the GPU and its Spark estimate (a range): the checkpoint read from the SSD, plus the
    GPU run's start less its weight loading (dummy weights there) at the Spark's CPU time. The low end takes the
    engine's construction (`LLM(...)`); the high end the child process's wall time from launch to exit, which also
    holds what `vllm serve` does before it (importing torch and vLLM) and, beyond a start, two timed requests and
    the shutdown: a bound from above, as no log line times the imports alone."""
    gb = specs.get(model).hybrid_gb
    rows = []
    for name in ("cold", "restart"):
        e = next(x for x in data["engines"] if x.get("name") == name)
        ph = {k: float(v) for k, v in e["phases"].items() if k in START_PHASES and isinstance(v, (int, float))}
        load = ph.get("model_load_s", 0.0)
        startup = float(e["startup_s"])
        wall = float(e["wall_s"]) if isinstance(e.get("wall_s"), (int, float)) and e["wall_s"] >= startup else startup
        low = gb / SPARK_DISK_GB_S[1] + (startup - load) * SPARK_CPU_TIME[0]
        high = gb / SPARK_DISK_GB_S[0] + (wall - load) * SPARK_CPU_TIME[1]
        rows.append({"engine": name, "gpu": data.get("device", data["gpu"]), "commit": data.get("git_sha"),
                     "startup_s_gpu": round(startup, 1), "process_wall_s_gpu": round(wall, 1), "phases_gpu": ph,
                     "spark_estimate_s": [round(low), round(high)], "checkpoint_gb": gb})
    return rows


# ---- the result and its tables -------------------------------------------------------------------------------

def model(steps=STEPS, start: dict | None = None) -> dict:
    cal = calibrate(steps)
    fit, band = cal["fit"], cal["band"]
    calibration = [{
        "source": p.source, "config": p.config, "context": p.setup.ctx, "published_tok_s": p.tok_s,
        "estimate_tok_s": round(est, 1), "loo_estimate_tok_s": round(loo, 1),
        "error_pct": round(100 * (est / p.tok_s - 1), 1), "loo_error_pct": round(100 * (loo / p.tok_s - 1), 1),
        "tokens_per_step": p.tokens_per_step, "tokens_per_step_source": p.tokens_source, "harness": p.harness,
        "in_fit": p.in_fit, "note": p.note or None} for p, est, loo in cal["rows"]]
    configurations = [configuration(steps, fit, band, *c) for c in CONFIGS]
    return {
        "kind": "onespark-spark-model", "schema_version": 1,
        "fit": {"bw_gb_s": round(fit.bw / 1e9, 1), "bw_of_peak": round(fit.bw / SPARK_PEAK_BW, 3),
                "k": round(fit.k, 3), "rho": round(fit.rho, 4), "band_pct": round(100 * band, 1),
                "points_in_fit": sum(p.in_fit for p in POINTS),
                "band_is": "root-mean-square of the leave-one-out errors of the points in the fit"},
        "calibration": calibration, "configurations": configurations,
        "default": choose_default(configurations, band),
        "starts": starts(start) if start else [],
        "starts_assume": {"spark_disk_gb_s": list(SPARK_DISK_GB_S), "spark_cpu_time": list(SPARK_CPU_TIME)},
        "steps": [{"model": s.setup.model, "setup": dataclasses.asdict(s.setup), "step_ms": s.ms, "gpu": s.gpu,
                   "commit": s.commit, "attention": s.attention} for s in steps],
        "note": "Estimates, not Spark measurements: GPU steps from vLLM 0.26.0 with dummy weights; tokens a step are "
                "published inputs; e2e points include prefill, which the model leaves out",
    }


def _table(title: str, headers: list[str], rows: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = "  ".join
    out = [title, line(h.ljust(w) for h, w in zip(headers, widths))]
    out += [line(str(x).ljust(w) for x, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def tables(result: dict) -> str:
    f = result["fit"]
    cal = _table(
        f"Calibration: every published one-Spark point (fit: bw {f['bw_gb_s']} GB/s = {100 * f['bw_of_peak']:.0f}% "
        f"of 273, k {f['k']}, rho {f['rho']}; band +-{f['band_pct']}% = RMS of leave-one-out errors)",
        ["published", "estimate", "err", "LOO", "LOO err", "fit", "tok/step", "ctx", "config (source)"],
        [[r["published_tok_s"], r["estimate_tok_s"], f"{r['error_pct']:+.1f}%", r["loo_estimate_tok_s"],
          f"{r['loo_error_pct']:+.1f}%" if r["in_fit"] else "-", "yes" if r["in_fit"] else "no",
          r["tokens_per_step"], r["context"], f"{r['config']} ({r['source'].split()[0]})"]
         for r in result["calibration"]])
    conf = _table(
        "Configurations on one Spark, single stream (estimates)",
        ["config", "ctx", "GPU ms", "GB/step", "Spark ms", "tok/step", "tok/s", "band", "for 65: tok/step or GB"],
        [[r["config"], r["context"], f"{r['step_ms_gpu']}{'' if r['gpu_step_measured'] else '*'}", r["gb_per_step"],
          r["spark_ms_estimate"], r["tokens_per_step"], r["estimate_tok_s"], f"+-{r['band_tok_s']}",
          f"{r['goal_tokens_per_step']} or {r['goal_gb_per_step']}"] for r in result["configurations"]])
    d = result["default"]
    tail = (f"* composed from other measured steps (see `gpu` in the JSON).\nDefault: {d['config']}: "
            f"{d['estimate_tok_s']} +- {d['band_tok_s']} tok/s (estimate; {d['beats_v2_by_pct']:+.1f}% over v2, band "
            f"+-{d['band_pct']}%). 65 tok/s met by: {', '.join(d['goal_met_by']) or 'none'}.")
    out = [cal, conf, tail]
    if result.get("starts"):
        a = result["starts_assume"]
        out.append(_table(
            f"Engine starts, 122B (GPU measured; Spark estimated: {a['spark_disk_gb_s'][0]:g}-{a['spark_disk_gb_s'][1]:g} "
            f"GB/s SSD, {a['spark_cpu_time'][0]:g}-{a['spark_cpu_time'][1]:g}x the GPU host's CPU time)",
            ["engine", "GPU start s", "process s", "compile", "cache load", "profiling", "graphs",
             "Spark s (estimate)"],
            [[r["engine"], r["startup_s_gpu"], r.get("process_wall_s_gpu", "-"), r["phases_gpu"].get("compile_s", "-"),
              r["phases_gpu"].get("compile_cache_load_s", "-"), r["phases_gpu"].get("profiling_s", "-"),
              r["phases_gpu"].get("graph_capture_s", "-"), f"{r['spark_estimate_s'][0]}-{r['spark_estimate_s'][1]}"]
             for r in result["starts"]]))
    return "\n\n".join(out)


def cli(write: str | None, steps_path: str | None, command: str, commit: str | None,
        start_path: str | None = None) -> int:
    steps = STEPS + (load_steps(steps_path) if steps_path else ())
    result = model(steps, load_start(start_path) if start_path else None)
    result.update(commit=commit, command=command, steps_file=steps_path, start_file=start_path,
                  date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    print(tables(result))
    if write:
        from onespark.bench.report import write_atomic

        write_atomic(write, json.dumps(result, indent=1) + "\n")
        print(f"wrote {write}")
    return 0

