"""DistributedOptimizer: a drop-in for `hvd.DistributedOptimizer` that routes every gradient
through the right collective for its compressor, with stock Horovod (no rebuild).

    opt = hvd_compress.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            compression=hvd_compress.Compression.bit8)
    loss.backward(); opt.step()

Differences from Horovod's, and why:
- The exchange starts in `step()` / `synchronize()`, not in per-gradient hooks while
  backward runs. This gives one fixed order of tensors on every rank (needed for buckets and
  the two-phase reduction) and clean timings of compress / communicate / decompress per step,
  which the course measures. What it costs: no overlap of backward with communication.
- With `Compression.none` or `.fp16` the gradients go through the same `allreduce_async_` calls
  as Horovod's optimizer, so results are bit-identical to `hvd.DistributedOptimizer`.
- At world size 1 the compressor still runs (a serial bit8 run shows the quantisation's effect).
- Ranks that disagree on the compressor, the route or the parameters fail at construction,
  on every rank, with a message naming the difference, instead of hanging in a collective.
"""
import warnings
from contextlib import contextmanager

import torch
import horovod.torch as hvd

from .communicators import make_communicator
from .compressors import Compression, compressor_name
from .memory import ResidualMemory

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 reduction, error_feedback, fusion_threshold_bytes, sparse_as_dense):
        super(self.__class__, self).__init__(params)
        self._params = _ordered_named_params(self.param_groups, named_parameters)
        self._compression = compression
        self._communicator = make_communicator(compression, reduction, op, fusion_threshold_bytes)
        if error_feedback and self._communicator.reduction == "allreduce":
            raise ValueError("error_feedback needs an 8/16-bit packet compressor "
                             "(Compression.bit8 or .bit16), not "
                             f"{compressor_name(compression)}")
        self._memory = ResidualMemory() if error_feedback else None
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.sparse_as_dense = sparse_as_dense
        self._synchronized = False
        self._should_synchronize = True
        _check_ranks_agree(self._describe_setup())

    def _describe_setup(self):
        return {"compression": compressor_name(self._compression),
                "reduction": self._communicator.reduction,
                "op": str(self.op),
                "error_feedback": self._memory is not None,
                "fusion_threshold_bytes": self._communicator.fusion_threshold_bytes,
                "parameters": [(name, tuple(p.shape)) for name, p in self._params]}

    def synchronize(self):
        """Exchange all gradients now and write the reduced ones into `p.grad`."""
        grads, names = [], []
        for name, p in self._params:
            if p.grad is None:
                # Another rank may have a gradient for it (dynamic graphs): send zeros, as Horovod does.
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                if not self.sparse_as_dense:
                    raise ValueError(f"parameter {name!r} has a sparse gradient: pass "
                                     "sparse_as_dense=True to exchange it densely (compressed), or "
                                     "use hvd.DistributedOptimizer for sparse allreduce")
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
            names.append(name)
        reduced = self._communicator.reduce(grads, names, memory=self._memory)
        for (name, p), r in zip(self._params, reduced):
            if r is not p.grad:
                p.grad.copy_(r)
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit `synchronize()` (e.g. to clip gradients) so `step()` does not
        exchange them again."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): gradients are exchanged twice.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def pop_stats(self):
        """{compress_s, communicate_s, decompress_s, bytes_sent} since the previous call."""
        return self._communicator.pop_stats()

    @property
    def communicator(self):
        return self._communicator


def _ordered_named_params(param_groups, named_parameters):
    """(name, parameter) for every parameter that needs a gradient, in param-group order,
    which is the same on every rank for the same model code."""
    group_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        names = {id(p): f"param.{i}" for i, p in enumerate(group_params)}
    else:
        named = list(named_parameters)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                             "usually produced by model.named_parameters()")
        seen = set()
        dups = {n for n, _ in named if n in seen or seen.add(n)}
        if dups:
            raise ValueError(f"parameter names must be unique; duplicates: {sorted(dups)}")
        names = {id(p): n for n, p in named}
        unnamed = [i for i, p in enumerate(group_params) if id(p) not in names]
        if unnamed:
            raise ValueError(f"named_parameters does not name {len(unnamed)} of the optimizer's "
                             "parameters")
    return [(names[id(p)], p) for p in group_params if p.requires_grad]


def _check_ranks_agree(setup):
    """Raise on every rank if any rank's setup differs from rank 0's."""
    if hvd.size() == 1:
        return
    setups = hvd.allgather_object(setup)
    for rank, other in enumerate(setups):
        if other != setups[0]:
            diff = sorted(k for k in setup if other.get(k) != setups[0].get(k))
            detail = "; ".join(f"{k}: rank 0 has {_short(setups[0][k])}, rank {rank} has {_short(other[k])}"
                               for k in diff)
            raise RuntimeError(f"hvd_compress.DistributedOptimizer: ranks disagree ({detail})")


def _short(value, limit=200):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=hvd.Average, reduction=None,
                         error_feedback=False, fusion_threshold_bytes=None,
                         sparse_as_dense=False):
    """Wrap `optimizer` so that `step()` first averages (or sums) gradients across ranks.

    compression: Compression.none | .fp16 (Horovod's, by allreduce) | .bit16 | .bit8.
    reduction: None (the compressor's default: allreduce for none/fp16, allgather for bit8 and
        bit16) or "allgather" | "alltoall" (two-phase) for bit8/bit16.
    error_feedback: carry each rank's quantisation error to the next step (bit8/bit16).
    fusion_threshold_bytes: bucket size in float32 bytes for the packet routes (0: no fusion).
    backward_passes_per_step: gradients of that many backward passes accumulate locally and are
        exchanged once, at step() (as in Horovod: summed, not averaged, over passes).
    """
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("hvd_compress.DistributedOptimizer supports op=hvd.Average or hvd.Sum; "
                         "use hvd.DistributedOptimizer for Adasum")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, int(backward_passes_per_step),
               op, reduction, error_feedback, fusion_threshold_bytes, sparse_as_dense)
