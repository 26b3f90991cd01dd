"""What a vLLM server's log says: the start-up stage (a progress line while the 122B model's cold start takes
minutes) and the likely cause of a failure. `onespark serve`, `onespark cluster` and the memory guard's report
read it; standard library only (serve --dry-run runs before any venv exists).
"""

from __future__ import annotations

import re

# Server-log line -> start-up stage. Patterns are vLLM 0.19.1's own log messages; the last line that
# matches any of them is the current stage.
# A table on purpose (`duplicates` pairs its same-shape rows, D8): one row a stage, read top to bottom.
STAGES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"vLLM API server version|Automatically detected platform"), "starting vLLM"),
    (re.compile(r"Resolved architecture"), "reading the model config"),
    (re.compile(r"Initializing a V1 LLM engine"), "starting the engine"),
    (re.compile(r"Starting to load model"), "loading weights"),
    (re.compile(r"Loading safetensors[^|]*?(\d+)% Completed \| (\d+)/(\d+)"), "loading weights ({2}/{3} shards)"),
    (re.compile(r"Loading weights took|Model loading took"), "weights loaded"),
    (re.compile(r"Dynamo bytecode transform|Compiling a graph"), "compiling (torch.compile)"),
    (re.compile(r"torch\.compile took"), "compiled"),
    (re.compile(r"Memory profiling takes|Available KV cache memory"), "sizing the KV cache"),
    (re.compile(r"Capturing CUDA graphs[^|]*?(\d+)%"), "capturing CUDA graphs ({1}%)"),
    (re.compile(r"Graph capturing finished"), "CUDA graphs captured"),
    (re.compile(r"init engine \(profile, create kv cache, warmup model\) took"), "engine ready"),
    (re.compile(r"Starting vLLM server on|Application startup complete"), "API server up"),
]

# (pattern in the log, likely cause and fix). First match wins; the order puts specific causes first.
CAUSES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"undefined symbol"),
     "torch ABI mismatch: vLLM's compiled ops were built against a different torch than the one installed. "
     "Rebuild the base image: steps/3-base-image.sh --no-cache (both stages then share one torch)."),
    (re.compile(r"sm_121a.*not defined|not defined.*sm_121a"),
     "Triton's bundled ptxas does not know sm_121a: TRITON_PTXAS_PATH must point at CUDA 13's ptxas "
     "(Dockerfile.base sets it; an image built elsewhere may not)."),
    (re.compile(r"CUDA out of memory|OutOfMemoryError|Cannot allocate memory"),
     "out of memory: lower --gpu-memory-utilization (default 0.82) or --max-model-len, and close other "
     "programs using the GPU (nvidia-smi)."),
    (re.compile(r"than the derived max_model_len"),
     "--max-model-len is longer than the model's config allows (max_position_embeddings): lower it."),
    (re.compile(r"larger than the available KV cache"),
     "the KV cache cannot hold --max-model-len tokens: lower --max-model-len, or raise "
     "--gpu-memory-utilization a little (0.82 is the stable default on a 128 GB Spark)."),
    (re.compile(r"No CUDA GPUs are available|could not select device driver|Found no NVIDIA driver|"
                r"no CUDA-capable device"),
     "the container sees no GPU: install and configure the NVIDIA container toolkit (onespark doctor prints "
     "the commands), then restart Docker."),
    (re.compile(r"Address already in use"), "the port is taken: stop the other server or pass --port."),
    (re.compile(r"No space left on device"), "the disk is full: free space (onespark doctor shows how much)."),
    (re.compile(r"KeyError: '?[\w.]*mtp|mtp\.[\w.]+ (is )?(missing|not found)|[Ss]peculative\w*Error|"
                r"speculative.*(not supported|invalid|missing)", re.IGNORECASE),
     "the MTP draft model did not load: run `onespark verify` on the checkpoint (every mtp.* tensor must be "
     "present), or start without MTP: onespark serve ... -- --speculative-config '{}'"),
    (re.compile(r"config\.json|Invalid repository ID or local directory|is not a local folder"),
     "no model at /model: --model must be the checkpoint directory (the one with config.json)."),
    (re.compile(r"onespark"), "the onespark plugin failed: see its error above (set VLLM_PLUGINS= to run "
                               "without it and confirm)."),
]


def detect_stage(log: str) -> str | None:
    """The start-up stage named by the last log line that matches one of STAGES."""
    stage = None
    for line in log.replace("\r", "\n").splitlines():
        for pattern, label in STAGES:
            m = pattern.search(line)
            if m:
                stage = label.format(*([m.group(0)] + list(m.groups())))
    return stage


def likely_cause(log: str, exit_code: int | None = None, oom_killed: bool = False) -> str:
    if oom_killed:
        return ("the container was killed for memory (OOM): lower --gpu-memory-utilization (default 0.82) or "
                "--max-model-len; on a Spark, CPU and GPU share the 128 GB, so close other programs too.")
    if exit_code == 137:
        # Docker sets OOMKilled only for its own memory limit; the host's OOM killer (no limit set, the
        # usual case on a Spark) and a `docker kill` / `docker rm -f` both show up as a bare SIGKILL.
        return ("the container was killed (SIGKILL): if `dmesg | grep -i oom` shows it, host memory ran out (OOM): "
                "lower --gpu-memory-utilization (default 0.82) or --max-model-len and close other programs; "
                "otherwise something stopped it (docker kill / rm -f, another `onespark serve --replace`).")
    # Only error lines: the config dump at start-up mentions mtp, speculative, memory... harmlessly.
    errors = [ln for ln in log.splitlines() if re.search(r"Error|error|Exception|fatal|Killed", ln)]
    text = "\n".join(errors[-30:])
    for pattern, cause in CAUSES:
        if pattern.search(text):
            return cause
    return "not recognised: read the log above (the first Traceback is usually the cause)."
