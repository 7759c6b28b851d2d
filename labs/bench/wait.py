#!/usr/bin/env python
"""Where a step of ours loses to stock Horovod: the lab net, stock vs ours, with the wait swapped.

    python -m labs.bench.wait --ranks 2               # stock:none,ours:none,stock:fp16,ours:fp16
    python -m labs.bench.wait --ranks 4 --rows stock:none,ours:none,ours:none@cap200,ours:none@sync

One Horovod job (Gloo, loopback); every row trains its own copy of the lab net on the same
batches, in interleaved rounds (row order reversed every other round), so rows are compared
side by side on the same machine state. `ours:SCHEME@WAIT` runs hvd_compress with its wait_for
replaced for that row: `sleep` (the shipped one,
instrumented: sleeps from POLL_SLEEP_S[0] doubling up to exchange.longest_sleep), `sync` (hvd.synchronize: Horovod's yield
spin, what stock waits with), `yield` (poll + sched_yield in Python), `capUS` (the shipped
sleeps, capped at US microseconds), `spinUS` (poll with sched_yield for US microseconds, then
the shipped sleeps).

Why the split: a wall-clock step on a shared machine swings widely from round to
round; the main thread's CPU time (time.thread_time) does not, so it tells whether our hooks and
synchronize() cost more Python than stock's (fwd_bwd_cpu, sync_cpu), apart from waiting.
`late` estimates how late the sleeping wait noticed a finished exchange: per wait that slept,
half the last gap between a poll that said "not yet" and the one that said "done" (the
exchange ended somewhere in that gap), summed over the step.

Writes OUT/steps.csv (rank 0, one row per timed step) and prints medians, the round-to-round
spread and each row's ratio to stock:none (median over rounds of the per-round ratio).
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from labs.bench.rounds import median, paired_ratio, round_spread_pct

COLUMNS = ["ranks", "row", "round", "step", "step_ms", "fwd_bwd_ms", "sync_ms", "update_ms",
           "fwd_bwd_cpu_ms", "sync_cpu_ms", "communicate_ms", "in_backward_ms", "late_ms"]


def waits(hvd, shipped):
    """name -> wait(handle) for every @WAIT a row may ask for, and the list `late` they fill."""
    late = []

    def sleeper(first, longest, spin_s=0.0):
        def wait(handle):
            end, before = time.perf_counter() + spin_s, None
            while time.perf_counter() < end and not hvd.poll(handle):
                os.sched_yield()
            delay = first
            while not hvd.poll(handle):
                before = time.perf_counter()
                time.sleep(delay)
                delay = min(2 * delay, longest)
            if before is not None:
                late.append((time.perf_counter() - before) / 2)
            return hvd.synchronize(handle)
        return wait

    def yielding(handle):
        while not hvd.poll(handle):
            os.sched_yield()
        return hvd.synchronize(handle)

    from hvd_compress.exchange.base import POLL_SLEEP_S, longest_sleep
    first = POLL_SLEEP_S[0]
    longest = longest_sleep(hvd.local_size(), len(os.sched_getaffinity(0)))

    def make(name):
        if name == "sleep":
            return sleeper(first, longest)
        if name == "shipped":
            return shipped
        if name == "sync":
            return hvd.synchronize
        if name == "yield":
            return yielding
        if name.startswith("cap"):
            return sleeper(first, int(name[3:]) * 1e-6)
        if name.startswith("spin"):
            return sleeper(first, longest, int(name[4:]) * 1e-6)
        raise ValueError(f"unknown wait {name!r}")
    return make, late


def use_wait(wait):
    """The wait of Horovod's engine, which every communicator of hvd_compress calls (and
    wait_for, the optimizer's)."""
    from hvd_compress.engine.horovod import horovod_engine
    engine = horovod_engine()
    if wait is None:                       # the engine's own again
        engine.__dict__.pop("wait", None)
    else:
        engine.wait = wait


