#!/usr/bin/env python
"""Training-step benchmark on PyTorch DDP: DDP's own hooks against hvd_compress's, side by side.

    python -m labs.bench.ddp                          # the whole grid (a quiet machine)
    python -m labs.bench.ddp --models basic --links 100mbit --ranks 2 --out results/ddp

The DDP twin of labs/bench/step.py, with its rounds, spreads, summary and plot (imported from
it and from labs/bench/rounds.py, not copied). For every (model, link, ranks) cell one
torch.distributed job (Gloo) is started, on loopback or over an emulated link (labs.netem:
root, network namespaces);
inside it every row trains its own DDP copy of the model on the same synthetic MNIST-shaped
batches, in interleaved rounds, so every ratio is measured in the same run on the same machine.

Rows ("stock" is the engine's own, here DDP's, so labs.bench.step's summary, plot and
labs.bench.wins_losses read them unchanged):
    stock:none        DDP with no hook: its own float32 allreduce (allreduce_hook)
    stock:fp16        DDP's fp16_compress_hook
    stock:powersgd1   DDP's powerSGD_hook, rank 1 (start_powerSGD_iter 2, warm start, error
                      feedback; its min_compression_rate 2 leaves small matrices uncompressed).
                      Both PowerSGD rows (stock and ours) run with DDP's parameters in one
                      bucket (ONE_BUCKET_MB), so that they compare step for step: DDP's hook
                      launches a bucket's second and third allreduces from the callback of its
                      first, on Gloo's thread, while the main thread launches the next
                      bucket's first; with two buckets the ranks issue them in different
                      orders and Gloo, which pairs collectives by order, aborts (its message
                      names two different byte counts). With one bucket the callbacks are the
                      only launches in flight.
    ours:<scheme>[:route]   hvd_compress.ddp's hook (none, fp16, bit16, bf16, bit8 allgather and
                      two-phase, powersgd1, topk at 0.01) and ours:auto (the planner in the job);
                      with the suffix @last, one-phase buckets are decoded at the last bucket
                      (HookState(decode_in_callback=False)) instead of in their callback
    local             the same model with no DDP and no exchange (forward, backward and SGD's
                      update): the compute floor; with it summary.csv gives every row its
                      bound, max(floor, the row's wire time), as bench_step's does
bf16_compress_hook is not a row: it needs CUDA and NCCL.

Writes OUT/steps.csv, OUT/calibration.csv, OUT/plans/, OUT/summary.csv and OUT/summary.png as
bench_step does, and OUT/cells.csv (each cell's start, seconds and load average before and
after; with --lock, each cell holds the lock alone) (vs_stock_none: against DDP's own allreduce; vs_stock_fp16: against
fp16_compress_hook).
"""
import argparse
import csv
import fcntl
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from labs.bench import step as bench_step
from labs.bench.rounds import add_grid_arguments, another_round, check_grid, run_torch_ranks, \
    worker_command
from labs.bench.step import AUTO_ROW, LINKS, LOCAL_ROW, cell_steps, plan_fields

DEFERRED = "@last"          # a row's suffix: one-phase buckets decoded at the last bucket
ROWS = ["stock:none", "stock:fp16", "stock:powersgd1", "ours:none", "ours:fp16",
        "ours:bit16:alltoall", "ours:bf16", "ours:bit8:allgather", "ours:bit8:alltoall",
        "ours:powersgd1", "ours:topk", "ours:auto"]
# Rows run only when asked (--rows): ours:powersgd1ddp, our PowerSGD in DDP's hook's variant
# (start_iter 2, min_compression_rate 2, init "ddp": docs/ddp.md)
EXTRA_ROWS = ["ours:powersgd1ddp"]
# DDP's bucket cap (MiB) that puts either lab network in one bucket: the PowerSGD rows' (above)
ONE_BUCKET_MB = 1024
MASTER_PORT = 29533          # on an emulated link: rank 0's address in its namespace
CELL_COLUMNS = ["model", "link", "ranks", "started_utc", "seconds", "load1_start", "load5_start",
                "load15_start", "load1_end", "load5_end", "load15_end"]
IN_BACKWARD = ("copy_s", "compress_s", "communicate_s", "decompress_s")   # the hook's work


# ---- inside one torch.distributed job ---------------------------------------------------------
def init_from_environment():
    """torch.distributed's rendezvous from what the launcher set: torchrun's variables, or, on an
    emulated link (labs.netem sets Horovod's), rank 0's address in its namespace."""
    import torch.distributed as dist
    if os.environ.get("HVDC_NETEM") == "1" and "RANK" not in os.environ:
        from labs.netem.topology import Topology
        os.environ.update(RANK=os.environ["HOROVOD_RANK"], WORLD_SIZE=os.environ["HOROVOD_SIZE"],
                          LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=Topology("x", int(os.environ["HOROVOD_SIZE"])).rank_ip(0),
                          MASTER_PORT=str(MASTER_PORT),
                          GLOO_SOCKET_IFNAME=os.environ.get("HOROVOD_GLOO_IFACE", "eth0"))
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))


