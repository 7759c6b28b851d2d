"""The frame of the communicators that send each gradient on its own, by a method that is not a
codec of values: top-k's sparse pairs (methods/topk.py), PowerSGD's factors (methods/powersgd.py). No fusion
(what is sent depends on each tensor's size or shape), their own error feedback (on by default:
both methods need it to converge), and state a checkpoint must keep."""

from ..engine.base import AVERAGE
from ..exchange.base import Capabilities, CommunicatorBase, Exchange
from ..exchange.fusion import Bucket
from ..exchange.memory import ResidualMemory

__all__ = ["TensorwiseCommunicator", "check_device"]

# Devices the per-tensor methods run on (their codecs are plain torch ops).
DEVICES = ("cpu", "cuda")


def check_device(method, tensor):
    """A clear error for a gradient on a device the method does not run on."""
    if tensor.device.type not in DEVICES:
        raise ValueError(f"{method} runs on {' or '.join(DEVICES)} gradients, got one on "
                         f"{tensor.device}")


class TensorwiseCommunicator(CommunicatorBase):
    """start(bucket) / progress(step) / finish(step) per tensor; subclasses say how."""
    capabilities = Capabilities(own_memory=True, per_tensor=True)

    def __init__(self, method, op=AVERAGE, engine=None):
        super().__init__(method, op, engine)
        self.memory = ResidualMemory() if method.error_feedback else None

    def plan(self, names, tensors, prefix=""):
        return Bucket.plan(names, tensors, 0, flat=False, prefix=prefix)

    def progress(self, step, wait=False):
        """Move a multi-phase exchange on; one-phase methods have nothing to do."""

    def _memory(self, memory):
        return memory if memory is not None else self.memory

    def state_dict(self):
        """The error-feedback residuals (subclasses add their own state)."""
        return {"residuals": self.memory.state_dict() if self.memory is not None else {}}

    def load_state_dict(self, state):
        if self.memory is not None:
            self.memory.load_state_dict(state["residuals"])

    def reset_state(self):
        if self.memory is not None:
            self.memory.load_state_dict({})
