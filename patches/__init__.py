"""The onespark vLLM plugin (entry point group `vllm.general_plugins`, installed by `pip install onespark`).

vLLM calls `register()` in every process it starts (API server, engine core, each worker), so it is
idempotent, imports vLLM lazily and never touches CUDA. It refuses to run on a vLLM other than the two it
was tested with (0.32.0, the default track, and 0.19.1; any local build suffix such as `+cu130` or
`.dev0+g<sha>`), naming the installed and the supported versions; the GPU lane's vLLM (0.26.0, the wheel that
matches the H200's torch: tests/gpu_vllm/) runs too, with 0.32.0's seams, and says so. Where the two differ for a hook, the code
sits behind one named function in patches/_compat.py (the ledger's "Seam" field).

Switches (environment variables, read once per process by register(); 1/0, true/false, on/off, yes/no; any other
value, an empty one included, stops start-up with one line naming the variable and these values; the TurboQuant
backend's three choices, read when it starts, are checked then too). This list
is the one description of them: docs/generate.py makes docs/concepts/plugin.md's table from it and TECHNIQUES, and
fails when an ONESPARK_* variable read in patches/ has no entry, or an entry's default is not its technique's.
An entry: `NAME=DEFAULT`, what it does, then `Speed/memory:` what it costs and gains.

  ONESPARK_HYBRID_FP8=1
      FP8 shared experts: checkpoints written by `onespark hybrid` (their `quantization_config` has
      `onespark_fp8`) load as `onespark_hybrid`, an `INCConfig` subclass: the spliced shared experts get vLLM's
      block-FP8 linear method, routed experts stay on the INT4 (GPTQ-Marlin) path, `mtp.*` stays 16-bit unless
      the checkpoint says INT4. Other checkpoints: stock vLLM.
      Speed/memory: shared experts read 1 byte/param instead of 2: 0.45 GB instead of 0.91 GB for the 144
      weights (48 layers x 3 x 3,072 x 1,024), plus 0.9 MB of block scales. `0`: the hybrid checkpoint loads as
      plain `inc`, which cannot read its FP8 layers: use the INT4 checkpoint instead.
  ONESPARK_INT8_LM_HEAD=1
      INT8 LM head: vLLM's `ParallelLMHead` is replaced (`CustomOp.register_oot`; 0.32.0:
      `PluggableLayer.register_oot`) by a subclass whose method quantizes the weight per row after loading and
      frees the BF16 weight before vLLM sizes the KV cache; logits come from the INT8 Triton kernel (`kernels/`;
      on CPU its plain-torch reference), vLLM's TP gather and vocab slicing unchanged. The MTP draft shares the
      same head module, so its logits are INT8 too. Not applied to a head the checkpoint already quantizes, or
      one tied to the embedding.
      Speed/memory: 0.76 GB less weight memory (goes to the KV cache); half the bytes read per logits call
      (timed: bench/results/lm_head_glue_h200.json).
  ONESPARK_TURBOQUANT_BACKEND=1
      TurboQuant attention backend (`patches/turboquant_backend.py`), registered as vLLM's `CUSTOM` backend
      (`register_backend`: a class path, nothing imported); used only by servers started with
      `--attention-backend CUSTOM` and a `turboquant_*` `--kv-cache-dtype`, which exist only in the v2-tq image
      (`patches/turboquant.diff`). Decode and MTP-verify batches: one decode-attention call (Triton, or the
      CUDA C++ kernel: `ONESPARK_TQ_KERNEL`); everything else: per request, the cache decoded into BF16 and
      attended by FlashAttention (`ONESPARK_TQ_PREFILL`).
      Speed/memory: 3.9x the KV tokens per GB (K4V4); speed: docs/concepts/turboquant.md. `0`: `CUSTOM` stays
      unregistered.
  ONESPARK_TQ_PREFILL=flash
      (read by the TurboQuant backend, not a 1/0 switch) the prefill path on CUDA: `flash` decodes the cache
      into BF16 for FlashAttention-2, `triton` the fused kernel that attends straight from the codes, `torch`
      plain torch; e.g. `onespark serve --tq --env ONESPARK_TQ_PREFILL=triton`.
      Speed/memory: on an H200, `flash` 1.02-1.07x BF16 flash, `triton` 1.8x, `torch` 20x at 128K
      (docs/concepts/turboquant.md).
  ONESPARK_TQ_DECODE=auto
      (read by the TurboQuant backend, not a 1/0 switch) how the decode kernel decodes codes on CUDA: `auto` the
      measured choice per GPU, preset and q_len (`turboquant_triton.decode_once`), `once` each code once per
      tile, `pure` in each warp that needs it; e.g. `onespark serve --tq --env ONESPARK_TQ_DECODE=pure` to time
      the other choice on a Spark, where `auto` is `once` at a verify step and for 3-bit values, from the
      Spark's code timed on an H200 with wgmma off; no Spark has timed either.
      Speed/memory: on an H200, K4V3 at one query position 1-3% faster once, K4V4 up to 1.3x slower once at
      batch 8; the Spark's code on an H200, once 5-22% less time at a verify step (docs/concepts/turboquant.md).
  ONESPARK_TQ_KERNEL=auto
      (read by the TurboQuant backend, not a 1/0 switch) which kernel serves decode steps on CUDA: `auto` the
      CUDA C++ kernel (`kernels/turboquant_decode.cuh`) at K4V4 verify steps on mma.sync-only GPUs (the Spark)
      and at every K4V4 step on sm_90 (H100, H200),
      Triton elsewhere, and Triton with one warning line wherever the image's build of the CUDA kernel is
      missing; `triton` always Triton; `cuda` the CUDA kernel at every K4V4 decode step (built on first use if
      missing; K4V3 and K8V4 refused at start).
      Speed/memory: on an H100 at an MTP-2 verify step, 8K-256K, the Triton kernel takes 0.78-1.63x the CUDA
      kernel's time (bench/results/turboquant_cuda_h100.json); no Spark has timed it.
  ONESPARK_DRAFT_VOCAB=1
      MTP draft head over a vocabulary subset: where the checkpoint directory holds `onespark-draft-vocab.json`
      (`onespark draft-vocab DIR`, written by step 2), the draft's logits come from a contiguous INT8 copy of
      those rows (32,768 of 248,320 by default), -inf elsewhere; the target's verify pass keeps the full INT8
      head, so the output is unchanged. No file: the draft shares the target's head, as without the plugin.
      `0`: always the full head.
      Speed/memory: 1/7.6 of the head's bytes per draft pass, ~4.9 ms less per MTP-2 step on a Spark (on paper:
      docs/concepts/draft-head.md); 101 MB more weight memory.
  ONESPARK_DRAFT_INT4=0
      (read by `draft_head.attach`, not a technique) with the draft vocabulary in use, `1` puts the subset's rows
      in INT4 groups of 128 (`int4_gemv`), quantized from the INT8 rows; changes only which tokens are drafted.
      Off until measured on a GPU (`lab/draft_head.py`).
      Speed/memory: half the draft head's bytes again (52 vs 101 MB): ~0.18 ms less per draft pass on a Spark,
      on paper.
  ONESPARK_ALLOW_ANY_VLLM=0
      The plugin refuses any vLLM but 0.19.1 and 0.32.0 (local build suffixes such as `+cu130` or `+cpu` are
      fine; the GPU lane's 0.26.0 runs with 0.32.0's seams): `installed vLLM is X, but this plugin was built and
      tested for vLLM 0.19.1 or 0.32.0`; `1` runs anyway with a warning.

VLLM_PLUGINS="" (vLLM's own switch) disables the whole plugin. What each patch touches, why, and when to
remove it: patches/README.md (the ledger; tests/test_plugin_ledger.py keeps it complete).
"""

