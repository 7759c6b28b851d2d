"""Time alltoall and allgather at the basic net's bucket sizes on this link, each rank's own
time and its network namespace's TCP retransmissions per call (README.md beside it):

    python -m labs.netem run -n 4 --rate 10mbit --launcher gloo -- python probe.py OUT.csv
"""
import csv
import sys
import time

import horovod.torch as hvd
import torch

from hvd_compress.exchange.base import wait_for

def retrans():
    with open("/proc/net/snmp") as f:
        lines = f.read().splitlines()
    tcp = [l.split() for l in lines if l.startswith('Tcp:')]
    return int(dict(zip(tcp[0][1:], tcp[1][1:]))['RetransSegs'])

hvd.init(); n = hvd.size(); r = hvd.rank()
rows = []
sizes = [4 << 10, 64 << 10, 256 << 10, 590 << 10, 1180 << 10, 2360 << 10]
for size in sizes:
    size -= size % n
    for coll in ("alltoall", "allgather"):
        for rep in range(4):
            hvd.allreduce(torch.zeros(1), name=f"sync.{coll}.{size}.{rep}")
            before = retrans(); t0 = time.perf_counter()
            if coll == "alltoall":
                t = torch.zeros(size, dtype=torch.uint8)
                splits = torch.full((n,), size // n, dtype=torch.int32)
                h = hvd.alltoall_async(t, splits=splits, name=f"a2a.{size}.{rep}")
            else:
                t = torch.zeros(size // n, dtype=torch.uint8)   # each rank's part of the same bytes
                h = hvd.allgather_async(t, name=f"ag.{size}.{rep}")
            wait_for(h)
            dt = time.perf_counter() - t0
            rows.append([coll, size, rep, dt, retrans() - before])
allrows = hvd.allgather_object(rows)
if r == 0:
    with open(sys.argv[1], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", "collective", "bytes", "rep", "seconds", "retrans"])
        for k, rank_rows in enumerate(allrows):
            for row in rank_rows:
                w.writerow([k] + row)
hvd.shutdown()
