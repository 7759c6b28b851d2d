"""What the step benchmarks share: the statistics of interleaved rounds, timing two things in
turn, and the grid's command line (labs/bench/step.py and its DDP twin ddp.py take the same
arguments and start their ranks alike).

Why rounds: a benchmark row's steps are timed in rounds, every row once a round, so that a
machine that slows for a while slows every row of that round alike. A row's median is then
known from the medians of its rounds (median_ci_pct), and two rows are compared round by round
(paired_ratio), which leaves the slow spell out of the ratio.
"""
import argparse
import math
import os
import socket
import subprocess
import sys
import time

__all__ = ["median", "median_interval", "medians_by_round", "round_spread_pct", "median_ci_pct",
           "paired_ratio", "another_round", "time_it", "time_pair", "TARGET_SPREAD_PCT",
           "add_grid_arguments", "check_grid", "worker_command", "netem_command"]

TARGET_SPREAD_PCT = 3.0         # how well a row's median step is to be known (median_ci_pct)


# ---- statistics ---------------------------------------------------------------------------------
def median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def medians_by_round(step_ms, rounds):
    """{round: the median of the row's steps in it}."""
    by_round = {}
    for value, rnd in zip(step_ms, rounds):
        by_round.setdefault(rnd, []).append(value)
    return {rnd: median(v) for rnd, v in by_round.items()}


def _round_medians(step_ms, rounds):
    return sorted(medians_by_round(step_ms, rounds).values())


def round_spread_pct(step_ms, rounds):
    """The spread of one round: (largest - smallest median of a row's rounds) / the median of
    all its steps, in %. NaN with fewer than two rounds. More rounds never shrink it."""
    per_round = _round_medians(step_ms, rounds)
    if len(per_round) < 2:
        return math.nan
    return 100 * (per_round[-1] - per_round[0]) / median(list(step_ms))


def median_ci_pct(step_ms, rounds, level=0.95):
    """How well a row's median step is known: the width of a distribution-free confidence
    interval (at `level`) of the median of its round medians, in % of its median step.

    The interval is [r_(j), r_(k+1-j)] of the k sorted round medians, j the largest rank with
    P(Binomial(k, 1/2) < j) <= (1 - level) / 2: a round's median falls below the true median
    with probability 1/2, whatever the distribution (rounds are interleaved, so a drift of
    the machine falls on every row alike). NaN where k rounds are too few for the level (5 at
    95%)."""
    per_round = _round_medians(step_ms, rounds)
    lo, hi = median_interval(per_round, level)
    return 100 * (hi - lo) / median(list(step_ms))


def median_interval(values, level=0.95):
    """The distribution-free interval of the median of `values` (median_ci_pct's order
    statistics): (lo, hi), NaNs where they are too few for the level."""
    ordered, k, tail, below, j = sorted(values), len(values), (1 - level) / 2, 0.0, 0
    while True:
        below += math.comb(k, j) / 2 ** k          # P(Binomial(k, 1/2) <= j)
        if below > tail:
            break
        j += 1
    if j == 0:
        return math.nan, math.nan
    return ordered[j - 1], ordered[k - j]


def paired_ratio(step_ms, rounds, base_ms, base_rounds, level=0.95):
    """A row against another, round by round: (median, lo, hi) of the ratios of its round
    medians to the other's in the rounds both ran, with median_ci_pct's interval.

    Rows take turns within a round, so a machine that slows for a while slows both sides of a
    round's ratio, and drops out of it; noise faster than a round does not. So the ratio is
    known better than either row's own median. An interval above 1 says the row is slower; one
    that holds 1 says the data cannot tell them apart."""
    mine, theirs = medians_by_round(step_ms, rounds), medians_by_round(base_ms, base_rounds)
    ratios = [mine[r] / theirs[r] for r in mine if r in theirs and theirs[r] > 0]
    if not ratios:
        return math.nan, math.nan, math.nan
    return (median(ratios), *median_interval(ratios, level))


def another_round(times, rnd, args):
    """1.0 if rank 0 should run round rnd + 1: fewer than --rounds done, or some row's median
    still known to worse than --target-spread (up to --max-rounds); else 0.0.
    times: {row: (step_ms list, round list)}."""
    if rnd >= args.max_rounds:
        return 0.0
    spreads = [median_ci_pct(*t) for t in times.values() if t[0]]
    worst = math.inf if any(map(math.isnan, spreads)) else max(spreads, default=0.0)
    return float(rnd < args.rounds or worst > args.target_spread)


