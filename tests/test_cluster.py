"""`onespark cluster`: two Sparks through vLLM's own multi-node (Ray).

1. The preflight against fake nodes: the real link probe (LINK_PROBE, bash) reads a made-up /sys tree and a
   stub `ip`; everything else a node answers comes from a table. Good nodes give the RoCE plan; each bad
   input is one line naming the node and the fix, and nothing is started.
2. The plan (--dry-run, and ./install.sh --nodes): every command for both machines.
3. A real two-node run on this machine: two network namespaces joined by a veth pair, a Ray node in each,
   the preflight's link reading on them, the onespark plugin registering in a Ray worker on each node
   (vLLM's load_general_plugins, as its workers call it), and the INT8 LM head at TP=2 across the two
   nodes (vLLM's own vocab-parallel shard and gather over Gloo on the veth) against a float64 reference.
   What vLLM's CPU build cannot do is serve across Ray nodes: its CPU platform has no Ray device key
   (0.19.1 replaces --distributed-executor-backend ray by mp on one machine, vllm/platforms/cpu.py; 0.32.0
   raises "current platform cpu does not support ray", vllm/v1/executor/ray_utils.py). The serving part
   is therefore the plan test in 2; test_vllm_cpu_has_no_ray_backend fails the day that changes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from onespark import __version__, tracks
from onespark.errors import UserError
from onespark.serving import cluster, cluster_link
from tests._compare import int8_rows_reference

ROOT = Path(__file__).resolve().parent.parent
ID_A = "sha256:" + "a" * 64
ID_B = "sha256:" + "b" * 64
ID_SERVING = "sha256:" + "5" * 64  # the serving image both cluster images were built from


# ---- fake nodes -----------------------------------------------------------------------------------------


def make_node_dir(root: Path, *, addrs, mtu, hcas=()) -> Path:
    """A node's /sys tree (net/*/mtu; infiniband/HCA/{device/net/NETDEV, ports/1/{state,gids,gid_attrs}})
    and a stub `ip` that prints `ip -o -4 addr show` lines for `addrs` [(iface, cidr)]."""
    sysd = root / "sys" / "class"
    for ifc, m in mtu.items():
        (sysd / "net" / ifc).mkdir(parents=True)
        (sysd / "net" / ifc / "mtu").write_text(f"{m}\n")
    for hca, state, netdev, gids in hcas:
        h = sysd / "infiniband" / hca
        (h / "device" / "net" / netdev).mkdir(parents=True)
        port = h / "ports" / "1"
        for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
            (port / sub).mkdir(parents=True)
        (port / "state").write_text(f"{state}\n")
        for idx, typ, gid in gids:
            (port / "gids" / str(idx)).write_text(gid + "\n")
            (port / "gid_attrs" / "types" / str(idx)).write_text(typ + "\n")
            (port / "gid_attrs" / "ndevs" / str(idx)).write_text(netdev + "\n")
    bind = root / "bin"
    bind.mkdir()
    lines = "\n".join(f"{i + 1}: {ifc}    inet {cidr} brd + scope global {ifc}\\       valid_lft forever"
                      for i, (ifc, cidr) in enumerate(addrs))
    (bind / "ip").write_text(f"#!/bin/sh\ncat <<'EOF'\n{lines}\nEOF\n")
    (bind / "ip").chmod(0o755)
    return root


def roce_node(root: Path, ip: str, gid_index: int = 3, *, state="4:ACTIVE", mtu=9000) -> Path:
    """A Spark as DGX OS sets it up: management on enP7s7, the ConnectX-7 port enp1s0f1np1 on the link
    subnet, RDMA device rocep1s0f1 with RoCE v1/v2 GIDs for the link-local and the IPv4 address."""
    a, b, c, d = (int(x) for x in ip.split("."))
    v4 = f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"
    gids = [(0, "IB/RoCE v1", "fe80:0000:0000:0000:0000:00ff:fe00:0001"),
            (1, "RoCE v2", "fe80:0000:0000:0000:0000:00ff:fe00:0001"),
            (gid_index - 1, "IB/RoCE v1", v4), (gid_index, "RoCE v2", v4)]
    return make_node_dir(root, addrs=[("enP7s7", f"10.0.0.{d}/24"), ("enp1s0f1np1", f"{ip}/24"),
                                      ("docker0", "172.17.0.1/16")],
                         mtu={"enP7s7": 1500, "enp1s0f1np1": mtu, "docker0": 1500},
                         hcas=[("rocep1s0f1", state, "enp1s0f1np1", gids)])


def socket_node(root: Path, ip: str) -> Path:
    """A link on a plain Ethernet port: no RDMA device."""
    d = ip.split(".")[-1]
    return make_node_dir(root, addrs=[("enP7s7", f"10.0.0.{d}/24"), ("eno1", f"{ip}/24")],
                         mtu={"enP7s7": 1500, "eno1": 9000})


def read_only(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The preflight's read-only commands, for every track the images may name (doctor's command carries it)."""
    c = cluster.Cluster.from_args(args)
    return [item for track in ("", *tracks.SUPPORTED_VLLM) for item in cluster.read_commands(c, track).items()]


class FakeNodes:
    """The injectable runner: answers each preflight command from a per-node table; LINK_PROBE runs for
    real in bash against the node's made-up /sys and stub `ip`. Records every command it was given."""

    def __init__(self, dirs: dict[str, Path], **overrides):
        good = {"ssh": (0, ""), "version": (0, __version__),
                "image": (0, f"{ID_A} {__version__} 0.19.1 {cluster.RAY_VERSION} {ID_SERVING}"),
                "serving image": (0, f"{ID_SERVING} {__version__} 0.19.1 <no value> <no value>"),
                "checkpoint": (0, "ok: ... 785/785 mtp"), "doctor": (0, "onespark doctor: all 7 checks passed")}
        self.dirs = dirs
        self.answers = {name: dict(good) for name in dirs}
        for key, value in overrides.items():  # worker_image=(rc, out) -> answers["spark2"]["image"]
            role, what = key.split("_", 1)
            self.answers["spark1" if role == "head" else "spark2"][what.replace("_", " ")] = value
        self.calls: list[tuple[str, str]] = []
        self.args = None

    def __call__(self, node, cmd, timeout):
        self.calls.append((node.name, cmd))
        if cmd == cluster.LINK_PROBE:
            d = self.dirs[node.name]
            env = {**os.environ, "ONESPARK_SYSROOT": str(d), "PATH": f"{d / 'bin'}:{os.environ['PATH']}"}
            p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=timeout)
            return p.returncode, p.stdout + p.stderr
        for what, known in read_only(self.args):
            if cmd == known:
                return self.answers[node.name][what]
        raise AssertionError(f"the preflight ran a command that is not read-only: {cmd!r}")


