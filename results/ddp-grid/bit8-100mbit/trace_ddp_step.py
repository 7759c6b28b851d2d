#!/usr/bin/env python
"""DDP steps of the bit8 hook traced on every rank, with Gloo's large allgathers and alltoalls
whole and in pieces (HookState gather_pieces; engine/distributed.py GATHER_PIECE_BYTES): when each rank starts
its step, when each bucket's hook runs and returns, when its collective completes, and when
backward and the step end (issue 47; results/ddp-grid/bit8-100mbit/).

    python -m labs.netem run -n 2 --rate 100mbit --launcher gloo -- \
        .venv/bin/python results/ddp-grid/bit8-100mbit/trace_ddp_step.py OUT.csv [allgather|alltoall]

The basic net, 14 steps a setting, the last 10 kept. Every rank writes OUT.csv's rows for
itself (OUT.csv.rank<r>, then rank 0 joins them): `at_ms`, milliseconds on the machine's
clock, shared by the ranks' namespaces, so the ranks' steps can be set side by side. The hook
is wrapped to log (a measurement tool, not the plugin's code path)."""
import csv
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hvd_compress.ddp as hcd
from labs.bench.ddp import init_from_environment
from labs.bench.step import make_model

COLUMNS = ["rank", "pieces", "step", "event", "bucket", "at_ms"]


def trace(route, pieces, rank, steps=14, kept=10):
    """`pieces`: HookState's gather_pieces (False: every collective whole; True: in pieces)."""
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model("basic"))
    state = hcd.HookState("bit8", route, model=ddp, gather_pieces=pieces)
    rows, step = [], [0]

    def log(event, bucket=""):
        rows.append([rank, pieces, step[0], event, bucket, time.time() * 1e3])

    def traced(state, bucket):
        log("hook", bucket.index())
        future = hcd.hook(state, bucket)
        log("hook_return", bucket.index())

        def done(f, index=bucket.index()):
            log("reduced", index)
            return f.value()
        return future.then(done)

    ddp.register_comm_hook(state, traced)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.5)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
    dist.barrier()
    for i in range(steps):
        step[0] = i
        log("step_begin")
        opt.zero_grad()
        out = ddp(x)
        log("forward_end")
        F.nll_loss(out, y).backward()
        log("backward_end")
        opt.step()
        log("step_end")
    return [r for r in rows if r[2] >= steps - kept]


def main():
    out = Path(sys.argv[1])
    route = sys.argv[2] if len(sys.argv) > 2 else "allgather"
    init_from_environment()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    rows = trace(route, False, rank) + trace(route, True, rank)
    mine = out.with_name(f"{out.name}.rank{rank}")
    with open(mine, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    dist.barrier()
    if rank == 0:
        with open(out, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            for r in range(dist.get_world_size()):
                part = out.with_name(f"{out.name}.rank{r}")
                writer.writerows(csv.reader(open(part)))
                part.unlink()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)              # DDP's and Gloo's threads torn down by the interpreter abort


if __name__ == "__main__":
    main()