# ---- timing in one process -----------------------------------------------------------------------
def time_it(fn, reps):
    """(best, median) seconds of `reps` calls of fn, after one call that warms caches up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0], times[len(times) // 2]


def time_pair(fn_a, fn_b, reps):
    """Run a and b alternately; return per-run times of each. On a shared machine a load
    spike then hits both sides of a ratio alike."""
    fn_a(), fn_b()
    ta, tb = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn_a()
        t1 = time.perf_counter()
        fn_b()
        ta.append(t1 - t0)
        tb.append(time.perf_counter() - t1)
    return ta, tb


# ---- the grid's command line ----------------------------------------------------------------------
MODELS = ("lab", "basic")


def add_grid_arguments(p, rows, out, links, rows_help="comma-separated rows (default: the grid's)"):
    """The arguments of a grid of (model, link, ranks) cells, each a job of interleaved rounds,
    and the worker's own (hidden); `rows`: the default rows, `out`: the default folder."""
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--links", default="loopback,100mbit,1gbit,10mbit", help=f"of {list(links)}")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--rows", default=",".join(rows), help=rows_help)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per row in its first rounds, every cell (default: the "
                        "benchmark's table, STEPS)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds, every cell (default: STEPS)")
    p.add_argument("--max-rounds", type=int, default=None,
                   help="rounds allowed while a row's median_ci_pct is over --target-spread "
                        "(default: STEPS with the default steps, else --rounds)")
    p.add_argument("--target-spread", type=float, default=TARGET_SPREAD_PCT, metavar="PCT",
                   help=f"width of each row's 95%% confidence interval of its median step to "
                        f"reach, in %% of it (default {TARGET_SPREAD_PCT:g})")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--auto-warmup-max", type=int, default=200,
                   help="ours:auto's most warm-up steps before it must have a plan (default 200)")
    p.add_argument("--auto-trial-steps", type=int, default=0,
                   help="ours:auto's trial: timed steps per contender (Compression.auto("
                        "trial_steps=...); default 0, no trial)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--timeout", type=int, default=2400, help="seconds per job (default 2400)")
    p.add_argument("--out", default=out)
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--link", help=argparse.SUPPRESS)
    p.add_argument("--per-round", type=int, help=argparse.SUPPRESS)
    p.add_argument("--csv", help=argparse.SUPPRESS)


def check_grid(p, args, links, known_row, rows_hint):
    """Split and check the grid's arguments in place (p.error on a bad one): rows known_row
    accepts, links among `links`, the two lab models, at least 2 ranks, counts not below their
    least."""
    args.rows = args.rows.split(",")
    args.models, args.links = args.models.split(","), args.links.split(",")
    bad = [r for r in args.rows if not known_row(r)]
    if bad or any(link not in links for link in args.links):
        p.error(f"rows must be among {rows_hint}, links among {list(links)}"
                + (f" (not {', '.join(bad)})" if bad else ""))
    if any(m not in MODELS for m in args.models):
        p.error(f"models must be among {list(MODELS)}")
    try:
        args.ranks = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks: comma-separated numbers of ranks, got {args.ranks!r}")
    for name in ("steps", "rounds", "max_rounds", "warmup", "auto_warmup_max", "timeout",
                 "auto_trial_steps"):
        value = getattr(args, name)
        least = 0 if name in ("warmup", "auto_trial_steps") else 1
        if value is not None and value < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}")
    if min(args.ranks) < 2:
        p.error("--ranks: at least 2 ranks (there is nothing to exchange on one)")
    return args


def worker_command(module, args, model, link, per_round, first, most, csv_path):
    """The command every rank of one cell runs: `python -m <module> --worker ...` with the
    cell's steps and the grid's settings."""
    return [sys.executable, "-m", module, "--worker", "--model", model, "--link", link,
            "--rows", ",".join(args.rows), "--per-round", str(per_round), "--rounds", str(first),
            "--max-rounds", str(most), "--target-spread", str(args.target_spread),
            "--warmup", str(args.warmup), "--auto-warmup-max", str(args.auto_warmup_max),
            "--auto-trial-steps", str(args.auto_trial_steps),
            "--batch-size", str(args.batch_size), "--csv", str(csv_path)]


def netem_command(n, rate, timeout, cmd):
    """`cmd` on n ranks over an emulated link of `rate` (labs.netem: root, namespaces)."""
    return [sys.executable, "-m", "labs.netem", "run", "-n", str(n), "--rate", rate,
            "--launcher", "gloo", "--timeout", str(timeout), "--"] + cmd


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch_ranks(n, rate, timeout, cmd, name):
    """`cmd` as n torch.distributed ranks: over an emulated link of `rate` (netem_command), or,
    with no rate, as n local processes given the environment torchrun gives (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT), killed if one outlives `timeout`."""
    if rate:
        subprocess.run(netem_command(n, rate, timeout, cmd), check=True, timeout=timeout + 60)
        return
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(n)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise RuntimeError(f"{name}: a rank failed ({codes})")