def cluster_args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cluster.add_arguments(p)
    return p.parse_args(["--nodes", "spark1,spark2", "--work", "/data/w", *extra])


HEAD = cluster.Node("spark1", "head", local=True)
WORKER = cluster.Node("spark2", "worker")


def preflight(fake: FakeNodes, *extra: str) -> cluster.Plan:
    fake.args = cluster_args(*extra)
    return cluster.preflight(cluster.Cluster.from_args(fake.args), HEAD, WORKER, fake)


@pytest.fixture
def nodes(tmp_path):
    return {"spark1": roce_node(tmp_path / "a", "192.168.100.1"),
            "spark2": roce_node(tmp_path / "b", "192.168.100.2")}


def test_good_nodes_give_the_roce_plan(nodes):
    fake = FakeNodes(nodes)
    plan = preflight(fake)
    assert plan.problems == []
    assert plan.vllm_track == "0.19.1"
    # doctor checks the Docker disk against the images' own track (the other track's base counts as missing)
    doctors = [c for _, c in fake.calls if " doctor " in c]
    assert len(doctors) == 2 and all(c.endswith(" doctor --work /data/w --skip-hf --vllm 0.19.1") for c in doctors)
    head, worker = plan.link["head"], plan.link["worker"]
    # The link is the RoCE port, not the management subnet both nodes share too (10.0.0.0/24).
    assert (head.iface, str(head.ip), head.hca, head.gid_index, head.mtu) == (
        "enp1s0f1np1", "192.168.100.1/24", "rocep1s0f1", 3, 9000)
    assert (worker.iface, str(worker.ip.ip), worker.gid_index) == ("enp1s0f1np1", "192.168.100.2", 3)
    assert plan.env["head"] == {
        "VLLM_HOST_IP": "192.168.100.1", "NCCL_SOCKET_IFNAME": "enp1s0f1np1", "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_IB_HCA": "rocep1s0f1", "NCCL_IB_GID_INDEX": "3"}
    assert plan.env["worker"]["VLLM_HOST_IP"] == "192.168.100.2"


def test_every_planned_command_is_valid_bash(nodes):
    fake = FakeNodes(nodes)
    plan = preflight(fake, "--sync", "--api-key", "k")
    cmds = cluster.plan_commands(cluster.Cluster.from_args(fake.args), plan)
    assert [stage for stage, _, _ in cmds] == ["sync"] * 5 + ["ray", "ray", "guard", "guard", "check", "vllm"]
    for _, node, cmd in cmds:
        p = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
        assert p.returncode == 0, (node, cmd, p.stderr)
        assert " k " not in f" {cmd} "  # the key travels in the environment only
    ray_worker = cmds[6][2]
    assert "--address 192.168.100.1:6379 --node-ip-address 192.168.100.2" in ray_worker
    assert "-e NCCL_IB_HCA=rocep1s0f1 -e NCCL_IB_GID_INDEX=3" in ray_worker
    assert "docker exec -d -e VLLM_API_KEY onespark-ray" in cmds[-1][2]


def test_link_probe_reads_gid_index_from_sysfs(tmp_path):
    # The index comes from the RoCE v2 entry whose GID is the link address, wherever it sits in the table.
    a = roce_node(tmp_path / "a", "192.168.100.1", gid_index=5)
    facts = cluster_link.parse_link_probe(subprocess.run(
        ["bash", "-c", cluster.LINK_PROBE], capture_output=True, text=True,
        env={**os.environ, "ONESPARK_SYSROOT": str(a), "PATH": f"{a / 'bin'}:{os.environ['PATH']}"}).stdout)
    assert facts.hcas == {"rocep1s0f1": ("4:ACTIVE", ["enp1s0f1np1"])}
    assert ("rocep1s0f1", 5, "RoCE v2", "enp1s0f1np1", "0000:0000:0000:0000:0000:ffff:c0a8:6401") in facts.gids
    assert facts.mtu["enp1s0f1np1"] == 9000


