"""Build an emulated cluster of network namespaces, probe what the kernel can do, clean up.

Everything is bounded: the namespaces are removed on every way out of `Cluster` (normal end,
failure, SIGINT/SIGTERM/SIGHUP raised as exceptions by the CLI). Only a SIGKILL can leave
namespaces behind; `cleanup` (also run when a Cluster starts) removes those whose owner
process is gone.
"""
from __future__ import annotations

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
import threading
import time
from pathlib import Path
from typing import Sequence

from .links import LinkShape, NetemError, tbf_args
from .topology import (HOST_PORT, MAX_RANKS, PREFIX, RANK_IFACE, Topology, hosts_file,
                       setup_commands)

NETNS_ETC = Path("/etc/netns")   # per-namespace /etc overlays read by `ip netns exec`
# One folder per live cluster: cluster.json (its namespaces and link) and the bridge's loss
# file, for `python -m labs.netem fault` (faults.py).
CONTROL_DIR = Path("/run/hvdc-netem")
# The delay bridge runs as a module, not by path, so it imports the package like any user.
DELAY_BRIDGE = [sys.executable, "-m", "labs.netem.bridge"]


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

    def require(self, link: LinkShape) -> None:
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
    if CONTROL_DIR.is_dir():     # control folders (tag = owner pid-sequence) of dead clusters
        for control in CONTROL_DIR.iterdir():
            owner = control.name.split("-")[0]
            if everything or not (owner.isdigit() and (int(owner) == os.getpid()
                                                       or _pid_alive(int(owner)))):
                shutil.rmtree(control, ignore_errors=True)
    return removed


class Cluster:
    """Context manager: builds the namespaces, veths, bridge and qdiscs; removes them on exit."""

    def __init__(self, n: int, link: LinkShape = LinkShape(), verbose: bool = False):
        if not 1 <= n <= MAX_RANKS:
            raise NetemError(f"-n {n}: need 1..{MAX_RANKS} ranks")
        self.link = link
        self.verbose = verbose
        self.topo = Topology(tag=f"{os.getpid()}-{next(_SEQ)}", n=n)
        self.up = False
        self.bridge: subprocess.Popen | None = None
        self.bridge_stats: dict = {}
        self.control = CONTROL_DIR / self.topo.tag

    @property
    def n(self) -> int:
        return self.topo.n

    def __enter__(self) -> "Cluster":
        caps = probe_capabilities()
        self.link = self.link.resolved(caps.netem)
        caps.require(self.link)
        cleanup(verbose=self.verbose)
        try:
            self.control.mkdir(parents=True, exist_ok=True)
            (self.control / "cluster.json").write_text(json.dumps({
                "tag": self.topo.tag, "n": self.n, "switch_ns": self.topo.switch_ns,
                "rank_ns": [self.topo.rank_ns(k) for k in range(self.n)],
                "rate_bps": self.link.rate_bps, "mtu": self.link.mtu,
                "bridge": self.link.uses_bridge, "pid": os.getpid()}))
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
        shutil.rmtree(self.control, ignore_errors=True)
        self.up = False

    def _start_bridge(self, timeout: float = 10.0) -> None:
        """Start the delay bridge (bridge.py) in the switch namespace; return once its ports are open."""
        ports = [f"p{k}" for k in range(self.n)] + [HOST_PORT]
        cmd = (["ip", "netns", "exec", self.topo.switch_ns] + DELAY_BRIDGE
               + ["--delay", f"{self.link.delay_s!r}", "--loss-file",
                  str(self.control / "loss")] + ports)
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

