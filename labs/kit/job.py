"""The course lab as one job: the table of trainings, the same rows over an emulated network
with predictions from a calibration of that network, then the report and its figures.

    python -m labs.kit.job                        # what scripts/run_lab.sh runs
    python -m labs.kit.job --no-network           # the loopback table only
    python -m labs.kit.job --dry-run              # the plan, nothing run
    python -m labs.kit.job --auto                 # + np2-auto, np4-auto in both tables
    python -m labs.kit.job --prefix /work/bin/cpu-quiet   # each run alone (a lock's wrapper)

Stages, each one resumable (a finished run is skipped, an interrupted one resumed, a finished
calibration kept): run the same command again after an interruption.

 1. The table (labs/kit/matrix.py): serial, then 2 and 4 processes x none / fp16 / bit16 / bit8
    over loopback, every run with the same epochs, seed and data, each scoring a held-out split
    of the training set as it trains (--holdout): the steps it took to each target accuracy.
 2. The network, as root where network namespaces work (`python -m labs.netem check`; the
    report says why it is missing otherwise): two short calibrations of one emulated link,
    with the cores kept busy and on idle cores (labs.netem.bench: allreduce of float32 and of
    float16, allgather and alltoall at 2 and 4 ranks, fitted per collective and rank count,
    hvd_compress.costmodel.fit), then the 8 parallel rows over the same link,
    --network-steps steps each: a timing table.  100 Mbit/s by default because at that rate the basic network's 4.8 MB of float32 gradients take 0.38 s a step at 2 ranks,
    more than a rank's forward and backward (0.24-0.29 s in the committed run, results/lab): the
    regime the course's question is about.  (Over loopback a step there waits 18-29 ms for the
    same exchange.)
    With --auto (a run matrix flag, passed on) both tables get the per-bucket plan's rows,
    np2-auto and np4-auto (--auto-allreduce): the report sets each one's plan beside its
    predicted and measured step.
 3. The report (runs/report.md by default) and the PNGs next to it (labs/kit/report.py,
    labs/kit/plots.py): with both tables, each scheme's time to each target on the emulated
    link (its steps from the table, its step from the network table, labs/kit/tta.py). The
    committed run's are in results/lab/.

After each run a line says how far the whole job is: "[lab 40% | 13.2 min | ~19 min left]".
"""
import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from . import matrix, tta
from .network import idle_fit_path
from .table import course_runs

# Outputs stay under runs/, out of the checkout's top folder (the committed run: results/lab/).
DEFAULT_REPORT = "runs/report.md"
NETWORK_RATE = "100mbit"
NETWORK_STEPS = 40
# Calibration sizes: each rank's input from 64 KiB to 4 MiB, the range of the buckets and
# tensors the table's rows exchange (costmodel.methods.exchange_units), at 2 and 4 ranks.
# About 1.5 s of repetitions of each case, 3 to 40 (the small ones, whose medians fix alpha,
# get the most), and no fit above the link's rate. More repetitions do not steady the 4-rank
# fits: alltoall at 4 ranks fitted 3.2 ms / 58 Mbit/s with 1.5 s a case, and an hour later
# 14.5 ms / 100 Mbit/s (held at the rate) with 3 s: on 2 busy cores, 4 ranks' collectives are
# timed by the scheduler more than by the link (docs/lab.md).
CALIBRATION_RANKS = (2, 4)
CALIBRATION = ["--collectives", "allreduce", "allreduce_fp16", "allgather", "alltoall",
               "--schemes", "--sizes", "65536,262144,1048576,4194304", "--budget", "1.5",
               "--min-reps", "3", "--max-reps", "40", "-n"] + [str(n) for n in CALIBRATION_RANKS]
# Relative costs for the progress line's percentage: seconds on the 2-core VM of the committed
# run (results/lab/run_lab.log): a table run's epoch by processes, a network run by processes.
EPOCH_WEIGHT = {1: 196, 2: 126, 4: 127}
NETWORK_WEIGHT = {2: 30, 4: 57}
WEIGHT = {"calibration": 200, "report": 10}     # two calibrations (busy and idle cores)


