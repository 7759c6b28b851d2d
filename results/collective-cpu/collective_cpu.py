#!/usr/bin/env python3
"""CPU seconds a rank spends per collective, beside its wall time (what Compression.auto's
calibration now measures in the job as `links_cpu`, docs/planner.md "The timeline").

The planner's links are timed by wall clock on otherwise idle cores. Where ranks share cores
with backward, what a collective costs the step is also its CPU: Horovod's and Gloo's threads,
the sum of an allreduce. This times each collective a plan can put on one bucket of `--values`
float32 values (the basic net's fc1.weight: 1,179,648) -- float32 and Horovod's fp16 allreduce,
bit8's allgather, alltoall and two-phase chunk allgather -- and reads the process's CPU time
(`time.process_time`: every thread) around each, waiting as the plugin does (`wait_for`).

    horovodrun -np 4 --gloo python results/collective-cpu/collective_cpu.py --out results/collective-cpu
"""
import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch

from hvd_compress.exchange.base import wait_for


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--values", type=int, default=1_179_648)
    p.add_argument("--reps", type=int, default=7, help="timed repetitions after one untimed")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    hvd.init()
    n, count = hvd.size(), args.values
    x32, x16 = torch.randn(count), torch.randn(count).half()
    u8 = torch.randint(0, 255, (count,), dtype=torch.uint8)
    chunk = u8[: count // n].clone()
    cases = {   # name: (input bytes, launch)
        "allreduce float32": (4 * count, lambda k: hvd.allreduce_async(x32, op=hvd.Sum, name=f"c.ar32.{k}")),
        "allreduce fp16": (2 * count, lambda k: hvd.allreduce_async(x16, op=hvd.Sum, name=f"c.ar16.{k}")),
        "allgather bit8": (count, lambda k: hvd.allgather_async(u8, name=f"c.ag8.{k}")),
        "alltoall bit8": (count, lambda k: hvd.alltoall_async(u8, name=f"c.a2a8.{k}")),
        "allgather bit8 chunk": (count // n, lambda k: hvd.allgather_async(chunk, name=f"c.agc.{k}")),
    }
    rows = []
    for case, (nbytes, launch) in cases.items():
        walls, cpus = [], []
        for k in range(args.reps + 1):
            hvd.allreduce(torch.zeros(1), name=f"c.sync.{case}.{k}")   # start together
            cpu, wall = time.process_time(), time.perf_counter()
            wait_for(launch(k))
            if k:                                  # the first negotiates the name: untimed
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
        rows.append({"ranks": n, "rank": hvd.rank(), "collective": case, "input_bytes": nbytes,
                     "wall_ms": round(1e3 * statistics.median(walls), 3),
                     "cpu_ms": round(1e3 * statistics.median(cpus), 3)})
    every = hvd.allgather_object(rows)
    if hvd.rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"cpu-np{n}.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            for r in every:
                w.writerows(r)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
