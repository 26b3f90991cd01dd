"""What one `onespark serve` starts (`Launch`), read once from its arguments: the one place that composes the
serving container's vLLM flags (the spec's defaults, the drafter's, the user's after --) and its `docker run`.

The spec is --model, else the one step 1 recorded in the checkpoint's manifest (writer.recorded_spec), else
none: the image's defaults, which are qwen3.5-122b-a10b's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field

from onespark import __version__, options
from onespark.checkpoint.writer import recorded_spec
from onespark.errors import UserError
from onespark.serving import launch, memory
from onespark.tracks import SUPPORTED_VLLM

# The default track's images (0.32.0: steps/lib.sh VLLM_DEFAULT); the source-build track's carry its version.
V2_IMAGE = f"onespark/v2:{__version__}"
V2_TQ_IMAGE = f"onespark/v2-tq:{__version__}"
DEMO_IMAGE = f"onespark-demo/v2:{__version__}"
SOURCE_TRACK = SUPPORTED_VLLM[0]
SOURCE_IMAGES = tuple(f"{repo}:{__version__}-vllm{SOURCE_TRACK}" for repo in ("onespark/v2", "onespark/v2-tq"))

# Defaults of docker/entrypoint.sh that make no sense on the CPU stand-in (GPU kernels, the MTP head of
# the real checkpoint, fastsafetensors' GPU loader, Qwen3 parsers the tiny model's tokenizer lacks).
DEMO_DROP = (
    "--attention-backend --speculative-config --load-format --gpu-memory-utilization "
    "--max-model-len --reasoning-parser --enable-auto-tool-choice --tool-call-parser"
)
# vLLM on CPU, as tests/vllm_server.py runs it: eager mode, a 1 GiB KV cache, nothing from the network.
DEMO_ENV = {"TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
DEMO_ARGS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "1024", "--served-model-name", "onespark-tiny"]


@dataclass(frozen=True)
class Launch:
    """What one `onespark serve` starts, read once from its arguments (run() and docker_run_command build it;
    nothing below them reads the Namespace)."""
    checkpoint: str  # the checkpoint directory as given
    spec: str | None  # the model spec whose serving defaults replace the image's (None: the image's)
    image: str
    name: str
    host: str
    port: int
    api_key: str | None = field(repr=False)  # --api-key, its file's first line, or $ONESPARK_API_KEY
    env: dict[str, str]  # --env NAME=VALUE, checked
    vllm_args: tuple[str, ...]  # the spec's flags the user does not set, the drafter's, then the user's after --
    drafter_dir: str | None  # --drafter dflash only: mounted at /drafter
    demo: bool
    replace: bool
    dry_run: bool
    smoke: bool
    prompt: str
    max_tokens: int
    timeout: float
    guard: bool
    guard_floor_gib: float
    host_reserve_gib: float
    meminfo: str
    vmstat: str
    compressor_dir: str | None = None  # --compressor-dir: `onespark compress serve` beside it, counted in the plan
    cache_volume: str | None = launch.CACHE_VOLUME  # --cache-volume: the compile caches' volume (None: none)

    @classmethod
    def from_args(cls, args: argparse.Namespace, image: str | None = None) -> Launch:
        api_key = launch.api_key(args)
        user = _after_dashes(args.vllm_args)
        options.reject_secret_flags(user, "serve")
        options.reject_own_flags(user, "serve")
        image = image or args.image or (DEMO_IMAGE if args.demo else V2_TQ_IMAGE if args.tq else V2_IMAGE)
        recorded = recorded_spec(args.checkpoint)
        spec = args.model or (recorded if recorded != "custom" else None)  # custom: no serving defaults of its own
        if spec and not args.model:
            _known_recorded(spec, args.checkpoint)
        vllm_args = _with_spec(spec, _with_drafter(args, spec, image, user))
        floor = args.guard_floor_gib
        if floor is None:
            floor = memory.DEMO_GUARD_FLOOR_GIB if args.demo else memory.GUARD_FLOOR_GIB
        return cls(checkpoint=args.checkpoint, spec=spec, image=image, name=args.name, host=args.host,
                   port=args.port, api_key=api_key, env=_env(args.env), vllm_args=tuple(vllm_args),
                   drafter_dir=os.path.abspath(args.drafter_dir) if args.drafter == "dflash" else None,
                   demo=args.demo, replace=args.replace, dry_run=args.dry_run, smoke=not args.no_smoke,
                   prompt=args.prompt, max_tokens=args.max_tokens,
                   timeout=args.timeout or (600 if args.demo else 1800), guard=not args.no_memory_guard,
                   guard_floor_gib=floor, host_reserve_gib=args.host_reserve_gib, meminfo=args.meminfo,
                   vmstat=args.vmstat, compressor_dir=args.compressor_dir, cache_volume=args.cache_volume)


def _known_recorded(spec: str, checkpoint: str) -> None:
    """A spec the manifest records must be one this onespark knows; the message names the manifest, not --model
    (which the user did not give)."""
    from onespark.checkpoint.writer import MANIFEST_FILE
    from onespark.model import specs
    if spec not in specs.SPECS:
        raise UserError(f"{os.path.join(checkpoint, MANIFEST_FILE)} records the spec {spec[:60]!r}, which this "
                        f"onespark does not know (it knows {', '.join(specs.SPECS)}): pass --model NAME, or update "
                        "onespark to the version that wrote it")


def _after_dashes(vllm_args: list[str] | None) -> list[str]:
    extra = list(vllm_args or [])
    return extra[1:] if extra and extra[0] == "--" else extra


def _env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            # the name only: the value may be the secret
            raise UserError(f"--env {key + '=...' if sep else item!r}: expected NAME=VALUE, NAME of letters, digits "
                            "and _, e.g. --env ONESPARK_INT8_LM_HEAD=0")
        if key == "VLLM_API_KEY":
            raise UserError("--env VLLM_API_KEY=...: use --api-key (or $ONESPARK_API_KEY) so the key stays off argv")
        env[key] = value
    return env


def _with_drafter(args: argparse.Namespace, spec_name: str | None, image: str, user: list[str]) -> list[str]:
    """--drafter dflash: its --speculative-config goes among the user's vLLM flags (so it replaces the spec's
    and the image's MTP default), unless the user gave one after --, which wins."""
    if args.drafter != "dflash":
        if args.drafter_dir or args.num_draft_tokens:
            raise UserError("--drafter-dir/--num-draft-tokens are for --drafter dflash")
        return user
    from onespark.model import specs
    if args.demo:
        raise UserError("--drafter dflash: not on the CPU demo (its tiny model has no DFlash drafter); drop --demo "
                        "or use --drafter mtp")
    if image in SOURCE_IMAGES:
        raise UserError(f"--drafter dflash needs the vLLM 0.32.0 track's image, not {image} (vLLM {SOURCE_TRACK}): "
                        f"./install.sh builds it; leave --image out ({V2_IMAGE})")
    spec = specs.get(spec_name)
    if not spec.dflash:
        raise UserError(f"--drafter dflash: spec {spec.name} has no DFlash drafter; use --drafter mtp")
    if not args.drafter_dir:
        raise UserError("--drafter dflash needs --drafter-dir DIR (onespark download --drafter dflash fetches it "
                        "to WORK/dflash)")
    if not args.dry_run and not os.path.isfile(os.path.join(args.drafter_dir, "config.json")):
        raise UserError(f"--drafter-dir {args.drafter_dir}: no config.json: fetch the drafter with onespark "
                        "download --drafter dflash (onespark verify --drafter DIR checks it)")
    if any(a == "--speculative-config" or a.startswith("--speculative-config=") for a in user):
        return user
    cfg = specs.dflash_config(spec, tokens=args.num_draft_tokens)
    return ["--speculative-config", json.dumps(cfg, separators=(",", ":")), *user]


