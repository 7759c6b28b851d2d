"""Worker for tests/test_gloo_patch.py: do both directions of a link carry data at once?

Each rank samples its own NIC's transmit counter (/sys of its network namespace) every 20 ms
while Horovod moves a large allgather and then a large alltoall, and reports, for each, the
fraction of the samples in which it was sending. Two ranks sending at once give ~1 each;
ranks taking turns (Gloo 0.28.1 without patches/gloo-post-receives-first.patch) give ~0.5.
Writes one JSON line per rank into $HVDC_DUPLEX_DIR/rank<k>.json; the sizes (MiB a rank) come
from HVDC_DUPLEX_ALLGATHER_MIB and HVDC_DUPLEX_ALLTOALL_MIB (tests/test_gloo_patch.py).
"""
import json
import os
import threading
import time
from pathlib import Path

import horovod.torch as hvd
import torch

TX = Path("/sys/class/net/eth0/statistics/tx_bytes")
MIB = 1 << 20


def sending_fraction(op, interval=0.02):
    """Run op(); return (fraction of intervals in which tx_bytes grew by > 64 KiB, seconds)."""
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(int(TX.read_text()))
            time.sleep(interval)

    hvd.barrier()
    thread = threading.Thread(target=sample)
    start = time.perf_counter()
    thread.start()
    op()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    steps = [b - a for a, b in zip(samples, samples[1:])]
    if len(steps) > 4:
        # the first interval holds the collective's start (negotiation, before any data), the
        # last its end: partial either way, evidence of neither sending at once nor turn-taking
        steps = steps[1:-1]
    return sum(s > 64 * 1024 for s in steps) / max(1, len(steps)), seconds


def main():
    hvd.init()
    n = hvd.size()
    gather_size = int(os.environ.get("HVDC_DUPLEX_ALLGATHER_MIB", "16")) * MIB
    a2a_size = int(os.environ.get("HVDC_DUPLEX_ALLTOALL_MIB", "16")) * MIB
    gather_in = torch.full((gather_size,), hvd.rank(), dtype=torch.uint8)
    a2a_in = torch.full((a2a_size,), hvd.rank(), dtype=torch.uint8)
    splits = torch.full((n,), a2a_size // n, dtype=torch.int32)
    splits[-1] += a2a_size - int(splits.sum())
    # warm up the connections, and check the results while at it
    got = hvd.allgather(gather_in[:1024])
    assert got.view(n, 1024).float().mean(1).tolist() == list(range(n))
    report = {"rank": hvd.rank(), "size": n}
    report["allgather"] = sending_fraction(lambda: hvd.allgather(gather_in))
    report["alltoall"] = sending_fraction(lambda: hvd.alltoall(a2a_in, splits=splits))
    out = Path(os.environ["HVDC_DUPLEX_DIR"]) / f"rank{hvd.rank()}.json"
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
