#!/usr/bin/env python3
"""Emulate a small cluster on one machine: one network namespace per Horovod rank.

Why: on one machine Horovod ranks talk over loopback, which is tens of Gbit/s and has no
latency worth the name, so every compression scheme "wins" or "loses" for reasons no real
cluster shares.  Here each rank gets its own network stack and a NIC of a chosen rate, and the
ranks really talk TCP to each other across those NICs::

    namespace hvdc-<id>-r0   eth0 198.18.0.1 ──veth── p0 ┐
    namespace hvdc-<id>-r1   eth0 198.18.0.2 ──veth── p1 ├─ br0 198.18.0.254  namespace hvdc-<id>-sw
    namespace hvdc-<id>-r2   eth0 198.18.0.3 ──veth── p2 ┘      (the switch; rendezvous server)

* Rate: a token bucket (``tc qdisc ... tbf``) on the egress of *both* ends of every veth, so
  each rank has a full-duplex link of ``--rate`` into a non-blocking switch (the picture the
  alpha-beta cost model assumes).
* Delay: ``--delay D`` makes a message from one rank to another take D more one way, 2D more
  round trip.  With the kernel's sch_netem, ``netem delay D`` sits on each rank's eth0 (tbf as
  its child).  Without it (this project's machines), the switch's ports leave the kernel
  bridge and ``scripts/delay_bridge.py``, a userspace switch, forwards every frame D late;
  ``--delay-via`` picks one, ``python scripts/netem.py check`` says whether netem exists.
* Addresses come from 198.18.0.0/15, the block reserved for network benchmarks (RFC 2544),
  and exist only inside our namespaces: no real interface, address or route is touched.

Horovod ranks are launched with Gloo, without ssh: we start Horovod's own RendezvousServer
inside the switch namespace, and start rank k with ``ip netns exec hvdc-<id>-r<k>`` and the
environment ``horovodrun --gloo`` would give it (see horovod/runner/gloo_run.py), every rank
being a host of its own (local_size 1), so all of its traffic crosses the shaped links.

Command line (run as root)::

    python scripts/netem.py check
    python scripts/netem.py run -n 2 --rate 1gbit --delay 0.5ms -- python labs/mnist.py ...
    python scripts/netem.py bench -n 4 --rate 10gbit -- --sizes 1KiB:64MiB --out results/b.csv
    python scripts/netem.py cleanup          # remove leftovers of runs that were killed

Everything is bounded: ``--timeout`` ends the ranks (exit code 124) and the namespaces are
removed on every way out (normal end, failure, timeout, SIGINT/SIGTERM/SIGHUP).  Only a
SIGKILL can leave namespaces behind; ``cleanup`` (also run at the start of every ``run``)
removes those whose owner process is gone.

As a library::

    from netem import Link, Cluster, run_ranks
    with Cluster(n=2, link=Link.parse("1gbit", "0")) as cluster:
        result = run_ranks(cluster, ["python", "train.py"], timeout=120)
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

PREFIX = "hvdc-"
SUBNET = "198.18.0"          # RFC 2544 benchmarking block; /24 inside each cluster
PREFIX_LEN = 24
NETNS_ETC = Path("/etc/netns")   # per-namespace /etc overlays read by `ip netns exec`
SWITCH_HOST = 254            # the switch namespace's own address: 198.18.0.254
RANK_IFACE = "eth0"          # same name in every rank namespace: HOROVOD_GLOO_IFACE
MAX_RANKS = 64
REPO = Path(__file__).resolve().parent.parent
DELAY_BRIDGE = REPO / "scripts" / "delay_bridge.py"
HOST_PORT = "ph"             # with the delay bridge: the switch namespace's own port (peer of br0)
DELAY_VIA = ("auto", "netem", "bridge")

# Token bucket sizing.  The bucket must hold at least one full frame (else tbf drops it) and
# enough bytes that the timer that refills it need not fire every microsecond at 10 Gbit/s;
# too big a bucket lets short messages pass faster than the link rate.  The queue must be
# long enough that TCP rarely sees a local drop.
BURST_SECONDS = 1e-3
QUEUE_SECONDS = 50e-3
MIN_QUEUE_BYTES = 256 * 1024


class NetemError(RuntimeError):
    """A clear, user-facing error (bad argument, missing privilege or kernel feature)."""


# ----------------------------------------------------------------------------------------
# Parsing link parameters (pure)
# ----------------------------------------------------------------------------------------

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_rate(text: str | None) -> float | None:
    """'1gbit' -> 1e9 bits/s; None, '', '0' or 'none' -> None (unlimited).

    Only bit units are accepted: tc reads 'mbps' as megaBYTES per second, a classic trap.
    """
    if text is None or str(text).strip().lower() in ("", "0", "none", "inf", "unlimited"):
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise NetemError(f"bad rate {text!r}: use a number and one of "
                         f"{', '.join(_RATE_UNITS)} (e.g. 100mbit, 1gbit, 10gbit)")
    bps = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if bps < 8e3:
        raise NetemError(f"rate {text!r} is below 8 kbit/s; nothing useful runs that slowly")
    return bps


def parse_duration(text: str | None) -> float:
    """'0.5ms' -> 0.0005 s; a bare number is seconds; None or '' -> 0."""
    if text is None or str(text).strip() == "":
        return 0.0
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or (m.group(2) and m.group(2) not in _TIME_UNITS):
        raise NetemError(f"bad duration {text!r}: use a number and s, ms or us (e.g. 0.5ms)")
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]
    if seconds > 10:
        raise NetemError(f"delay {text!r} is over 10 s; that is not a network")
    return seconds


@dataclasses.dataclass(frozen=True)
class Link:
    """What every rank's NIC looks like: rate in bit/s (None = unlimited), one-way delay in s,
    and what adds the delay: the kernel's netem qdisc, the userspace delay bridge, or "auto"
    (netem where the kernel has it)."""
    rate_bps: float | None = None
    delay_s: float = 0.0
    mtu: int = 1500
    delay_via: str = "auto"

    @classmethod
    def parse(cls, rate: str | None, delay: str | None = None, mtu: int = 1500,
              delay_via: str = "auto") -> "Link":
        if not 576 <= mtu <= 65535:
            raise NetemError(f"mtu {mtu} out of range 576..65535")
        if delay_via not in DELAY_VIA:
            raise NetemError(f"--delay-via {delay_via!r}: one of {', '.join(DELAY_VIA)}")
        return cls(parse_rate(rate), parse_duration(delay), mtu, delay_via)

    def resolved(self, netem_available: bool) -> "Link":
        """This link with delay_via 'auto' replaced by what will really add the delay."""
        if self.delay_via != "auto":
            return self
        return dataclasses.replace(self, delay_via="netem" if netem_available else "bridge")

    @property
    def uses_bridge(self) -> bool:
        return self.delay_s > 0 and self.delay_via == "bridge"

    def describe(self) -> str:
        rate = "unlimited" if self.rate_bps is None else f"{self.rate_bps / 1e6:g} Mbit/s"
        via = f" (via {self.delay_via})" if self.delay_s > 0 else ""
        return f"rate {rate}, delay {self.delay_s * 1e3:g} ms{via}, mtu {self.mtu}"


# ----------------------------------------------------------------------------------------
# The commands that build a cluster (pure: easy to read, print and test)
# ----------------------------------------------------------------------------------------

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


def tbf_args(rate_bps: float, mtu: int) -> list[str]:
    """Arguments of a tbf qdisc for `rate_bps` (see the BURST/QUEUE constants for why)."""
    rate_Bps = rate_bps / 8
    burst = int(max(rate_Bps * BURST_SECONDS, 2 * (mtu + 14)))
    limit = int(max(rate_Bps * QUEUE_SECONDS, MIN_QUEUE_BYTES, 4 * burst))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


def shaping_commands(ns: str, dev: str, link: Link, with_delay: bool) -> list[list[str]]:
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


def setup_commands(topo: Topology, link: Link) -> list[list[str]]:
    """Every `ip`/`tc` command that builds the cluster, in order.

    `link.delay_via` must be resolved ('netem' or 'bridge').  With the delay bridge, br0 (the
    switch namespace's own address) is a plain veth whose peer ph is one more port of the
    userspace switch, and the rank ports p<k> join no kernel bridge: delay_bridge.py forwards
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


# ----------------------------------------------------------------------------------------
# Running ip/tc, checking what this machine can do
# ----------------------------------------------------------------------------------------

def _run(cmd: Sequence[str], verbose: bool = False, check: bool = True,
         timeout: float = 30) -> subprocess.CompletedProcess:
    if verbose:
        print("+ " + shlex.join(cmd), file=sys.stderr)
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NetemError(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n"
                         f"{proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of all network namespaces made by this tool (any owner)."""
    proc = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return sorted(name for name in names if name.startswith(PREFIX))


@dataclasses.dataclass
class Capabilities:
    root: bool
    iproute2: bool
    netns: bool = False
    tbf: bool = False
    netem: bool = False
    problem: str = ""

    def require(self, link: Link) -> None:
        """Raise a NetemError saying what is missing for `link`, if anything is."""
        if not (self.root and self.iproute2 and self.netns):
            raise NetemError(self.problem)
        if link.rate_bps is not None and not self.tbf:
            raise NetemError("this kernel has no tbf qdisc (CONFIG_NET_SCH_TBF): cannot limit rate")
        if link.delay_s > 0 and link.delay_via == "netem" and not self.netem:
            raise NetemError(
                "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM is not set); use "
                "--delay-via bridge (or auto) for the userspace delay bridge")


_CAPS: Capabilities | None = None


def probe_capabilities() -> Capabilities:
    """Find out (once per process) whether we can make namespaces, veths, tbf and netem."""
    global _CAPS
    if _CAPS is not None:
        return _CAPS
    caps = Capabilities(root=os.geteuid() == 0,
                        iproute2=bool(shutil.which("ip") and shutil.which("tc")))
    if not caps.root:
        caps.problem = "network namespaces need root (run as root, or with CAP_NET_ADMIN+CAP_SYS_ADMIN)"
    elif not caps.iproute2:
        caps.problem = "iproute2 is missing (`apt-get install -y iproute2` gives ip and tc)"
    else:
        ns = f"{PREFIX}{os.getpid()}-probe"
        try:
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
            caps.netns = True
            caps.tbf = _run(["tc", "-n", ns, "qdisc", "add", "dev", "probe0", "root"]
                            + tbf_args(1e9, 1500), check=False).returncode == 0
            caps.netem = _run(["tc", "-n", ns, "qdisc", "add", "dev", "probe1", "root", "netem",
                               "delay", "100us"], check=False).returncode == 0
        except (NetemError, OSError, subprocess.SubprocessError) as exc:
            caps.problem = f"cannot create a network namespace with a veth pair: {exc}"
        finally:
            _run(["ip", "netns", "del", ns], check=False)
    _CAPS = caps
    return caps


# ----------------------------------------------------------------------------------------
# Cluster: build on enter, always tear down on exit
# ----------------------------------------------------------------------------------------

_SEQ = itertools.count()


def _owner_pid(ns: str) -> int | None:
    m = re.match(rf"{re.escape(PREFIX)}(\d+)-", ns)
    return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_namespace(ns: str, verbose: bool = False) -> None:
    """Kill whatever still runs inside `ns`, then delete it (a namespace with live processes
    would outlive its name)."""
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = []
        for pid in pids:
            try:
                os.kill(int(pid), sig)
                live.append(pid)
            except (ProcessLookupError, ValueError):
                pass
        if not live:
            break
        time.sleep(0.2)
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    _run(["ip", "netns", "del", ns], verbose=verbose, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def cleanup(everything: bool = False, verbose: bool = False) -> list[str]:
    """Remove leftover hvdc-* namespaces: those whose owner process is gone, or all of them.

    Returns the names removed."""
    def leftover(name: str) -> bool:
        pid = _owner_pid(name)
        return everything or pid is None or (pid != os.getpid() and not _pid_alive(pid))

    removed = []
    for ns in list_namespaces():
        if leftover(ns):
            delete_namespace(ns, verbose)
            removed.append(ns)
    if NETNS_ETC.is_dir():       # /etc overlays left without their namespace
        for etc in NETNS_ETC.glob(PREFIX + "*"):
            if leftover(etc.name):
                shutil.rmtree(etc, ignore_errors=True)
    return removed


class Cluster:
    """Context manager: builds the namespaces, veths, bridge and qdiscs; removes them on exit."""

    def __init__(self, n: int, link: Link = Link(), verbose: bool = False):
        if not 1 <= n <= MAX_RANKS:
            raise NetemError(f"-n {n}: need 1..{MAX_RANKS} ranks")
        self.link = link
        self.verbose = verbose
        self.topo = Topology(tag=f"{os.getpid()}-{next(_SEQ)}", n=n)
        self.up = False
        self.bridge: subprocess.Popen | None = None
        self.bridge_stats: dict = {}

    @property
    def n(self) -> int:
        return self.topo.n

    def __enter__(self) -> "Cluster":
        caps = probe_capabilities()
        self.link = self.link.resolved(caps.netem)
        caps.require(self.link)
        cleanup(verbose=self.verbose)
        try:
            for cmd in setup_commands(self.topo, self.link):
                _run(cmd, verbose=self.verbose)
            if self.link.uses_bridge:
                self._start_bridge()
            hostname = socket.gethostname()
            for k in range(self.n):
                etc = NETNS_ETC / self.topo.rank_ns(k)
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_file(self.topo, k, hostname))
            etc = NETNS_ETC / self.topo.switch_ns      # mpirun resolves the ranks' names
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file(self.topo, None, hostname))
            self.up = True
            self._wait_reachable()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def teardown(self) -> None:
        self._stop_bridge()
        for ns in self.topo.namespaces:
            delete_namespace(ns, self.verbose)
        self.up = False

    def _start_bridge(self, timeout: float = 10.0) -> None:
        """Start delay_bridge.py in the switch namespace; return once its ports are open."""
        ports = [f"p{k}" for k in range(self.n)] + [HOST_PORT]
        cmd = ["ip", "netns", "exec", self.topo.switch_ns, sys.executable, str(DELAY_BRIDGE),
               "--delay", f"{self.link.delay_s!r}"] + ports
        if self.verbose:
            print("+ " + shlex.join(cmd), file=sys.stderr)
        self.bridge = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       text=True)
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.bridge.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        if not ready or ready[0].strip() != "ready":
            self.bridge.kill()             # and let the reader see EOF before anyone else reads
            reader.join(5)
            raise NetemError(f"the delay bridge did not start (exit code {self.bridge.poll()}); "
                             f"command: {shlex.join(cmd)}")

    def _stop_bridge(self) -> None:
        """SIGTERM the delay bridge and keep the counters it prints (frames, drops, lateness)."""
        if self.bridge is None:
            return
        bridge, self.bridge = self.bridge, None
        if bridge.poll() is None:
            bridge.terminate()
        try:
            out, _ = bridge.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            bridge.kill()
            out, _ = bridge.communicate()
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                self.bridge_stats = json.loads(line)
                break

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Wait until every rank's link is up (veth carrier and bridge port forwarding)."""
        deadline = time.monotonic() + timeout
        for k in range(self.n):
            while True:
                state = _run(["ip", "-n", self.topo.rank_ns(k), "-o", "link", "show",
                              RANK_IFACE]).stdout
                if "LOWER_UP" in state:
                    break
                if time.monotonic() > deadline:
                    raise NetemError(f"link of rank {k} did not come up: {state.strip()}")
                time.sleep(0.05)

    def exec_prefix(self, k: int) -> list[str]:
        """Prefix that runs a command inside rank k's namespace."""
        return ["ip", "netns", "exec", self.topo.rank_ns(k)]

    def counters(self) -> list[dict]:
        """Bytes/packets each rank's eth0 sent and received so far (kernel counters)."""
        rows = []
        for k in range(self.n):
            out = _run(["ip", "-n", self.topo.rank_ns(k), "-s", "-j", "link", "show",
                        RANK_IFACE]).stdout
            stats = json.loads(out)[0]["stats64"]
            rows.append({"rank": k, "tx_bytes": stats["tx"]["bytes"],
                         "rx_bytes": stats["rx"]["bytes"], "tx_packets": stats["tx"]["packets"],
                         "rx_packets": stats["rx"]["packets"],
                         "tx_dropped": stats["tx"].get("dropped", 0)})
        return rows

    def qdisc_stats(self) -> str:
        """Human-readable qdisc statistics of every shaped interface (drops, overlimits)."""
        parts = []
        for k in range(self.n):
            parts.append(_run(["tc", "-n", self.topo.rank_ns(k), "-s", "qdisc", "show", "dev",
                               RANK_IFACE]).stdout)
            parts.append(_run(["tc", "-n", self.topo.switch_ns, "-s", "qdisc", "show", "dev",
                               f"p{k}"]).stdout)
        return "".join(parts)


