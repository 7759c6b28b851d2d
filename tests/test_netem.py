"""Tests of labs/netem (`python -m labs.netem`): the commands it builds (pure), and,
as root, real namespaces, a real shaped link, real Horovod ranks across namespaces, and tear-down on every way out.
Also labs/netem/bridge.py, the userspace switch that adds the delay where the kernel has no
netem: its forwarding logic (pure) and, as root, the delay and rate it really gives.

The root-only tests skip (with the reason) where network namespaces cannot be made: not
root, no iproute2, or a kernel/sandbox without veth.  Nothing here addresses anything but
the namespaces it creates (198.18.0.0/24 inside them).
"""
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from conftest import load_script
from labs import netem
from labs.netem import bridge as delay_bridge
from labs.netem import cluster as netem_cluster

REPO = Path(__file__).resolve().parents[1]
NETEM = ["-m", "labs.netem"]            # the emulator's command line, as a user runs it

MiB = 2**20


# ---------------------------------------------------------------- pure parts

@pytest.mark.unit
def test_parse_rate_in_bits_per_second():
    assert netem.parse_rate("100mbit") == 100e6
    assert netem.parse_rate("1gbit") == 1e9
    assert netem.parse_rate("2.5gbit") == 2.5e9
    assert netem.parse_rate("1mibit") == 2**20
    assert netem.parse_rate(None) is None and netem.parse_rate("none") is None


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["1gbps", "fast", "10", "-1gbit", "1kbit"])
def test_parse_rate_refuses_ambiguous_or_silly(bad):
    # '1gbps' is gigaBYTES per second to tc: refused rather than misread; '10' has no unit.
    with pytest.raises(netem.NetemError):
        netem.parse_rate(bad)


@pytest.mark.unit
def test_parse_duration():
    assert netem.parse_duration("0.5ms") == pytest.approx(5e-4)
    assert netem.parse_duration("100us") == pytest.approx(1e-4)
    assert netem.parse_duration("0") == 0.0
    for bad in ("5 parsecs", "1h", "20s"):
        with pytest.raises(netem.NetemError):
            netem.parse_duration(bad)


@pytest.mark.unit
def test_tbf_bucket_holds_frames_and_queue_holds_the_bucket():
    for rate in (1e6, 100e6, 1e9, 10e9):
        args = netem.tbf_args(rate, 1500)
        burst = int(args[args.index("burst") + 1])
        limit = int(args[args.index("limit") + 1])
        assert burst >= 2 * 1514               # else tbf drops full-size frames
        assert limit >= 4 * burst
        assert args[args.index("rate") + 1] == f"{int(rate)}bit"


@pytest.mark.unit
def test_commands_touch_only_our_namespaces():
    """Every ip/tc command is `ip netns add hvdc-...` or runs with `-n hvdc-...`: nothing is
    done to the root namespace's interfaces, addresses or routes."""
    topo = netem.Topology("123-0", 3)
    link = netem.LinkShape.parse("1gbit", "0.2ms", delay_via="netem")
    cmds = netem.setup_commands(topo, link)
    ours = set(topo.namespaces)
    for cmd in cmds:
        if cmd[:3] == ["ip", "netns", "add"]:
            assert cmd[3] in ours
        else:
            assert cmd[1] == "-n" and cmd[2] in ours, cmd
        for word in cmd:                       # every address is in the benchmark block
            if re.fullmatch(r"\d+\.\d+\.\d+\.\d+(/\d+)?", word):
                assert word.startswith("198.18.0."), cmd
    # each rank: one veth end in its namespace; rate on both ends, delay on the rank's end
    assert sum("veth" in c for c in cmds) == 3
    assert sum("tbf" in c for c in cmds) == 6
    netems = [c for c in cmds if "netem" in c]
    assert len(netems) == 3 and all(c[2].endswith(("-r0", "-r1", "-r2")) for c in netems)
    assert all(c[c.index("delay") + 1] == "200us" for c in netems)


