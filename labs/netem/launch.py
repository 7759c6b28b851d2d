"""Launch Horovod ranks inside an emulated cluster, one rank per namespace, without ssh.

Gloo: we start Horovod's own RendezvousServer inside the switch namespace and start rank k
with `ip netns exec hvdc-<id>-r<k>` and the environment `horovodrun --gloo` would give it
(horovod/runner/gloo_run.py), every rank being a host of its own (local_size 1), so all of its
traffic crosses the shaped links. MPI: mpirun in the switch namespace, its daemons started
through `ip netns exec` instead of ssh.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from .cluster import Cluster
from .links import NetemError
from .topology import PREFIX_LEN, RANK_IFACE, SUBNET


def wire_counter(environ=os.environ):
    """A function returning the bytes this rank's NIC has sent so far: only meaningful in a
    netem namespace (HVDC_NETEM=1), where eth0 is this rank's own link; on loopback every rank
    shares lo, so it returns NaN there."""
    path = Path("/sys/class/net") / RANK_IFACE / "statistics" / "tx_bytes"
    if environ.get("HVDC_NETEM") == "1" and path.exists():
        return lambda: float(path.read_text())
    return lambda: float("nan")


def link_probe(environ=os.environ):
    """A function returning this rank's link, {"iface", "state", "rx_bytes"}, read from
    /sys/class/net/eth0 in its namespace (labs.netem), for the watchdog's diagnosis; None off
    an emulated network."""
    base = Path("/sys/class/net") / RANK_IFACE
    if environ.get("HVDC_NETEM") != "1" or not base.exists():
        return None

    def probe():
        return {"iface": RANK_IFACE, "state": (base / "operstate").read_text().strip(),
                "rx_bytes": int((base / "statistics" / "rx_bytes").read_text())}
    return probe


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
        ["ip", "netns", "exec", topo.switch_ns, sys.executable, "-m", "labs.netem",
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
# plm_rsh_agent for labs.netem: $1 is a host (= a network namespace), the rest a shell command.
# Each host's daemon keeps its session folder beside this script, one per host: the look-alike
# hosts share one /tmp and one host name, and two daemons making the job's folder at once fail
# ("A call to mkdir was unable to create the desired directory ... File exists").
host="$1"; shift
base="$(dirname "$0")/session-$host"
mkdir -p "$base"
exec ip netns exec "$host" env OMPI_MCA_orte_tmpdir_base="$base" sh -c "$*"
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

