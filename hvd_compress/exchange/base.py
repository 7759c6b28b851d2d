"""What every communicator shares: an exchange in flight, the wait that does not spin, the
counters it reports, and the frame of start/advance/finish (CommunicatorBase).

The packet routes (exchange/routes.py) and the per-tensor methods (methods/tensorwise.py: top-k,
PowerSGD) build on this one module, so neither imports the other.
"""
import time

from ..engine.base import (AVERAGE, POLL_SLEEP_S, SUM, UNCROWDED_LONGEST_SLEEP_S, longest_sleep,
                           usable_cores)
from ..roles import Capabilities, Communicator, Stats
from .fusion import Bucket

__all__ = ["Stats", "Capabilities", "Exchange", "CommunicatorBase", "wait_for", "launch_next_phases",
           "POLL_SLEEP_S", "UNCROWDED_LONGEST_SLEEP_S", "longest_sleep", "default_engine"]

_usable_cores = usable_cores


def default_engine():
    """Horovod's engine (engine/horovod.py): what a communicator runs on unless it is given
    another (imported when first needed, so a torch.distributed job never loads Horovod)."""
    from ..engine.horovod import horovod_engine
    return horovod_engine()


def wait_for(handle, engine=None):
    """engine.synchronize(handle), but waiting by sleeping between polls instead of spinning
    (Engine.wait, engine/base.py, says why); Horovod's engine unless another is given."""
    return (engine or default_engine()).wait(handle)


def launch_next_phases(communicator, exchanges):
    """Wait until no exchange is still in phase 1, calling communicator.progress(ex) on each as
    soon as its phase 1 completes; sleeps between polls as wait_for does (the sleeps count as
    communicate_s).

    Why not finish bucket by bucket: finish(bucket 0) would wait for its phase 2 before bucket
    1's phase 2 is even launched, though bucket 1's phase 1 may have completed long before;
    the link would idle between the phases of consecutive buckets.
    """
    if communicator.engine.matches_by_order:
        # torch.distributed pairs collectives by the order they are issued, not by name: the
        # later phases are launched in the exchanges' order, the same on every rank
        for ex in exchanges:
            if ex.phase == 1:
                communicator.progress(ex, wait=True)
        return
    pending = [ex for ex in exchanges if ex.phase == 1]
    sleeps = communicator.engine.poll_sleeps()
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
    ops = (AVERAGE, SUM)
    fusion_threshold_bytes = 0
    scale_block = None

    def __init__(self, compression, op=AVERAGE, engine=None):
        self.engine = engine or default_engine()
        parsed = self.engine.parse_op(op)
        if parsed not in self.ops:
            raise ValueError(f"{self.describe_method(compression)} supports "
                             f"op={' or '.join(map(str, self.ops))} (hvd.Average, hvd.Sum), "
                             f"got {op!r}; use hvd.DistributedOptimizer for Adasum")
        self.compression, self.op, self.stats = compression, parsed, Stats()

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
        return Bucket.plan(names, tensors, self.fusion_threshold_bytes,
                           flat=self.capabilities.fuses, prefix=prefix)

    def drop(self, exchange):
        """Wait for an abandoned exchange; its result and its own error are dropped."""
        try:
            wait_for(exchange.handle, self.engine)
        except Exception:
            pass

    def progress(self, exchange, wait=False):
        """Move a multi-phase exchange on if its current phase is done (wait=True: once it
        is); never blocks otherwise."""

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
