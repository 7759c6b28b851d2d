"""Tests of scripts/netem.py: the commands it builds (pure), and, as root, real namespaces,
a real shaped link, real Horovod ranks across namespaces, and tear-down on every way out.

The root-only tests skip (with the reason) where network namespaces cannot be made: not
root, no iproute2, or a kernel/sandbox without veth.  Nothing here addresses anything but
the namespaces it creates (198.18.0.0/24 inside them).
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NETEM_PY = REPO / "scripts" / "netem.py"
_spec = importlib.util.spec_from_file_location("netem", NETEM_PY)
netem = importlib.util.module_from_spec(_spec)
sys.modules["netem"] = netem            # dataclasses look their module up there
_spec.loader.exec_module(netem)

MiB = 2**20


# ---------------------------------------------------------------- pure parts

def test_parse_rate_in_bits_per_second():
    assert netem.parse_rate("100mbit") == 100e6
    assert netem.parse_rate("1gbit") == 1e9
    assert netem.parse_rate("2.5gbit") == 2.5e9
    assert netem.parse_rate("1mibit") == 2**20
    assert netem.parse_rate(None) is None and netem.parse_rate("none") is None


@pytest.mark.parametrize("bad", ["1gbps", "fast", "10", "-1gbit", "1kbit"])
def test_parse_rate_refuses_ambiguous_or_silly(bad):
    # '1gbps' is gigaBYTES per second to tc: refused rather than misread; '10' has no unit.
    with pytest.raises(netem.NetemError):
        netem.parse_rate(bad)


def test_parse_duration():
    assert netem.parse_duration("0.5ms") == pytest.approx(5e-4)
    assert netem.parse_duration("100us") == pytest.approx(1e-4)
    assert netem.parse_duration("0") == 0.0
    for bad in ("5 parsecs", "1h", "20s"):
        with pytest.raises(netem.NetemError):
            netem.parse_duration(bad)


def test_tbf_bucket_holds_frames_and_queue_holds_the_bucket():
    for rate in (1e6, 100e6, 1e9, 10e9):
        args = netem.tbf_args(rate, 1500)
        burst = int(args[args.index("burst") + 1])
        limit = int(args[args.index("limit") + 1])
        assert burst >= 2 * 1514               # else tbf drops full-size frames
        assert limit >= 4 * burst
        assert args[args.index("rate") + 1] == f"{int(rate)}bit"


def test_commands_touch_only_our_namespaces():
    """Every ip/tc command is `ip netns add hvdc-...` or runs with `-n hvdc-...`: nothing is
    done to the root namespace's interfaces, addresses or routes."""
    topo = netem.Topology("123-0", 3)
    link = netem.Link.parse("1gbit", "0.2ms")
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


def test_rate_only_needs_no_netem_and_delay_does():
    caps = netem.Capabilities(root=True, iproute2=True, netns=True, tbf=True, netem=False)
    caps.require(netem.Link.parse("1gbit", "0"))
    with pytest.raises(netem.NetemError, match="netem"):
        caps.require(netem.Link.parse("1gbit", "0.1ms"))
    assert not any("netem" in c for c in netem.setup_commands(
        netem.Topology("1-0", 2), netem.Link.parse("1gbit", "0")))


def test_hosts_file_maps_own_hostname_to_own_address():
    topo = netem.Topology("7-0", 2)
    text = netem.hosts_file(topo, 1, "myhost")
    assert "198.18.0.2 myhost" in text.splitlines()
    assert f"198.18.0.1 {topo.rank_ns(0)}" in text.splitlines()


def test_mpirun_command_uses_our_agent_and_tcp_only():
    class FakeCluster:
        topo = netem.Topology("9-0", 2)
    cmd = netem.mpirun_command(FakeCluster(), ["python", "x.py"], "/tmp/agent.sh")
    assert cmd[cmd.index("plm_rsh_agent") + 1] == "/tmp/agent.sh"
    assert cmd[cmd.index("btl") + 1] == "tcp,self"
    assert cmd[cmd.index("-H") + 1] == "hvdc-9-0-r0:1,hvdc-9-0-r1:1"
    assert cmd[-2:] == ["python", "x.py"]