@pytest.mark.unit
def test_delay_needs_netem_only_when_netem_is_to_add_it():
    caps = netem.Capabilities(root=True, iproute2=True, netns=True, tbf=True, netem=False)
    caps.require(netem.LinkShape.parse("1gbit", "0"))
    caps.require(netem.LinkShape.parse("1gbit", "0", delay_via="netem"))     # no delay: no netem
    with pytest.raises(netem.NetemError, match="--delay-via bridge"):
        caps.require(netem.LinkShape.parse("1gbit", "0.1ms", delay_via="netem"))
    caps.require(netem.LinkShape.parse("1gbit", "0.1ms", delay_via="bridge"))
    caps.require(netem.LinkShape.parse("1gbit", "0.1ms").resolved(caps.netem))   # auto -> bridge
    # with netem in the kernel, either way is fine
    with_netem = netem.Capabilities(root=True, iproute2=True, netns=True, tbf=True, netem=True)
    for via in netem.DELAY_VIA:
        with_netem.require(netem.LinkShape.parse("1gbit", "0.1ms", delay_via=via))
    # what is still refused: rate without tbf, anything without namespaces
    no_tbf = netem.Capabilities(root=True, iproute2=True, netns=True, tbf=False, netem=False)
    no_tbf.require(netem.LinkShape.parse(None, "0.1ms", delay_via="bridge"))
    with pytest.raises(netem.NetemError, match="tbf"):
        no_tbf.require(netem.LinkShape.parse("1gbit", "0.1ms", delay_via="bridge"))
    with pytest.raises(netem.NetemError, match="root"):
        netem.Capabilities(root=False, iproute2=True, problem="need root").require(
            netem.LinkShape.parse(None, "0.1ms", delay_via="bridge"))
    assert not any("netem" in c for c in netem.setup_commands(
        netem.Topology("1-0", 2), netem.LinkShape.parse("1gbit", "0")))


@pytest.mark.unit
def test_link_resolved_maps_auto_and_keeps_explicit_choices():
    auto = netem.LinkShape.parse("1gbit", "2ms")
    assert auto.delay_via == "auto"
    assert auto.resolved(True).delay_via == "netem"
    assert auto.resolved(False).delay_via == "bridge"
    # everything else survives
    assert auto.resolved(False) == netem.LinkShape(1e9, 2e-3, 1500, "bridge")
    for via in ("netem", "bridge"):
        link = netem.LinkShape.parse("100mbit", "1ms", mtu=9000, delay_via=via)
        assert link.resolved(True) == link and link.resolved(False) == link
    assert netem.LinkShape.parse("1gbit", "1ms", delay_via="bridge").uses_bridge
    assert not netem.LinkShape.parse("1gbit", "1ms", delay_via="netem").uses_bridge
    assert not netem.LinkShape.parse("1gbit", "0", delay_via="bridge").uses_bridge    # no delay
    assert not auto.uses_bridge                                   # not resolved yet
    with pytest.raises(netem.NetemError, match="delay-via"):
        netem.LinkShape.parse("1gbit", "1ms", delay_via="userspace")
    assert "via bridge" in auto.resolved(False).describe()
    assert "via" not in netem.LinkShape.parse("1gbit", "0", delay_via="bridge").describe()


def _by_kind(cmds):
    """(tc commands, `master` commands, the command that creates br0)"""
    tcs = [c for c in cmds if c[0] == "tc"]
    masters = [c for c in cmds if "master" in c]
    br0 = [c for c in cmds if c[3:6] == ["link", "add", "br0"]]
    assert len(br0) == 1, br0
    return tcs, masters, br0[0]


@pytest.mark.unit
def test_setup_commands_with_the_delay_bridge():
    topo = netem.Topology("5-0", 3)
    cmds = netem.setup_commands(topo, netem.LinkShape.parse("1gbit", "2ms", delay_via="bridge"))
    sw = topo.switch_ns
    tcs, masters, br0 = _by_kind(cmds)
    assert masters == []                                 # no port joins a kernel bridge
    assert not any("netem" in c for c in cmds)           # and no qdisc holds packets back
    assert not any("bridge" in c for c in cmds)          # there is no kernel bridge at all
    # br0 (the switch's own address) is a veth whose peer ph is the bridge's fourth port
    assert br0[:3] == ["ip", "-n", sw]
    assert br0[br0.index("type") + 1] == "veth"
    assert br0[br0.index("peer") + 1: br0.index("peer") + 3] == ["name", netem.HOST_PORT]
    assert br0[br0.index("mtu") + 1] == "1500"
    assert ["ip", "-n", sw, "link", "set", netem.HOST_PORT, "up"] in cmds
    assert ["ip", "-n", sw, "addr", "add", "198.18.0.254/24", "dev", "br0"] in cmds
    # rate: tbf at the root of both ends of every rank's veth, as without delay
    shaped = sorted((c[2], c[6]) for c in tcs)
    assert shaped == sorted([(topo.rank_ns(k), "eth0") for k in range(3)]
                            + [(sw, f"p{k}") for k in range(3)])
    assert all(c[7:10] == ["root", "handle", "10:"] and c[10] == "tbf" for c in tcs), tcs
    # the ports the bridge opens all exist and are up
    for port in ("p0", "p1", "p2"):
        assert ["ip", "-n", sw, "link", "set", port, "up"] in cmds
    # without a rate, the bridge needs no qdisc at all
    assert not any(c[0] == "tc" for c in netem.setup_commands(
        topo, netem.LinkShape.parse(None, "2ms", delay_via="bridge")))