class JobProgress:
    """Weighted tasks done so far, elapsed time and an estimate of what is left (from the
    pace of the tasks run by this invocation, not of those found already done)."""

    def __init__(self, weights):
        self.total, self.done, self.ran = sum(weights), 0.0, 0.0
        self.start = time.monotonic()

    def advance(self, weight, ran):
        self.done += weight
        if ran:
            self.ran += weight

    def line(self):
        elapsed = time.monotonic() - self.start
        left = self.total - self.done
        pct = 100 * self.done / self.total
        if self.ran > 0 and left > 0:
            eta = f"~{elapsed / self.ran * left / 60:.0f} min left"
        else:
            eta = "done" if left <= 0 else "estimating"
        return f"[lab {pct:.0f}% | {elapsed / 60:.1f} min | {eta}]"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist", choices=["mnist", "fashion-mnist"])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--split-test", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of the table's runs (default: the trainer's, 2)")
    parser.add_argument("--holdout", type=int, default=tta.HOLDOUT, metavar="K",
                        help=f"the table's runs hold the training set's last K images out and "
                             f"score them every {tta.EVAL_IMAGES} training images: the report's "
                             f"time to accuracy (default {tta.HOLDOUT}; 0: none)")
    parser.add_argument("--controller", choices=["gloo", "mpi"], default="gloo")
    parser.add_argument("--out", default="runs/matrix", help="the table's folder")
    parser.add_argument("--report", default=DEFAULT_REPORT,
                        help="the report (its PNGs go next to it)")
    parser.add_argument("--network-rate", default=NETWORK_RATE, metavar="RATE",
                        help=f"the emulated link of the network table (default {NETWORK_RATE})")
    parser.add_argument("--network-steps", type=int, default=NETWORK_STEPS, metavar="N",
                        help=f"steps per rank of each network run (default {NETWORK_STEPS})")
    parser.add_argument("--no-network", action="store_true",
                        help="skip the network table (the report says it was skipped)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    args, matrix_extra = parser.parse_known_args(argv)
    if args.network_steps < 1:
        parser.error(f"--network-steps must be at least 1, got {args.network_steps}")
    return args, matrix_extra


def table_args(args, extra):
    """The loopback table's settings (labs/kit/matrix.py flags): its runs hold images out and
    score them as they train, so that the report can say when each reached its target."""
    argv = ["--dataset", args.dataset, "--controller", args.controller, "--out", args.out]
    if args.holdout:
        argv += ["--holdout", str(args.holdout)]
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    return matrix.parse_args(argv + matrix.data_flags(args) + extra)


def network_args(args, table):
    """The network table's settings: the table's, one epoch of --network-steps steps, in a
    folder beside the table's (runs/matrix -> runs/matrix-netem-100mbit)."""
    out = Path(table.out)
    argv = ["--out", str(out.with_name(f"{out.name}-netem-{args.network_rate.lower()}")),
            "--dataset", table.dataset, "--controller", "gloo", "--epochs", "1",
            "--steps-per-epoch", str(args.network_steps), "--netem-rate", args.network_rate,
            "--lr", str(table.lr), "--momentum", str(table.momentum), "--model", table.model,
            "--seed", str(table.seed), "--batch-size", str(table.batch_size),
            "--timeout", f"{table.timeout:g}"] + (["--quiet"] if table.quiet else [])
    if table.prefix:
        argv += ["--prefix", shlex.join(table.prefix)]
    return matrix.parse_args(argv + matrix.data_flags(table))


def calibration_paths(network_out):
    base = Path(network_out) / "calibration" / "link.csv"
    return base, base.with_name("link_fit.json")


@contextlib.contextmanager
def busy_cores(n):
    """``n`` processes that keep a core each busy until the block ends.

    Why: in a training step the first of the exchange runs while backward keeps every core
    busy (2 or 4 ranks on this machine's 2 cores), and the emulated link's delay is a userspace
    process (labs.netem's bridge) on those same cores; the rest runs on idle cores. One
    calibration for both was wrong either way at 4 processes: on idle cores 22-42% low, on busy
    cores 6-33% (once 89%) high, as the busy fit's alpha moved from 2 to 31 ms between
    calibrations.  So the link is calibrated both ways and each collective timed by the one
    that applies while it runs (labs/kit/network.py).
    """
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(n)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def calibrate(network, csv, fit_json, dry_run, prefix=()):
    """labs.netem.bench over the network table's link twice: with every core busy, as backward
    keeps them while the first of a step's exchange runs (csv -> fit_json), and on idle cores,
    as after backward (link_idle.csv -> network.idle_fit_path); each kept once its fit is
    written."""
    # as many busy cores as the widest training keeps busy, at most every core there is
    cores = min(os.cpu_count() or 1, max(CALIBRATION_RANKS))
    idle_csv = csv.with_name("link_idle.csv")
    for out, fit, busy in ((csv, fit_json, cores), (idle_csv, idle_fit_path(fit_json), 0)):
        cmd = [sys.executable, "-m", "labs.netem.bench", "--launch", "netem",
               "--rate", network.netem_rate, "--controller", "gloo", "--out", str(out)] + CALIBRATION
        if dry_run:
            print(f"calibration ({busy} core(s) kept busy): " + " ".join(cmd))
            continue
        if fit.is_file():
            print(f"calibration: kept {fit}", flush=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"calibration of the {network.netem_rate} link, {busy} core(s) kept busy: "
              f"{' '.join(cmd[1:])}", flush=True)
        if prefix:                   # the spinners go inside the wrapper, with the calibration
            spin = [sys.executable, "-m", "labs.kit.job", "--busy", str(busy), "--"]
            done = subprocess.run(list(prefix) + spin + cmd, env=matrix.child_env(), timeout=3600)
        else:
            with busy_cores(busy):
                done = subprocess.run(cmd, env=matrix.child_env(), timeout=1800)
        if done.returncode != 0 or not fit.is_file():
            return False
    return True


def busy_main(argv):
    """python -m labs.kit.job --busy N -- COMMAND...: COMMAND with N cores kept busy (the
    calibration on busy cores, when it runs inside a wrapper such as --prefix's lock)."""
    count, command = int(argv[1]), argv[3:]
    with busy_cores(count):
        return subprocess.run(command, env=matrix.child_env()).returncode


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--busy"]:
        return busy_main(argv)
    args, extra = parse_args(argv)
    table = table_args(args, extra)
    main_runs = matrix.select(course_runs(table.extras, table.methods, table.auto), table.only)
    network = network_args(args, table)
    net_runs = [run for run in course_runs(auto=table.auto) if run.ranks > 1]
    problem = None if not args.no_network else "--no-network"
    if problem is None and not args.dry_run:
        problem = matrix.netem_problem()
    weights = [EPOCH_WEIGHT.get(r.ranks, 260) * table.epochs for r in main_runs]
    if problem is None:
        weights += [WEIGHT["calibration"]] + [NETWORK_WEIGHT.get(r.ranks, 80) for r in net_runs]
    weights.append(WEIGHT["report"])
    progress = JobProgress(weights)
    out, net_out = Path(table.out).resolve(), Path(network.out).resolve()
    csv, fit_json = calibration_paths(net_out)

    # 1. the table over loopback
    failures = []
    for number, (spec, weight) in enumerate(zip(main_runs, weights), 1):
        header = f"[table {number}/{len(main_runs)}] {spec.name}"
        if args.dry_run:
            print(header + ": " + " ".join(table.prefix + matrix.launch_command(
                spec, table, out / spec.name, False)))
            continue
        out.mkdir(parents=True, exist_ok=True)
        before = time.monotonic()
        if not matrix.execute(spec, table, out, header, progress.line()):
            failures.append(spec.name)
        progress.advance(weight, ran=time.monotonic() - before > 5)
        print(progress.line(), flush=True)
    if not args.dry_run and matrix.finish(out, failures):
        return 1

    # 2. the same rows over an emulated network, and the link's calibration
    if problem is None:
        if not calibrate(network, csv, fit_json, args.dry_run, table.prefix):
            print("error: the calibration failed (its output is above); run again to retry",
                  file=sys.stderr)
            return 1
        progress.advance(WEIGHT["calibration"], ran=True)
        for number, spec in enumerate(net_runs, 1):
            header = f"[network {number}/{len(net_runs)}] {spec.name}"
            if args.dry_run:
                print(header + ": " + " ".join(network.prefix + matrix.launch_command(
                    spec, network, net_out / spec.name, False)))
                continue
            net_out.mkdir(parents=True, exist_ok=True)
            before = time.monotonic()
            if not matrix.execute(spec, network, net_out, header, progress.line()):
                failures.append(f"network {spec.name}")
            progress.advance(NETWORK_WEIGHT.get(spec.ranks, 80), ran=time.monotonic() - before > 5)
            print(progress.line(), flush=True)
        if not args.dry_run and matrix.finish(net_out, failures):
            return 1
    else:
        print(f"network table skipped: {problem}", flush=True)
    if args.dry_run:
        return 0

    # 3. the report and its figures
    report_cmd = [sys.executable, "-m", "labs.kit.report", "--summary", str(out / "summary.csv"),
                  "--out", args.report]
    if problem is None:
        report_cmd += ["--network-summary", str(net_out / "summary.csv"),
                       "--calibration", str(fit_json)]
    else:
        report_cmd += ["--network-skipped", problem]
    plots_cmd = [sys.executable, "-m", "labs.kit.plots", "--summary", str(out / "summary.csv"),
                 "--out-dir", str(Path(args.report).resolve().parent)]
    if problem is None:
        plots_cmd += ["--network-summary", str(net_out / "summary.csv"),
                      "--calibration", str(fit_json)]
    for cmd in (report_cmd, plots_cmd):
        if subprocess.run(cmd, env=matrix.child_env()).returncode != 0:
            return 1
    progress.advance(WEIGHT["report"], ran=True)
    print(f"{progress.line()} report: {args.report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
