"""The link between the two Sparks of `onespark cluster`: each node's interfaces and RDMA devices read by one
probe, the one subnet both share (RoCE first), its NCCL environment per node, and the problems that stop the
preflight (one line each, naming the node and the fix). The nodes themselves and how a command reaches one
(Runner) are here too, since everything else in cluster reads them."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field

from onespark.errors import UserError

# Interfaces that are never the link between two Sparks.
NOT_LINK = ("lo", "docker", "veth", "br-", "virbr", "tailscale", "wg")


@dataclass(frozen=True)
class Node:
    name: str  # the ssh address
    role: str  # "head" | "worker"
    local: bool = False  # the head runs its commands here, without ssh

    def __str__(self) -> str:
        return f"{self.name} ({self.role})"


# (node, shell command, timeout in s) -> (exit status, stdout + stderr). Tests pass their own.
Runner = Callable[[Node, str, float], tuple[int, str]]


# ---- the link -----------------------------------------------------------------------------------------

# Read-only. Prints one fact per line: `addr IFACE CIDR`, `mtu IFACE N`, `hca NAME STATE NETDEV...`,
# `gid HCA INDEX TYPE NETDEV GID`. ONESPARK_SYSROOT lets tests point /sys at a made-up tree.
LINK_PROBE = r"""
sys=${ONESPARK_SYSROOT:-}/sys
ip -o -4 addr show 2>/dev/null | while read -r _ ifc _ cidr _; do echo "addr $ifc $cidr"; done
for d in "$sys"/class/net/*; do [ -r "$d/mtu" ] && echo "mtu ${d##*/} $(cat "$d/mtu")"; done
for h in "$sys"/class/infiniband/*; do
  [ -d "$h" ] || continue
  p=$h/ports/1
  echo "hca ${h##*/} $(tr -d ' ' < "$p/state" 2>/dev/null) $(ls "$h/device/net" 2>/dev/null | tr '\n' ' ')"
  for g in "$p"/gids/*; do
    i=${g##*/}
    t=$(cat "$p/gid_attrs/types/$i" 2>/dev/null | tr ' ' '_') || continue
    n=$(cat "$p/gid_attrs/ndevs/$i" 2>/dev/null) || continue
    echo "gid ${h##*/} $i $t $n $(cat "$g")"
  done