@pytest.mark.unit
def test_setup_commands_with_netem_as_before():
    topo = netem.Topology("5-0", 2)
    sw = topo.switch_ns
    cmds = netem.setup_commands(topo, netem.LinkShape.parse("1gbit", "2ms", delay_via="netem"))
    tcs, masters, br0 = _by_kind(cmds)
    assert br0[br0.index("type") + 1] == "bridge" and "veth" not in br0
    assert not any(netem.HOST_PORT in c for c in cmds)
    assert masters == [["ip", "-n", sw, "link", "set", f"p{k}", "master", "br0"] for k in range(2)]
    netems = [c for c in tcs if "netem" in c]
    assert [c[2] for c in netems] == [topo.rank_ns(0), topo.rank_ns(1)]     # rank ends only
    assert all(c[c.index("delay") + 1] == "2000us" and c[7:9] == ["root", "handle"]
               for c in netems)
    # tbf under netem on the rank ends, at the root on the switch ends
    under = [c for c in tcs if "tbf" in c and "parent" in c]
    assert [c[2] for c in under] == [topo.rank_ns(0), topo.rank_ns(1)]
    assert all(c[c.index("parent") + 1] == "1:1" for c in under)
    assert sum("tbf" in c for c in tcs) == 4
    # a delay-free link builds the same kernel bridge whichever way a delay would have gone
    plain = netem.setup_commands(topo, netem.LinkShape.parse("1gbit", "0", delay_via="netem"))
    assert plain == netem.setup_commands(topo, netem.LinkShape.parse("1gbit", "0", delay_via="bridge"))
    assert [c for c in plain if "master" in c] == masters


