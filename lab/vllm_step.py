"""The decode step of the real Qwen3.5 shapes inside vLLM on a GPU, one technique at a time, with dummy weights.

  python lab/vllm_step.py --out F.json [--models 122b,35b] [--configs stock,...] [--deadline-s 540]

Each (model, config) is a fresh vLLM engine in a child process (`--one`): `--load-format dummy` on the real
config.json (onespark.checkpoint.synth.make_config with the spec's real dims: AutoRound INT4 experts, 16-bit shared experts,
and for `fp8-shared` step 1's onespark_fp8 section), CUDA graphs and torch.compile on, prefix caching off (every
request prefills, so two runs of one prompt cost the same), TRITON_ATTN and Triton GDN prefill (the GPU lane's
wheel set: tests/gpu_vllm/). Configs, in the order they run (the deadline stops the list, never a config midway):

  stock        INT4 experts + BF16 shared experts, vLLM's BF16 LM head, no speculative decoding, BF16 KV cache
  product      + FP8 shared experts + onespark's INT8 head (the v2 image without MTP)
  mtp2         product + MTP-2: random weights accept ~no drafts, so each step is one verify step of 3 tokens per
               request plus the drafter's 2 steps (acceptance comes from the published runs: README)
  int8-head    stock + INT8 head only (separates the head from the FP8 shared experts)
  upstream-tq  product + upstream vLLM's TurboQuant KV cache (--kv-cache-dtype turboquant_4bit_nc, its backend)
  tq           product + onespark's TurboQuant K4V4 (--kv-cache-dtype turboquant_k4v4 --attention-backend CUSTOM),
               served from a copy of the installed vLLM with patches/turboquant-0.26.0.diff applied
               (harness.patched_vllm; the installed vLLM is not touched)
  tq-mtp2      tq + MTP-2: the v2-tq image's defaults (every step a 3-token verify in the TurboQuant decode kernel)
  mtp2-fa      mtp2 on vLLM's FLASH_ATTN backend (FlashAttention 3 on Hopper): the strongest BF16-cache baseline for
               a verify step in this wheel set (TRITON_ATTN does not split the context when a query is > 1 token)

Decode step = (last_token_ts - first_token_ts) / (generated - 1), vLLM's own per-request timestamps (engine core,
monotonic); each (context, batch) point is one request batch after a warm-up at every batch size (a Triton
kernel compiled while a point was timed is named in the run's jit_in_points). Bytes per step come from the
shapes (onespark.model.qwen35): weights each step reads once (8 of 256 experts per token, the expected number of
distinct experts for the batch's tokens), the KV cache of the 12 attention layers and the 36 GDN states. The
Spark estimate is bytes / 273 GB/s plus the H200's measured time beyond its own bytes / bandwidth: an estimate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

from onespark.bench.metrics import error_cause
from onespark.checkpoint import synth
from onespark.model import qwen35, specs

MODELS = {"122b": "qwen3.5-122b-a10b", "35b": "qwen3.5-35b-a3b"}
TQ = {"kv_cache_dtype": "turboquant_k4v4", "attention_backend": "CUSTOM"}  # onespark's TurboQuant, as v2-tq serves it
CONFIGS = {  # name -> (FP8 shared experts, INT8 head, MTP-2, extra engine kwargs)
    "stock": (False, False, False, {}),
    "product": (True, True, False, {}),
    "mtp2": (True, True, True, {}),
    "int8-head": (False, True, False, {}),
    "upstream-tq": (True, True, False, {"kv_cache_dtype": "turboquant_4bit_nc", "attention_backend": "TURBOQUANT"}),
    "tq": (True, True, False, TQ),
    "tq-mtp2": (True, True, True, TQ),
    "mtp2-fa": (True, True, True, {"attention_backend": "FLASH_ATTN"}),
}
# Configs served from a patched copy of vLLM: the diff (under patches/) that makes their KV-cache dtype exist
PATCHED = {name: "turboquant-0.26.0.diff" for name, (*_, extra) in CONFIGS.items() if extra is TQ}
# KV-cache bytes per token and KV head at head_dim 256, by --kv-cache-dtype: BF16 K and V; onespark's K4V4 (4-bit
# codes of K and V + two fp32 scales: kernels/turboquant.py); upstream's 4-bit preset as vLLM 0.26.0 sizes its
# slot (TurboQuantConfig.slot_size_aligned: 130 B of key + 132 of value). Every attention layer: upstream keeps
# boundary layers in BF16 only for dense models (get_boundary_skip_layers returns none for a hybrid)
KV_BYTES = {"auto": 1024, "turboquant_k4v4": 264, "turboquant_4bit_nc": 262}
H200_BW = 4.3e12  # B/s, a device-to-device copy on this workplace's H200 (read + write; KINDS.md, 2026-10-28)
SPARK_BW = 273e9  # B/s, the GB10's LPDDR5x (published)
DECODE_STEPS = 64
# CUDA graphs for the batch sizes measured (tokens per step: batch x (1 + drafts)), not vLLM's default 67 sizes:
# capture time is per size, and the call's budget is 10 minutes
CAPTURE_SIZES = [1, 2, 3, 4, 6, 8, 12, 16]
# A batch's prompts must prefill in one step: a request decoding while another's prefill chunks run pays for
# them (first H200 run, 222ae6e: 32K x 4 read 93.6 ms a step against 8.3 at batch 1), so a batch point runs
# only where batch x ctx fits one step's token budget
MAX_BATCHED_TOKENS = 16384


WARMED = "== warm-up done"  # the child's log line after its warm-up requests (jit_in_points starts judging there)


def point_key(ctx, batch) -> str:
    """A point's name in jit_in_points (its log line reads "... ctx N batch B: X ms/step")."""
    return f"ctx {ctx} batch {batch}"