def make_row(row, model, trial_steps=0):
    """(the DDP model, its hook state or None) for a row."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    import hvd_compress.ddp as hcd
    from hvd_compress.compression import Compression
    if row == LOCAL_ROW:
        return model, None
    row, deferred = row.removesuffix(DEFERRED), row.endswith(DEFERRED)
    who, scheme, *route = row.split(":")
    one_bucket = {"bucket_cap_mb": ONE_BUCKET_MB} if scheme.startswith("powersgd") else {}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **one_bucket)
    if who == "stock":
        if scheme == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif scheme.startswith("powersgd"):
            state = powerSGD_hook.PowerSGDState(process_group=None,
                                                matrix_approximation_rank=int(scheme[8:]),
                                                start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp, None
    if row == AUTO_ROW:
        from labs.kit.flags import auto_compression
        compression = auto_compression()(trial_steps=trial_steps)
    elif scheme.startswith("powersgd"):
        variant = dict(start_iter=2, min_compression_rate=2, init="ddp") \
            if scheme.endswith("ddp") else {}
        compression = Compression.powersgd(int(scheme[8:].removesuffix("ddp")), **variant)
    elif bench_step.parameter_row(row):          # ours:topk0.1: a method at a parameter
        compression, _ = bench_step.row_compression(row)
    else:
        compression = scheme
    state = hcd.HookState(compression, route[0] if route else None, model=ddp,
                          decode_in_callback=not deferred)
    ddp.register_comm_hook(state, hcd.hook)
    return ddp, state


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from hvd_compress.engine.distributed import TorchEngine
    init_from_environment()
    torch.set_num_threads(1)
    engine = TorchEngine()
    rank, n = engine.rank(), engine.size()
    rows = {}
    for row in args.rows.split(","):
        torch.manual_seed(0)
        ddp, state = make_row(row, bench_step.make_model(args.model), args.auto_trial_steps)
        rows[row] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.5), state)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(args.batch_size, 1, 28, 28, generator=g),
             torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(4)]

    def step(ddp, opt, state, i):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        opt.zero_grad()
        F.nll_loss(ddp(x), y).backward()      # DDP exchanges in here
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        stats = state.pop_stats() if state is not None else {}
        if stats:                              # all of the exchange ran inside backward
            stats["in_backward_s"] = sum(stats[k] for k in IN_BACKWARD)
        return t0, t1, t2, stats

    def warm_up_auto(ddp, opt, state):
        start = time.perf_counter()
        for i in range(args.auto_warmup_max):
            *_, stats = step(ddp, opt, state, i)
            fields = plan_fields(AUTO_ROW, stats)
            if fields["plan"] or "fallback" in fields["plan_event"]:
                outcome = fields["plan_event"] if "fallback" in fields["plan_event"] else "planned"
                return i + 1, time.perf_counter() - start, outcome, state.plan_report()
        raise RuntimeError(f"ours:auto neither planned nor fell back in {args.auto_warmup_max} "
                           "warm-up steps (--auto-warmup-max)")

    # bytes a rank sends where no hook counts them: DDP's float32 / fp16 ring allreduce (as
    # Horovod's, bench_step.stock_bytes_sent) and the local row's none; PowerSGD's stays NaN
    bytes_of = {row: bench_step.stock_bytes_sent(row, ddp, n) for row, (ddp, _, _) in rows.items()
                if row in (LOCAL_ROW, "stock:none", "stock:fp16")}
    out = open(args.csv, "a", newline="") if rank == 0 else None
    writer = csv.writer(out) if out else None
    times = {row: ([], []) for row in rows}
    rnd = 0
    while True:                                     # round 0 warms every row up
        for row, (ddp, opt, state) in rows.items():
            dist.barrier()
            if rnd == 0 and row == AUTO_ROW:
                count, seconds, outcome, report = warm_up_auto(ddp, opt, state)
                if rank == 0:
                    bench_step.write_calibration(args, n, AUTO_ROW, count, seconds, outcome, report)
                continue
            pause = getattr(state.communicator if state else None, "pause_step_clock", None)
            if pause is not None:
                pause()
            for i in range(args.per_round if rnd else args.warmup):
                t0, t1, t2, stats = step(ddp, opt, state, i)
                if rnd and writer:
                    plan = plan_fields(row, stats)
                    writer.writerow([args.model, args.link, n, row, rnd, i, 1e3 * (t2 - t0),
                                     1e3 * (t1 - t0 - stats.get("in_backward_s", 0.0)),
                                     *(1e3 * stats.get(k[:-3] + "_s", math.nan)
                                       for k in bench_step.SPLIT[1:]),
                                     stats.get("bytes_sent", bytes_of.get(row, math.nan)),
                                     *plan.values()])
                    times[row][0].append(1e3 * (t2 - t0))
                    times[row][1].append(rnd)
        if rank == 0:
            print(f"[bench_ddp] {args.model} {args.link} n={n}: round {rnd}", flush=True)
            out.flush()
        more = another_round(times, rnd, args) if rank == 0 else 0.0
        if not engine.broadcast_object(more, root_rank=0, name=f"more.{rnd}"):
            break
        rnd += 1
    if AUTO_ROW in rows and rank == 0:
        plans = Path(args.csv).parent / "plans"
        plans.mkdir(exist_ok=True)
        (plans / f"{args.model}-{args.link}-n{n}.json").write_text(
            json.dumps(rows[AUTO_ROW][2].plan_report(), indent=2, default=str) + "\n")
    if out:
        out.close()
    dist.barrier()
    # every row's DDP, hooks and Gloo threads torn down by the interpreter ended the ranks with
    # SIGABRT ("terminate called without an active exception"): leave as the test workers do
    sys.stdout.flush()
    os._exit(0)


# ---- the driver ---------------------------------------------------------------------------------
@contextmanager
def cell_lock(path):
    """Hold `path`'s flock (shared with `flock PATH cmd`) while a cell runs, so that no other
    benchmark on the machine runs beside it; nothing held without --lock."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def launch(args, model, link, n, csv_path):
    """One cell's job (under --lock), its start, length and load average in OUT/cells.csv."""
    cells = Path(csv_path).parent / "cells.csv"
    if not cells.exists():
        cells.write_text(",".join(CELL_COLUMNS) + "\n")
    with cell_lock(args.lock):
        start, load_start = time.time(), os.getloadavg()
        _launch(args, model, link, n, csv_path)
        load_end = os.getloadavg()
    with open(cells, "a", newline="") as f:
        csv.writer(f).writerow([model, link, n, time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime(start)),
                                round(time.time() - start, 1), *load_start, *load_end])