@pytest.mark.unit
def test_delay_bridge_parse_seconds():
    p = delay_bridge.parse_seconds
    assert p("0.5ms") == pytest.approx(5e-4)
    assert p("100us") == pytest.approx(1e-4)
    assert p("2s") == 2.0
    assert p("0.001") == pytest.approx(1e-3)
    assert p("0") == 0.0
    # netem.py hands over repr(delay_s): every delay netem.py accepts must come back intact
    for text in ("2ms", "1us", "0.01ms", "10us", "1.5s", "3e-5"):
        seconds = netem.parse_duration(text)
        assert p(repr(seconds)) == seconds, text
    for bad in ("fast", "1h", "ms", ""):
        with pytest.raises(ValueError):
            p(bad)


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["11s", "-1ms"])
def test_delay_bridge_refuses_a_silly_delay_before_opening_anything(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        delay_bridge.main([f"--delay={bad}", "p0", "p1"])
    assert exc.value.code == 2
    assert "0..10 s" in capsys.readouterr().err


class _FakePort:
    """Stands in for a packet socket: frames to be read, frames sent."""
    def __init__(self, fd):
        self.fd, self.inbox, self.sent = fd, [], []

    def fileno(self):
        return self.fd

    def recv(self, size):
        if not self.inbox:
            raise BlockingIOError
        return self.inbox.pop(0)

    def send(self, frame):
        self.sent.append(frame)
        return len(frame)


def _frame(dst: bytes, src: bytes, payload: bytes = b"x" * 46) -> bytes:
    return bytes(delay_bridge.VNET_HDR_LEN) + dst + src + b"\x08\x00" + payload


def _fake_switch(loss_file=None):
    """A DelaySwitch on fake ports: its __init__ opens packet sockets (root), so set its state
    by hand, the loss control included."""
    import random
    switch = object.__new__(delay_bridge.DelaySwitch)
    ports = [_FakePort(10 + i) for i in range(3)]
    switch.names = ["p0", "p1", "ph"]
    switch.socks = ports
    switch.index = {p.fileno(): i for i, p in enumerate(ports)}
    switch.delay, switch.max_queue = 0.002, 1 << 20
    switch.mac_port, switch.queue, switch.queued_bytes = {}, collections.deque(), 0
    switch.stats = {"frames_in": 0, "bytes_in": 0, "frames_out": 0, "dropped_queue_full": 0,
                    "dropped_send": 0, "dropped_loss": 0, "late_max_s": 0.0}
    switch.loss_file, switch.loss, switch._loss_seen, switch._loss_checked = loss_file, 0.0, None, 0.0
    switch._random = random.Random(0)
    return switch, ports


@pytest.mark.unit
def test_delay_switch_drops_frames_with_the_loss_files_probability(tmp_path):
    """`fault loss P` writes P into the switch's loss file: re-read when it changes (at most
    every LOSS_POLL_S), a bad value ignored; frames dropped with that probability, counted."""
    loss = tmp_path / "loss"
    switch, ports = _fake_switch(loss)
    a, b = b"\x02" + bytes(4) + b"\x0a", b"\x02" + bytes(4) + b"\x0b"
    switch._check_loss(10.0)
    assert switch.loss == 0.0                         # no file yet: no loss
    loss.write_text("1.0\n")
    switch._check_loss(10.1)
    assert switch.loss == 0.0                         # looked at too soon after the last look
    switch._check_loss(10.3)
    assert switch.loss == 1.0
    ports[0].inbox += [_frame(b, a)] * 10
    switch._receive(0, now=11.0)
    assert switch.stats["dropped_loss"] == 10 and not switch.queue
    loss.write_text("0.3")
    switch._check_loss(11.0)
    assert switch.loss == 0.3
    ports[0].inbox += [_frame(b, a)] * 2000
    switch._receive(0, now=12.0)
    assert 500 < switch.stats["dropped_loss"] - 10 < 700 and len(switch.queue) == 2000 - (switch.stats["dropped_loss"] - 10)
    loss.write_text("two")                            # refused: the last good value stays
    switch._check_loss(13.0)
    assert switch.loss == 0.3


@pytest.mark.unit
def test_delay_switch_holds_frames_learns_and_floods():
    """The forwarding logic, without sockets: nothing leaves before its time, unknown and
    broadcast destinations are flooded, learned ones go to one port only."""
    switch, ports = _fake_switch()
    a, b, bcast = b"\x02" + bytes(4) + b"\x0a", b"\x02" + bytes(4) + b"\x0b", b"\xff" * 6
    arp = _frame(bcast, a)                       # from a on p0, to everybody
    ports[0].inbox.append(arp)
    switch._receive(0, now=100.0)
    switch._release(100.0019)
    assert all(p.sent == [] for p in ports)          # held back for the whole delay
    switch._release(100.002)
    assert ports[0].sent == [] and ports[1].sent == [arp] and ports[2].sent == [arp]
    reply = _frame(a, b)                         # from b on p1 to a: a was learned on p0
    ports[1].inbox.append(reply)
    switch._receive(1, now=101.0)
    switch._release(101.0021)
    assert ports[0].sent == [reply] and ports[1].sent == [arp] and ports[2].sent == [arp]
    assert switch.mac_port == {a: 0, b: 1}
    assert switch.stats["frames_in"] == 2 and switch.stats["frames_out"] == 3
    assert switch.queued_bytes == 0 and not switch.queue
    assert switch.stats["late_max_s"] == pytest.approx(1e-4)
    # over --max-queue: dropped and counted, not queued
    switch.max_queue = len(arp)
    ports[0].inbox += [_frame(b, a), _frame(b, a)]
    switch._receive(0, now=102.0)
    assert len(switch.queue) == 1 and switch.stats["dropped_queue_full"] == 1


@pytest.mark.unit
def test_hosts_file_maps_own_hostname_to_own_address():
    topo = netem.Topology("7-0", 2)
    text = netem.hosts_file(topo, 1, "myhost")
    assert "198.18.0.2 myhost" in text.splitlines()
    assert f"198.18.0.1 {topo.rank_ns(0)}" in text.splitlines()


@pytest.mark.unit
def test_mpirun_command_uses_our_agent_and_tcp_only():
    class FakeCluster:
        topo = netem.Topology("9-0", 2)
    cmd = netem.mpirun_command(FakeCluster(), ["python", "x.py"], "/tmp/agent.sh")
    assert cmd[cmd.index("plm_rsh_agent") + 1] == "/tmp/agent.sh"
    assert cmd[cmd.index("btl") + 1] == "tcp,self"
    assert cmd[cmd.index("-H") + 1] == "hvdc-9-0-r0:1,hvdc-9-0-r1:1"
    assert cmd[-2:] == ["python", "x.py"]


@pytest.mark.unit
def test_collecting_the_netns_modules_makes_no_namespace(monkeypatch):
    """Importing this module, test_bench_collectives.py or test_gloo_patch.py probes nothing
    (probing makes a namespace): `pytest -m unit` collects them too."""
    def probe():
        raise AssertionError("labs.netem probed while a test module was imported")
    monkeypatch.setattr(netem, "probe_capabilities", probe)
    monkeypatch.setattr(netem_cluster, "probe_capabilities", probe)
    for name in ("test_netem", "test_bench_collectives", "test_gloo_patch"):
        load_script(REPO / "tests" / f"{name}.py", f"{name}_imported_again")


# ---------------------------------------------------------------- real namespaces (root)

# Probed when the first test that needs it runs (conftest.emulated_network), not at import.
needs_netns = pytest.mark.usefixtures("emulated_network")

# Rank 0 sends NBYTES to rank 1 over TCP across the emulated switch; rank 0 prints seconds.
XFER = textwrap.dedent("""
    import os, socket, sys, time
    rank, nbytes, port = int(os.environ["HOROVOD_RANK"]), int(sys.argv[1]), 29417
    peer = "198.18.0.2"
    if rank == 1:
        srv = socket.create_server((peer, port))
        conn, _ = srv.accept()
        got = 0
        while got < nbytes:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        conn.sendall(b"k")
        assert got == nbytes, got
    else:
        for _ in range(200):
            try:
                conn = socket.create_connection((peer, port), timeout=5)
                break
            except OSError:
                time.sleep(0.05)
        t0 = time.perf_counter()
        conn.sendall(bytes(nbytes))
        assert conn.recv(1) == b"k"
        print("SECONDS", time.perf_counter() - t0)
""")


def _ours_alive():
    return [ns for ns in netem.list_namespaces() if netem_cluster._owner_pid(ns) == os.getpid()]


def _qdisc_bytes(ns, dev):
    """Bytes the root qdisc of `dev` in `ns` has sent so far."""
    out = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    return sum(q["bytes"] for q in json.loads(out) if q.get("root"))


def _transfer(link, nbytes, tmp_path):
    """Rank 0 sends `nbytes` to rank 1 across a cluster of `link`: seconds, rank counters,
    bytes sent by the switch end of rank 1's veth (p1), the cluster (torn down) and the delay
    bridge process it had (None without one)."""
    script = tmp_path / "xfer.py"
    script.write_text(XFER)
    out = tmp_path / f"out-{time.monotonic_ns()}.txt"
    with netem.Cluster(2, link) as cluster, open(out, "w+") as sink:
        bridge = cluster.bridge
        result = netem.run_ranks(cluster, ["python", str(script), str(nbytes)], timeout=60,
                                 stdout=sink, stderr=sink)
        p1_sent = _qdisc_bytes(cluster.topo.switch_ns, "p1") if link.rate_bps else None
        sink.seek(0)
        text = sink.read()
    assert result.returncode == 0, text
    seconds = float(re.search(r"SECONDS (\S+)", text).group(1))
    return types.SimpleNamespace(seconds=seconds, counters=result.counters, p1_sent=p1_sent,
                                 cluster=cluster, bridge=bridge)


def _transfer_seconds(rate, nbytes, tmp_path):
    run = _transfer(netem.LinkShape.parse(rate), nbytes, tmp_path)
    return run.seconds, run.counters


def _root_links():
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines() if ":" in line}