BAD = {
    # name: (FakeNodes overrides or a node-dir change, expected words in the one line)
    "worker image missing": (dict(worker_image=(1, "Error: No such image")),
                             ["spark2 (worker)", f"no image onespark/v2:{__version__}-ray2.48.0", "--sync"]),
    "head cluster image outdated": (dict(head_image=(0, f"{ID_A} {__version__} 0.19.1 2.48.0 {ID_B}")),
                                    ["spark1 (head)", "an outdated cluster image", "pass --sync to build it"]),
    "worker checkpoint missing": (dict(worker_checkpoint=(1, "/data/w/hybrid/config.json: missing")),
                                  ["spark2 (worker)", "does not verify", "config.json: missing", "--sync"]),
    "onespark versions differ": (dict(worker_version=(0, "0.0.9")),
                                 ["spark2 (worker)", "onespark 0.0.9", f"but {__version__}", "same commit"]),
    "images differ": (dict(worker_image=(0, f"{ID_B} {__version__} 0.32.0 {cluster.RAY_VERSION} {ID_B}")),
                      ["spark2 (worker)", "vLLM 0.32.0", "vLLM 0.19.1", "re-copy it with --sync"]),
    "no onespark on the worker": (dict(worker_version=(127, "onespark: command not found")),
                                  ["spark2 (worker)", "no onespark CLI", "./install.sh"]),
    "doctor fails on the worker": (dict(worker_doctor=(1, "  FAIL  NVIDIA runtime  docker has no nvidia runtime")),
                                   ["spark2 (worker)", "onespark doctor failed", "NVIDIA runtime"]),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_node_is_one_line_naming_node_and_fix(nodes, case, capsys):
    overrides, words = BAD[case]
    fake = FakeNodes(nodes, **overrides)
    plan = preflight(fake)
    assert len(plan.problems) == 1, plan.problems
    line = plan.problems[0]
    assert "\n" not in line
    for w in words:
        assert w in line, (w, line)
    # Through run(): the same line on stderr, exit 1, and every command it ran was a read-only one.
    fake.calls.clear()
    assert cluster.run(fake.args, runner=fake, nodes=(HEAD, WORKER)) == 1
    assert all(c in [known for _, known in read_only(fake.args)] for _, c in fake.calls)
    err = capsys.readouterr().err
    assert f"onespark cluster: error: {line}" in err and "nothing was started" in err


def test_run_refuses_a_remote_head(nodes):
    fake = FakeNodes(nodes)
    fake.args = cluster_args()
    with pytest.raises(UserError, match="the head spark1 is not this machine"):
        cluster.run(fake.args, runner=fake)  # spark1 is no name of this test machine
    assert fake.calls == []


def test_worker_not_answering_ssh(nodes):
    fake = FakeNodes(nodes, worker_ssh=(255, "ssh: connect to host spark2 port 22: No route to host"))
    with pytest.raises(UserError) as e:
        preflight(fake)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("node spark2 (worker) does not answer ssh (ssh: connect to host spark2 port 22: No route")
    assert "ssh-copy-id spark2" in msg
    assert [c for _, c in fake.calls] == ["true", "true"]  # nothing else was tried


def test_link_without_roce(tmp_path):
    nodes = {"spark1": roce_node(tmp_path / "a", "192.168.100.1"), "spark2": socket_node(tmp_path / "b", "192.168.100.2")}
    plan = preflight(FakeNodes(nodes))
    assert plan.problems == [
        "node spark2 (worker): link eno1 (192.168.100.2/24) has no RDMA device behind it (/sys/class/infiniband): "
        "NCCL would fall back to TCP sockets (public figure: 12.7 vs ~20 tok/s at TP=2): cable the ConnectX-7 "
        "ports and load mlx5_ib, or pass --allow-sockets"]
    # --allow-sockets: the same link over TCP, NCCL told not to look for IB.
    plan = preflight(FakeNodes(nodes), "--allow-sockets")
    assert plan.problems == []
    assert plan.env["worker"]["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in plan.env["worker"]
    assert plan.env["worker"]["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1,eno1"


def test_port_down_and_mtu_mismatch(tmp_path):
    nodes = {"spark1": roce_node(tmp_path / "a", "192.168.100.1"),
             "spark2": roce_node(tmp_path / "b", "192.168.100.2", state="1:DOWN", mtu=1500)}
    plan = preflight(FakeNodes(nodes))
    assert len(plan.problems) == 2, plan.problems
    assert plan.problems[0].startswith("node spark2 (worker): RDMA port rocep1s0f1/1 is 1:DOWN, not ACTIVE")
    assert plan.problems[1].startswith("node spark2 (worker): MTU 1500 on enp1s0f1np1, but 9000 on spark1's")


def test_no_shared_subnet(tmp_path):
    nodes = {"spark1": roce_node(tmp_path / "a", "192.168.100.1"),
             "spark2": make_node_dir(tmp_path / "b", addrs=[("enp1s0f1np1", "192.168.101.2/24")],
                                     mtu={"enp1s0f1np1": 9000})}
    plan = preflight(FakeNodes(nodes))
    assert len(plan.problems) == 1 and "share no IPv4 subnet" in plan.problems[0] and "netplan" in plan.problems[0]


@pytest.mark.parametrize("track,problem", [("0.19.1", True), ("0.32.0", False)])
def test_gid_index_differs(tmp_path, track, problem):
    # 0.19.1 copies the head's NCCL_* onto the worker; 0.32.0 keeps each node's (setdefault).
    nodes = {"spark1": roce_node(tmp_path / "a", "192.168.100.1", gid_index=3),
             "spark2": roce_node(tmp_path / "b", "192.168.100.2", gid_index=5)}
    img = (0, f"{ID_A} {__version__} {track} {cluster.RAY_VERSION} {ID_SERVING}")
    plan = preflight(FakeNodes(nodes, head_image=img, worker_image=img,
                               head_serving_image=(0, f"{ID_SERVING} {__version__} {track}")))
    assert plan.vllm_track == track
    if problem:
        assert len(plan.problems) == 1 and "GID index 5, but 3 on spark1" in plan.problems[0]
    else:
        assert plan.problems == []
        assert (plan.env["head"]["NCCL_IB_GID_INDEX"], plan.env["worker"]["NCCL_IB_GID_INDEX"]) == ("3", "5")


def test_sync_lets_the_worker_lack_image_and_checkpoint(nodes):
    fake = FakeNodes(nodes, worker_image=(1, "Error: No such image"), head_image=(1, "Error: No such image"),
                     worker_checkpoint=(1, "missing"))
    plan = preflight(fake, "--sync")
    assert plan.problems == []
    # ... but the head must have the serving image to build the cluster image from.
    fake = FakeNodes(nodes, head_image=(1, "no"), head_serving_image=(1, "Error: No such image"))
    plan = preflight(fake, "--sync")
    assert plan.problems == [f"node spark1 (head): no image onespark/v2:{__version__}: build it there first (./install.sh)"]


def test_wait_cluster_names_the_worker_that_never_joins():
    def one_node(node, cmd, timeout):
        return 0, "1"
    with pytest.raises(UserError, match=r"node spark2 \(worker\): its Ray node did not join spark1's Ray head"):
        cluster.wait_cluster(one_node, HEAD, WORKER, {"192.168.100.1", "192.168.100.2"}, timeout=0)


def test_wait_cluster_checks_the_plugin_on_every_node():
    answers = iter(["2", json.dumps([["192.168.100.1", ["int8-lm-head"]], ["192.168.100.2", []]])])

    def runner(node, cmd, timeout):
        return 0, next(answers)
    with pytest.raises(UserError, match="node at 192.168.100.2: the onespark plugin is not active"):
        cluster.wait_cluster(runner, HEAD, WORKER, {"192.168.100.1", "192.168.100.2"})


def test_wait_cluster_reads_the_plugin_result_among_rays_log_lines():
    """The runner gives stdout and stderr together, and Ray's C++ log lines start with "[" too: the last such
    line was taken for the JSON (JSONDecodeError), and a JSON list of another shape failed to unpack (ValueError),
    both tracebacks once both Ray containers were up."""
    good = json.dumps([["192.168.100.1", ["int8-lm-head"]], ["192.168.100.2", ["int8-lm-head"]]])
    ray_line = "[2026-01-01 10:00:00,123 W 77 88] core_worker.cc:1234: Shutting down the core worker"
    def answering(out: str):
        answers = iter(["2", out])  # the node count, then the plugin check
        return lambda node, cmd, timeout: (0, next(answers))

    ips = {"192.168.100.1", "192.168.100.2"}
    for out in (good + "\n" + ray_line, ray_line + "\n" + good):
        seen = cluster.wait_cluster(answering(out), HEAD, WORKER, ips)
        assert [ip for ip, _ in seen] == ["192.168.100.1", "192.168.100.2"]
    for out in ('["192.168.100.1"]', "[[1, 2, 3]]", '[["192.168.100.1", "int8"]]', ray_line, "[" * 100_000):
        with pytest.raises(UserError, match=r"node spark1 \(head\): the plugin check printed no result"):
            cluster.wait_cluster(answering(out), HEAD, WORKER, ips)


def test_link_probe_skips_a_line_that_is_no_address():
    """A node's answer is outside input: `addr IFACE CIDR` with no CIDR in it (a banner, a damaged answer) raised
    ipaddress's ValueError out of the preflight."""
    facts = cluster_link.parse_link_probe("addr eth0 999.1.1.1/24\naddr eth1 not-an-ip\naddr eth2 10.0.0.1/24\n")
    assert [(i, str(ip)) for i, ip in facts.addrs] == [("eth2", "10.0.0.1/24")]


@pytest.mark.parametrize("log,expect", [
    # NCCL 2.2x INIT,NET lines as vLLM's workers print them.
    ("NCCL INFO NET/IB : Using [0]rocep1s0f1:1/RoCE [RO]; OOB enp1s0f1np1:192.168.100.1<0>\n"
     "NCCL INFO Using network IB", "RoCE"),
    ("NCCL INFO NET/IB : No device found.\nNCCL INFO NET/Socket : Using [0]enp1s0f1np1:192.168.100.1<0>\n"
     "NCCL INFO Using network Socket", "Socket"),
    ("INFO Starting vLLM API server", None),
])
def test_transport_from_nccl_log(log, expect):
    assert cluster.transport(log) == expect


class FakeCluster(FakeNodes):
    """FakeNodes that also take the changing commands: the copy makes the worker's image appear, the Ray
    containers make the cluster count 2 nodes, the plugin check answers from both link addresses, the
    vLLM log carries NCCL's RoCE lines. vLLM itself is a small HTTP server on this machine."""

    def __init__(self, dirs, **overrides):
        super().__init__(dirs, **overrides)
        self.ray_up = set()

    def __call__(self, node, cmd, timeout):
        try:
            return super().__call__(node, cmd, timeout)
        except AssertionError:  # not a read-only command (FakeNodes recorded it)
            pass
        if "docker save" in cmd:
            self.answers["spark2"]["image"] = self.answers["spark1"]["image"]
        elif "--entrypoint ray" in cmd:
            self.ray_up.add(node.name)
        elif "ray.nodes()" in cmd and "load_general_plugins" in cmd:
            return 0, json.dumps([["192.168.100.1", ["int8-lm-head"]], ["192.168.100.2", ["int8-lm-head"]]])
        elif "ray.nodes()" in cmd:
            return 0, str(len(self.ray_up))
        elif "tail -n 400" in cmd:
            return 0, "NCCL INFO NET/IB : Using [0]rocep1s0f1:1/RoCE [RO]; OOB enp1s0f1np1:192.168.100.1<0>"
        return 0, ""


@pytest.fixture
def fake_vllm():
    """/health, /v1/models and one chat completion, as vLLM's OpenAI server answers them."""
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({} if self.path == "/health" else {"data": [{"id": "qwen3.5-122b-a10b"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send({"choices": [{"message": {"content": "A small desktop AI computer."}}],
                        "usage": {"completion_tokens": 7}})

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def test_run_end_to_end_against_fake_nodes(nodes, fake_vllm, capsys):
    fake = FakeCluster(nodes, worker_image=(1, "Error: No such image"), worker_checkpoint=(1, "missing"))
    fake.args = cluster_args("--sync", "--port", str(fake_vllm))
    assert cluster.run(fake.args, runner=fake, nodes=(HEAD, WORKER)) == 0
    out = capsys.readouterr().out
    changing = [(n, c) for n, c in fake.calls if c not in [known for _, known in read_only(fake.args)]]
    order = [next(k for k in ("docker build", "docker save", "mkdir", "rsync", " verify ", "--entrypoint ray",
                              "load_general_plugins", "ray.nodes()", "docker exec -d", "kill -0", "tail -n")
                  if k in c) for _, c in changing]
    # The copy before Ray, Ray on both before the check, the check before vLLM.
    first = {k: order.index(k) for k in dict.fromkeys(order)}
    assert first["docker build"] < first["docker save"] < first["rsync"] < first[" verify "] < first["--entrypoint ray"]
    assert first["--entrypoint ray"] < first["ray.nodes()"] < first["load_general_plugins"] < first["docker exec -d"]
    assert [n for n, c in changing if "--entrypoint ray" in c] == ["spark1", "spark2"]
    assert [n for n, c in changing if " verify " in c] == ["spark2"]
    assert "onespark cluster: Ray cluster of 2 nodes, onespark plugin active in a Ray worker on each" in out
    assert "onespark cluster: NCCL transport: RoCE" in out
    assert "7 tokens in" in out and "TP=2 across spark1 and spark2" in out


def test_a_wrong_smoke_answer_stops_the_ray_containers_on_both_nodes(nodes, monkeypatch, capsys):
    """The smoke request is serve's (onespark.serving.launch.smoke); a server that answers without `usage` is one line,
    and the cluster it started is stopped on both nodes (before: a KeyError traceback, both left serving)."""
    from onespark.serving import launch

    answers = {"/v1/models": (200, b'{"data": [{"id": "qwen3.5-122b-a10b"}]}'),
               "/v1/chat/completions": (200, b'{"choices": [{"message": {"content": "hi"}}]}')}
    monkeypatch.setattr(launch, "http", lambda url, *a, **k: answers.get(url.split(":8000")[1], (200, b"{}")))
    fake = FakeCluster(nodes)
    fake.args = cluster_args()
    with pytest.raises(UserError) as e:
        cluster.run(fake.args, runner=fake, nodes=(HEAD, WORKER))
    assert str(e.value) == ("the chat answer has no choices[0].message text or usage.completion_tokens (it answered "
                            "b'{\"choices\": [{\"message\": {\"content\": \"hi\"}}]}'): " + launch.NOT_VLLM
                            + "; stopped onespark-ray on both nodes (vLLM's log: docker cp "
                            "onespark-ray:/tmp/onespark-vllm.log . on spark1)")
    assert [(n, c) for n, c in fake.calls if c.startswith("docker stop")] == [
        ("spark1", "docker stop onespark-ray"), ("spark2", "docker stop onespark-ray")]


# ---- the plan --------------------------------------------------------------------------------------------


def dry_run(*extra: str) -> str:
    p = subprocess.run([sys.executable, "-m", "onespark", "cluster", "--nodes", "spark1,spark2", "--work", "/data/w",
                        "--dry-run", *extra], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_dry_run_prints_both_machines_commands():
    out = dry_run("--sync")
    lines = out.splitlines()
    head = [ln for ln in lines if ln.startswith("[head spark1] +")]
    worker = [ln for ln in lines if ln.startswith("[worker spark2] +")]
    # Read-only preflight on both.
    for what in ("ssh", "version", "image", "checkpoint", "doctor", "link"):
        assert any(ln.startswith(f"[worker spark2] (read {what})") for ln in lines), what
    assert any(f"docker save onespark/v2:{__version__}-ray2.48.0" in ln and "| ssh -o BatchMode=yes -o ConnectTimeout=10 -- "
               "spark2 docker load" in ln for ln in head)
    # `--` before the paths; the host only in the destination, never in -e's ssh command
    assert any("rsync -a --partial" in ln and "-e 'ssh -o BatchMode=yes -o ConnectTimeout=10' -- /data/w/hybrid/ "
               "spark2:/data/w/hybrid/" in ln for ln in head)
    assert any(" verify /data/w/hybrid" in ln for ln in worker)
    ray_head = next(ln for ln in head if "--entrypoint ray" in ln)
    ray_worker = next(ln for ln in worker if "--entrypoint ray" in ln)
    assert "start --block --disable-usage-stats --head --node-ip-address HEAD_LINK_IP --port 6379" in ray_head
    assert "--address HEAD_LINK_IP:6379 --node-ip-address WORKER_LINK_IP --num-gpus 1" in ray_worker
    for ln in (ray_head, ray_worker):
        assert "--device /dev/infiniband" in ln and "-e NCCL_IB_HCA=RDMA_DEVICE" in ln and "--network host" in ln
        assert "-e RAY_worker_niceness=0" in ln  # vLLM's workers (Ray actors) at nice 0, not Ray's 15
    assert "-e VLLM_HOST_IP=WORKER_LINK_IP" in ray_worker
    assert any("load_general_plugins()" in ln for ln in out.split("[head spark1] + "))
    vllm = next(ln for ln in head if "entrypoint.sh" in ln)
    assert ("--host 127.0.0.1 --port 8000 --distributed-executor-backend ray --tensor-parallel-size 2" in vllm)
    assert "wait for /health on http://127.0.0.1:8000, one chat request" in out


def test_dry_run_pipeline_parallel_and_extra_flags():
    out = dry_run("--pp", "--", "--max-model-len", "65536")
    vllm = next(ln for ln in out.splitlines() if "entrypoint.sh" in ln)
    assert "--tensor-parallel-size 1 --pipeline-parallel-size 2 --max-model-len 65536" in vllm
    assert "docker save" not in out  # no --sync: nothing copied


def test_bad_nodes_argument():
    p = subprocess.run([sys.executable, "-m", "onespark", "cluster", "--nodes", "spark1", "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip() == ("onespark cluster: error: --nodes 'spark1': expected two different ssh addresses, "
                                "HEAD,WORKER (e.g. spark1,spark2)")


# ---- a real two-node cluster in two network namespaces ---------------------------------------------------

RAY_PIN = "ray==" + cluster.RAY_VERSION


def _netns_available() -> str | None:
    """None when this process can make network namespaces and veth pairs, else why not."""
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`): apt-get install iproute2 (.ci/apt-packages.txt)"
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns add)"
    name = f"ospk-probe-{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return f"ip netns add is not allowed here ({p.stderr.strip()[:120]}): needs CAP_SYS_ADMIN"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ray_pythonpath() -> str | None:
    """'' when Ray is importable in this venv (tests/requirements-ray.txt installed), else a directory with
    the pinned Ray (installed once with uv --target, kept in the venv), or None when it cannot be had."""
    probe = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"], capture_output=True, text=True)
    if probe.returncode == 0:
        return "" if probe.stdout.strip() == cluster.RAY_VERSION else None
    target = Path(sys.prefix) / f"ray-{cluster.RAY_VERSION}"
    if not (target / ".installed").exists():
        # --no-deps: Ray's other dependencies are vLLM's too (uv resolves only ray + msgpack as new).
        # --compile-bytecode: the test starts a dozen Ray processes; without .pyc each compiles Ray from source.
        p = subprocess.run([sys.executable, "-m", "uv", "pip", "install", "--quiet", "--no-deps", "--compile-bytecode",
                            "--target", str(target), "-r", str(ROOT / "tests" / "requirements-ray.txt")],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            return None
        (target / ".installed").touch()
    return str(target)


NETNS_SKIP = _netns_available()

# In the head namespace: wait for both nodes, one actor per node; each loads vLLM's plugins as a vLLM worker
# does, then the two form vLLM's TP group over Gloo and compute the onespark LM head's logits.
DRIVER = textwrap.dedent(r"""
    import json, os, sys, time
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head_ip, V, K, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    ray.init(address=f"{head_ip}:6379", _node_ip_address=head_ip, logging_level="ERROR", log_to_driver=False)
    t0 = time.time()
    while len([n for n in ray.nodes() if n["Alive"]]) < 2:
        assert time.time() - t0 < 90, "the worker's Ray node never joined"
        time.sleep(0.5)
    nodes = sorted((n["NodeManagerAddress"], n["NodeID"]) for n in ray.nodes() if n["Alive"])

    @ray.remote(num_cpus=1)
    class Rank:
        def plugin(self):
            from vllm.plugins import load_general_plugins
            load_general_plugins()  # what every vLLM worker process calls first
            from vllm.model_executor.custom_op import op_registry_oot
            import onespark.patches as p
            head = op_registry_oot.get("ParallelLMHead")
            return {"ip": ray.util.get_node_ip_address(), "nice": os.nice(0), "active": p._active,
                    "lm_head": f"{head.__module__}.{head.__qualname__}" if head else None}

        def tp_head(self, rank, init):
            import torch
            # Two hosts never share an SHM group: a distinct ident per node keeps vLLM's CPU communicator
            # on torch.distributed (Gloo over the veth) instead of /dev/shm, which only this test shares.
            os.environ["VLLM_DIST_IDENT"] = ray.util.get_node_ip_address()
            from vllm.config import VllmConfig, set_current_vllm_config
            from vllm.distributed import init_distributed_environment, initialize_model_parallel
            with set_current_vllm_config(VllmConfig()):
                init_distributed_environment(world_size=2, rank=rank, distributed_init_method=init,
                                             local_rank=0, backend="gloo")
                initialize_model_parallel(tensor_model_parallel_size=2)
                from vllm.model_executor.layers.logits_processor import LogitsProcessor
                from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
                g = torch.Generator().manual_seed(0)
                w = torch.randn(V, K, generator=g).to(torch.bfloat16)
                x = torch.randn(T, K, generator=g).to(torch.bfloat16)
                head = ParallelLMHead(V, K, params_dtype=torch.bfloat16, prefix="lm_head")
                head.weight_loader(head.weight, w)  # vLLM's loader takes this rank's vocab shard
                head.quant_method.process_weights_after_loading(head)
                logits = LogitsProcessor(V)._get_logits(x, head, None)  # shard logits + vLLM's gather
                return {"rank": rank, "class": type(head).__name__, "method": type(head.quant_method).__name__,
                        "shard_rows": int(head.onespark_w_int8.shape[0]), "bf16_left": head.weight.numel(),
                        "logits": logits.float().tolist()}

    ranks = [Rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote()
             for _, nid in nodes]
    plugin = ray.get([r.plugin.remote() for r in ranks])
    tp = ray.get([r.tp_head.remote(i, f"tcp://{head_ip}:29517") for i, r in enumerate(ranks)], timeout=180)
    print(json.dumps({"nodes": [ip for ip, _ in nodes], "plugin": plugin, "tp": tp}))
""")


class TwoNamespaces:
    """Two network namespaces joined by a veth pair (10.77.0.1/24 <-> 10.77.0.2/24), loopback up in each;
    no route out. Removing a namespace removes its end of the pair."""

    def __init__(self):
        tag = os.getpid()
        self.ns = {"head": f"ospk-h{tag}", "worker": f"ospk-w{tag}"}
        self.ifc = {"head": f"ospkh{tag}"[:15], "worker": f"ospkw{tag}"[:15]}
        self.ip = {"head": "10.77.0.1", "worker": "10.77.0.2"}

    def __enter__(self):
        sh = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
        for role in ("head", "worker"):
            sh("netns", "add", self.ns[role])
        sh("link", "add", self.ifc["head"], "type", "veth", "peer", "name", self.ifc["worker"])
        for role in ("head", "worker"):
            ns, ifc = self.ns[role], self.ifc[role]
            sh("link", "set", ifc, "netns", ns)
            sh("-n", ns, "addr", "add", f"{self.ip[role]}/24", "dev", ifc)
            sh("-n", ns, "link", "set", "lo", "up")
            sh("-n", ns, "link", "set", ifc, "up")
        return self

    def argv(self, role: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[role], *cmd]

    def runner(self, node, cmd, timeout):
        """cluster.Runner for the preflight: the node's shell runs inside its namespace."""
        p = subprocess.run(self.argv(node.role, "bash", "-c", cmd), capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr

    def __exit__(self, *exc):
        for role in ("worker", "head"):
            ns = self.ns[role]
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:  # every process left in the namespace is one this test started
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Stages:
    """The test's child processes against one deadline: each gets the time left, so a slow stage fails as itself,
    with every stage's time and the tail of its output and of Ray's logs, before pytest-timeout would kill the
    test blind (it did, in CI at 8af196a, before cluster.RAY_ENV: the message named no stage)."""

    def __init__(self, deadline_s: float, ray_logs: Path):
        self.end, self.ray_logs, self.took = time.monotonic() + deadline_s, ray_logs, {}

    def __call__(self, name: str, argv: list[str], env: dict[str, str], *, json_line: bool = False):
        """Runs one stage; with json_line, its last stdout line parsed (the drivers print one JSON line)."""
        t0 = time.monotonic()
        try:
            p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=max(1.0, self.end - t0))
        except subprocess.TimeoutExpired as e:
            self.took[name] = f"{time.monotonic() - t0:.0f} s, killed at the deadline"
            pytest.fail(self.report(name, _text(e.stdout) + _text(e.stderr)))
        self.took[name] = f"{time.monotonic() - t0:.0f} s, rc {p.returncode}"
        if p.returncode != 0:
            pytest.fail(self.report(name, p.stdout + p.stderr))
        if json_line:
            if not p.stdout.strip():
                pytest.fail(self.report(name, "no JSON line on stdout\n" + p.stderr))
            return json.loads(p.stdout.strip().splitlines()[-1])

    def report(self, name: str, output: str) -> str:
        ray = [f for ext in ("err", "out") for f in sorted(self.ray_logs.glob(f"session_[0-9]*/logs/*.{ext}"))]
        tails = "".join(f"\n--- {f.name} (tail)\n{f.read_text(errors='replace')[-800:]}" for f in ray
                        if f.stat().st_size)
        return (f"stage {name!r} failed; stages: {self.took}\n--- its output (tail)\n{output[-4000:]}"
                f"{tails[-6000:]}")


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


@pytest.mark.vllm
@pytest.mark.vllm032
@pytest.mark.skipif(NETNS_SKIP is not None, reason=NETNS_SKIP or "")
# ~50 s alone, or both tracks at once beside 4 busy processes on 2 cores (before cluster.RAY_ENV's worker
# niceness: stalled until the load stopped). Ray's install (a venv's first run) comes before the stages' 540 s.
@pytest.mark.timeout(1200)
def test_two_ray_nodes_in_two_namespaces(tmp_path):
    import torch

    pythonpath = _ray_pythonpath()
    if pythonpath is None:
        pytest.skip(f"needs {RAY_PIN} (tests/requirements-ray.txt) and PyPI to install it")
    temp = tempfile.mkdtemp(prefix="ospk-ray-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    V, K, T = 1001, 64, 3  # a vocabulary that splits unevenly: vLLM pads it to 1024, 512 rows per rank
    try:
        with TwoNamespaces() as nets:
            run = Stages(deadline_s=540, ray_logs=Path(temp))
            head, worker = cluster.Node("head-ns", "head", local=True), cluster.Node("worker-ns", "worker")
            # The preflight's link reading, for real on the veth pair: no RDMA there, so NCCL would use sockets.
            plan = cluster.link_preflight(head, worker, nets.runner, iface=None, allow_sockets=False, track="0.19.1")
            assert [p.split(":")[0] for p in plan.problems] == ["node head-ns (head)", "node worker-ns (worker)"]
            assert all("has no RDMA device behind it" in p and "--allow-sockets" in p for p in plan.problems)
            plan = cluster.link_preflight(head, worker, nets.runner, iface=None, allow_sockets=True, track="0.19.1")
            assert plan.problems == []
            assert {r: (plan.link[r].iface, str(plan.link[r].ip.ip)) for r in ("head", "worker")} == {
                r: (nets.ifc[r], nets.ip[r]) for r in ("head", "worker")}
            assert plan.env["head"]["NCCL_SOCKET_IFNAME"] == f"{nets.ifc['head']},{nets.ifc['worker']}"

            base = {**os.environ, **cluster.RAY_ENV, "OMP_NUM_THREADS": "1",
                    "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
            if pythonpath:
                base["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, base.get("PYTHONPATH")]))
            ray = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"]
            # Worker and driver ports from the OS (0, 0: as Ray's own tests run): from Ray's pool, a port is checked
            # free, then bound later, and something else can take it between the two (ray-project/ray#19336; a
            # driver failed so on port 10003 in a cold CI run, 2026-12-04).
            common = ["start", "--num-cpus", "1", "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port", "0"]
            steps = [("head", common + ["--head", "--node-ip-address", nets.ip["head"], "--port", "6379",
                                        "--include-dashboard=false", "--temp-dir", temp]),
                     ("worker", common + ["--address", f"{nets.ip['head']}:6379", "--node-ip-address", nets.ip["worker"]])]
            for role, args in steps:
                # The node's environment is the plan's (GLOO_SOCKET_IFNAME = its end of the link, ...).
                run(f"ray start ({role})", nets.argv(role, *ray, *args), {**base, **plan.env[role]})
            got = run("driver", nets.argv("head", sys.executable, "-c", DRIVER, nets.ip["head"], str(V), str(K), str(T)),
                      {**base, **plan.env["head"]}, json_line=True)
            # onespark cluster's own plugin check (run in the head's container on a Spark), on this cluster.
            checked = run("plugin check", nets.argv("head", sys.executable, "-c", cluster.PLUGIN_CHECK),
                          {**base, **plan.env["head"], "RAY_ADDRESS": f"{nets.ip['head']}:6379"}, json_line=True)
    finally:
        shutil.rmtree(temp, ignore_errors=True)

    # The cluster: one node per namespace, at the link addresses.
    assert got["nodes"] == ["10.77.0.1", "10.77.0.2"]
    # The plugin registered in a Ray worker process on each node, as vLLM's workers load it.
    assert [p["ip"] for p in got["plugin"]] == ["10.77.0.1", "10.77.0.2"]
    for p in got["plugin"]:
        assert p["nice"] == 0, p  # cluster.RAY_ENV: vLLM's workers are Ray actors, and Ray's default is 15
        assert "int8-lm-head" in p["active"], p
        assert p["lm_head"] == "onespark.patches.lm_head.OnesparkParallelLMHead", p
    assert sorted(ip for ip, _ in checked) == ["10.77.0.1", "10.77.0.2"]
    assert all("int8-lm-head" in active for _, active in checked), checked
    # TP=2 across the nodes: each rank holds half the padded vocabulary in INT8, no BF16 bytes left,
    # and vLLM's gather gives both ranks the full logits.
    for r in got["tp"]:
        assert (r["class"], r["method"], r["shard_rows"], r["bf16_left"]) == (
            "OnesparkParallelLMHead", "Int8LMHeadMethod", 512, 0), r
    # Reference, independent of onespark.kernels: per-row symmetric INT8 of the whole weight as the quantizer
    # documents it (fp32: scale = max|w_row| / 127, q = round-half-even(w / scale) clamped to +-127), then
    # x @ (q * scale).T in float64. A row shard quantizes to the same numbers, so any shard, gather or
    # padding mistake shows up as wrong columns.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, K, generator=g).to(torch.bfloat16)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16).double()
    q, scale = int8_rows_reference(w)
    ref = x @ (q.double() * scale.double()[:, None]).T
    for r in got["tp"]:
        out = torch.tensor(r["logits"], dtype=torch.float64)
        assert out.shape == (T, V)
        # The head computes in fp32 and returns BF16: one BF16 rounding (2^-8 relative) plus fp32
        # accumulation over K = 64 terms (~1e-6 relative): 2^-7 of |ref| + 1e-3 leaves 2x margin.
        bad = (out - ref).abs() > (ref.abs() * 2**-7 + 1e-3)
        assert not bad.any(), f"rank {r['rank']}: {int(bad.sum())} of {bad.numel()} logits off, first at " \
                              f"{bad.nonzero()[0].tolist()}"
        assert torch.equal(out.argmax(dim=1), ref.argmax(dim=1))


@pytest.mark.vllm
@pytest.mark.vllm032
def test_vllm_cpu_has_no_ray_backend():
    """What keeps the two-node test from serving: vLLM's CPU platform names no Ray device. When a vLLM
    release gives it one, this fails: then serve the tiny model across the namespaces for real."""
    from vllm.platforms.cpu import CpuPlatform

    assert CpuPlatform.ray_device_key == ""


# ---- ./install.sh --nodes -------------------------------------------------------------------------------


def test_install_dry_run_prints_the_two_machine_plan():
    p = subprocess.run(["./install.sh", "--dry-run", "-y", "--nodes", "A,B"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert re.search(r"^\+ \S*onespark cluster --nodes A\\?,B --sync --work ", out, re.M), out[:2000]
    plan = [ln.strip() for ln in out.splitlines() if ln.startswith("    [")]  # onespark cluster's lines
    for role, name in (("head", "A"), ("worker", "B")):
        assert any(ln.startswith(f"[{role} {name}] (read doctor)") for ln in plan), role
        assert any(ln.startswith(f"[{role} {name}] + docker rm -f onespark-ray") and "ray start" not in ln
                   and "--entrypoint ray" in ln for ln in plan), role
    assert any("docker save" in ln and "ssh -o BatchMode=yes -o ConnectTimeout=10 -- B docker load" in ln for ln in plan)
    assert any("--distributed-executor-backend ray --tensor-parallel-size 2" in ln for ln in plan)
    # The single-node launch is replaced, not added.
    assert "onespark serve" not in out


@pytest.mark.parametrize("argv,message", [
    (["--nodes", "A"], "--nodes 'A': expected two different ssh addresses, HEAD,WORKER (e.g. spark1,spark2)"),
    (["--nodes", "A,A"], "--nodes 'A,A': expected two different ssh addresses"),
    (["--demo", "--nodes", "A,B"], "--nodes needs two DGX Sparks; --demo runs on this one machine"),
])
def test_install_bad_nodes(argv, message):
    p = subprocess.run(["./install.sh", "--dry-run", "-y", *argv], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1].startswith(f"onespark: error: {message}")


# ---- host strings: a node name is an ssh destination, never an ssh option ---------------------------------

HOSTILE = "localhost,-oProxyCommand=touch pwned"
NOT_AN_ADDRESS = ("--nodes: '-oProxyCommand=touch pwned' is not an ssh address: give [user@]host, host a DNS name or "
                  "an IP address (letters, digits, '.', '-', '_'; no leading '-', no spaces), e.g. --nodes "
                  "spark1,user@192.168.100.2")
GOOD_NAMES = ["spark2", "user@192.168.100.2", "spark-2.lan.", "u_1@spark_2", "u@fe80::1", "fe80::1%enp1s0f1np1"]
BAD_NAMES = ["-oProxyCommand=touch pwned", "-x", "user@-x", "-@x", "spark 2", "a;touch x", "$(touch x)", "`id`",
             "@host", "a..b", "b-", "x@y@z", "[::1]", "fe80::1%a b", "ho'st", "h\tx",
             "a" * 64, "u@spark." + "b" * 64]  # a label past DNS's 63 characters: idna's UnicodeError (issue 58)


def test_a_host_string_is_never_an_ssh_option(tmp_path):
    """Before: the preflight's first `ssh -o BatchMode=yes ... -oProxyCommand=touch pwned true` ran the
    ProxyCommand on this machine (a file `pwned` in the working directory)."""
    for extra in ([], ["--dry-run"], ["--down"], ["--sync"], ["--down", "--dry-run"]):
        r = subprocess.run([sys.executable, "-m", "onespark", "cluster", "--nodes", HOSTILE, *extra], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (1, ""), (extra, r.stdout, r.stderr)
        assert r.stderr.splitlines() == [f"onespark cluster: error: {NOT_AN_ADDRESS}"], (extra, r.stderr)
    assert list(tmp_path.iterdir()) == []  # nothing created: ssh never ran


def test_install_nodes_refuses_a_host_string_before_anything_runs(tmp_path):
    r = subprocess.run([str(ROOT / "install.sh"), "--dry-run", "-y", "--nodes", HOSTILE], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"onespark: error: {NOT_AN_ADDRESS}"], r.stderr
    assert "+ " not in r.stdout  # not one command planned
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", BAD_NAMES)
def test_both_node_checks_refuse_what_is_no_ssh_address(name):
    """cluster's rule (Python) and install.sh's (bash) on one table."""
    assert not cluster.is_ssh_destination(name)
    with pytest.raises(UserError, match=re.escape(f"--nodes: {name!r} is not an ssh address")):
        cluster.parse_nodes(f"spark1,{name}")
    r = subprocess.run(["./install.sh", "--dry-run", "-y", "--nodes", f"spark1,{name}"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith(f"onespark: error: --nodes: '{name}' is not "
                                                                      "an ssh address"), r.stderr


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_ssh_addresses_pass_both_checks_and_reach_rsync_after_its_double_dash(name):
    assert cluster.is_ssh_destination(name)
    out = dry_run_nodes(f"spark1,{name}", "--sync")
    host = cluster.rsync_host(name)
    rsync = next(ln for ln in out.splitlines() if "rsync -a" in ln)
    assert rsync.endswith(f"-- /data/w/hybrid/ {shlex.quote(host + ':/data/w/hybrid/')}"), rsync
    assert ("[" in host) == (":" in name)  # an IPv6 address in brackets, rsync's HOST:PATH syntax
    assert f"| ssh -o BatchMode=yes -o ConnectTimeout=10 -- {shlex.quote(name)} docker load" in out
    if name in ("user@192.168.100.2", "u@fe80::1"):  # install.sh's bash rule (a full dry run is ~5 s each)
        r = subprocess.run(["./install.sh", "--dry-run", "-y", "--nodes", f"spark1,{name}"], capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr


def dry_run_nodes(nodes: str, *extra: str) -> str:
    p = subprocess.run([sys.executable, "-m", "onespark", "cluster", "--nodes", nodes, "--work", "/data/w",
                        "--dry-run", *extra], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_the_runner_puts_double_dash_before_the_host(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: seen.append(argv) or subprocess.CompletedProcess(
        argv, 0, "", ""))
    cluster.shell_runner(cluster.Node("user@spark2", "worker"), "true")
    assert seen == [["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "--", "user@spark2", "true"]]