def _with_spec(spec_name: str | None, user: list[str]) -> list[str]:
    """The spec's serving flags before the user's vLLM flags, leaving out any flag the user sets."""
    if not spec_name:
        return user
    from onespark.model import specs
    spec_args, i = specs.get(spec_name).vllm_args(), 0
    keep = []
    while i < len(spec_args):  # flag value pairs
        flag = spec_args[i]
        if not any(a == flag or a.startswith(flag + "=") for a in user):
            keep += spec_args[i:i + 2]
        i += 2
    return [*keep, *user]


def container_command(la: Launch) -> tuple[list[str], dict[str, str]]:
    """The `docker run` argv and the environment variables it forwards (by name, values not on argv)."""
    env = {"ONESPARK_HEALTH_URL": f"{launch.base_url(la.host, la.port)}/health"}
    drafter = ("-v", f"{la.drafter_dir}:/drafter:ro") if la.drafter_dir else ()
    cmd = launch.container_flags(la.name, os.path.abspath(la.checkpoint), mounts=drafter, gpu=not la.demo,
                                 cache_volume=la.cache_volume)
    if la.demo:
        env.update(DEMO_ENV)
        env["ONESPARK_DROP_DEFAULTS"] = DEMO_DROP
        # vLLM 0.32.0 on CPU asks 160 MiB of /dev/shm at engine start (tiny Qwen3.5-MoE + MTP-2, measured
        # 2026-12-01); Docker gives a container 64 MiB.
        cmd += ["--shm-size", "1g"]
    env.update(la.env)
    if la.api_key:
        env["VLLM_API_KEY"] = la.api_key
    cmd += launch.env_flags(env)  # run() passes env to docker, so the secrets it names by name arrive
    cmd += [la.image, "--host", la.host, "--port", str(la.port)]
    if la.demo:
        cmd += DEMO_ARGS
    cmd += la.vllm_args
    return cmd, env