@pytest.mark.netns
@needs_netns
def test_namespaces_exist_during_and_are_gone_after(tmp_path):
    before = _root_links()
    with netem.Cluster(2, netem.LinkShape.parse("1gbit")) as cluster:
        names = set(cluster.topo.namespaces)
        assert names <= set(netem.list_namespaces())
        r = subprocess.run(cluster.exec_prefix(1) + ["ip", "-4", "-o", "addr", "show", "eth0"],
                           capture_output=True, text=True, check=True)
        assert "198.18.0.2/24" in r.stdout
        # the root namespace never sees our interfaces or addresses
        assert _root_links() == before
        assert "198.18.0." not in subprocess.run(["ip", "-o", "addr"], capture_output=True,
                                                 text=True).stdout
    assert not names & set(netem.list_namespaces())
    assert not any((netem.NETNS_ETC / ns).exists() for ns in names)


@pytest.mark.netns
@needs_netns
def test_teardown_when_the_command_fails_or_times_out():
    with netem.Cluster(2) as cluster:
        names = set(cluster.topo.namespaces)
        failed = netem.run_ranks(cluster, ["sh", "-c", 'exit $((3 + HOROVOD_RANK))'], timeout=30)
        assert failed.returncode in (3, 4)
        t0 = time.monotonic()
        slow = netem.run_ranks(cluster, ["sleep", "60"], timeout=0.5)    # started in ms, killed at 0.5 s
        assert slow.timed_out and slow.returncode == 124
        assert time.monotonic() - t0 < 15
    assert not names & set(netem.list_namespaces())
    assert not _ours_alive()


