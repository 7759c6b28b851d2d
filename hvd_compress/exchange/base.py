"""What every communicator shares: an exchange in flight, the wait that does not spin, the
counters it reports, and the frame of start/advance/finish (CommunicatorBase).

The packet routes (exchange/routes.py) and the per-tensor methods (methods/tensorwise.py: top-k,
PowerSGD) build on this one module, so neither imports the other.
"""
import os
import time

import horovod.torch as hvd

from ..roles import Communicator, Stats
from .fusion import Bucket

__all__ = ["Stats", "Exchange", "CommunicatorBase", "wait_for", "launch_next_phases",
           "POLL_SLEEP_S", "UNCROWDED_LONGEST_SLEEP_S", "longest_sleep"]

# How long wait_for() sleeps between polls: doubling from the first value up to the second on a
# crowded host (more ranks than cores), up to UNCROWDED_LONGEST_SLEEP_S where every rank has a
# core of its own (see longest_sleep for why and for the figures).
POLL_SLEEP_S = (50e-6, 1e-3)
UNCROWDED_LONGEST_SLEEP_S = 200e-6


def longest_sleep(local_ranks, cores):
    """The longest sleep between two polls, for `local_ranks` ranks on `cores` usable cores.

    A finished exchange is noticed up to one sleep late, and a rank's lateness delays the next
    step of all. Where each rank has a core (2 ranks on 2 cores), polling every 200 us instead
    of 1 ms cost no more main-thread CPU and cut the estimated lateness 2-3x (1.0 to 0.4 ms a
    step of the lab net); with 4 ranks on 2 cores it cost 0.5-0.9 ms more CPU a step per rank,
    on the cores the other ranks compute on, so crowded hosts keep POLL_SLEEP_S[1]
    (results/wait/README.md, scripts/bench_wait.py, AMD EPYC family 25 model 17, 2 cores)."""
    if local_ranks > cores:
        return POLL_SLEEP_S[1]
    return min(POLL_SLEEP_S[1], UNCROWDED_LONGEST_SLEEP_S)


def _usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def wait_for(handle):
    """hvd.synchronize(handle), but waiting by sleeping between polls instead of spinning.

    Why: Horovod's synchronize() loops on std::this_thread::yield() until the handle is done
    (horovod/torch/mpi_ops_v2.cc, WaitAndClear). A rank that waits so keeps its core busy, and
    the core is what the other ranks' backward and Horovod's background thread (which does
    the reduction) need when there are as many processes as cores or more: 4 ranks on this
    2-core machine spent 35% of the CPU in the kernel, at ~30,000 preemptions a second each.
    Sleeping adds at most longest_sleep() to a wait; a finished handle's synchronize()
    returns at once (and raises its error, if any).
    """
    sleeps = _poll_sleeps()
    while not hvd.poll(handle):
        time.sleep(next(sleeps))
    return hvd.synchronize(handle)


def _poll_sleeps():
    """The sleeps between polls: POLL_SLEEP_S[0] doubling up to longest_sleep() for this host."""
    delay = POLL_SLEEP_S[0]
    longest = longest_sleep(hvd.local_size(), _usable_cores())
    while True:
        yield delay
        delay = min(2 * delay, longest)


def launch_next_phases(communicator, exchanges):
    """Wait until no exchange is still in phase 1, calling communicator.progress(ex) on each as
    soon as its phase 1 completes; sleeps between polls as wait_for does (the sleeps count as
    communicate_s).

    Why not finish bucket by bucket: finish(bucket 0) would wait for its phase 2 before bucket
    1's phase 2 is even launched, though bucket 1's phase 1 may have completed long before;
    the link would idle between the phases of consecutive buckets.
    """
    pending, sleeps = [ex for ex in exchanges if ex.phase == 1], _poll_sleeps()
    while pending:
        for ex in pending:
            communicator.progress(ex)
        pending = [ex for ex in pending if ex.phase == 1]
        if pending:
            with communicator.stats.timing("communicate_s"):
                time.sleep(next(sleeps))


class Exchange:
    """One bucket's (or tensor's) collective in flight: its handle, phase, launch time, what
    the route keeps between phases (ctx) and the memory it compensated with, if any."""
    __slots__ = ("bucket", "handle", "phase", "launched", "ctx", "memory")

    def __init__(self, bucket, handle, ctx=None, phase=1, memory=None):
        self.bucket, self.handle, self.ctx, self.phase = bucket, handle, ctx, phase
        self.memory = memory
        self.launched = time.perf_counter()


class CommunicatorBase(Communicator):
    """The frame every communicator shares: counters, names, planning and a whole exchange
    (`reduce`) built from the contract's start/advance/finish."""
    ops = (hvd.Average, hvd.Sum)
    fusion_threshold_bytes = 0
    scale_block = None

    def __init__(self, compression, op=hvd.Average):
        if op not in self.ops:
            raise ValueError(f"{self.describe_method(compression)} supports "
                             f"op={' or '.join(map(str, self.ops))}, got {op!r}; use "
                             "hvd.DistributedOptimizer for Adasum")
        self.compression, self.op, self.stats = compression, op, Stats()

    @staticmethod
    def describe_method(compression):
        return getattr(compression, "name", getattr(compression, "__name__", str(compression)))

    def pop_stats(self):
        """The counters since the last call, and which implementation of the codec ran."""
        return dict(self.stats.pop(), codec_path=self.codec_path())

    def codec_path(self):
        """'native' (the C++ kernel) or 'torch': which implementation codes the gradients."""
        return "torch"

    def describe(self):
        return f"{self.describe_method(self.compression)}/{self.route.value}"

    def _tag(self, name):
        # The route is part of the name, so ranks that disagree on it never match silently.
        return f"hvdc.{self.describe()}.{name}"

    def plan(self, names, tensors, prefix=""):
        """[(member indices, Bucket)] for these tensors, in the order given."""
        return Bucket.plan(names, tensors, self.fusion_threshold_bytes, flat=self.fuses,
                           prefix=prefix)

    def progress(self, exchange):
        """Move a multi-phase exchange on if its current phase is done; never blocks."""

    def reduce(self, tensors, names, memory=None):
        """Exchange `tensors` now (start every bucket, then finish each); reduced tensors in
        the same order, shapes and dtypes. The optimizer does the same from its hooks."""
        planned = self.plan(names, tensors)
        exchanges = []
        for group, bucket in planned:
            with self.stats.timing("copy_s"):
                for j, i in enumerate(group):
                    bucket.put(j, tensors[i])
            exchanges.append(self.start(bucket, memory))
        self.advance(exchanges)
        results = [None] * len(tensors)
        for (group, bucket), ex in zip(planned, exchanges):
            self.finish(ex)
            for j, i in enumerate(group):
                results[i] = bucket.result(j)
        return results