def worker(args):
    import torch
    import torch.nn.functional as F
    import horovod.torch as hvd
    import hvd_compress as hc
    from labs.mnist import MODELS
    hvd.init()
    torch.set_num_threads(1)
    from hvd_compress.engine.base import Engine
    from hvd_compress.engine.horovod import horovod_engine
    make_wait, late = waits(hvd, lambda handle: Engine.wait(horovod_engine(), handle))
    rows = {}
    for row in args.rows.split(","):
        who, rest = row.split(":", 1)
        scheme, _, wait = rest.partition("@")
        torch.manual_seed(0)
        model = MODELS["horovod"]()
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
        lib = hvd if who == "stock" else hc
        opt = lib.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       compression=getattr(lib.Compression, scheme))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        rows[row] = (model, opt, make_wait(wait or "sleep"))
    g = torch.Generator().manual_seed(hvd.rank())
    data = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g))
            for _ in range(4)]
    records, names = [], list(rows)
    for rnd in range(args.rounds + 1):                 # round 0 warms every row up
        for row in (names if rnd % 2 else names[::-1]):
            model, opt, wait = rows[row]
            use_wait(wait)
            hvd.allreduce(torch.zeros(1), name="bench_wait.barrier")
            for i in range(args.steps if rnd else args.warmup):
                x, y = data[i % len(data)]
                late.clear()
                c0, t0 = time.thread_time(), time.perf_counter()
                opt.zero_grad()
                F.nll_loss(model(x), y).backward()
                c1, t1 = time.thread_time(), time.perf_counter()
                opt.synchronize()
                c2, t2 = time.thread_time(), time.perf_counter()
                with opt.skip_synchronize():
                    opt.step()
                t3 = time.perf_counter()
                stats = opt.pop_stats() if hasattr(opt, "pop_stats") else {}
                if rnd:
                    records.append([hvd.size(), row, rnd, i] + [1e3 * v for v in (
                        t3 - t0, t1 - t0, t2 - t1, t3 - t2, c1 - c0, c2 - c1,
                        stats.get("communicate_s", float("nan")),
                        stats.get("in_backward_s", float("nan")), sum(late))])
    use_wait(None)
    if hvd.rank() == 0:
        with open(args.csv, "a") as out:
            for r in records:
                out.write(",".join(map(str, r)) + "\n")
        print(summary(records, args.rounds))


def summary(records, rounds):
    """Medians per row, its round-to-round spread (rounds.round_spread_pct) and its ratio to
    stock:none taken round by round (rounds.paired_ratio)."""
    rows = list(dict.fromkeys(r[1] for r in records))

    def med(row, col):
        k = COLUMNS.index(col)
        return median(r[k] for r in records if r[1] == row)

    def steps(row):                            # (step_ms, round) of each of the row's steps
        mine = [r for r in records if r[1] == row]
        return [r[COLUMNS.index("step_ms")] for r in mine], [r[2] for r in mine]
    base = "stock:none" if "stock:none" in rows else rows[0]
    cols = ["step_ms", "fwd_bwd_ms", "sync_ms", "fwd_bwd_cpu_ms", "sync_cpu_ms", "late_ms"]
    lines = [f"{records[0][0]} ranks, {rounds} rounds, load {os.getloadavg()[0]:.1f}",
             f"{'row':22s}" + "".join(f"{c[:-3]:>13s}" for c in cols)
             + f"{'spread%':>9s}{'vs ' + base:>16s}"]
    for row in rows:
        spread = round_spread_pct(*steps(row))
        ratio = paired_ratio(*steps(row), *steps(base))[0]
        lines.append(f"{row:22s}" + "".join(f"{med(row, c):13.2f}" for c in cols)
                     + f"{spread:9.0f}{ratio:16.3f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--controller", default="gloo", choices=["gloo", "mpi"])
    p.add_argument("--rows", default="stock:none,ours:none,stock:fp16,ours:fp16")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=20, help="timed steps per row and round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="results/wait")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--csv", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    from labs.kit.launch import horovodrun_command, launch_env
    root = Path(__file__).resolve().parents[2]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv = (out / "steps.csv").resolve()
    if not csv.exists():
        csv.write_text(",".join(COLUMNS) + "\n")
    cmd = [sys.executable, "-m", "labs.bench.wait", "--worker", "--rows", args.rows,
           "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--csv", str(csv)]
    env = launch_env()
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run(horovodrun_command(args.ranks, cmd, args.controller), env=env, check=True,
                   timeout=args.timeout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