def _launch(args, model, link, n, csv_path):
    per_round, first, most = cell_steps(model, link, args.steps, args.rounds, args.max_rounds)
    cmd = worker_command("labs.bench.ddp", args, model, link, per_round, first, most, csv_path)
    run_torch_ranks(n, LINKS[link], args.timeout, cmd, "bench_ddp")


def known_row(row):
    """A row this benchmark can make (make_row): the grid's, ours at any registered scheme and
    route or a method at a parameter, DDP's PowerSGD hook at any rank."""
    if row in ROWS + EXTRA_ROWS + [LOCAL_ROW] or bench_step.parameter_row(row):
        return True
    if row.startswith("stock:powersgd"):
        return row[len("stock:powersgd"):].isdigit() and int(row[len("stock:powersgd"):]) > 0
    return row.startswith("ours:") and row in bench_step.known_rows()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grid_arguments(p, ROWS, "results/ddp", LINKS)
    p.add_argument("--lock", default=None, help="hold this file's flock during each cell "
                   "(/tmp/hvd-bench.lock: one benchmark at a time on a shared machine)")
    args = p.parse_args(argv)
    if args.worker:
        return args
    check_grid(p, args, LINKS, lambda r: known_row(r.removesuffix(DEFERRED)),
               f"{ROWS + EXTRA_ROWS + [LOCAL_ROW]}, ours:<scheme>[:route] of any registered "
               f"scheme, a method at a parameter (ours:topk0.1, ours:powersgd4, stock:powersgd2)")
    if args.warmup < 2 and "stock:powersgd1" in args.rows:
        p.error("--warmup: at least 2 (DDP's PowerSGD hook allreduces uncompressed until "
                "its step 2)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    (Path(args.out) / "cells.csv").unlink(missing_ok=True)
    out = bench_step.run_cells(args, launch, tag="labs.bench.ddp")
    summary = bench_step.replot(out, title="Training step on DDP (Gloo): DDP's own hooks "
                                "(grey) vs hvd_compress's hook (blue; auto: orange), median "
                                "and p10-p90, same run")
    cols = ["model", "link", "ranks", "row", "step_ms", "median_ci_pct", "rounds",
            "vs_stock_none", "vs_stock_fp16", "vs_fastest", "communicate_ms", "plan"]
    print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
