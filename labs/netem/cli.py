"""Emulate a small cluster on one machine: one network namespace per Horovod rank.

Command line (run as root)::

    python -m labs.netem check
    python -m labs.netem run -n 2 --rate 1gbit --delay 0.5ms -- python labs/mnist.py ...
    python -m labs.netem bench -n 4 --rate 10gbit -- --sizes 1KiB:64MiB --out results/b.csv
    python -m labs.netem cleanup          # remove leftovers of runs that were killed

`--timeout` ends the ranks (exit code 124); the namespaces are removed on every way out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import signal
import sys

from . import faults
from .cluster import Cluster, cleanup, probe_capabilities
from .launch import RunResult, _rendezvous_main, run_ranks
from .links import DELAY_VIA, LinkShape, NetemError
from .topology import Topology, setup_commands


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


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
    link = LinkShape.parse(args.rate, args.delay, args.mtu, args.delay_via)
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
               "  python -m labs.netem run -n 2 --rate 1gbit -- python labs/mnist.py --bit8-allreduce\n"
               "  python -m labs.netem bench -n 4 --rate 1gbit -- --out results/bench/1g_n4.csv\n"
               "details: docs/netem.md")
    sub = parser.add_subparsers(dest="cmd", required=True,
                                metavar="{run,bench,check,cleanup,commands,fault}")

    def add_link_args(p):
        p.add_argument("-n", type=int, default=2, help="number of ranks (default 2)")
        p.add_argument("--rate", default=None,
                       help="per-rank link rate, e.g. 100mbit, 1gbit, 10gbit (default unlimited)")
        p.add_argument("--delay", default="0", help="one-way delay, e.g. 0.1ms")
        p.add_argument("--delay-via", choices=DELAY_VIA, default="auto",
                       help="netem: the kernel's qdisc; bridge: labs/netem/bridge.py, a "
                            "userspace switch (for kernels without sch_netem); auto (default): "
                            "netem if the kernel has it")
        p.add_argument("--mtu", type=int, default=1500)
        p.add_argument("--timeout", type=float, default=600,
                       help="seconds before every rank is stopped (exit code 124)")
        p.add_argument("--launcher", choices=["gloo", "mpi"], default="gloo",
                       help="gloo: our rendezvous + ip netns exec (default); mpi: mpirun "
                            "with an ip-netns-exec agent instead of ssh")
        p.add_argument("-v", "--verbose", action="store_true", help="print every ip/tc command")

    p_run = sub.add_parser("run", help="run COMMAND (after --) as n Horovod ranks")
    add_link_args(p_run)
    p_bench = sub.add_parser("bench", help="run the collectives benchmark (labs.netem.bench) as the ranks; "
                                           "arguments after -- go to it")
    add_link_args(p_bench)
    sub.add_parser("check", help="say whether this machine can emulate (root, netns, tbf, netem)")
    p_clean = sub.add_parser("cleanup", help="remove leftover hvdc-* namespaces")
    p_clean.add_argument("--all", action="store_true",
                         help="also those of live owners (a run in progress will break)")
    p_show = sub.add_parser("commands", help="print the ip/tc commands a cluster is built with")
    add_link_args(p_show)
    p_fault = sub.add_parser("fault", help="inject a fault into the running cluster: down K, "
                                           "up K, loss P, rate K RATE (faults.py)")
    p_fault.add_argument("--tag", default=None, help="the cluster (when several run)")
    p_fault.add_argument("what", choices=["down", "up", "loss", "rate"])
    p_fault.add_argument("values", nargs="+", help="a rank; a probability; a rank and a rate")
    p_rdv = sub.add_parser("rendezvous")     # internal: run by run_ranks in the switch ns
    p_rdv.add_argument("hosts", nargs="+")
    args = parser.parse_args(argv)

    try:
        if args.cmd == "rendezvous":
            _rendezvous_main(args.hosts)
            return 0
        if args.cmd == "fault":
            wanted = {"down": 1, "up": 1, "loss": 1, "rate": 2}[args.what]
            if len(args.values) != wanted:
                parser.error(f"fault {args.what} takes {wanted} value(s)")
            try:
                return faults.main(args)
            except ValueError as exc:
                parser.error(f"fault {args.what}: {exc}")
        if args.cmd == "check":
            caps = probe_capabilities()
            print(json.dumps(dataclasses.asdict(caps), indent=1))
            return 0 if caps.netns and caps.tbf else 1
        if args.cmd == "cleanup":
            removed = cleanup(everything=args.all, verbose=True)
            print(f"removed {len(removed)} namespaces" + (": " + " ".join(removed) if removed else ""))
            return 0
        if args.cmd == "commands":
            link = LinkShape.parse(args.rate, args.delay, args.mtu, args.delay_via)
            link = link.resolved(probe_capabilities().netem)
            for cmd in setup_commands(Topology("PID-0", args.n), link):
                print(shlex.join(cmd))
            return 0
        if args.cmd == "bench":
            command = [sys.executable, "-m", "labs.netem.bench"] + command
        elif not command:
            parser.error("run needs a command after --")
        return cmd_run(args, command)
    except NetemError as exc:
        print(f"netem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
