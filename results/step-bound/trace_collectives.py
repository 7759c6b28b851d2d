#!/usr/bin/env python
"""Where an overlapped step's time goes, collective by collective, on every rank (issue 46).

    python -m labs.netem run -n 2 --rate 100mbit --launcher gloo -- .venv/bin/python \
        results/step-bound/trace_collectives.py OUT.csv --link 100mbit [--route allgather] [--job K] [--steps N]
    python results/step-bound/trace_collectives.py OUT.csv --summary        # OUT-summary.csv and .png again

The basic net, bit8, schedule="overlap", WARMUP steps and then --steps timed ones. Every rank
logs when each collective is launched and when it is first seen complete (a poll of the
sender's thread, or the main thread's wait), and when its forward and backward end, on one
clock: perf_counter is CLOCK_MONOTONIC, the same for every process on a host, so the ranks'
events line up. Rank 0 appends them all to OUT.csv, and each rank's CPU over the timed steps
(all its threads, and the training thread alone) to OUT-cpu.csv.

Per step, for the bucket that is cut into chunks (fc1's):
  wire   the later rank's launch of its first chunk -> its last chunk complete on every rank
  loop   -> the later rank's launch of the next step's first chunk: fc1's update, the forward
         from fc1 on, the loss and the backward down to fc1 (what the next launch waits for)
  skew   the first chunk's launches, latest rank minus earliest
  cycle  wire + loop: the step, from first chunk to first chunk
OUT-summary.csv: each job's median, mean, 10th and 90th percentile of each, in ms; OUT-summary.png
draws them. The Horovod engine's methods are wrapped to log (a measurement tool, not the
plugin's code path)."""
import argparse
import csv
import os
import re
import time
from pathlib import Path

WARMUP = 10
PHASES = ("wire", "loop", "skew", "cycle")
FIRST, LAST = re.compile(r"\.c0of(\d+)$"), re.compile(r"\.c(\d+)of(\d+)(\.gather)?$")


def traced_engine(log):
    """Wrap HorovodEngine's launches and polls to append (time, event, name) to `log`."""
    from hvd_compress.engine.horovod import HorovodEngine as E
    names, seen = {}, set()
    launch_ag, launch_aa, poll = E.allgather_async, E.alltoall_async, E.poll

    def logged(handle, name):
        names[handle] = name
        log.append((time.perf_counter(), "launch", name))
        return handle

    def poll_logged(self, handle):
        done = poll(self, handle)
        if done and handle in names and handle not in seen:
            seen.add(handle)
            log.append((time.perf_counter(), "done", names[handle]))
        return done
    E.allgather_async = lambda self, t, name, sizes=None: logged(launch_ag(self, t, name), name)
    E.alltoall_async = lambda self, t, splits, name: logged(launch_aa(self, t, splits, name), name)
    E.poll = poll_logged


def cpu_seconds():
    """(all of this process's threads, this thread): CPU seconds."""
    return time.process_time(), time.thread_time()


def trace(args):
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import hvd_compress as hc
    from labs.mnist import MODELS
    hvd.init()
    torch.set_num_threads(1)
    log = []
    traced_engine(log)
    torch.manual_seed(0)
    model = MODELS["basic"]()
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5),
                                  model.named_parameters(), compression=hc.Compression.bit8,
                                  route=args.route, schedule="overlap", model=model)
    g = torch.Generator().manual_seed(hvd.rank())
    data = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g))
            for _ in range(4)]
    hvd.allreduce(torch.zeros(1), name="trace.begin")
    for i in range(WARMUP + args.steps):
        if i == WARMUP:
            log.clear()
            start, (cpu0, main0) = time.perf_counter(), cpu_seconds()
        log.append((time.perf_counter(), "step_begin", str(i - WARMUP)))
        x, y = data[i % 4]
        opt.zero_grad()
        out = model(x)
        log.append((time.perf_counter(), "forward_end", ""))
        F.nll_loss(out, y).backward()
        log.append((time.perf_counter(), "backward_end", ""))
        opt.step()
    opt.flush()
    wall, (cpu1, main1) = time.perf_counter() - start, cpu_seconds()
    opt.close()
    mine = ([(hvd.rank(), t, e, n) for t, e, n in log],
            (hvd.rank(), round(1e3 * wall / args.steps, 2), round(1e3 * (cpu1 - cpu0) / args.steps, 2),
             round(1e3 * (main1 - main0) / args.steps, 2)))
    every = hvd.allgather_object(mine)
    if hvd.rank() != 0:
        return
    origin = min(t for events, _ in every for _, t, _, _ in events)
    cell = (args.link, hvd.size(), args.route, args.variant, args.job)
    append(args.out, ["link", "n", "route", "variant", "job", "rank", "t_ms", "event", "name"],
           [cell + (r, round(1e3 * (t - origin), 3), e, n)
            for events, _ in every for r, t, e, n in sorted(events, key=lambda row: row[1])])
    append(with_suffix(args.out, "-cpu"), ["link", "n", "route", "variant", "job", "rank", "step_ms",
                                           "cpu_ms_per_step", "main_cpu_ms_per_step"],
           [cell + row for _, row in every])
    summarise(args.out)


