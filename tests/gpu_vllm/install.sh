#!/usr/bin/env bash
# On the GPU host: put vLLM 0.26.0 back together from the pieces tests/gpu_vllm/pack.py cut, in consecutive
# device calls (each carries one piece; files under /root stay while the host is held), then install it.
#
#   tests/gpu_vllm/install.sh stash PIECE...   copy pieces (e.g. .gpu-vllm/part-00) to $STORE, sha256-checked
#                                              against .gpu-vllm/manifest.json
#   tests/gpu_vllm/install.sh install          every piece there: check the bundle, unpack, install the wheels and
#                                              the trimmed vLLM tree into $STORE/site, then check `import vllm`
#                                              and the OpenAI server's --help
#   tests/gpu_vllm/install.sh env              print the environment lines the lane sources
#
# STORE defaults to /root/gpu-vllm. Idempotent: install returns at once when $STORE/site/.installed names the
# manifest's bundle digest. Nothing is fetched: the host reaches no network.
set -euo pipefail
cd "$(dirname "$0")/../.."

STORE=${STORE:-/root/gpu-vllm}
MANIFEST=${MANIFEST:-.gpu-vllm/manifest.json}
py=${PYTHON:-python3}

manifest() {  # FIELD-EXPR: a Python expression over the manifest `m`
  "$py" -c "import json,sys; m=json.load(open(sys.argv[1])); print($1)" "$MANIFEST"
}

stash() {
  mkdir -p "$STORE/parts"
  cp -f "$MANIFEST" "$STORE/manifest.json"
  local piece name want got
  for piece in "$@"; do
    name=$(basename "$piece")
    want=$(manifest "next((p['sha256'] for p in m['parts'] if p['name'] == '$name'), '')") || return
    got=$(sha256sum "$piece" | cut -d' ' -f1)
    [[ -n $want && $got == "$want" ]] || { echo "install.sh: $piece has sha256 $got, the manifest says $want: re-run pack.py" >&2; return 1; }
    cp -f "$piece" "$STORE/parts/$name.tmp" && mv -f "$STORE/parts/$name.tmp" "$STORE/parts/$name" || return
    echo "stashed $name ($(du -h "$STORE/parts/$name" | cut -f1)) in $STORE/parts"
  done
}

install() {
  MANIFEST=$STORE/manifest.json
  local digest
  digest=$(manifest "m['bundle_sha256']")
  if [[ $(cat "$STORE/site/.installed" 2>/dev/null) == "$digest" ]]; then
    echo "vLLM bundle $digest already installed in $STORE/site"
  else
    local names missing=()
    names=$(manifest "' '.join(p['name'] for p in m['parts'])")
    for n in $names; do [[ -f $STORE/parts/$n ]] || missing+=("$n"); done
    ((${#missing[@]} == 0)) || { echo "install.sh: pieces not stashed yet: ${missing[*]}" >&2; return 1; }
    local got
    got=$(for n in $names; do cat "$STORE/parts/$n"; done | sha256sum | cut -d' ' -f1)
    [[ $got == "$digest" ]] || { echo "install.sh: the pieces join to $got, not the bundle $digest" >&2; return 1; }
    # Each line returns on failure itself: main runs under `||`, where set -e does not apply.
    rm -rf "$STORE/unpacked" "$STORE/site" && mkdir -p "$STORE/unpacked" "$STORE/site" || return
    for n in $names; do cat "$STORE/parts/$n"; done | xz -d -T0 | tar -x -C "$STORE/unpacked" || return
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$STORE/site" \
      "$STORE"/unpacked/wheels/*.whl || return
    cp -a "$STORE/unpacked/vllm-tree/." "$STORE/site/" && rm -rf "$STORE/unpacked" || return
    echo "$digest" > "$STORE/site/.installed"
  fi
  env_lines > "$STORE/env.sh"
  # shellcheck disable=SC1091
  source "$STORE/env.sh"
  "$py" -c 'import vllm, torch; print(f"vllm {vllm.__version__} on torch {torch.__version__}, {torch.cuda.get_device_name()}")' || return
  "$py" -m vllm.entrypoints.openai.api_server --help >/dev/null && echo "vllm api_server --help: ok"
}

# The settings this wheel set needs (../shared/gpu-vllm-0.26.0.md, checked here): no FlashInfer in the set, so its
# sampler is off; apache-tvm-ffi (through xgrammar) must not JIT-build a torch add-on; nothing reaches a network.
env_lines() {
  cat <<EOF
export PYTHONPATH=$STORE/site\${PYTHONPATH:+:\$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export TRITON_CACHE_AUTOTUNING=1  # as the images: the second server of a call reuses the first's autotuning
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EOF
}

main() {
  case ${1:-} in
    stash) shift; stash "$@" ;;
    install) install ;;
    env) env_lines ;;
    *) echo "usage: tests/gpu_vllm/install.sh stash PIECE... | install | env" >&2; return 2 ;;
  esac
}

main "$@" || exit 1