from __future__ import annotations

import logging
import os

from onespark.patches._compat import SUPPORTED_VLLM, lane_release, supported_release

ENV_ALLOW_ANY_VLLM = "ONESPARK_ALLOW_ANY_VLLM"
ENV_HYBRID_FP8 = "ONESPARK_HYBRID_FP8"
ENV_INT8_LM_HEAD = "ONESPARK_INT8_LM_HEAD"
ENV_TURBOQUANT_BACKEND = "ONESPARK_TURBOQUANT_BACKEND"
ENV_DRAFT_VOCAB = "ONESPARK_DRAFT_VOCAB"
ENV_DRAFT_INT4 = "ONESPARK_DRAFT_INT4"  # read by draft_head.attach(): 1 = the subset's rows in INT4 groups of 128
# The TurboQuant backend's choices (patches/turboquant_backend.py says what each means), the default first. The
# backend reads them when it starts, after the weights have loaded: register() checks them first, so a typo costs
# seconds and one line, not a model load and a traceback.
TQ_CHOICES: dict[str, tuple[str, ...]] = {
    "ONESPARK_TQ_PREFILL": ("flash", "triton", "torch"),
    "ONESPARK_TQ_DECODE": ("auto", "once", "pure"),
    "ONESPARK_TQ_KERNEL": ("auto", "triton", "cuda"),
}