def fits(ctx: int, batches: list[int]) -> list[int]:
    """The batch sizes measured at this context: all of a batch's prompts prefill in one step."""
    return [b for b in batches if b == 1 or ctx * b <= MAX_BATCHED_TOKENS]


def spec_counts(llm) -> dict:
    """vLLM's own speculative-decoding counters (drafts = verify steps, accepted draft tokens), summed."""
    counts = {"drafts": 0.0, "accepted": 0.0}
    for m in llm.get_metrics():
        name = m.name.removesuffix("_total")
        if name == "vllm:spec_decode_num_drafts":
            counts["drafts"] += m.value
        elif name == "vllm:spec_decode_num_accepted_tokens":
            counts["accepted"] += m.value
    return counts


def log_facts(text: str) -> dict:
    """What an engine's log says that the step time depends on: the CUDA-graph mode vLLM settled on when it
    lowered the requested one (FULL_AND_PIECEWISE -> PIECEWISE for a backend without full-graph support puts every
    attention and GDN layer of a decode step outside the graph), and for a failed start the first exception
    line, not vLLM's closing "Engine core initialization failed" (the root cause scrolls out of a tail)."""
    facts = {}
    modes = re.findall(r"setting cudagraph_mode=(\w+)", text)
    if modes:
        facts["cudagraph_mode"] = modes[-1]
    if cause := error_cause(text):
        facts["error_cause"] = cause
    if jit := jit_in_points(text):
        facts["jit_in_points"] = jit
    return facts


def jit_in_points(text: str) -> dict:
    """The Triton kernels vLLM's JIT monitor saw compiled (or loaded) while a point was timed, by point: a
    compile of seconds inside 64 steps adds tens of ms to each (bench/results/vllm_step_h200_122b_tq_mtp2.json:
    fused_moe_kernel in the 122B's first 1K x 4 point, 18.50 ms against 10.38 beside it). A point's window runs
    from the line before it (WARMED or the previous point) to its own line; the window before the first such line
    is the warm-up and not judged (in logs from before WARMED it also holds the first point)."""
    out, window, judged = {}, [], False
    for line in text.splitlines():
        if m := re.search(r"JIT compilation during inference: (\w+)", line):
            window.append(m.group(1))
        elif m := re.search(r" ctx (\d+) batch (\d+): [\d.]+ ms/step", line):
            if judged and window:
                out[point_key(m.group(1), m.group(2))] = window
            window, judged = [], True
        elif WARMED in line:
            window, judged = [], True
    return out