# ----------------------------------------------------------------------------------------
# Launching Horovod ranks (Gloo) inside the cluster
# ----------------------------------------------------------------------------------------

def rank_env(cluster: Cluster, k: int, rendezvous_port: int) -> dict[str, str]:
    """The environment horovodrun --gloo gives a rank (gloo_run.py), one host per rank."""
    topo = cluster.topo
    link = cluster.link
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": topo.switch_ip,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": RANK_IFACE,
        "HOROVOD_HOSTNAME": topo.rank_ns(k),
        "HOROVOD_RANK": str(k),
        "HOROVOD_SIZE": str(topo.n),
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": str(k),
        "HOROVOD_CROSS_SIZE": str(topo.n),
        "PYTHONUNBUFFERED": "1",
        # So that a program can say in its results which network it ran on.
        "HVDC_NETEM": "1",
        "HVDC_NETEM_RATE_BPS": "" if link.rate_bps is None else f"{link.rate_bps:.0f}",
        "HVDC_NETEM_DELAY_S": f"{link.delay_s:g}",
        "HVDC_NETEM_DELAY_VIA": link.delay_via if link.delay_s > 0 else "",
        "HVDC_NETEM_MTU": str(link.mtu),
    }


def _rendezvous_main(hostnames: list[str]) -> None:
    """Body of the hidden `rendezvous` subcommand, run inside the switch namespace: serve
    Horovod's Gloo rendezvous, print the port, stop when stdin closes (our parent ended)."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    plan = get_host_assignments(parse_hosts(",".join(f"{h}:1" for h in hostnames)),
                                len(hostnames))
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    print(port, flush=True)
    sys.stdin.read()          # returns at EOF: the launcher closed the pipe or died
    server.stop()


class _Timeout(Exception):
    pass


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


@dataclasses.dataclass
class RunResult:
    returncode: int             # 0, the first failing rank's code, 124 on timeout, 128+sig
    rank_codes: list[int | None]
    seconds: float
    counters: list[dict]        # per-rank eth0 byte counters at the end
    timed_out: bool = False


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(prefix + line)
        sink.flush()
    stream.close()


def _stop(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every process group, then SIGKILL what is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _wait(procs: Sequence[subprocess.Popen], deadline: float) -> tuple[int, bool]:
    """Wait until all succeed, one fails or the deadline passes: (first failure code, timed out)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0], False   # read before we stop the others (they'd say -15)
        if all(c is not None for c in codes):
            return 0, False
        if time.monotonic() > deadline:
            return 0, True
        time.sleep(0.05)