# technique name -> (switch, default, "module:function" that installs it)
TECHNIQUES: dict[str, tuple[str, bool, str]] = {
    "hybrid-fp8": (ENV_HYBRID_FP8, True, "onespark.patches.hybrid_fp8:install"),
    "int8-lm-head": (ENV_INT8_LM_HEAD, True, "onespark.patches.lm_head:install"),
    "turboquant-backend": (ENV_TURBOQUANT_BACKEND, True, "onespark.patches.turboquant_backend:install"),
    "draft-vocab": (ENV_DRAFT_VOCAB, True, "onespark.patches.draft_head:install"),
}

# A child of vLLM's logger, so our lines use vLLM's handler and format in every process.
logger = logging.getLogger("vllm.onespark")

_active: list[str] | None = None  # set by the first register() in this process

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}  # not "": an empty value is a variable left unfilled, not an answer


def switch(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a switch value: use 1 or 0 (also true/false, on/off, yes/no), or unset "
                     f"it for the default ({int(default)})")


def choice(name: str) -> str:
    """The value of TQ_CHOICES variable `name`, its default when unset; any other value (an empty one included) is
    refused in one line that names the variable and its values."""
    values = TQ_CHOICES[name]
    raw = os.environ.get(name)
    if raw is None:
        return values[0]
    if raw not in values:
        raise ValueError(f"{name}={raw!r} is not one of its values: use {values[0]} (the default), "
                         f"{', '.join(values[1:-1])} or {values[-1]}")
    return raw


def _read_switches() -> dict[str, bool]:
    """Every technique's switch, by technique. The switches read later or only sometimes (the draft head's INT4
    choice and the TurboQuant backend's choices, once the weights have loaded; the version escape hatch, only for an
    unsupported vLLM) are checked here too, so that a typo in any of them stops start-up before anything is loaded:
    one error line naming the variable and its values, and an exit without a traceback through vLLM's plugin loader
    (which does not catch)."""
    try:
        switch(ENV_ALLOW_ANY_VLLM, False)
        switch(ENV_DRAFT_INT4, False)
        for name in TQ_CHOICES:
            choice(name)
        return {name: switch(env, default) for name, (env, default, _) in TECHNIQUES.items()}
    except ValueError as e:
        logger.error("onespark plugin: %s", e)
        raise SystemExit(1) from None


def version_supported(version: str) -> bool:
    """True for 0.19.1 / 0.32.0 and local builds of them (0.19.1+cu130, 0.32.0+cpu, 0.19.1.dev0+gabc123);
    not 0.19.10, 0.19.2 or 0.32.1."""
    return supported_release(version) is not None


def check_vllm_version(version: str) -> None:
    if version_supported(version):
        return
    if lane_release(version):
        logger.info("onespark: vLLM %s is the GPU lane's vLLM (tests/gpu_vllm/), not a shipped track (%s); its "
                    "hooks take 0.32.0's seams", version, " or ".join(SUPPORTED_VLLM))
        return
    if switch(ENV_ALLOW_ANY_VLLM, False):
        logger.warning(
            "onespark: vLLM %s is NOT one of the tested %s; %s=1 so the plugin runs anyway. Its hooks target "
            "those versions' internals (patches/README.md): check every ledger entry against this one.",
            version, " or ".join(SUPPORTED_VLLM), ENV_ALLOW_ANY_VLLM,
        )
        return
    raise RuntimeError(
        f"onespark plugin: installed vLLM is {version}, but this plugin was built and tested for vLLM "
        f"{' or '.join(SUPPORTED_VLLM)}. Install vllm=={SUPPORTED_VLLM[1]} (the default track) or "
        f"vllm=={SUPPORTED_VLLM[0]}, or set VLLM_PLUGINS='' to run without onespark, or set "
        f"{ENV_ALLOW_ANY_VLLM}=1 to try anyway."
    )


def register() -> list[str]:
    """vLLM's plugin entry point. Returns the active techniques (also logged once per process)."""
    global _active
    if _active is not None:
        return _active
    import importlib

    import vllm

    wanted = _read_switches()
    check_vllm_version(vllm.__version__)
    active = []
    for name, on in wanted.items():
        if on:
            module, func = TECHNIQUES[name][2].split(":")
            getattr(importlib.import_module(module), func)()
            active.append(name)
    _active = active
    off = [f"{n} ({TECHNIQUES[n][0]}=0)" for n, on in wanted.items() if not on]
    logger.info(
        "onespark plugin active on vLLM %s: %s%s",
        vllm.__version__, ", ".join(active) or "no techniques", f"; off: {', '.join(off)}" if off else "",
    )
    return active
