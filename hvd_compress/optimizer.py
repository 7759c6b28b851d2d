"""DistributedOptimizer: a drop-in for `hvd.DistributedOptimizer` that routes every gradient
through the right collective for its compressor, with stock Horovod (no rebuild).

    opt = hvd_compress.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            compression=hvd_compress.Compression.bit8)
    loss.backward(); opt.step()

How a step goes, and why:
- Overlap, as Horovod's and DDP's do: a hook on every parameter fires when its gradient has
  been accumulated (`Tensor.register_post_accumulate_grad_hook`); when a bucket's last
  gradient is in, they are copied into it (one op) and it is compressed and its collective
  launched at once, while backward goes on computing earlier layers. `step()` only waits for
  what is still in flight.
- Gradients as views of their bucket, as DDP's `gradient_as_bucket_view`
  (https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html):
  after `step()` a float32 parameter's `.grad` IS its slice of the bucket, so the reduced
  gradient is never copied back; zeroed in place (`zero_grad(set_to_none=False)`), the next
  backward accumulates straight into the bucket and nothing is copied in either. Keep no
  reference to a `.grad` across steps: the bucket is reused.
- Buckets are fixed at construction from the parameter order, last layer first (the order
  backward produces gradients), the same on every rank; collectives carry the bucket's name,
  which is how Horovod matches them across ranks, so arrival order never changes a result.
- With `Compression.none` or `.fp16` each gradient goes through the same `allreduce_async_`
  call as in Horovod's optimizer, so results are bit-identical to `hvd.DistributedOptimizer`.
- At world size 1 the compressor still runs (a serial bit8 run shows the quantisation's effect).
- Ranks that disagree on the compressor, the route or the parameters fail at construction,
  on every rank, with a message naming the difference, instead of hanging in a collective.
- schedule="overlap" (overlap.py says why): `step()` returns without waiting; each bucket's
  parameters are updated when it is reduced, at the latest in the forward pre-hook of a module
  that holds one of them, with the hyperparameters of step() time: the bits of the waiting
  schedule. Whatever reads the parameters or the optimizer's state outside a forward first
  sees every update applied: state_dict() (the model's and the optimizer's), load_state_dict(),
  synchronize(), zero_grad() (deferred per bucket), close(), the next backward; `flush()` for
  a read of your own.
"""
import os
import time
import warnings
import weakref
from contextlib import contextmanager

import torch
import horovod.torch as hvd

from .codecs import SCALE_BLOCK
from .compression import Compression
from .compressors import compressor_name
from .exchange.base import wait_for
from .exchange.memory import ResidualMemory
from .exchange.routes import make_communicator
from .overlap import ForwardGate, group_settings, step_subset, why_not_overlap, zero_grad_subset

__all__ = ["DistributedOptimizer"]