def write_config(out: Path, model: str, fp8_shared: bool) -> dict:
    spec = specs.get(MODELS[model])
    config = synth.make_config("int4", dict(spec.text), mtp_dtype=spec.mtp_dtype, vision=synth.REAL_VISION,
                               mixed_bits=spec.mixed_bits)
    if fp8_shared:  # what step 1 writes (onespark.checkpoint.hybrid._hybrid_config) for the spliced shared experts
        layers = [w[: -len(".weight")] for w in qwen35.shared_expert_weights(config)]
        config["quantization_config"][qwen35.HYBRID_KEY] = {
            "layers": layers, "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3",
            "scale_name": qwen35.SCALE_SUFFIX, "scale_dtype": "BF16", "source": {"repo": spec.fp8.repo if spec.fp8 else None}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return config


def step_bytes(config: dict, fp8_shared: bool, int8_head: bool, ctx: int, batch: int, q_len: int,
               kv_dtype: str = "auto") -> dict:
    """Bytes one decode step reads, by part, from the shapes: AutoRound's INT4 (0.5 B + a BF16 scale per group of
    128) except its 16-bit layers (extra_config; routers), FP8 shared experts 1 B + a scale per 128x128 block."""
    tc = qwen35.text_config(config)
    e, k = tc["num_experts"], tc["num_experts_per_tok"]
    distinct = e * (1 - (1 - k / e) ** (batch * q_len))  # expected distinct routed experts per layer
    extra = config["quantization_config"].get("extra_config", {})
    parts = {"routed_experts": 0.0, "shared_experts": 0.0, "attention_and_gdn": 0.0, "router": 0.0, "lm_head": 0.0}
    for m in qwen35.language_modules(config):
        if not isinstance(m, qwen35.Linear):
            continue
        n = m.out * m.inp
        bits = 16 if qwen35.INT4_ALWAYS_16BIT.search(m.prefix) else extra.get(m.prefix, {}).get("bits", 4)
        packed = n * (0.5 + 2 / 128) if bits == 4 else n * bits / 8  # INT4: a BF16 scale per group of 128
        if ".mlp.experts." in m.prefix:
            parts["routed_experts"] += packed * distinct / e
        elif ".shared_expert." in m.prefix:
            parts["shared_experts"] += n * (1 + 4 / (128 * 128)) if fp8_shared else packed
        elif m.prefix == "lm_head":
            parts["lm_head"] += n * (1 if int8_head else 2) + m.out * 4 * int8_head
        elif qwen35.INT4_ALWAYS_16BIT.search(m.prefix):
            parts["router"] += packed
        else:
            parts["attention_and_gdn"] += packed
    kinds = qwen35.layer_types(tc)
    attn = kinds.count("full_attention")
    if tc["head_dim"] != 256:
        raise ValueError(f"KV_BYTES is for head_dim 256, the config has {tc['head_dim']}")
    parts["kv_cache"] = attn * KV_BYTES[kv_dtype] * tc["num_key_value_heads"] * ctx * batch
    gdn_state = tc["linear_num_value_heads"] * tc["linear_key_head_dim"] * tc["linear_value_head_dim"] * 4
    parts["gdn_state"] = (len(kinds) - attn) * gdn_state * 2 * batch  # fp32 state read + written per request
    parts["total"] = sum(parts.values())
    return parts


def engine_kwargs(config_name: str, ctxs: list[int], batches: list[int]) -> dict:
    """vLLM's LLM(...) arguments for one config (all but the model folder): the lane's defaults, then the
    config's own (a TurboQuant config replaces the attention backend)."""
    _, _, mtp2, extra = CONFIGS[config_name]
    kw = dict(load_format="dummy", skip_tokenizer_init=True, language_model_only=True,
              max_model_len=max(ctxs) + DECODE_STEPS + 16, max_num_seqs=max(batches),
              max_num_batched_tokens=MAX_BATCHED_TOKENS, gpu_memory_utilization=0.88, enable_prefix_caching=False,
              disable_log_stats=False, gdn_prefill_backend="triton", cudagraph_capture_sizes=CAPTURE_SIZES,
              attention_backend="TRITON_ATTN")
    kw.update(extra)
    if mtp2:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 2}
    return kw