@pytest.mark.netns
@needs_netns
def test_cli_cleans_up_after_failure_and_sigterm():
    # exit code of the failing rank comes back; no namespace of that process is left
    r = subprocess.run([sys.executable, *NETEM, "run", "-n", "2", "--timeout", "30",
                        "--", "sh", "-c", "exit 7"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 7, r.stderr
    # SIGTERM in the middle of a run: exit 128+15, namespaces and ranks removed
    p = subprocess.Popen([sys.executable, *NETEM, "run", "-n", "2", "--timeout", "60",
                          "--", "sleep", "55"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if any(netem_cluster._owner_pid(ns) == p.pid for ns in netem.list_namespaces()):
            break
        time.sleep(0.1)
    else:
        p.kill()
        pytest.fail("the namespaces never appeared")
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert not any(netem_cluster._owner_pid(ns) == p.pid for ns in netem.list_namespaces())
    assert subprocess.run(["pgrep", "-f", "sleep 55"], capture_output=True).returncode == 1


@pytest.mark.netns
@needs_netns
def test_cleanup_removes_namespaces_of_dead_owners():
    dead = "hvdc-999999999-0-sw"          # above any pid_max: its owner cannot be alive
    try:
        with netem.Cluster(2) as live:          # a live cluster of ours must survive
            subprocess.run(["ip", "netns", "add", dead], check=True)
            (netem.NETNS_ETC / dead).mkdir(parents=True, exist_ok=True)
            removed = netem.cleanup()
            assert dead in removed
            assert set(live.topo.namespaces) <= set(netem.list_namespaces())
        assert dead not in netem.list_namespaces()
        assert not (netem.NETNS_ETC / dead).exists()
    finally:
        subprocess.run(["ip", "netns", "del", dead], capture_output=True)


@pytest.mark.netns
@needs_netns
def test_rate_limit_slows_a_transfer(tmp_path):
    nbytes = 8 * MiB
    # 8 MiB at 100 Mbit/s is 0.67 s of payload alone; allow a loose bound
    slow, counters = _transfer_seconds("100mbit", nbytes, tmp_path)
    fast, _ = _transfer_seconds("none", nbytes, tmp_path)
    assert slow > 0.4, slow
    assert fast < slow / 2, (fast, slow)
    # the bytes really crossed rank 0's emulated NIC (payload + headers)
    assert counters[0]["tx_bytes"] >= nbytes
    assert counters[1]["rx_bytes"] >= nbytes


ALLREDUCE = textwrap.dedent("""
    import os, torch, horovod.torch as hvd
    hvd.init()
    x = torch.arange(1 << 20, dtype=torch.float32) * (hvd.rank() + 1)      # 4 MiB
    y = hvd.allreduce(x, op=hvd.Sum, name="x")
    n = hvd.size()
    ok = torch.equal(y, torch.arange(1 << 20, dtype=torch.float32) * (n * (n + 1) // 2))
    print(f"RANK {hvd.rank()} SIZE {n} LOCAL {hvd.local_size()} OK {ok}")
    print(f"VIA {hvd.rank()} {os.environ.get('HVDC_NETEM_DELAY_VIA')!r}")
""")


@pytest.mark.netns
@needs_netns
@pytest.mark.parametrize("launcher", ["mpi"])
@pytest.mark.parametrize("delay,via", [("0", "auto"), ("1ms", "bridge")],
                         ids=["no-delay", "delay-bridge"])
def test_horovod_allreduce_across_namespaces(tmp_path, launcher, delay, via):
    """Under mpirun, on both links. Gloo's launch across namespaces (labs.netem's own rendezvous
    and `ip netns exec`, run_ranks' default) is run end to end by the other netns tests, on
    both links too: without a delay test_bench_collectives' netem run (each rank's NIC bytes)
    and test_gloo_patch; with a delay test_lab_matrix_netem (the delay's route in the ranks'
    manifest, the wire bytes) and test_link_faults (the bridge's counters), through the bridge
    where the kernel has no netem (this machine's: `auto` picks the bridge)."""
    if launcher == "mpi" and not shutil.which("mpirun"):
        pytest.skip("Open MPI's mpirun is not installed")
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    out = tmp_path / "out.txt"
    link = netem.LinkShape.parse("1gbit", delay, delay_via=via)
    with netem.Cluster(2, link) as cluster, open(out, "w+") as sink:
        names = set(cluster.topo.namespaces)
        result = netem.run_ranks(cluster, ["python", str(script)], timeout=120,
                                 launcher=launcher, stdout=sink, stderr=sink)
        sink.seek(0)
        text = sink.read()
    assert result.returncode == 0, text
    lines = re.findall(r"RANK (\d) SIZE (\d) LOCAL (\d) OK (\w+)", text)
    assert sorted(lines) == [("0", "2", "1", "True"), ("1", "2", "1", "True")], text
    # Ring allreduce of 4 MiB on 2 ranks: each rank sends 4 MiB; over the veth, not shm.
    for row in result.counters:
        assert row["tx_bytes"] >= 4 * MiB, result.counters
    vias = sorted(re.findall(r"VIA (\d) '(\w*)'", text))
    if via == "bridge":
        # the ranks know how the delay was made, and all their traffic crossed the bridge
        assert vias == [("0", "bridge"), ("1", "bridge")], text
        assert cluster.bridge_stats["bytes_in"] >= 8 * MiB, cluster.bridge_stats
        assert cluster.bridge_stats["dropped_queue_full"] == 0, cluster.bridge_stats
    else:
        assert vias == [("0", ""), ("1", "")], text
        assert cluster.bridge_stats == {}
    assert not names & set(netem.list_namespaces())


# ---------------------------------------------------------------- the delay bridge (root)

# 1-byte ping-pong over TCP (no Nagle): the client prints the median round trip in seconds.
PINGPONG = textwrap.dedent("""
    import socket, statistics, sys, time
    role, host, rounds, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), 29418
    if role == "server":
        srv = socket.create_server((host, port))
        srv.settimeout(30)
        print("listening", flush=True)
        conn, _ = srv.accept()
        conn.settimeout(30)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            byte = conn.recv(1)
            if not byte:
                break
            conn.sendall(byte)
    else:
        conn = socket.create_connection((host, port), timeout=30)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        warmup, rtts = 3, []
        for _ in range(warmup + rounds):
            t0 = time.perf_counter()
            conn.sendall(b"x")
            assert conn.recv(1) == b"x"
            rtts.append(time.perf_counter() - t0)
        print("MEDIAN", statistics.median(rtts[warmup:]))
""")


def _median_rtt(cluster, tmp_path, server_ns, server_ip, rounds=30):
    """Median round trip of 1-byte messages from rank 0 to a server in `server_ns`."""
    script = tmp_path / "pingpong.py"
    script.write_text(PINGPONG)
    server = subprocess.Popen(["ip", "netns", "exec", server_ns, sys.executable, str(script),
                               "server", server_ip, "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening", server.communicate(timeout=10)
        client = subprocess.run(cluster.exec_prefix(0) + [sys.executable, str(script), "client",
                                                         server_ip, str(rounds)],
                                capture_output=True, text=True, timeout=60)
        assert client.returncode == 0, client.stderr
        assert server.wait(timeout=10) == 0, server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return float(re.search(r"MEDIAN (\S+)", client.stdout).group(1))


@pytest.mark.netns
@needs_netns
def test_delay_bridge_adds_twice_the_delay_to_a_round_trip(tmp_path):
    delay = 2e-3
    link = netem.LinkShape.parse("1gbit", "2ms", delay_via="bridge")
    with netem.Cluster(2, link) as cluster:
        assert cluster.link.uses_bridge and cluster.bridge.poll() is None
        rank_to_rank = _median_rtt(cluster, tmp_path, cluster.topo.rank_ns(1),
                                   cluster.topo.rank_ip(1))
        # the switch's own address (rendezvous, mpirun) sits behind the bridge too (br0 -- ph)
        rank_to_switch = _median_rtt(cluster, tmp_path, cluster.topo.switch_ns,
                                     cluster.topo.switch_ip)
    with netem.Cluster(2, netem.LinkShape.parse("1gbit", "0", delay_via="bridge")) as cluster:
        assert cluster.bridge is None                  # no delay: the kernel bridge
        undelayed = _median_rtt(cluster, tmp_path, cluster.topo.rank_ns(1),
                                cluster.topo.rank_ip(1))
    rtts = (rank_to_rank, rank_to_switch, undelayed)
    assert 2 * delay <= rank_to_rank < 2 * delay + 4e-3, rtts
    assert 2 * delay <= rank_to_switch < 2 * delay + 4e-3, rtts
    assert undelayed < 1.5e-3, rtts


@pytest.mark.netns
@needs_netns
def test_delay_bridge_keeps_the_rate_limit(tmp_path):
    """16 MiB over 100 Mbit/s with 1 ms through the bridge takes about what the rate says: the
    frames the bridge sends still wait for the token buckets, and it is no bottleneck itself."""
    nbytes = 16 * MiB
    ideal = nbytes * 8 / 100e6                          # 1.34 s of payload alone
    run = _transfer(netem.LinkShape.parse("100mbit", "1ms", delay_via="bridge"), nbytes, tmp_path)
    assert 0.9 * ideal <= run.seconds <= 2 * ideal, (run.seconds, ideal)
    # the payload went through the bridge, then through the tbf of the switch end of p1
    assert run.cluster.bridge_stats["bytes_in"] >= nbytes, run.cluster.bridge_stats
    assert run.p1_sent >= nbytes, run.p1_sent
    assert run.counters[1]["rx_bytes"] >= nbytes


@pytest.mark.netns
@needs_netns
def test_delay_bridge_stops_with_the_cluster_and_reports(tmp_path):
    nbytes = 1 * MiB
    run = _transfer(netem.LinkShape.parse(None, "1ms", delay_via="bridge"), nbytes, tmp_path)
    bridge, cluster = run.bridge, run.cluster
    assert bridge is not None and cluster.bridge is None
    # it ended by itself on SIGTERM, after printing its counters (not killed), and is reaped
    assert bridge.returncode == 0
    assert not Path(f"/proc/{bridge.pid}").exists()
    stats = cluster.bridge_stats
    assert stats["frames_in"] > 0 and stats["frames_out"] > 0, stats
    assert stats["bytes_in"] >= nbytes, stats
    assert stats["dropped_queue_full"] == 0 and stats["dropped_send"] == 0, stats
    assert stats["ports"] == ["p0", "p1", netem.HOST_PORT] and stats["delay_s"] == 1e-3
    assert not set(cluster.topo.namespaces) & set(netem.list_namespaces())
    assert not _ours_alive()
    assert not any((netem.NETNS_ETC / ns).exists() for ns in cluster.topo.namespaces)


@pytest.mark.netns
@needs_netns
def test_cluster_is_removed_when_the_delay_bridge_does_not_start(tmp_path, monkeypatch):
    broken = tmp_path / "broken_bridge.py"
    broken.write_text("import sys\nprint('no such port', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(netem_cluster, "DELAY_BRIDGE", [sys.executable, str(broken)])
    cluster = netem.Cluster(2, netem.LinkShape.parse("1gbit", "1ms", delay_via="bridge"))
    t0 = time.monotonic()
    with pytest.raises(netem.NetemError, match="delay bridge did not start"):
        cluster.__enter__()
    assert time.monotonic() - t0 < 15
    assert cluster.bridge is None and not cluster.up
    assert not set(cluster.topo.namespaces) & set(netem.list_namespaces())
    assert not _ours_alive()


@pytest.mark.netns                  # `labs.netem commands` probes with a namespace
def test_cli_commands_with_the_delay_bridge():
    def commands(*via):
        r = subprocess.run([sys.executable, *NETEM, "commands", "-n", "2", "--rate",
                            "1gbit", "--delay", "1ms", *via],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout
    bridge = commands("--delay-via", "bridge")
    assert "netem" not in bridge and "master br0" not in bridge
    assert "link add br0 mtu 1500 type veth peer name ph" in bridge
    assert bridge.count(" tbf ") == 4
    netem_out = commands("--delay-via", "netem")
    assert netem_out.count(" netem delay 1000us") == 2 and netem_out.count("master br0") == 2
    r = subprocess.run([sys.executable, *NETEM, "commands", "--delay", "1ms",
                        "--delay-via", "tc"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.netns                  # `labs.netem commands` probes with a namespace
def test_the_command_line_needs_no_path_into_the_checkout():
    """`python -m labs.netem` gives the same commands from the checkout and from /: the delay
    bridge starts as a module, so it needs no path into the checkout (the namespace's working
    directory does not matter)."""
    args = ["commands", "-n", "2", "--rate", "1gbit", "--delay", "1ms", "--delay-via", "bridge"]
    here = subprocess.run([sys.executable, *NETEM, *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    elsewhere = subprocess.run([sys.executable, *NETEM, *args], capture_output=True,
                               text=True, timeout=60, cwd="/")
    assert here.returncode == 0, here.stderr
    assert here.stdout == elsewhere.stdout
    assert netem_cluster.DELAY_BRIDGE[1:] == ["-m", "labs.netem.bridge"]