def append(path, header, rows):
    new = not Path(path).exists()
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(header)
        w.writerows(rows)


def with_suffix(path, suffix):
    p = Path(path)
    return p.with_name(p.stem + suffix + p.suffix)


def phases(events):
    """{phase: [ms per step]} of one job's events (rows of OUT.csv as dicts), see the docstring."""
    launches, dones = {}, {}          # step's index of the cut bucket -> {rank: ms}
    counts = {}
    for e in events:
        rank, t, name = int(e["rank"]), float(e["t_ms"]), e["name"]
        if e["event"] == "launch" and FIRST.search(name):
            k = counts[rank] = counts.get(rank, -1) + 1
            launches.setdefault(k, {})[rank] = t
        elif e["event"] == "done" and (m := LAST.search(name)):
            last, total, gather = int(m.group(1)), int(m.group(2)), m.group(3)
            two_phase = "alltoall" in name
            if last == total - 1 and (gather or not two_phase):
                dones.setdefault(counts.get(rank, 0), {})[rank] = t
    ranks = {int(e["rank"]) for e in events}
    out = {p: [] for p in PHASES}
    for k in sorted(launches):
        here, after = launches[k], launches.get(k + 1, {})
        if len(here) < len(ranks) or len(after) < len(ranks) or len(dones.get(k, {})) < len(ranks):
            continue
        begin, end, nxt = max(here.values()), max(dones[k].values()), max(after.values())
        out["wire"].append(end - begin)
        out["loop"].append(nxt - end)
        out["skew"].append(begin - min(here.values()))
        out["cycle"].append(nxt - begin)
    return out


def summarise(path):
    """OUT-summary.csv and OUT-summary.png from OUT.csv (every job in it)."""
    import numpy as np
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    jobs = {}
    for r in rows:
        jobs.setdefault((r["link"], r["n"], r["route"], r["variant"], r["job"]), []).append(r)
    out, drawn = [], []
    for cell, events in jobs.items():
        per = phases(events)
        if not per["cycle"]:
            continue
        row = dict(zip(("link", "n", "route", "variant", "job"), cell), steps=len(per["cycle"]))
        for p, v in per.items():
            row.update({f"{p}_median_ms": round(float(np.median(v)), 1),
                        f"{p}_mean_ms": round(float(np.mean(v)), 1),
                        f"{p}_p10_ms": round(float(np.percentile(v, 10)), 1),
                        f"{p}_p90_ms": round(float(np.percentile(v, 90)), 1)})
        out.append(row)
        drawn.append((cell, per))
    if not out:
        raise SystemExit(f"{path}: no job there has a step with its first chunk launched and its "
                         f"last complete on every rank, and a next step (was a bucket cut?)")
    target = with_suffix(path, "-summary")
    with open(target, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    print(f"{target}:")
    for row in out:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items() if not k.endswith(("p10_ms", "p90_ms"))))
    plot(drawn, target.with_suffix(".png"))


def plot(drawn, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(PHASES), figsize=(3.4 * len(PHASES), 4.8), squeeze=False)
    labels = [f"{link} n{n} {route}, {variant or 'default'}, job {job}"
              for (link, n, route, variant, job), _ in drawn]
    for ax, p in zip(axes[0], PHASES):
        ax.boxplot([per[p] for _, per in drawn], whis=(10, 90), showfliers=True)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=6, rotation=90)
        ax.set(title=p, ylabel="ms a step")
    fig.suptitle("bit8 overlapped, per step: fc1's chunks on the wire, the loop, the ranks' skew",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="CSV of events: appended to (a header first where new)")
    parser.add_argument("--route", default="allgather", choices=("allgather", "alltoall"))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--link", default="", help="the link's name, for the CSV's link column")
    parser.add_argument("--job", type=int, default=1, help="for the CSV's job column")
    parser.add_argument("--variant", default="", help="for the CSV's variant column: what was "
                        "set differently (an environment variable, say)")
    parser.add_argument("--summary", action="store_true", help="only re-derive the summary")
    args = parser.parse_args()
    if args.summary:
        return summarise(args.out)
    trace(args)


if __name__ == "__main__":
    main()
