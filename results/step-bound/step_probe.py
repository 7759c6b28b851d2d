#!/usr/bin/env python
"""A bit8 step's wall time and where its CPU goes, thread by thread, with no exchange, waiting and
overlapped, and overlapped with the large bucket cut into other numbers of chunks (issue 46):
the main thread's CPU (forward, backward, update, the codec, the hooks, the polls), the
sender's, and the rest of the process's (Horovod's background thread, Gloo's: `native`), in
ms of CPU per step, on every rank.

    python -m labs.netem run -n 2 --rate 100mbit --launcher gloo -- \
        .venv/bin/python results/step-bound/step_probe.py OUT.csv --link 100mbit [--job K] [--steps N] \
        [--chunks 1,2,4,16]
    python results/step-bound/step_probe.py OUT.csv --plot          # OUT.png beside it

The basic net, bit8 allgather; `local` (plain SGD, no exchange), `wait`, `overlap` (the
chunks the layout gives: exchange/sender.py) and `overlap` at each --chunks count, one after
the other in one job, WARMUP steps each before the timed ones; the wall time per step counts
the last step's flush (an overlapped row's last updates). CPU from /proc/self/task/<tid>/stat;
the chunk count is set on the route's class (a measurement tool, not the plugin's code path).
Rank 0 gathers every rank's rows and appends them to OUT.csv."""
import argparse
import csv
import os
import threading
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_compress as hc
from hvd_compress.exchange import routes, sender
from labs.mnist import MODELS

WARMUP = 10
DEFAULTS = (routes.AllgatherCommunicator.max_chunks, sender.MIN_CHUNK_BYTES)
TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu():
    """{tid: CPU seconds} of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue                                 # a thread that ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def thread_names():
    """{tid: name}: the main thread, Python's own threads by name; the rest are native."""
    names = {os.getpid(): "main"}
    names.update({t.native_id: t.name for t in threading.enumerate()
                  if t.native_id and t.native_id != os.getpid()})
    return names


def run(schedule, steps, chunks=None):
    """Rows (rank, schedule, chunks, thread, cpu_ms_per_step, step_ms) of `steps` timed steps."""
    if chunks is not None:                 # at most `chunks`, each at least a scale block
        routes.AllgatherCommunicator.max_chunks, sender.MIN_CHUNK_BYTES = chunks, 1
    torch.manual_seed(0)
    model = MODELS["basic"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    if schedule != "local":
        opt = hc.DistributedOptimizer(opt, model.named_parameters(), compression=hc.Compression.bit8,
                                      route="allgather", schedule=schedule,
                                      model=model if schedule == "overlap" else None)
    g = torch.Generator().manual_seed(hvd.rank())
    data = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g))
            for _ in range(4)]
    hvd.allreduce(torch.zeros(1), name=f"begin.{schedule}")
    for i in range(WARMUP + steps):
        if i == WARMUP:
            before, start, names = thread_cpu(), time.perf_counter(), thread_names()
        x, y = data[i % 4]
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        opt.step()
    if schedule == "overlap":
        opt.flush()
    wall, after = time.perf_counter() - start, thread_cpu()
    cut = opt._communicator.chunk_counts() if schedule == "overlap" else {}   # the cut it ran
    names.update(thread_names())
    per = {}
    for tid, seconds in after.items():
        name = names.get(tid, "native")
        per[name] = per.get(name, 0.0) + seconds - before.get(tid, 0.0)
    if schedule != "local":
        opt.close()
    routes.AllgatherCommunicator.max_chunks, sender.MIN_CHUNK_BYTES = DEFAULTS
    count = max(cut.values(), default=1) if schedule == "overlap" else ""
    return [(hvd.rank(), schedule, count, name, round(1e3 * s / steps, 2),
             round(1e3 * wall / steps, 2)) for name, s in sorted(per.items())]


def plot(path):
    """PATH's PNG beside it: each job's step (rank 0) against the chunk count, per link, with
    the waiting schedule and the floor (local) as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    d = pd.read_csv(path)
    d = d[d["rank"] == 0].drop_duplicates(["link", "job", "schedule", "chunks"])
    links = list(dict.fromkeys(d.link))
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 3.6), squeeze=False)
    for ax, link in zip(axes[0], links):
        here = d[d.link == link]
        cut = here[here.schedule == "overlap"]
        ax.plot(cut.chunks, cut.step_ms, "o", label="overlap, by chunks")
        for schedule, style in (("wait", "--"), ("local", ":")):
            ax.axhline(here[here.schedule == schedule].step_ms.median(), ls=style, color="grey",
                       label=f"{schedule} (median of jobs)")
        ax.set_xscale("log", base=2)
        ax.set(title=f"bit8 allgather, 2 ranks, {link}", xlabel="chunks of fc1's bucket",
               ylabel="ms a step (rank 0)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="CSV: appended to (a header first where new)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--chunks", default="", help="comma-separated counts to run overlapped too")
    parser.add_argument("--link", default="", help="the link's name, for the CSV's link column")
    parser.add_argument("--job", type=int, default=1, help="for the CSV's job column")
    parser.add_argument("--plot", action="store_true", help="only draw OUT's PNG beside it")
    args = parser.parse_args()
    if args.plot:
        return plot(args.out)
    hvd.init()
    torch.set_num_threads(1)
    rows = []
    for schedule in ("local", "wait", "overlap"):
        rows += run(schedule, args.steps)
    for count in filter(None, args.chunks.split(",")):
        rows += run("overlap", args.steps, int(count))
    every = hvd.allgather_object(rows)
    if hvd.rank() == 0:
        new = not Path(args.out).exists()
        with open(args.out, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["link", "job", "rank", "schedule", "chunks", "thread",
                            "cpu_ms_per_step", "step_ms"])
            for part in every:
                w.writerows((args.link, args.job) + row for row in part)


if __name__ == "__main__":
    main()