# ---------------------------------------------------------------- real namespaces (root)

CAPS = netem.probe_capabilities()
needs_netns = pytest.mark.skipif(
    not (CAPS.netns and CAPS.tbf),
    reason=f"cannot emulate a network here: {CAPS.problem or 'no tbf qdisc in this kernel'}")

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
    return [ns for ns in netem.list_namespaces() if netem._owner_pid(ns) == os.getpid()]


def _transfer_seconds(rate, nbytes, tmp_path):
    script = tmp_path / "xfer.py"
    script.write_text(XFER)
    out = tmp_path / f"out-{rate}.txt"
    with netem.Cluster(2, netem.Link.parse(rate)) as cluster, open(out, "w+") as sink:
        result = netem.run_ranks(cluster, ["python", str(script), str(nbytes)], timeout=60,
                                 stdout=sink, stderr=sink)
        sink.seek(0)
        text = sink.read()
    assert result.returncode == 0, text
    seconds = float(re.search(r"SECONDS (\S+)", text).group(1))
    return seconds, result.counters


@needs_netns
def _root_links():
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines() if ":" in line}


def test_namespaces_exist_during_and_are_gone_after(tmp_path):
    before = _root_links()
    with netem.Cluster(2, netem.Link.parse("1gbit")) as cluster:
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


@needs_netns
def test_teardown_when_the_command_fails_or_times_out():
    with netem.Cluster(2) as cluster:
        names = set(cluster.topo.namespaces)
        failed = netem.run_ranks(cluster, ["sh", "-c", 'exit $((3 + HOROVOD_RANK))'], timeout=30)
        assert failed.returncode in (3, 4)
        t0 = time.monotonic()
        slow = netem.run_ranks(cluster, ["sleep", "60"], timeout=1.5)
        assert slow.timed_out and slow.returncode == 124
        assert time.monotonic() - t0 < 15
    assert not names & set(netem.list_namespaces())
    assert not _ours_alive()


@needs_netns
def test_cli_cleans_up_after_failure_and_sigterm():
    # exit code of the failing rank comes back; no namespace of that process is left
    r = subprocess.run([sys.executable, str(NETEM_PY), "run", "-n", "2", "--timeout", "30",
                        "--", "sh", "-c", "exit 7"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 7, r.stderr
    # SIGTERM in the middle of a run: exit 128+15, namespaces and ranks removed
    p = subprocess.Popen([sys.executable, str(NETEM_PY), "run", "-n", "2", "--timeout", "60",
                          "--", "sleep", "55"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if any(netem._owner_pid(ns) == p.pid for ns in netem.list_namespaces()):
            break
        time.sleep(0.1)
    else:
        p.kill()
        pytest.fail("the namespaces never appeared")
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert not any(netem._owner_pid(ns) == p.pid for ns in netem.list_namespaces())
    assert subprocess.run(["pgrep", "-f", "sleep 55"], capture_output=True).returncode == 1


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
    import torch, horovod.torch as hvd
    hvd.init()
    x = torch.arange(1 << 20, dtype=torch.float32) * (hvd.rank() + 1)      # 4 MiB
    y = hvd.allreduce(x, op=hvd.Sum, name="x")
    n = hvd.size()
    ok = torch.equal(y, torch.arange(1 << 20, dtype=torch.float32) * (n * (n + 1) // 2))
    print(f"RANK {hvd.rank()} SIZE {n} LOCAL {hvd.local_size()} OK {ok}")
""")


@needs_netns
@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_horovod_allreduce_across_namespaces(tmp_path, launcher):
    if launcher == "mpi" and not netem.shutil.which("mpirun"):
        pytest.skip("Open MPI's mpirun is not installed")
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    out = tmp_path / "out.txt"
    with netem.Cluster(2, netem.Link.parse("1gbit")) as cluster, open(out, "w+") as sink:
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
