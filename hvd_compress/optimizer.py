"""DistributedOptimizer: a drop-in for `hvd.DistributedOptimizer` that routes every gradient
through the right collective for its compressor, with stock Horovod (no rebuild).

    opt = hvd_compress.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            compression=hvd_compress.Compression.bit8,
                                            model=model)
    loss.backward(); opt.step()

The Horovod front: this module keeps Horovod's life cycle (a hook per parameter, buckets
fixed at construction, step()); what every front shares is its FrontCore (front/core.py). Why
a step goes as it does:
- A hook on every parameter (`register_post_accumulate_grad_hook`) fires when its gradient
  is final; when a bucket's last gradient is in, the bucket is filled (one op), compressed
  and launched at once, while backward goes on.
- A float32 parameter's `.grad` becomes its view of the bucket, as DDP's
  gradient_as_bucket_view: nothing is copied back, and a gradient zeroed in place is
  accumulated straight into the bucket (keep no reference to a `.grad` across steps).
- Buckets are cut once, last layer first, alike on every rank; collectives carry the bucket's
  name, which is how Horovod matches them, so arrival order never changes a result. `none` and
  `fp16` go through Horovod's own allreduce_async_: bit for bit hvd.DistributedOptimizer.
- Ranks that disagree on the setup fail at construction, naming the difference.
- With model=, step() returns at once and each bucket's update waits for the next forward
  (overlap.py), with the waiting schedule's bits; any read outside a forward sees every update.
"""
import os
import time
import warnings
from contextlib import contextmanager

import torch

from .codecs import SCALE_BLOCK
from .compression import Compression
from .exchange.fusion import Filling
from .front.core import FrontAPI, FrontCore, named_params
from .overlap import Pending, group_settings, overlap_gate

__all__ = ["DistributedOptimizer"]

# The optimizer's own counters beside the communicator's (pop_stats says what they measure).
OWN_STATS = ("step_interval_s", "forward_wait_s", "update_s")


