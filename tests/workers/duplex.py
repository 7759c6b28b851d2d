"""Worker for tests/test_gloo_patch.py: do both directions of a link carry data at once?

Each rank samples its own NIC's byte counters (/sys of its network namespace) every 20 ms
while Horovod moves a large allgather and then a large alltoall, and reports, for each, the
fraction of the samples in which it was sending, among those in which its link moved data
either way. Two ranks sending at once give ~1 each; ranks taking turns (Gloo 0.28.1 without
patches/gloo-post-receives-first.patch) give ~0.5: while one sends, the other only receives.
A sample in which nothing moved (the ranks off the cores the suite shares) is evidence of
neither, and is not counted; the ranks wait on the collective by sleeping
(hvd_compress.exchange.base.wait_for), not in Horovod's spinning synchronize(), so that the cores
go to Gloo's threads. In the suite, before both, 4 spinning ranks read 48% and 74%.
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

from hvd_compress.exchange.base import wait_for

STATS = Path("/sys/class/net/eth0/statistics")
MIB = 1 << 20
MOVED = 64 * 1024              # bytes in 20 ms (26 Mbit/s): a link at 100 Mbit/s is in use


def sending_fraction(op, interval=0.02):
    """Run op(); return (the fraction of intervals in which tx_bytes grew by > MOVED, among
    those in which tx_bytes or rx_bytes did, seconds)."""
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append((int((STATS / "tx_bytes").read_text()),
                            int((STATS / "rx_bytes").read_text())))
            time.sleep(interval)

    hvd.barrier()
    thread = threading.Thread(target=sample)
    start = time.perf_counter()
    thread.start()
    op()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(samples, samples[1:])]
    if len(steps) > 4:
        # the first interval holds the collective's start (negotiation, before any data), the
        # last its end: partial either way, evidence of neither sending at once nor turn-taking
        steps = steps[1:-1]
    active = [tx for tx, rx in steps if tx > MOVED or rx > MOVED]
    return sum(tx > MOVED for tx in active) / max(1, len(active)), seconds


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
    report["allgather"] = sending_fraction(
        lambda: wait_for(hvd.allgather_async(gather_in)))
    report["alltoall"] = sending_fraction(
        lambda: wait_for(hvd.alltoall_async(a2a_in, splits=splits)))
    out = Path(os.environ["HVDC_DUPLEX_DIR"]) / f"rank{hvd.rank()}.json"
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
