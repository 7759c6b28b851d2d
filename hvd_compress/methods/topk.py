"""Top-K sparsification: each rank sends only the k = ceil(ratio * numel) largest |g| of a
gradient, as (index, value) pairs; what it did not send waits in its residual (error feedback,
as Deep Gradient Compression does: Lin et al., ICLR 2018, https://arxiv.org/abs/1712.01887).

Per tensor and step, on every rank:

    g += e                          error feedback (on by default)
    S = the k largest |g|           ties at the k-th magnitude: lowest indices first; NaN counts
                                    as the largest (a diverging run stays visible)
    message = [int32 indices of S, ascending | float32 g[S]]      8k bytes
    allgather the messages (every rank's k is the same: it depends on numel only)
    result = sum over ranks, in rank order, of the scattered values, / n (average)
    e = g with S zeroed             exactly what was not sent

Sparse results cannot be summed by allreduce (each rank picks other indices), hence the
allgather: (n-1) 8k bytes per rank and tensor, against 2(n-1)/n 4 numel for float32 allreduce,
so at ratio 0.01 about 1/50 of the bytes on 2 ranks and 3/100 on 4.
"""
import math

import torch

from ..engine.base import AVERAGE
from ..exchange.base import Capabilities, Exchange
from ..registry import Route, topk_count
from .tensorwise import TensorwiseCommunicator, check_device

__all__ = ["TopK", "TopKCommunicator", "select", "scatter_sum"]


class TopK:
    """The method and its ratio, as a value `Compression.topk(ratio)` returns."""
    name = "topk"

    def __init__(self, ratio=0.01, error_feedback=True):
        if not 0 < float(ratio) <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio!r}")
        self.ratio, self.error_feedback = float(ratio), bool(error_feedback)

    def k(self, numel):
        """How many values of a tensor of `numel` are sent: ceil(ratio * numel), at least 1."""
        return topk_count(numel, self.ratio)

    def communicator(self, op=AVERAGE, engine=None):
        """Top-k carries its own collective (an allgather of pairs), declared here."""
        return TopKCommunicator(self, op=op, engine=engine)

    def __repr__(self):
        return f"TopK(ratio={self.ratio})"

    def __eq__(self, other):
        return isinstance(other, TopK) and (self.ratio, self.error_feedback) == (other.ratio, other.error_feedback)

    def __hash__(self):
        return hash((TopK, self.ratio, self.error_feedback))


def select(flat, k):
    """Ascending indices of the k largest |flat| (NaN largest; ties at the k-th magnitude broken
    by lowest index), as int64. Linear time: the k-th magnitude, then everything above it and
    the first of those equal to it."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device)
    mag = flat.abs().nan_to_num(nan=math.inf)
    kth = torch.kthvalue(mag, flat.numel() - k + 1).values
    above = (mag > kth).nonzero().view(-1)
    tied = (mag == kth).nonzero().view(-1)[:k - above.numel()]
    return torch.cat([above, tied]).sort().values


def scatter_sum(indices, values, numel, device=None):
    """sum over rows r, in order, of a dense vector holding values[r] at indices[r] (rows of a
    tensor or a list of them; on the values' device)."""
    if device is None:
        device = values.device if isinstance(values, torch.Tensor) else \
            (values[0].device if len(values) else "cpu")
    out = torch.zeros(numel, dtype=torch.float32, device=device)
    for idx, val in zip(indices, values):
        out.index_add_(0, idx.long(), val)
    return out


class TopKCommunicator(TensorwiseCommunicator):
    """Every gradient's top-k pairs by one allgather, summed sparsely in rank order."""
    route = Route.ALLGATHER
    capabilities = Capabilities(own_memory=True, per_tensor=True, one_phase=True)

    def describe(self):
        return f"topk{self.compression.ratio:g}/allgather"

    def start(self, bucket, memory=None):
        memory = self._memory(memory)
        with self.stats.timing("compress_s"):
            check_device("top-k", bucket.tensor)
            flat = bucket.tensor.detach().to(torch.float32).reshape(-1)
            if memory is not None:
                flat = memory.compensate(bucket.name, flat)
            k = self.compression.k(flat.numel())
            idx = select(flat, k)
            message = torch.empty(2 * k, dtype=torch.int32, device=flat.device)
            message[:k] = idx.to(torch.int32)
            message[k:].view(torch.float32).copy_(flat[idx])
            if memory is not None:
                kept = torch.zeros_like(flat)
                kept[idx] = flat[idx]
                memory.remember(bucket.name, flat, kept)
        handle = self.engine.allgather_async(message, self._tag(bucket.name))
        self.stats.add("bytes_sent", (self.engine.size() - 1) * 8 * k)
        return Exchange(bucket, handle, ctx=k, memory=memory)

    def finish(self, step):
        bucket, n, k = step.bucket, self.engine.size(), step.ctx
        with self.stats.timing("communicate_s"):
            rows = self.engine.wait(step.handle).view(n, 2 * k)
        with self.stats.timing("decompress_s"):
            grad = bucket.tensor
            out = scatter_sum(rows[:, :k], rows[:, k:].contiguous().view(torch.float32), grad.numel())
            if self.op == AVERAGE and n > 1:
                out.div_(n)
            bucket.tensor = out.view(grad.shape).to(grad.dtype)