def one(model: str, config_name: str, ctxs: list[int], batches: list[int], out: Path,
        model_dir: Path | None = None) -> None:
    """In the child: one engine, every (context, batch) point; `out` is rewritten after each point, so a child
    stopped at the deadline keeps what it measured. `model_dir`: write the config there rather than in a new
    temporary folder (vLLM's compile-cache key holds the model path: a restart must see the same one)."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    fp8_shared, int8_head, mtp2, extra = CONFIGS[config_name]
    os.environ["ONESPARK_INT8_LM_HEAD"] = "1" if int8_head else "0"
    with (contextlib.nullcontext(str(model_dir)) if model_dir else tempfile.TemporaryDirectory()) as d:
        Path(d).mkdir(parents=True, exist_ok=True)
        config = write_config(Path(d), model, fp8_shared)
        t0 = time.monotonic()
        llm = LLM(model=d, **engine_kwargs(config_name, ctxs, batches))
        result = dict(model=MODELS[model], config=config_name, startup_s=round(time.monotonic() - t0, 1), points=[])
        rng = random.Random(0)
        sp = SamplingParams(max_tokens=DECODE_STEPS + 1, ignore_eos=True, temperature=0, detokenize=False)

        def run(ctx: int, batch: int) -> tuple[list[float], float, dict]:
            """Median-ready step times: the engine steps after the first token are the generated tokens minus
            one, less the drafts accepted (random weights accept few, but an accepted draft is a step saved)."""
            prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 200000) for _ in range(ctx)])
                       for _ in range(batch)]
            before = spec_counts(llm) if mtp2 else None
            outs = llm.generate(prompts, sp, use_tqdm=False)
            spec = {k: v - before[k] for k, v in spec_counts(llm).items()} if mtp2 else {}
            accepted_per_req = spec.get("accepted", 0.0) / batch
            steps, ttft = [], 0.0
            for o in outs:
                m = o.metrics
                steps.append((m.last_token_ts - m.first_token_ts) / max(m.num_generation_tokens - 1 - accepted_per_req, 1))
                ttft = max(ttft, m.first_token_ts - m.scheduled_ts)
            return steps, ttft, spec

        for batch in fits(min(ctxs), batches):  # warm-up: first-request allocations and each batch's kernels
            run(min(ctxs), batch)
        print(WARMED, flush=True)
        out.write_text(json.dumps(result))
        for ctx in ctxs:
            for batch in batches:
                if batch not in fits(ctx, batches):
                    result.setdefault("skipped", []).append(f"ctx {ctx} x batch {batch}: prefill would overlap decode")
                    out.write_text(json.dumps(result))
                    continue
                steps, ttft, spec = run(ctx, batch)
                ms = 1e3 * sorted(steps)[len(steps) // 2]
                b = step_bytes(config, fp8_shared, int8_head, ctx, batch, 3 if mtp2 else 1,
                               extra.get("kv_cache_dtype", "auto"))
                h200_floor = b["total"] / H200_BW
                result["points"].append(dict(ctx=ctx, batch=batch, step_ms=round(ms, 3), prefill_s=round(ttft, 3),
                                   bytes=round(b["total"]), bytes_by_part={k: round(v) for k, v in b.items()},
                                   achieved_tb_s=round(b["total"] / (ms / 1e3) / 1e12, 3),
                                   spark_estimate_ms=round(1e3 * (b["total"] / SPARK_BW) + max(ms - 1e3 * h200_floor, 0), 2),
                                   **({"spec_decode": spec} if mtp2 else {})))
                out.write_text(json.dumps(result))
                print(f"  {model} {config_name} {point_key(ctx, batch)}: {ms:.2f} ms/step", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default="122b,35b")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--ctx", default="1024,32768,131072")
    p.add_argument("--batch", default="1,4")
    p.add_argument("--deadline-s", type=float, default=540, help="start no engine past this many seconds")
    p.add_argument("--git-sha", help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # MODEL:CONFIG, in the child
    a = p.parse_args(argv)
    ctxs, batches = [int(x) for x in a.ctx.split(",")], [int(x) for x in a.batch.split(",")]
    if a.one:
        model, config = a.one.split(":")
        one(model, config, ctxs, batches, a.out)
        return 0
    import vllm

    t0 = time.monotonic()
    result = harness.header(a.git_sha, argv=argv) | dict(vllm=vllm.__version__, decode_steps=DECODE_STEPS,
                                                         h200_bw=H200_BW, spark_bw=SPARK_BW, runs=[], not_run=[])
    order = [(m, c) for c in a.configs.split(",") for m in a.models.split(",")]
    unknown = sorted({c for _, c in order} - set(CONFIGS)) + sorted({m for m, _ in order} - set(MODELS))
    if unknown:
        p.error(f"unknown --configs/--models {', '.join(unknown)}: configs {', '.join(CONFIGS)}; models {', '.join(MODELS)}")
    scratch = tempfile.TemporaryDirectory()
    patched = {c: harness.patched_vllm([harness.ROOT / "patches" / PATCHED[c]], Path(scratch.name) / c)
               for c in {c for _, c in order} & set(PATCHED)}
    for model, config in order:
        left = a.deadline_s - (time.monotonic() - t0)
        if left < 60:  # an engine needs minutes: starting one with less left would only be killed
            result["not_run"].append(f"{model}:{config} (deadline)")
            print(f"== {model} {config}: not run, {left:.0f} s left of --deadline-s {a.deadline_s:g} "
                  "(an engine is started only with 60 s or more left)", flush=True)
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--one", f"{model}:{config}", "--out", f.name, "--ctx", a.ctx,
                   "--batch", a.batch]
            env = dict(os.environ)
            if config in PATCHED:  # the child imports the patched copy first
                env["PYTHONPATH"] = os.pathsep.join(x for x in (str(patched[config]), env.get("PYTHONPATH")) if x)
            print(f"== {model} {config} ({left:.0f} s left)", flush=True)
            # the engine's whole log beside the result: where its start-up time goes (compile, graphs, weights)
            log = a.out.with_name(f"{a.out.stem}_{model}_{config}.log")
            error = None
            try:
                with open(log, "w") as lf:
                    r = subprocess.run(cmd, timeout=left, stdout=lf, stderr=subprocess.STDOUT, text=True, env=env)
            except subprocess.TimeoutExpired:
                error = f"stopped at the deadline (log: {log.name})"
            log_text = log.read_text(errors="replace")
            if error is None and r.returncode != 0:
                error = log_text[-1500:]
            text = Path(f.name).read_text()
            run = json.loads(text) if text else dict(model=MODELS[model], config=config, points=[])
            run.update(log_facts(log_text))
            if error:
                run["error"] = error
        result["runs"].append(run)
        print(run.get("error_cause") or run.get("error", "")[-600:], flush=True)
        harness.write_result(a.out, result)
    harness.write_result(a.out, result)  # also when the deadline left no engine to run: not_run says so
    print(f"{'model':18s} {'config':12s} {'ctx':>7s} {'b':>2s} {'ms/step':>8s} {'GB/step':>8s} {'TB/s':>6s} "
          f"{'Spark ms (est.)':>15s}  graphs; Triton JIT while timed")
    for run in result["runs"]:
        for pt in run.get("points", []):
            jit = run.get("jit_in_points", {}).get(point_key(pt["ctx"], pt["batch"]), [])
            print(f"{run['model']:18s} {run['config']:12s} {pt['ctx']:7d} {pt['batch']:2d} {pt['step_ms']:8.2f} "
                  f"{pt['bytes'] / 1e9:8.2f} {pt['achieved_tb_s']:6.2f} {pt['spark_estimate_ms']:15.1f}  "
                  f"{run.get('cudagraph_mode', 'as requested')}; {', '.join(jit) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
