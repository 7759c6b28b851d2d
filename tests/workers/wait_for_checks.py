"""Run under horovodrun (tests/workers/suite.py, or alone): exchange.wait_for (re-exported by
communicators), Horovod's
synchronize() without its yield spin, on real ranks. It returns what synchronize() would (the
sum of every rank's tensor), sleeping between polls from POLL_SLEEP_S[0] doubling up to
exchange.longest_sleep for this host (its ranks and cores), and raises Horovod's own error for a handle it never made.

Run at 2 ranks: the sum, 2 * arange(2**18), is exact in float32 (below 2**24)."""
import os
import re
import time

import torch

import checks
from hvd_compress.exchange import base as exchange, routes as communicators


def run(hvd):
    delays = []
    real_sleep = time.sleep

    def sleep(seconds):
        delays.append(seconds)
        real_sleep(seconds)
    # 1 MiB: any allreduce waits for Horovod's background thread's cycle and the other rank (a
    # 10-float one: about 11 ms under Gloo, 1.2 ms under MPI, here), far longer than the 150 us
    # the sleeps take to reach the longest (200 us at 2 ranks on 2 cores); 16 MiB a call took
    # 20 x 0.25 s of the job under load
    x = torch.arange(1 << 18, dtype=torch.float32)
    exchange.time.sleep = sleep                               # where wait_for sleeps
    try:
        outs = [communicators.wait_for(hvd.allreduce_async(x, name=f"wait_for.{i}", op=hvd.Sum))
                for i in range(20)]
    finally:
        exchange.time.sleep = real_sleep
    for i, out in enumerate(outs):
        checks.check(f"wait_for.allreduce{i}.returns_the_sum", torch.equal(out, x * hvd.size()))
    first = exchange.POLL_SLEEP_S[0]
    longest = exchange.longest_sleep(hvd.local_size(), len(os.sched_getaffinity(0)))
    checks.check("wait_for.something_was_waited_for", len(delays) > 0,
                 "every allreduce was done before its first poll")
    checks.check("wait_for.first_sleep_is_the_shortest", delays[0] == first, f"{delays[:3]}")
    checks.check("wait_for.no_sleep_longer_than_longest", max(delays) <= longest, f"{max(delays)}")
    checks.check("wait_for.sleeps_reach_the_longest", longest in delays,
                 f"longest {longest}, slept {sorted(set(delays))}")
    checks.check("wait_for.sleeps_double", all(b in (2 * a, longest, first) for a, b in zip(delays, delays[1:])),
                 f"{delays[:12]}")
    try:
        communicators.wait_for(987654)
        error = "no error"
    except ValueError as err:
        error = str(err)
    checks.check("wait_for.unknown_handle_raises_horovods_error",
                 bool(re.search("Handle 987654 was not created or has been cleared", error)), error)


if __name__ == "__main__":
    checks.main(run)