SCHEDULES = ("wait", "overlap")
# The optimizer's own counters beside the communicator's (pop_stats says what they measure).
OWN_STATS = ("step_interval_s", "forward_wait_s", "update_s")


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 route, error_feedback, fusion_threshold_bytes, scale_block, sparse_as_dense,
                 schedule="wait", model=None):
        self._pending = {}                       # overlap: bucket index -> Exchange not applied
        super(self.__class__, self).__init__(params)
        self._params = _ordered_named_params(self.param_groups, named_parameters)
        self._compression = compression
        self._communicator = make_communicator(compression, route, op,
                                               fusion_threshold_bytes, scale_block)
        # What the communicator can do is declared (roles.Communicator): the packet routes take
        # the optimizer's memory; top-k and PowerSGD keep their own residuals (on by default:
        # TopK/PowerSGD's error_feedback). None is the method's own default (on for onebit).
        comm = self._communicator
        if error_feedback is None:
            error_feedback = bool(getattr(compression, "error_feedback", False)) and comm.takes_memory
        if error_feedback and not (comm.takes_memory or comm.own_memory):
            raise ValueError("error_feedback needs a packet compressor "
                             "(Compression.bit8, .bit16, .int8 or .onebit), not "
                             f"{compressor_name(compression)}")
        self._memory = ResidualMemory() if error_feedback and comm.takes_memory else None
        self._failure = None                     # an error raised in a gradient hook
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.sparse_as_dense = sparse_as_dense
        self._synchronized = False
        self._should_synchronize = True
        # Last layer first: the order in which backward produces gradients.
        order = self._params[::-1]
        planned = self._communicator.plan([n for n, _ in order], [p for _, p in order])
        self._buckets = [bucket for _, bucket in planned]
        self._members = [[order[i] for i in group] for group, _ in planned]
        self._slot = {}
        for b, (group, _) in enumerate(planned):
            for j, i in enumerate(group):
                self._slot[order[i][1]] = (b, j)
        self._reset_step()
        # Elastic workers must not run a collective outside hvd.elastic.run's sync point (a
        # worker that joins later would wait alone): there the check is skipped.
        if os.environ.get("HOROVOD_ELASTIC") != "1":
            _check_ranks_agree(self._describe_setup())
        self._hooks = []
        _take_hooks(self)
        self._pending_of = {}                    # id(parameter) -> its pending bucket
        self._pending_step = None                # settings and times of the step they belong to
        self._zero_pending = None                # a zero_grad(set_to_none) deferred to them
        self._step_returned = None               # when step() last returned (step_s)
        self._own_stats = dict.fromkeys(OWN_STATS, 0.0)
        self._gate = None
        self.schedule = self._choose_schedule(schedule, model)

    def _choose_schedule(self, schedule, model):
        """'overlap' where it can be had, else 'wait', said once (a warning)."""
        if schedule == "wait":
            return schedule
        why = why_not_overlap(type(self))
        if why is not None:
            warnings.warn(f"schedule='overlap' falls back to 'wait': {why}", stacklevel=4)
            return "wait"
        self._gate = ForwardGate(model, self._before_forward, self.flush)
        prioritise = getattr(self._communicator, "prioritise", None)
        if prioritise is not None and os.environ.get("HVD_COMPRESS_PRIORITY", "1") != "0":
            prioritise(self._buckets)            # the front layers' buckets first on the wire
        return schedule

    def _describe_setup(self):
        route = self._communicator.route
        return {"compression": compressor_name(self._compression),
                # a compression with settings of its own (Compression.auto) shows them in its repr
                "options": repr(self._compression)
                if callable(getattr(self._compression, "options", None)) else None,
                "route": route.value if route is not None else self._communicator.describe(),
                "op": str(self.op),
                "error_feedback": self._memory is not None,
                "fusion_threshold_bytes": self._communicator.fusion_threshold_bytes,
                "scale_block": self._communicator.scale_block,
                "backward_passes_per_step": self.backward_passes_per_step,
                "parameters": [(name, tuple(p.shape)) for name, p in self._params]}

    def _reset_step(self):
        self._passes_left = {p: self.backward_passes_per_step for _, p in self._params}
        self._missing = [len(bucket) for bucket in self._buckets]
        self._waiting = [[] for _ in self._buckets]     # (member, gradient) not yet in the bucket
        self._arrived = set()                    # parameters already in their bucket
        self._in_flight = {}                     # bucket index -> Exchange
        self._first_launch = self._last_launch = None   # this step's first and last launch
        self._first_hook = None                  # this step's first gradient hook (last pass)

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
        if self._pending:                        # a parameter whose module's forward did not run
            self.flush()
        if p.grad is None or p.grad.is_sparse:   # left for synchronize(), which handles both
            return
        start = time.perf_counter()
        if self._first_hook is None:
            self._first_hook = start
        self._put(p, p.grad)
        self._progress()
        self._communicator.stats.add("in_backward_s", time.perf_counter() - start)

    def _put(self, p, grad):
        """Note p's gradient; when its bucket is complete, copy them all in (one op) and launch."""
        b, j = self._slot[p]
        self._arrived.add(p)
        self._waiting[b].append((j, grad))
        self._missing[b] -= 1
        if self._missing[b] == 0:
            start = time.perf_counter()
            self._buckets[b].put_all(self._waiting[b])
            self._last_launch = time.perf_counter()
            self._communicator.stats.add("copy_s", self._last_launch - start)
            if self._first_launch is None:
                self._first_launch = self._last_launch
            try:
                self._in_flight[b] = self._communicator.start(self._buckets[b], self._memory)
            except BaseException as err:         # kept for synchronize(), then raised here
                self._failure = err
                raise

    def _progress(self):
        for exchange in self._in_flight.values():
            self._communicator.progress(exchange)

    # ---- at step() ------------------------------------------------------------------------
    def synchronize(self):
        """Finish the exchange of every gradient and write the reduced ones into `p.grad`.

        If a bucket failed to start in a gradient hook, or an exchange fails here, the error
        is raised (the real one) after what is still in flight has been waited for, and the
        optimizer is ready for the next step; this step's gradients are not exchanged."""
        self.flush()
        if self._failure is not None:
            err, self._failure = self._failure, None
            self._abandon_step()
            err.add_note("hvd_compress: raised in a gradient hook during backward; this step's "
                         "exchange was abandoned and the optimizer is ready for the next one")
            raise err
        try:
            self._synchronize()
        except BaseException:
            self._abandon_step()
            raise

    def _abandon_step(self):
        """Wait for the collectives still in flight (their results are dropped) and forget the
        step, so that the next backward starts afresh."""
        for exchange in self._in_flight.values():
            self._drop(exchange)
        self._reset_step()
        self._synchronized = False

    def _drop(self, exchange):
        """Wait for an abandoned exchange; its result and its own error are dropped (the caller
        raises the first)."""
        drop = getattr(self._communicator, "drop", None)
        if drop is not None:
            return drop(exchange)
        try:
            wait_for(exchange.handle)
        except Exception:
            pass

    def _synchronize(self):
        now = backward_end = time.perf_counter()
        stats = self._communicator.stats
        stats.add("overlap_s", sum(now - ex.launched for ex in self._in_flight.values()))
        for name, p in self._params:
            if p not in self._arrived:           # no gradient, a sparse one, or an early step()
                self._put(p, self._final_grad(name, p))
        self._communicator.advance(list(self._in_flight.values()))
        for b, bucket in enumerate(self._buckets):
            self._communicator.finish(self._in_flight[b])
            with stats.timing("copy_s"):
                for j, (name, p) in enumerate(self._members[b]):
                    view = bucket.grad_view(j)
                    if view is not None:         # the reduced gradient, where it already is
                        if p.grad is not view:
                            p.grad = view
                        continue
                    result = bucket.result(j)
                    if result is not p.grad:
                        p.grad.copy_(result)
        if self._first_launch is not None:
            stats.add("exchange_s", time.perf_counter() - self._first_launch)
            stats.add("launch_span_s", self._last_launch - self._first_launch)
        first_hook = self._first_hook
        self._reset_step()
        self._synchronized = True
        # a step boundary every rank reaches at the same count (Compression.auto plans here)
        self._communicator.end_step(first_hook, backward_end)

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
                              "gradient at once; such steps wait for every bucket", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    # ---- schedule="overlap" ---------------------------------------------------------------
    def _step_overlap(self):
        """Launch what backward left, note the step's settings and return: each bucket is
        applied when it is reduced (_apply), at the latest when a forward needs it."""
        self.flush()
        if self._failure is not None:
            self.synchronize()                   # raises it, as the waiting schedule does
        now = time.perf_counter()
        stats = self._communicator.stats
        stats.add("overlap_s", sum(now - ex.launched for ex in self._in_flight.values()))
        try:
            for name, p in self._params:
                if p not in self._arrived:       # no gradient, a sparse one, or an early step()
                    self._put(p, self._final_grad(name, p))
        except BaseException:
            self._abandon_step()
            raise
        self._pending = dict(sorted(self._in_flight.items()))
        self._pending_of = {id(p): b for b in self._pending for _, p in self._members[b]}
        self._pending_step = (group_settings(self.param_groups), self._first_hook, now,
                              self._first_launch, self._last_launch)
        self._reset_step()
        self._synchronized = False
        self._progress_pending()
        return None

    def _progress_pending(self):
        for exchange in self._pending.values():
            self._communicator.progress(exchange)

    def _before_forward(self, params):
        """A module's forward pre-hook: apply the buckets that hold its own parameters."""
        if not self._pending:
            return
        wanted = sorted({self._pending_of[id(p)] for p in params if id(p) in self._pending_of})
        if not wanted:
            return
        start = time.perf_counter()
        self._progress_pending()
        for b in wanted:
            self._apply(b, start)
        self._own_stats["forward_wait_s"] += time.perf_counter() - start

    def flush(self):
        """Apply every pending update now (schedule="overlap"; nothing otherwise): call it
        before reading parameters outside a forward by means that have no hook (p.data, a
        norm of your own). state_dict(), synchronize(), zero_grad() and the next backward
        call it, or apply what they need, themselves."""
        if not self._pending:
            return
        start = time.perf_counter()
        self._communicator.advance(list(self._pending.values()))
        for b in list(self._pending):
            self._apply(b, start)

    def _apply(self, b, needed_at):
        """Finish bucket b's exchange, put the reduced gradients in .grad, update its
        parameters (the step's settings), zero their gradients if zero_grad() asked.
        needed_at: when the forward (or a flush) asked for it; Compression.auto times the next
        forward's pace from it (record_apply)."""
        began = time.perf_counter()
        exchange = self._pending.pop(b)
        members = [p for _, p in self._members[b]]
        try:
            self._communicator.finish(exchange)
        except BaseException as err:
            self._abandon_pending()
            err.add_note("hvd_compress: schedule='overlap' abandoned this step's pending "
                         "updates; the optimizer is ready for the next step")
            raise
        bucket, stats = self._buckets[b], self._communicator.stats
        with stats.timing("copy_s"):
            for j, p in enumerate(members):
                view = bucket.grad_view(j)
                if view is not None:
                    if p.grad is not view:
                        p.grad = view
                    continue
                result = bucket.result(j)
                if p.grad is None:
                    p.grad = result.clone()
                elif result is not p.grad:
                    p.grad.copy_(result)
        settings = self._pending_step[0]
        start = time.perf_counter()
        record_apply = getattr(self._communicator, "record_apply", None)
        if record_apply is not None:             # the wait, decode and copy: not the update
            record_apply(b, needed_at, start - began)
        step_subset(self, super(self.__class__, self).step, members, settings)
        self._own_stats["update_s"] += time.perf_counter() - start
        for p in members:
            del self._pending_of[id(p)]
        if self._zero_pending is not None:
            zero_grad_subset(self, super(self.__class__, self).zero_grad, members,
                             self._zero_pending)
        if not self._pending:
            self._end_overlapped_step()

    def _end_overlapped_step(self):
        _, first_hook, backward_end, first_launch, last_launch = self._pending_step
        stats = self._communicator.stats
        if first_launch is not None:
            stats.add("exchange_s", time.perf_counter() - first_launch)
            stats.add("launch_span_s", last_launch - first_launch)
        self._pending_step = self._zero_pending = None
        self._communicator.end_step(first_hook, backward_end)

    def _abandon_pending(self):
        """Wait for the pending exchanges (their results dropped) and forget them."""
        for exchange in self._pending.values():
            self._drop(exchange)
        self._pending, self._pending_of = {}, {}
        self._pending_step = self._zero_pending = None

    def zero_grad(self, set_to_none=True):
        """As the wrapped optimizer's; under schedule="overlap" a pending bucket's gradients
        (which its update still reads) are zeroed once it is applied."""
        if not getattr(self, "_pending", None):
            return super(self.__class__, self).zero_grad(set_to_none)
        self._zero_pending = set_to_none
        done = [p for group in self.param_groups for p in group["params"]
                if id(p) not in self._pending_of]
        zero_grad_subset(self, super(self.__class__, self).zero_grad, done, set_to_none)

    def state_dict(self):
        self.flush()
        return super(self.__class__, self).state_dict()

    def load_state_dict(self, state_dict):
        self.flush()
        return super(self.__class__, self).load_state_dict(state_dict)

    def pop_stats(self, link_bits_per_s=None):
        """The counters since the previous call (roles.Stats says what each measures):
        copy_s, compress_s, communicate_s, decompress_s, bytes_sent, overlap_s, in_backward_s,
        exchange_s, launch_span_s, and the codec_path. exchange_s is what the cost model
        predicts (first launch to last reduced gradient, overlapped with backward or not);
        copy_s, compress_s and decompress_s include work done in gradient hooks during
        backward, which in_backward_s measures (subtract it from a timing of backward).

        How far the step is from what the machine and the link allow (issue 46), from a
        second step() on: step_s, the time between step()'s returns since the last pop;
        compute_s, the job's own work in it (step_s less the time it waited for the exchange,
        communicate_s, in step() or in a forward: the compute floor); with the link's rate
        (`link_bits_per_s`, e.g. 1e8 for 100 Mbit/s), wire_s (bytes_sent at that rate),
        bound_s = max(compute_s, wire_s) and step_over_bound. Under schedule="overlap" also
        forward_wait_s (the forward pre-hooks: waits, decodes and updates) and update_s (the
        wrapped optimizer's updates)."""
        stats = self._communicator.pop_stats()
        own, self._own_stats = self._own_stats, dict.fromkeys(OWN_STATS, 0.0)
        if own["step_interval_s"] > 0:
            stats["step_s"] = own["step_interval_s"]
            stats["compute_s"] = own["step_interval_s"] - stats.get("communicate_s", 0.0)
            if link_bits_per_s:
                stats["wire_s"] = 8 * stats.get("bytes_sent", 0) / float(link_bits_per_s)
                stats["bound_s"] = max(stats["compute_s"], stats["wire_s"])
                stats["step_over_bound"] = stats["step_s"] / stats["bound_s"]
        if self.schedule == "overlap":
            stats.update(forward_wait_s=own["forward_wait_s"], update_s=own["update_s"])
        return stats

    def plan_report(self):
        """Compression.auto: the plan (a label per bucket), its predicted and measured step,
        what it was chosen from, the calibration's cost and the events (auto.records.PlanReport;
        its to_dict() is JSON-able); None for a fixed scheme."""
        return self._communicator.plan_report()

    def pause_step_clock(self):
        """Compression.auto: the job did other work since its last step (an evaluation, a
        checkpoint): the next step's time is left out of what the plan is judged on. Call it on
        every rank alike; nothing for a fixed scheme."""
        self._communicator.pause_step_clock()

    @property
    def communicator(self):
        return self._communicator

    def close(self):
        """Remove this optimizer's gradient hooks (step() still exchanges every gradient, at
        synchronize(), without overlapping backward). Also `with hc.DistributedOptimizer(...)`."""
        self.flush()
        if self._gate is not None:
            self._gate.remove()
            self._gate = None
            self.schedule = "wait"
            if callable(getattr(self._communicator, "close", None)):
                self._communicator.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for _, p in self._params:
            if _owner(p) is self:
                del _OWNERS[id(p)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def compression_state_dict(self):
        """This rank's own compression state: error-feedback residuals, PowerSGD's Q. It differs
        from rank to rank, so a checkpoint keeps one per rank (labs/kit/recorder.py does)."""
        state = {"residuals": self._memory.state_dict() if self._memory is not None else {}}
        own = self._communicator.state_dict()
        if own is not None:
            state["communicator"] = own
        return state

    def reset_compression_state(self):
        """Forget residuals and PowerSGD's Q, and any exchange of an unfinished step: what
        elastic training does when the ranks change (labs/elastic.py says why)."""
        if self._memory is not None:
            self._memory.load_state_dict({})
        self._abandon_pending()
        self._communicator.reset_state()
        self._reset_step()
        self._synchronized = False

    def load_compression_state_dict(self, state):
        if self._memory is not None:
            self._memory.load_state_dict(state["residuals"])
        if "communicator" in state:
            self._communicator.load_state_dict(state["communicator"])


# id(parameter) -> (weak reference to it, to the optimizer whose hooks it carries). Not an
# attribute of the parameter: a pickled or deep-copied model must not carry it.
_OWNERS = {}


def _owner(p):
    """The optimizer whose hooks parameter p carries, if any."""
    param, owner = _OWNERS.get(id(p), (lambda: None, lambda: None))
    return owner() if param() is p else None


def _take_hooks(optimizer):
    """Hook every parameter of `optimizer`. Wrapping parameters again hands them to the new
    optimizer: the previous one is closed, so two sets of hooks never fire under the same names."""
    previous = {id(owner): owner for _, p in optimizer._params
                for owner in [_owner(p)] if owner is not None and owner is not optimizer}
    for owner in previous.values():
        warnings.warn("these parameters were already wrapped by another "
                      "hvd_compress.DistributedOptimizer: its gradient hooks are removed (it "
                      "was closed); call close() on an optimizer you replace", stacklevel=4)
        owner.close()
    for key in [k for k, (param, _) in _OWNERS.items() if param() is None]:
        del _OWNERS[key]                         # parameters that are gone
    for _, p in optimizer._params:
        optimizer._hooks.append(p.register_post_accumulate_grad_hook(optimizer._on_gradient))
        _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(optimizer))


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
                         backward_passes_per_step=1, op=hvd.Average, route=None,
                         error_feedback=None, fusion_threshold_bytes=None,
                         sparse_as_dense=False, scale_block=SCALE_BLOCK, schedule="wait",
                         model=None):
    """Wrap `optimizer` so that `step()` first averages (or sums) gradients across ranks.

    compression: Compression.none | .fp16 (Horovod's, by allreduce) | .bit16 | .bit8 | .int8 |
        .onebit | .topk(ratio) | .powersgd(rank) (these two carry their own error feedback, on
        by default) | .auto or .auto(options): a scheme and route per bucket, planned from
        what the job measures (docs/planner.md); pop_stats() then adds plan, plan_predicted_s,
        plan_measured_s and plan_event, and plan_report() says how the plan was chosen.
    route: None (the scheme's default, registry.SCHEMES: allreduce for none/fp16, allgather for
        bit8, int8 and onebit, two-phase "alltoall" for bit16) or "allgather" | "alltoall" for
        the packet schemes that list both (registry.SCHEMES).
    error_feedback: carry each rank's quantisation error to the next step (the packet
        compressors); None: the method's default, on for onebit only.
    fusion_threshold_bytes: bucket size in float32 bytes for the packet routes (0: no fusion;
        default exchange.bucketing.DEFAULT_FUSION_BYTES).
    scale_block: values per power-of-two scale in a bucket (default codecs.SCALE_BLOCK); None:
        one scale per tensor and no fusion, the course's per-tensor packets, bit for bit.
    backward_passes_per_step: gradients of that many backward passes accumulate locally and are
        exchanged once, after the last (as in Horovod: summed, not averaged, over passes).
    schedule: "wait" (step() waits for every bucket, then updates) or "overlap" (step()
        returns at once; each bucket's parameters are updated when it is reduced, and a
        module's forward waits for its own: docs/performance.md); "overlap" needs `model`, and
        falls back to "wait", with a warning, for an optimizer not known to update each
        parameter from its own gradient alone (overlap.ELEMENTWISE). Compression.auto then
        plans at the step boundary after every update of the step is applied, and prices the
        overlapped step (docs/planner.md).
    """
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("hvd_compress.DistributedOptimizer supports op=hvd.Average or hvd.Sum; "
                         "use hvd.DistributedOptimizer for Adasum")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "overlap" and not isinstance(model, torch.nn.Module):
        raise ValueError("schedule='overlap' needs model=, the torch.nn.Module whose parameters "
                         f"these are (its forward waits per layer), got {type(model).__name__}")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, int(backward_passes_per_step),
               op, route, error_feedback, fusion_threshold_bytes, scale_block, sparse_as_dense,
               schedule, model)
