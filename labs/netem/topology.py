"""Names, addresses and the ip/tc commands of one emulated cluster (pure: print and test them).

    namespace hvdc-<id>-r0   eth0 198.18.0.1 ──veth── p0 ┐
    namespace hvdc-<id>-r1   eth0 198.18.0.2 ──veth── p1 ├─ br0 198.18.0.254  namespace hvdc-<id>-sw
    namespace hvdc-<id>-r2   eth0 198.18.0.3 ──veth── p2 ┘      (the switch; rendezvous server)

Addresses come from 198.18.0.0/15, the block reserved for network benchmarks (RFC 2544), and
exist only inside our namespaces: no real interface, address or route is touched.
"""
from __future__ import annotations

import dataclasses

from .links import LinkShape, NetemError, tbf_args

PREFIX = "hvdc-"
SUBNET = "198.18.0"          # RFC 2544 benchmarking block; /24 inside each cluster
PREFIX_LEN = 24
SWITCH_HOST = 254            # the switch namespace's own address: 198.18.0.254
RANK_IFACE = "eth0"          # same name in every rank namespace: HOROVOD_GLOO_IFACE
MAX_RANKS = 64
HOST_PORT = "ph"             # with the delay bridge: the switch namespace's own port (peer of br0)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Names and addresses of one emulated cluster; `tag` is unique per live cluster."""
    tag: str
    n: int

    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}{self.tag}-sw"

    def rank_ns(self, k: int) -> str:
        return f"{PREFIX}{self.tag}-r{k}"

    def rank_ip(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    @property
    def switch_ip(self) -> str:
        return f"{SUBNET}.{SWITCH_HOST}"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_ns] + [self.rank_ns(k) for k in range(self.n)]



def shaping_commands(ns: str, dev: str, link: LinkShape, with_delay: bool) -> list[list[str]]:
    """tc commands for the egress of one veth end.

    delay (by netem) and rate: netem (delay) at the root, tbf (rate) as its child: the classic
    'tbf under netem' of tc-netem(8).  Rate only, or delay added by the bridge: tbf at the root.
    """
    tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
    delay = link.delay_s if with_delay and link.delay_via == "netem" else 0.0
    if delay > 0:
        # netem's queue must hold everything in flight during the delay.
        cmds = [tc + ["root", "handle", "1:", "netem", "delay", f"{delay * 1e6:.0f}us",
                      "limit", "100000"]]
        if link.rate_bps is not None:
            cmds.append(tc + ["parent", "1:1", "handle", "10:"] + tbf_args(link.rate_bps, link.mtu))
        return cmds
    if link.rate_bps is not None:
        return [tc + ["root", "handle", "10:"] + tbf_args(link.rate_bps, link.mtu)]
    return []


def hosts_file(topo: Topology, k: int | None, hostname: str) -> str:
    """/etc/hosts as rank k (None: the switch) sees it: `ip netns exec` bind-mounts
    /etc/netns/<ns>/hosts over /etc/hosts.

    This machine's own name resolves to rank k's address, as it would on a real host.
    Horovod 0.28.1 needs it: the Gloo context of a process set ignores HOROVOD_GLOO_IFACE
    (GlooContext::InitializeForProcessSet leaves gloo_iface_ empty) and binds to whatever
    the host name resolves to, which is 127.0.0.1 here, unreachable from the other ranks.
    """
    lines = ["127.0.0.1 localhost",
             f"{topo.switch_ip if k is None else topo.rank_ip(k)} {hostname}"]
    lines += [f"{topo.rank_ip(j)} {topo.rank_ns(j)}" for j in range(topo.n)]
    lines.append(f"{topo.switch_ip} {topo.switch_ns}")
    return "\n".join(lines) + "\n"


def setup_commands(topo: Topology, link: LinkShape) -> list[list[str]]:
    """Every `ip`/`tc` command that builds the cluster, in order.

    `link.delay_via` must be resolved ('netem' or 'bridge').  With the delay bridge, br0 (the
    switch namespace's own address) is a plain veth whose peer ph is one more port of the
    userspace switch, and the rank ports p<k> join no kernel bridge: bridge.py forwards
    between p0..p<n-1> and ph.
    """
    if link.delay_s > 0 and link.delay_via not in ("netem", "bridge"):
        raise NetemError(f"delay_via {link.delay_via!r} is not resolved: "
                         "call link.resolved(probe_capabilities().netem) first")
    sw = topo.switch_ns
    bridge = link.uses_bridge
    cmds = [["ip", "netns", "add", ns] for ns in topo.namespaces]
    cmds.append(["ip", "-n", sw, "link", "set", "lo", "up"])
    if bridge:
        cmds += [["ip", "-n", sw, "link", "add", "br0", "mtu", str(link.mtu), "type", "veth",
                  "peer", "name", HOST_PORT, "mtu", str(link.mtu)],
                 ["ip", "-n", sw, "link", "set", HOST_PORT, "up"]]
    else:
        cmds += [["ip", "-n", sw, "link", "add", "br0", "type", "bridge", "forward_delay", "0",
                  "stp_state", "0"],
                 ["ip", "-n", sw, "link", "set", "br0", "mtu", str(link.mtu)]]
    cmds += [["ip", "-n", sw, "addr", "add", f"{topo.switch_ip}/{PREFIX_LEN}", "dev", "br0"],
             ["ip", "-n", sw, "link", "set", "br0", "up"]]
    for k in range(topo.n):
        ns, port = topo.rank_ns(k), f"p{k}"
        cmds += [
            # Both ends are born inside their namespaces: nothing appears in the root one.
            ["ip", "-n", sw, "link", "add", port, "mtu", str(link.mtu), "type", "veth",
             "peer", "name", RANK_IFACE, "netns", ns, "mtu", str(link.mtu)],
        ]
        if not bridge:
            cmds.append(["ip", "-n", sw, "link", "set", port, "master", "br0"])
        cmds += [
            ["ip", "-n", sw, "link", "set", port, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{topo.rank_ip(k)}/{PREFIX_LEN}", "dev", RANK_IFACE],
            ["ip", "-n", ns, "link", "set", RANK_IFACE, "up"],
        ]
        cmds += shaping_commands(ns, RANK_IFACE, link, with_delay=True)
        cmds += shaping_commands(sw, port, link, with_delay=False)
    return cmds

