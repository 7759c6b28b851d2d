#!/usr/bin/env python
"""One bit8 step of each schedule as a timeline, rank 0, event by event: when backward launches
each bucket, when a wait for one begins and when it is reduced, forward's and backward's ends
and step()'s return (issue 46; results/step-bound/timeline.csv, docs/performance.md).

    python -m labs.netem run -n 2 --rate 100mbit --launcher gloo -- \
        .venv/bin/python results/step-bound/trace_step.py OUT.csv [allgather|alltoall]

The basic net, 14 steps a schedule, the last 4 kept; the route's communicator's start and
finish are wrapped to log (a measurement tool, not the plugin's code path)."""
import csv, sys, time
import torch, horovod.torch as hvd, hvd_compress as hc
import torch.nn.functional as F
from labs.mnist import MODELS
from hvd_compress.exchange import routes
hvd.init(); torch.set_num_threads(1)
log = []
def ev(what, bucket=""): log.append((time.perf_counter(), what, bucket))
route = sys.argv[2] if len(sys.argv) > 2 else "allgather"
A = {"allgather": routes.AllgatherCommunicator, "alltoall": routes.AlltoallCommunicator}[route]
ostart, ofinish = A.start, A.finish
def start(self, b, m=None):
    ev("launch", b.name); return ostart(self, b, m)
def finish(self, ex):
    ev("wait_begin", ex.bucket.name); r = ofinish(self, ex); ev("reduced", ex.bucket.name); return r
A.start, A.finish = start, finish
out = sys.argv[1]
rows = []
for sched in ("wait", "overlap"):
    torch.manual_seed(0); m = MODELS["basic"]()
    opt = hc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.5), m.named_parameters(),
          compression=hc.Compression.bit8, route=route, schedule=sched, model=m if sched == "overlap" else None)
    g = torch.Generator().manual_seed(hvd.rank())
    data = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(4)]
    hvd.allreduce(torch.zeros(1), name=f"b.{sched}")
    for i in range(14):
        if i == 10: log.clear()
        ev("step_begin")
        x, y = data[i % 4]
        opt.zero_grad(); o = m(x); ev("forward_end"); F.nll_loss(o, y).backward(); ev("backward_end"); opt.step(); ev("step_return")
    opt.flush(); ev("flushed")
    base = log[0][0]; step = 10
    for t, w, b in log:
        if w == "step_begin" and t > base: step += 1
        rows.append((sched, step, round(1e3 * (t - base), 2), w, b))
    opt.close()
if hvd.rank() == 0:
    with open(out, "w", newline="") as f:
        w = csv.writer(f); w.writerow(["schedule", "step", "t_ms", "event", "bucket"]); w.writerows(rows)
