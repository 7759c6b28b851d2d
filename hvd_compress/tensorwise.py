"""The frame of the communicators that send each gradient on its own, by a method that is not a
codec of values: top-k's sparse pairs (topk.py), PowerSGD's factors (powersgd.py). No fusion
(what is sent depends on each tensor's size or shape), their own error feedback (on by default:
both methods need it to converge), and state a checkpoint must keep."""
import time

import horovod.torch as hvd

from .communicators import Stats
from .fusion import Bucket
from .memory import ResidualMemory
from .roles import Communicator

__all__ = ["TensorwiseCommunicator", "Step"]


class Step:
    """One tensor's exchange in flight: its collective's handle, phase, and what the method
    keeps between phases (ctx)."""
    __slots__ = ("bucket", "handle", "phase", "launched", "ctx", "memory")

    def __init__(self, bucket, handle, memory, phase=1, ctx=None):
        self.bucket, self.handle, self.memory, self.phase, self.ctx = bucket, handle, memory, phase, ctx
        self.launched = time.perf_counter()


class TensorwiseCommunicator(Communicator):
    """start(bucket) / progress(step) / finish(step) per tensor; subclasses say how."""
    fuses = False
    fusion_threshold_bytes = 0
    scale_block = None
    ops = (hvd.Average, hvd.Sum)

    def __init__(self, method, op=hvd.Average):
        if op not in self.ops:
            raise ValueError(f"{method.name} supports op={' or '.join(map(str, self.ops))}, got {op!r}")
        self.compression, self.op, self.stats = method, op, Stats()
        self.memory = ResidualMemory() if method.error_feedback else None

    @property
    def reduction(self):
        return self.route.value

    def pop_stats(self):
        return self.stats.pop()

    def plan(self, names, tensors, prefix=""):
        return Bucket.plan(names, tensors, 0, flat=False, prefix=prefix)

    def progress(self, step, wait=False):
        """Move a multi-phase exchange on; one-phase methods have nothing to do."""

    def _memory(self, memory):
        return memory if memory is not None else self.memory

    def reduce(self, tensors, names, memory=None):
        """Exchange `tensors` now; the reduced tensors in the same order."""
        steps = []
        for group, bucket in self.plan(names, tensors):
            bucket.put(0, tensors[group[0]])
            steps.append(self.start(bucket, memory))
        self.advance(steps)
        for step in steps:
            self.finish(step)
        return [step.bucket.tensor for step in steps]

    def state_dict(self):
        """The error-feedback residuals (subclasses add their own state)."""
        return {"residuals": self.memory.state_dict() if self.memory is not None else {}}

    def load_state_dict(self, state):
        if self.memory is not None:
            self.memory.load_state_dict(state["residuals"])