done
"""


@dataclass
class LinkFacts:
    addrs: list[tuple[str, ipaddress.IPv4Interface]] = field(default_factory=list)
    mtu: dict[str, int] = field(default_factory=dict)
    hcas: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # name -> (port state, netdevs)
    gids: list[tuple[str, int, str, str, str]] = field(default_factory=list)  # hca, index, type, netdev, gid


def parse_link_probe(text: str) -> LinkFacts:
    f = LinkFacts()
    for line in text.splitlines():
        w = line.split()
        if not w:
            continue
        if w[0] == "addr" and len(w) == 3:
            try:
                f.addrs.append((w[1].split("@")[0], ipaddress.IPv4Interface(w[2])))
            except ValueError:  # not `ip`'s line (a login banner, a damaged answer): no address of the link
                continue
        elif w[0] == "mtu" and len(w) == 3 and w[2].isdigit():
            f.mtu[w[1]] = int(w[2])
        elif w[0] == "hca" and len(w) >= 3:
            f.hcas[w[1]] = (w[2], w[3:])
        elif w[0] == "gid" and len(w) == 6 and w[2].isdigit():
            f.gids.append((w[1], int(w[2]), w[3].replace("_", " "), w[4], w[5]))
    return f


@dataclass
class NodeLink:
    iface: str
    ip: ipaddress.IPv4Interface
    mtu: int | None
    hca: str | None = None
    gid_index: int | None = None


def _ipv4_gid(ip: ipaddress.IPv4Address) -> str:
    """The RoCE v2 GID of an IPv4 address as the kernel writes it: ::ffff:a.b.c.d in 8 groups of 4 hex."""
    h = ip.packed.hex()
    return f"0000:0000:0000:0000:0000:ffff:{h[:4]}:{h[4:]}"


def rdma_of(facts: LinkFacts, iface: str, ip: ipaddress.IPv4Interface) -> tuple[str | None, str, int | None]:
    """(HCA behind iface or None, its port state, the RoCE v2 GID index of ip or None)."""
    for hca, (state, netdevs) in sorted(facts.hcas.items()):
        if iface in netdevs:
            want = _ipv4_gid(ip.ip)
            idx = [i for h, i, t, n, g in facts.gids if h == hca and n == iface and "v2" in t and g == want]
            return hca, state, (idx[0] if idx else None)
    return None, "", None


def choose_link(head: LinkFacts, worker: LinkFacts, iface: str | None) -> tuple[NodeLink, NodeLink]:
    """The pair of interfaces, one per node, on one subnet: RoCE-capable ones first, then the name asked."""
    pairs = []
    for hi, hip in head.addrs:
        for wi, wip in worker.addrs:
            if hip.network != wip.network or hi.startswith(NOT_LINK) or wi.startswith(NOT_LINK):
                continue
            if iface and iface not in (hi, wi):
                continue
            rdma = (rdma_of(head, hi, hip)[0] is not None) + (rdma_of(worker, wi, wip)[0] is not None)
            pairs.append((-rdma, hi, hip, wi, wip))
    if not pairs:
        raise LookupError
    _, hi, hip, wi, wip = sorted(pairs, key=lambda p: (p[0], p[1], p[3]))[0]
    out = []
    for facts, ifc, ip in ((head, hi, hip), (worker, wi, wip)):
        hca, _, gid = rdma_of(facts, ifc, ip)
        out.append(NodeLink(ifc, ip, facts.mtu.get(ifc), hca, gid))
    return out[0], out[1]


# ---- the plan -----------------------------------------------------------------------------------------


@dataclass
class Plan:
    head: Node
    worker: Node
    link: dict[str, NodeLink]  # role -> link
    env: dict[str, dict[str, str]]  # role -> container environment
    vllm_track: str = ""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def nccl_env(head: NodeLink, worker: NodeLink, allow_sockets: bool) -> dict[str, dict[str, str]]:
    """Per-node NCCL/Gloo/vLLM environment for the Ray containers.

    vLLM 0.19.1's Ray executor copies the driver's (head's) NCCL_* and VLLM_* variables onto every worker,
    overwriting the worker's own (RayDistributedExecutor: update_environment_variables); 0.32.0's
    RayExecutorV2 applies them with setdefault, so node-local values win. NCCL_IB_HCA and
    NCCL_SOCKET_IFNAME are prefix filters, so listing both nodes' names is right on either track; a GID
    index cannot be a list, so on 0.19.1 it must be the same number on both (the preflight checks it).
    VLLM_HOST_IP is worker-specific in both versions (never copied).
    """
    env: dict[str, dict[str, str]] = {}
    ifnames = ",".join(dict.fromkeys([head.iface, worker.iface]))
    hcas = ",".join(dict.fromkeys(h for h in (head.hca, worker.hca) if h))
    for role, link in (("head", head), ("worker", worker)):
        e = {"VLLM_HOST_IP": str(link.ip.ip), "NCCL_SOCKET_IFNAME": ifnames, "GLOO_SOCKET_IFNAME": link.iface,
             # INIT,NET prints the transport NCCL chose ("NET/IB ... RoCE" or "NET/Socket"): checked after start.
             "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
        if hcas and not allow_sockets:
            e["NCCL_IB_HCA"] = hcas
            if link.gid_index is not None:
                e["NCCL_IB_GID_INDEX"] = str(link.gid_index)
        if allow_sockets and not (head.hca and worker.hca):
            e["NCCL_IB_DISABLE"] = "1"
        env[role] = e
    return env


def link_preflight(head: Node, worker: Node, runner: Runner, *, iface: str | None, allow_sockets: bool,
                   track: str) -> Plan:
    """Read both nodes' interfaces and RDMA devices; the link, its NCCL environment, and any problems."""
    facts = {}
    for node in (head, worker):
        rc, out = runner(node, LINK_PROBE, 30)
        if rc != 0:
            raise UserError(f"node {node}: reading its network interfaces failed ({out[-200:]})")
        facts[node.role] = parse_link_probe(out)
    plan = Plan(head, worker, {}, {}, vllm_track=track)
    try:
        hl, wl = choose_link(facts["head"], facts["worker"], iface)
    except LookupError:
        which = f" on interface {iface}" if iface else ""
        plan.problems.append(
            f"nodes {head.name} and {worker.name} share no IPv4 subnet{which}: give the ConnectX-7 ports "
            f"addresses on one subnet (e.g. 192.168.100.1/24 and .2/24 with netplan, docs/guides/two-sparks.md)")
        return plan
    plan.link = {"head": hl, "worker": wl}
    for node, link in ((head, hl), (worker, wl)):
        if link.hca is None:
            if not allow_sockets:
                plan.problems.append(
                    f"node {node}: link {link.iface} ({link.ip}) has no RDMA device behind it "
                    f"(/sys/class/infiniband): NCCL would fall back to TCP sockets (public figure: 12.7 vs ~20 "
                    f"tok/s at TP=2): cable the ConnectX-7 ports and load mlx5_ib, or pass --allow-sockets")
            continue
        state = facts[node.role].hcas[link.hca][0]
        if "ACTIVE" not in state:
            plan.problems.append(f"node {node}: RDMA port {link.hca}/1 is {state or 'unknown'}, not ACTIVE: check "
                                 f"the cable and `ibv_devinfo -d {link.hca}` (or pass --allow-sockets)")
        if link.gid_index is None and not allow_sockets:
            plan.problems.append(
                f"node {node}: {link.hca} has no RoCE v2 GID for {link.ip.ip} on {link.iface} (show_gids): "
                f"bring {link.iface} up with that address, then re-run")
    if hl.mtu and wl.mtu and hl.mtu != wl.mtu:
        plan.problems.append(f"node {worker}: MTU {wl.mtu} on {wl.iface}, but {hl.mtu} on {head.name}'s "
                             f"{hl.iface}: set the same MTU on both (netplan `mtu: 9000`)")
    elif hl.mtu and hl.mtu < 9000:
        plan.notes.append(f"link MTU {hl.mtu}: public two-Spark setups use 9000 (jumbo frames)")
    if (track == "0.19.1" and not allow_sockets and hl.gid_index is not None and wl.gid_index is not None
            and hl.gid_index != wl.gid_index):
        plan.problems.append(
            f"node {worker}: RoCE v2 GID index {wl.gid_index}, but {hl.gid_index} on {head.name}: vLLM 0.19.1 "
            f"copies the head's NCCL_IB_GID_INDEX to every worker; give both links the same address layout "
            f"(one IPv4 address per port) or use the 0.32.0 image, which keeps each node's value")
    plan.env = nccl_env(hl, wl, allow_sockets)
    return plan