def _base_env(env: dict[str, str] | None) -> dict[str, str]:
    base = dict(os.environ if env is None else env)
    # `python` in the command means the interpreter running this script (the venv's).
    base["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), base.get("PATH", "")])
    # A launcher's leftovers must not confuse the ranks about who they are.
    for key in [k for k in base if k.startswith(("HOROVOD_GLOO_", "OMPI_", "PMIX_"))]:
        del base[key]
    return base


def run_ranks(cluster: Cluster, command: Sequence[str], timeout: float = 600.0,
              launcher: str = "gloo", env: dict[str, str] | None = None,
              stdout=None, stderr=None) -> RunResult:
    """Run `command` as Horovod ranks 0..n-1, rank k inside namespace k.

    launcher "gloo": our own rendezvous server + one `ip netns exec` per rank (default).
    launcher "mpi": Open MPI's mpirun in the switch namespace, starting its daemons through
    `ip netns exec` instead of ssh.  Either way every rank is stopped when one fails (like
    horovodrun) or when `timeout` seconds pass (exit code 124).
    """
    if not command:
        raise NetemError("no command to run")
    if launcher not in ("gloo", "mpi"):
        raise NetemError(f"launcher {launcher!r}: use gloo or mpi")
    start = time.monotonic()
    run = _run_gloo if launcher == "gloo" else _run_mpi
    rc, codes, timed_out = run(cluster, list(command), start + timeout, _base_env(env),
                               stdout or sys.stdout, stderr or sys.stderr)
    if timed_out:
        print(f"netem: timeout after {timeout:g} s: ranks stopped", file=sys.stderr)
        rc = 124
    if rc < 0:                   # killed by a signal: report it the way a shell does
        rc = 128 - rc
    return RunResult(rc, codes, time.monotonic() - start, cluster.counters(), timed_out)


def _run_gloo(cluster, command, deadline, base_env, stdout, stderr):
    topo = cluster.topo
    rendezvous = subprocess.Popen(
        ["ip", "netns", "exec", topo.switch_ns, sys.executable, str(Path(__file__).resolve()),
         "rendezvous", *[topo.rank_ns(k) for k in range(topo.n)]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        port_line = rendezvous.stdout.readline().strip()
        if not port_line.isdigit():
            raise NetemError(f"rendezvous server did not start (said {port_line!r})")
        for k in range(topo.n):
            p = subprocess.Popen(cluster.exec_prefix(k) + command,
                                 env={**base_env, **rank_env(cluster, k, int(port_line))},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, text=True, start_new_session=True)
            procs.append(p)
            for stream, sink in ((p.stdout, stdout), (p.stderr, stderr)):
                t = threading.Thread(target=_pump, args=(stream, f"[{k}] ", sink), daemon=True)
                t.start()
                pumps.append(t)
        rc, timed_out = _wait(procs, deadline)
    finally:
        _stop(procs)
        for t in pumps:
            t.join(timeout=5)
        if rendezvous.stdin:
            rendezvous.stdin.close()
        _stop([rendezvous], grace=2.0)
    return rc, [p.returncode for p in procs], timed_out


# mpirun starts one daemon (orted) per host with "AGENT HOST 'orted ...'", as it would with
# ssh; the host names are our namespace names, so the agent is one `ip netns exec` away.
MPI_AGENT = """#!/bin/sh
# plm_rsh_agent for netem.py: $1 is a host (= a network namespace), the rest a shell command.
host="$1"; shift
exec ip netns exec "$host" sh -c "$*"
"""


def mpirun_command(cluster: Cluster, command: Sequence[str], agent: str) -> list[str]:
    """The mpirun command line (pure); run inside the switch namespace."""
    topo = cluster.topo
    subnet = f"{SUBNET}.0/{PREFIX_LEN}"
    passed = ["PATH", "PYTHONUNBUFFERED", "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS",
              "HVDC_NETEM", "HVDC_NETEM_RATE_BPS", "HVDC_NETEM_DELAY_S", "HVDC_NETEM_DELAY_VIA",
              "HVDC_NETEM_MTU"]
    return (["mpirun", "--allow-run-as-root", "-np", str(topo.n),
             "-H", ",".join(f"{topo.rank_ns(k)}:1" for k in range(topo.n)),
             "--mca", "plm_rsh_agent", agent,
             "--mca", "btl", "tcp,self",                  # no shared memory: use the links
             "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet,
             "--bind-to", "none",          # each daemon thinks it owns the machine's core 0
             # Without this, orted crashed in hwloc_shmem_topology_write in 6 of 100 starts
             # (the look-alike hosts share one machine); 0 of 100 with it.
             "--mca", "rtc_hwloc_vmhole", "none",
             "--tag-output"]
            + [a for key in passed for a in ("-x", key)]
            + list(command))


def _run_mpi(cluster, command, deadline, base_env, stdout, stderr):
    if not shutil.which("mpirun"):
        raise NetemError("launcher mpi needs Open MPI's mpirun on PATH")
    env = {**base_env, "PYTHONUNBUFFERED": "1", "HOROVOD_CONTROLLER": "mpi",
           "PMIX_MCA_gds": "hash",   # the shared-memory store trips over our fake hosts
           "HOROVOD_CPU_OPERATIONS": "mpi"}
    env.update({k: v for k, v in rank_env(cluster, 0, 0).items() if k.startswith("HVDC_")})
    with tempfile.TemporaryDirectory(prefix="hvdc-mpi-") as tmp:
        agent = Path(tmp) / "netns_agent.sh"
        agent.write_text(MPI_AGENT)
        agent.chmod(0o755)
        proc = subprocess.Popen(["ip", "netns", "exec", cluster.topo.switch_ns]
                                + mpirun_command(cluster, command, str(agent)),
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        pumps = [threading.Thread(target=_pump, args=(stream, "", sink), daemon=True)
                 for stream, sink in ((proc.stdout, stdout), (proc.stderr, stderr))]
        for t in pumps:
            t.start()
        try:
            rc, timed_out = _wait([proc], deadline)
        finally:
            _stop([proc])
            for t in pumps:
                t.join(timeout=5)
            # Ranks or daemons that outlived mpirun are killed with their namespaces.
    return rc, [proc.returncode], timed_out


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------

def _raise_on_signal(signum, frame):
    # Once: a second Ctrl-C must not interrupt the teardown that this one starts.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise _Interrupted(signum)


def _print_counters(result: RunResult, seconds: float) -> None:
    print(f"netem: {len(result.counters)} ranks, {seconds:.2f} s, exit {result.returncode}",
          file=sys.stderr)
    for row in result.counters:
        print(f"netem:   rank {row['rank']}: sent {row['tx_bytes'] / 2**20:9.2f} MiB "
              f"received {row['rx_bytes'] / 2**20:9.2f} MiB (tx dropped {row['tx_dropped']})",
              file=sys.stderr)


def cmd_run(args, command: list[str]) -> int:
    link = Link.parse(args.rate, args.delay, args.mtu, args.delay_via)
    link = link.resolved(probe_capabilities().netem)
    print(f"netem: {args.n} ranks, each with {link.describe()}", file=sys.stderr)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    try:
        with Cluster(args.n, link, verbose=args.verbose) as cluster:
            result = run_ranks(cluster, command, timeout=args.timeout, launcher=args.launcher)
            _print_counters(result, result.seconds)
            if args.verbose:
                print(cluster.qdisc_stats(), file=sys.stderr)
        if cluster.bridge_stats:
            print(f"netem: delay bridge {json.dumps(cluster.bridge_stats)}", file=sys.stderr)
        return result.returncode
    except _Interrupted as exc:
        print(f"netem: interrupted by signal {exc.signum}; namespaces removed", file=sys.stderr)
        return 128 + exc.signum


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  netem.py run -n 2 --rate 1gbit -- python labs/mnist.py --bit8-allreduce\n"
               "  netem.py bench -n 4 --rate 1gbit -- --out results/bench/1g_n4.csv\n"
               "details: docs/netem.md")
    sub = parser.add_subparsers(dest="cmd", required=True,
                                metavar="{run,bench,check,cleanup,commands}")

    def add_link_args(p):
        p.add_argument("-n", type=int, default=2, help="number of ranks (default 2)")
        p.add_argument("--rate", default=None,
                       help="per-rank link rate, e.g. 100mbit, 1gbit, 10gbit (default unlimited)")
        p.add_argument("--delay", default="0", help="one-way delay, e.g. 0.1ms")
        p.add_argument("--delay-via", choices=DELAY_VIA, default="auto",
                       help="netem: the kernel's qdisc; bridge: scripts/delay_bridge.py, a "
                            "userspace switch (for kernels without sch_netem); auto (default): "
                            "netem if the kernel has it")
        p.add_argument("--mtu", type=int, default=1500)
        p.add_argument("--timeout", type=float, default=600,
                       help="seconds before every rank is stopped (exit code 124)")
        p.add_argument("--launcher", choices=["gloo", "mpi"], default="gloo",
                       help="gloo: our rendezvous + ip netns exec (default); mpi: mpirun "
                            "with an ip-netns-exec agent instead of ssh")
        p.add_argument("-v", "--verbose", action="store_true", help="print every ip/tc command")

    p_run = sub.add_parser("run", help="run COMMAND as n Horovod ranks: netem.py run [...] -- CMD")
    add_link_args(p_run)
    p_bench = sub.add_parser("bench", help="run scripts/bench_collectives.py as the ranks; "
                                           "arguments after -- go to it")
    add_link_args(p_bench)
    sub.add_parser("check", help="say whether this machine can emulate (root, netns, tbf, netem)")
    p_clean = sub.add_parser("cleanup", help="remove leftover hvdc-* namespaces")
    p_clean.add_argument("--all", action="store_true",
                         help="also those of live owners (a run in progress will break)")
    p_show = sub.add_parser("commands", help="print the ip/tc commands a cluster is built with")
    add_link_args(p_show)
    p_rdv = sub.add_parser("rendezvous")     # internal: run by run_ranks in the switch ns
    p_rdv.add_argument("hosts", nargs="+")
    args = parser.parse_args(argv)

    try:
        if args.cmd == "rendezvous":
            _rendezvous_main(args.hosts)
            return 0
        if args.cmd == "check":
            caps = probe_capabilities()
            print(json.dumps(dataclasses.asdict(caps), indent=1))
            return 0 if caps.netns and caps.tbf else 1
        if args.cmd == "cleanup":
            removed = cleanup(everything=args.all, verbose=True)
            print(f"removed {len(removed)} namespaces" + (": " + " ".join(removed) if removed else ""))
            return 0
        if args.cmd == "commands":
            link = Link.parse(args.rate, args.delay, args.mtu, args.delay_via)
            link = link.resolved(probe_capabilities().netem)
            for cmd in setup_commands(Topology("PID-0", args.n), link):
                print(shlex.join(cmd))
            return 0
        if args.cmd == "bench":
            command = [sys.executable, str(REPO / "scripts" / "bench_collectives.py")] + command
        elif not command:
            parser.error("run needs a command after --")
        return cmd_run(args, command)
    except NetemError as exc:
        print(f"netem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