class _DistributedOptimizer(torch.optim.Optimizer, FrontAPI):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 route, error_feedback, fusion_threshold_bytes, scale_block, sparse_as_dense,
                 schedule, model, prioritise):
        self._pending = None
        super(self.__class__, self).__init__(params)
        self._params = named_params(self.param_groups, named_parameters)
        self.core = FrontCore("hvd_compress.DistributedOptimizer", compression, route, op,
                              fusion_threshold_bytes, scale_block, error_feedback)
        self._communicator = self.core.communicator       # the hot path's
        self._failure = None                     # an error raised in a gradient hook
        self.backward_passes_per_step, self.op = backward_passes_per_step, op
        self.sparse_as_dense = sparse_as_dense
        self._synchronized, self._should_synchronize = False, True
        order = self._params[::-1]               # last layer first: backward's order
        planned = self.core.plan(order)
        self._buckets = [bucket for _, bucket in planned]
        self._members = [[order[i] for i in group] for group, _ in planned]
        self._filling = Filling(self._buckets, {order[i][1]: (b, j) for b, (group, _)
                                                in enumerate(planned) for j, i in enumerate(group)})
        self._reset_step()
        # Elastic workers must not run a collective outside hvd.elastic.run's sync point (a
        # worker that joins later would wait alone): there the check is skipped.
        if os.environ.get("HOROVOD_ELASTIC") != "1":
            self.core.agree(dict(self.core.setup(),
                                 backward_passes_per_step=backward_passes_per_step,
                                 parameters=[(n, tuple(p.shape)) for n, p in self._params]))
        self._step_returned = None               # when step() last returned (step_s)
        self._own_stats = dict.fromkeys(OWN_STATS, 0.0)
        self._pending = Pending(self, self.core, [[p for _, p in m] for m in self._members],
                                super(self.__class__, self).step,
                                super(self.__class__, self).zero_grad, self._own_stats)
        self._hooks = _take_hooks(self)
        self._gate = overlap_gate(type(self), schedule, model, self._pending)
        self.schedule = "wait" if self._gate is None else "overlap"
        if self._gate is not None and prioritise:
            self._communicator.prioritise(self._buckets)    # the front layers' buckets first

    def _reset_step(self):
        self._passes_left = {p: self.backward_passes_per_step for _, p in self._params}
        self._filling.reset()
        self.core.next_step()                    # its exchanges by bucket index, its times

    # ---- during backward ----------------------------------------------------------------
    def _on_gradient(self, p):
        """Gradient hook: p.grad is final for this pass. On the last pass before step(), put it
        in its bucket; launch the bucket when it is full."""
        if not self._should_synchronize or p not in self._passes_left:
            return
        self._passes_left[p] -= 1
        if self._passes_left[p] > 0:
            return
        if self._passes_left[p] < 0:
            raise AssertionError(
                "gradients were computed more than backward_passes_per_step times before "
                "step(); raise backward_passes_per_step to accumulate more passes")
        self._pending.flush()                    # a parameter whose module's forward did not run
        if p.grad is None or p.grad.is_sparse:   # left for synchronize(), which handles both
            return
        start = time.perf_counter()
        self.core.hooked()
        self._put(p, p.grad)
        for exchange in self.core.step.exchanges.values():
            self.core.progress(exchange)
        self._communicator.stats.add("in_backward_s", time.perf_counter() - start)

    def _put(self, p, grad):
        """Note p's gradient; when its bucket is complete, fill it (one op) and launch it."""
        with self._communicator.stats.timing("copy_s"):
            b = self._filling.put(p, grad)
        if b is None:
            return
        try:
            self.core.start(self._buckets[b], key=b)
        except BaseException as err:             # kept for synchronize(), then raised here
            self._failure = err
            raise

    # ---- at step() ------------------------------------------------------------------------
    def synchronize(self):
        """Finish the exchange of every gradient and write the reduced ones into `p.grad`. An
        error (in a gradient hook, or here) is raised, the real one, once what is in flight has
        been waited for; the step is dropped and the optimizer is ready for the next."""
        self._pending.flush()
        if self._failure is not None:
            err, self._failure = self._failure, None
            self._abandon_step()
            err.add_note("hvd_compress: raised in a gradient hook during backward; this step's "
                         "exchange was abandoned and the optimizer is ready for the next one")
            raise err
        try:
            self._launch_the_rest()
            exchanges = self.core.step.exchanges
            self.core.advance(list(exchanges.values()))
            for b, bucket in enumerate(self._buckets):
                self.core.finish(exchanges[b])
                self.core.write_grads(bucket, [p for _, p in self._members[b]])
        except BaseException:
            self._abandon_step()
            raise
        step = self.core.step
        self._reset_step()
        self._synchronized = True
        self.core.end_step(step)                 # a step boundary every rank reaches alike

    def _launch_the_rest(self):
        """backward is over: launch what it left (no gradient, a sparse one, an early step())."""
        self.core.backward_ended(self.core.step.exchanges.values())
        for name, p in self._params:
            if p not in self._filling.arrived:
                self._put(p, self._final_grad(name, p))

    def _abandon_step(self):
        """Wait for what is in flight (results dropped), forget the step: the next starts afresh."""
        for exchange in self.core.step.exchanges.values():
            self.core.drop(exchange)
        self._reset_step()
        self._synchronized, self._failure = False, None

    def _final_grad(self, name, p):
        if p.grad is None:
            # Another rank may have a gradient for it (dynamic graphs): send zeros, as Horovod does.
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            if not self.sparse_as_dense:
                raise ValueError(f"parameter {name!r} has a sparse gradient: pass "
                                 "sparse_as_dense=True to exchange it densely (compressed), or "
                                 "use hvd.DistributedOptimizer for sparse allreduce")
            p.grad = p.grad.to_dense()
        return p.grad

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
        try:
            return self._step(closure)
        finally:
            # step to step, return to return: the waits of a step (in step() under "wait", in
            # the next forward under "overlap") fall in the same interval as its compute
            now = time.perf_counter()
            if self._step_returned is not None:
                self._own_stats["step_interval_s"] += now - self._step_returned
            self._step_returned = now

    def _step(self, closure):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): gradients are exchanged twice.")
            elif self.schedule == "overlap" and closure is None:
                return self._step_overlap()
            elif self.schedule == "overlap" and not getattr(self, "_said_closure", False):
                self._said_closure = True
                warnings.warn("schedule='overlap': a step with a closure needs the whole "
                              "gradient at once; such steps wait for every bucket", stacklevel=3)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def _step_overlap(self):
        """Launch what backward left and return: Pending applies each bucket when it is needed."""
        self._pending.flush()
        if self._failure is not None:
            self.synchronize()                   # raises it, as the waiting schedule does
        try:
            self._launch_the_rest()
        except BaseException:
            self._abandon_step()
            raise
        self._pending.begin(self.core.step, group_settings(self.param_groups))
        self._reset_step()
        self._synchronized = False

    def flush(self):
        """Apply every pending update now: before a read the guard cannot see (overlap.py)."""
        self._pending.flush()

    def zero_grad(self, set_to_none=True):
        """As the wrapped optimizer's; a pending update's gradients are zeroed once it is applied."""
        if not self._pending:
            return super(self.__class__, self).zero_grad(set_to_none)
        self._pending.zero_grad(set_to_none)

    def state_dict(self):
        self._settle()
        return super(self.__class__, self).state_dict()

    def load_state_dict(self, state_dict):
        self._settle()
        return super(self.__class__, self).load_state_dict(state_dict)

    def pop_stats(self, link_bits_per_s=None):
        """The counters since the previous call (roles.Stats), the codec_path and, from a
        second step() on (step_s: step() return to return), the bound (FrontCore.pop_stats);
        under "overlap" forward_wait_s (the forward pre-hooks) and update_s too."""
        own = dict(self._own_stats)
        self._own_stats.update(dict.fromkeys(OWN_STATS, 0.0))
        stats = self.core.pop_stats(own["step_interval_s"], link_bits_per_s)
        if self.schedule == "overlap":
            stats.update(forward_wait_s=own["forward_wait_s"], update_s=own["update_s"])
        return stats

    def close(self):
        """Remove this optimizer's gradient hooks (step() still exchanges every gradient, at
        synchronize(), without overlapping backward). Also `with hc.DistributedOptimizer(...)`."""
        self._settle()
        if self._gate is not None:
            self._gate.remove()
            self._gate, self.schedule = None, "wait"
            self.core.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _settle(self):
        if self._pending is not None:            # None while torch's __init__ runs
            self._pending.flush()

    def _forget_step(self):
        self._pending.abandon()
        self._reset_step()
        self._synchronized = False


