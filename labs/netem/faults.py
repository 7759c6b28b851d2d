"""Faults injected into a running emulated cluster: a rank's link down or up, packet loss, a
link slowed to a crawl.  What the lab's reliability table tries (docs/reliability.md).

    python -m labs.netem fault down 1            # rank 1's eth0 down (in its namespace)
    python -m labs.netem fault up 1
    python -m labs.netem fault loss 0.02         # drop 2% of frames (needs --delay: the bridge)
    python -m labs.netem fault rate 1 1mbit      # rank 1's link now 1 Mbit/s
    python -m labs.netem fault --tag 1234-0 ...  # when several clusters run

A cluster is found through its control folder (cluster.CONTROL_DIR/<tag>/cluster.json); a
folder whose owner process is gone (a cluster killed with SIGKILL leaves one until the next
cluster's cleanup) is not a running cluster, so it neither answers nor makes --tag necessary.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .cluster import CONTROL_DIR, _pid_alive
from .links import NetemError, parse_rate, tbf_args
from .topology import RANK_IFACE


def _owner(folder: Path, cluster: dict) -> int | None:
    """The pid of the process that made the cluster: cluster.json's, else the tag's first
    part (<pid>-<sequence>); None if neither says."""
    pid = cluster.get("pid")
    if isinstance(pid, int):
        return pid
    first = folder.name.split("-")[0]
    return int(first) if first.isdigit() else None


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None                  # being written or removed: not a cluster to fault


def find_cluster(tag: str | None = None) -> tuple[Path, dict]:
    """The control folder and description of the running cluster `tag`, or of the only one.
    Folders left by clusters whose owner process is dead are passed over."""
    found = [(path.parent, _read(path)) for path in
             (sorted(CONTROL_DIR.glob("*/cluster.json")) if CONTROL_DIR.is_dir() else [])]
    if tag is not None:
        found = [(folder, cluster) for folder, cluster in found if folder.name == tag]
    live, dead = [], []
    for folder, cluster in found:
        if cluster is None:
            continue
        owner = _owner(folder, cluster)
        (live if owner is None or _pid_alive(owner) else dead).append((folder, cluster))
    if not live:
        left = (f"; {', '.join(f.name for f, _ in dead)} left by a process that is gone "
                f"(python -m labs.netem cleanup removes it)" if dead else "")
        raise NetemError("no emulated cluster is running" + (f" with tag {tag}" if tag else "")
                         + left + " (python -m labs.netem run ... starts one)")
    if len(live) > 1:
        raise NetemError("several clusters are running; choose one with --tag: "
                         + ", ".join(folder.name for folder, _ in live))
    return live[0]


def _rank_ns(cluster: dict, rank: int) -> str:
    if not 0 <= rank < cluster["n"]:
        raise NetemError(f"rank {rank}: the cluster has ranks 0..{cluster['n'] - 1}")
    return cluster["rank_ns"][rank]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetemError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def link_state(rank: int, up: bool, tag: str | None = None) -> str:
    _, cluster = find_cluster(tag)
    _run(["ip", "-n", _rank_ns(cluster, rank), "link", "set", RANK_IFACE,
          "up" if up else "down"])
    return f"rank {rank}: {RANK_IFACE} {'up' if up else 'down'}"


def loss(probability: float, tag: str | None = None) -> str:
    if not 0.0 <= probability <= 1.0:
        raise NetemError(f"loss {probability}: need a probability in [0, 1]")
    control, cluster = find_cluster(tag)
    if not cluster.get("bridge"):
        raise NetemError("loss needs the userspace bridge: start the cluster with a delay "
                         "(--delay 0.1ms; the kernel has no netem loss)")
    tmp = control / "loss.tmp"
    tmp.write_text(f"{probability!r}\n")
    tmp.replace(control / "loss")
    return f"every frame through the switch now dropped with probability {probability:g}"


def rate(rank: int, text: str, tag: str | None = None) -> str:
    _, cluster = find_cluster(tag)
    bps = parse_rate(text)
    if bps is None:
        raise NetemError("rate: give a rate, e.g. 1mbit")
    _run(["tc", "-n", _rank_ns(cluster, rank), "qdisc", "replace", "dev", RANK_IFACE, "root",
          "handle", "10:"] + tbf_args(bps, cluster.get("mtu", 1500)))
    return f"rank {rank}: {RANK_IFACE} now {bps / 1e6:g} Mbit/s"


def main(args) -> int:
    """`python -m labs.netem fault ...` (cli.py parses the arguments)."""
    if args.what in ("down", "up"):
        print(link_state(int(args.values[0]), args.what == "up", args.tag))
    elif args.what == "loss":
        print(loss(float(args.values[0]), args.tag))
    elif args.what == "rate":
        print(rate(int(args.values[0]), args.values[1], args.tag))
    return 0