def _take_hooks(optimizer):
    """Hook every parameter; one that carries another optimizer's hook (its own hook table
    says so) hands it over: that one is closed, so two sets never fire under the same names."""
    hooks = _DistributedOptimizer._on_gradient
    previous = {id(h.__self__): h.__self__ for _, p in optimizer._params
                for h in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()
                if getattr(h, "__func__", None) is hooks and h.__self__ is not optimizer}
    for owner in previous.values():
        warnings.warn("these parameters were already wrapped by another "
                      "hvd_compress.DistributedOptimizer: its gradient hooks are removed (it "
                      "was closed); call close() on an optimizer you replace", stacklevel=4)
        owner.close()
    return [p.register_post_accumulate_grad_hook(optimizer._on_gradient)
            for _, p in optimizer._params]


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=None, route=None,
                         error_feedback=None, fusion_threshold_bytes=None,
                         sparse_as_dense=False, scale_block=SCALE_BLOCK, schedule=None,
                         model=None, prioritise=True):
    """Wrap `optimizer` so that `step()` first averages (or sums) gradients across ranks.

    compression: Compression.none | .fp16 (Horovod's allreduce) | .bit16 | .bit8 | .int8 |
        .onebit | .bf16 | .topk(ratio) | .powersgd(rank) (their own error feedback) | .auto
        (a scheme and route per bucket, measured or pinned by plan=; docs/planner.md).
    op: hvd.Average (None) or hvd.Sum. route: None (the scheme's default, registry.SCHEMES)
        or "allgather" | "alltoall" where the scheme lists both.
    error_feedback: carry each rank's quantisation error to the next step (packet schemes);
        None: the method's default, on for onebit only.
    fusion_threshold_bytes: float32 bytes per bucket (0: no fusion; None:
        exchange.bucketing.DEFAULT_FUSION_BYTES). scale_block: values per power-of-two scale
        (None: one per tensor, no fusion: the course's per-tensor packets, bit for bit).
    backward_passes_per_step: that many backward passes accumulate locally (summed, as in
        Horovod) and are exchanged once, after the last.
    model: the torch.nn.Module of these parameters: with it, schedule None is "overlap"
        (step() returns at once, each bucket's update waits for the next forward that needs
        it; docs/performance.md) where the update is elementwise (overlap.ELEMENTWISE), else
        "wait". schedule: None, "wait" (step() waits for every bucket, then updates) or
        "overlap" (needs model=; says so when it falls back to "wait").
    prioritise: under "overlap", send what the next forward needs first (a large late bucket
        in chunks behind the front buckets, exchange/sender.py); False: every bucket whole.
    """
    from .engine.horovod import hvd     # here, not above: `import hvd_compress` needs no Horovod
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("hvd_compress.DistributedOptimizer supports op=hvd.Average or hvd.Sum; "
                         "use hvd.DistributedOptimizer for Adasum")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if schedule not in (None, "wait", "overlap"):
        raise ValueError(f"schedule must be 'wait', 'overlap' or None, got {schedule!r}")
    if model is not None and not isinstance(model, torch.nn.Module) or \
            schedule == "overlap" and model is None:
        raise ValueError("schedule='overlap' needs model=, the torch.nn.Module whose parameters "
                         f"these are (its forward waits per layer), got {type(model).__name__}")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, FrontAPI),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, int(backward_passes_per_step),
               op, route, error_feedback, fusion_threshold_bytes, scale_block, sparse_as_dense,
               schedule, model, prioritise)
