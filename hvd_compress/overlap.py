"""schedule="overlap": each bucket's parameters are updated as soon as the bucket is reduced,
and the next forward waits per layer for its own parameters, not for the whole step. The
default wherever the optimizer is given the model (model=).

Why: with the waiting schedule `step()` waits for every bucket before any parameter moves, and
the next forward starts only after that, although its first layers need only their own small
buckets; the wire idles while the next forward waits. Here `step()` returns at once; a forward
pre-hook on each module finishes the buckets that hold that module's own parameters and applies
their update (the wrapped optimizer's own rule, over its param_groups restricted to those
parameters, with the hyperparameters the groups had at step(): the same arithmetic, only later,
so the parameters are bit-identical to the waiting schedule's).

Every read outside a forward sees every update. Between step() and the next forward a
TorchFunctionMode watches the torch functions called (ReadGuard): one that touches a parameter
still waiting for its update (p.data, p.grad, p.clone(), a norm, torch.save or deepcopy of
the model, an evaluation that reads a weight by hand) first applies every pending update. Inside
the model's forward the guard stands aside (each module's pre-hook applies its own parameters),
and when the model's forward returns, what it did not use is applied too. A module's
state_dict() and the optimizer's state_dict(), load_state_dict(), zero_grad(), synchronize(),
close() and the next backward apply them as well. What the guard cannot see: a read from
another thread, or from C++ that reaches the memory without a torch function (call the
optimizer's flush() before it).

This module holds what does not depend on the exchange: which optimizers can be stepped a
bucket at a time, the restricted step, the pending updates of a step (Pending, driven by the
optimizer through its front core), and the hooks on the model (ForwardGate, ReadGuard).
"""
import time
import warnings

import torch
from torch.overrides import (TorchFunctionMode, _get_current_function_mode_stack, _pop_mode,
                             _push_mode)
from torch.utils._device import DeviceContext

__all__ = ["ELEMENTWISE", "why_not_overlap", "overlap_gate", "group_settings", "step_subset",
           "zero_grad_subset", "Pending", "ForwardGate", "ReadGuard"]

# Optimizers whose update of a parameter reads only that parameter, its gradient, its own
# state and its group's settings: stepping them a few parameters at a time gives the bits of
# one step over all (their CPU default is a loop over parameters; the foreach and fused kernels
# are elementwise too). Anything else needs the whole gradient at once, or may.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad)


def why_not_overlap(optimizer_class):
    """None where `optimizer_class` can be stepped a bucket at a time, else why not. The class
    whose step() it runs must be one of ELEMENTWISE itself: a subclass that overrides step (a
    trust ratio over all parameters, say) is not known to be elementwise."""
    owner = next((klass for klass in optimizer_class.__mro__
                  if not klass.__module__.startswith("hvd_compress") and "step" in vars(klass)),
                 None)
    if owner in ELEMENTWISE:
        return None
    name = owner.__name__ if owner is not None else optimizer_class.__name__
    return (f"{name}.step is not among the updates known to read each parameter's own "
            f"gradient alone ({', '.join(c.__name__ for c in ELEMENTWISE)})")


def overlap_gate(optimizer_class, schedule, model, pending):
    """The ForwardGate of the overlapped schedule where it can be had, else None (the waiting
    schedule): schedule None overlaps wherever `model` is given and the update is elementwise,
    "overlap" says with a warning when it falls back, "wait" never overlaps."""
    if schedule == "wait" or model is None:
        return None
    why = why_not_overlap(optimizer_class)
    if why is not None:
        if schedule == "overlap":
            warnings.warn(f"schedule='overlap' falls back to 'wait': {why}", stacklevel=5)
        return None
    return ForwardGate(model, pending)


def group_settings(param_groups):
    """Each group's hyperparameters now (a copy without its parameters): an update applied
    later uses these, not what a learning-rate schedule set meanwhile."""
    return [{k: v for k, v in group.items() if k != "params"} for group in param_groups]


def _restricted(param_groups, params, settings=None):
    """param_groups with only `params` in them (empty groups left out), each with `settings`."""
    mine = {id(p) for p in params}
    views = []
    for i, group in enumerate(param_groups):
        kept = [p for p in group["params"] if id(p) in mine]
        if kept:
            views.append(dict(settings[i] if settings is not None else group, params=kept))
    return views


def step_subset(optimizer, step, params, settings):
    """Run `step()` (the wrapped optimizer's own) on `params` alone, with `settings`."""
    saved = optimizer.param_groups
    optimizer.param_groups = _restricted(saved, params, settings)
    try:
        step()
    finally:
        optimizer.param_groups = saved


def zero_grad_subset(optimizer, zero_grad, params, set_to_none):
    """The wrapped optimizer's zero_grad on `params` alone."""
    saved = optimizer.param_groups
    optimizer.param_groups = _restricted(saved, params)
    try:
        zero_grad(set_to_none)
    finally:
        optimizer.param_groups = saved


class Pending:
    """The exchanges of the last step whose updates are not applied yet, and their applying:
    finish through the front core, write the reduced gradients back, run the wrapped
    optimizer's step on those parameters with the settings of step() time, zero them if
    zero_grad() came meanwhile; after the last, the core's end of the step.

    optimizer: the wrapped optimizer (its param_groups); core: its FrontCore; members:
    bucket index -> its parameters; step, zero_grad: the wrapped optimizer's own; stats: the
    optimizer's own counters (forward_wait_s, update_s)."""

    def __init__(self, optimizer, core, members, step, zero_grad, stats):
        self.optimizer, self.core, self.members = optimizer, core, members
        self._step, self._zero_grad, self.stats = step, zero_grad, stats
        self.exchanges = {}          # bucket index -> Exchange not applied yet
        self.of = {}                 # id(parameter) -> its pending bucket
        self.storages = {}           # a pending parameter's memory (data_ptr) -> its bucket
        self._step_info = None       # (settings of step() time, the step's StepRecord)
        self._zero = None            # a zero_grad(set_to_none) deferred to them
        self.gate = None             # the ForwardGate that applies them, if any

    def __bool__(self):
        return bool(self.exchanges)

    def begin(self, step, settings):
        """step() returned: the exchanges of `step` (a StepRecord, by bucket index) wait for
        their updates, with the groups' `settings` of now."""
        self.exchanges = dict(sorted(step.exchanges.items()))
        self.of = {id(p): b for b in self.exchanges for p in self.members[b]}
        self._step_info = (settings, step)
        self.progress()
        if self.exchanges and self.gate is not None:
            self.storages = {_storage(p): b for b in self.exchanges for p in self.members[b]}
            self.storages.pop(None, None)
            self.gate.guard.watch()

    def progress(self):
        for exchange in self.exchanges.values():
            self.core.progress(exchange)

    def before_forward(self, params):
        """A module's forward pre-hook: apply the buckets that hold its own parameters."""
        if not self.exchanges:
            return
        wanted = sorted({self.of[id(p)] for p in params if id(p) in self.of})
        if not wanted:
            return
        start = time.perf_counter()
        self.progress()
        for b in wanted:
            self.apply(b, start)
        self.stats["forward_wait_s"] += time.perf_counter() - start

    def flush(self):
        """Apply every pending update now."""
        if not self.exchanges:
            return
        start = time.perf_counter()
        self.core.advance(list(self.exchanges.values()))
        for b in list(self.exchanges):
            self.apply(b, start)

    def apply(self, b, needed_at):
        """Finish bucket b's exchange and update its parameters. needed_at: when the forward
        (or a flush) asked for it; Compression.auto times the next forward's pace from it."""
        guard = self.gate.guard if self.gate is not None else None
        if guard is not None:                    # its own reads of the parameters
            guard.quiet += 1
        try:
            self._apply(b, needed_at)
        finally:
            if guard is not None:
                guard.quiet -= 1

    def _apply(self, b, needed_at):
        began = time.perf_counter()
        exchange = self.exchanges.pop(b)
        params = self.members[b]
        try:
            self.core.finish(exchange)
        except BaseException as err:
            self.abandon()
            err.add_note("hvd_compress: schedule='overlap' abandoned this step's pending "
                         "updates; the optimizer is ready for the next step")
            raise
        self.core.write_grads(exchange.bucket, params)
        start = time.perf_counter()
        self.core.communicator.record_apply(b, needed_at, start - began)   # not the update
        step_subset(self.optimizer, self._step, params, self._step_info[0])
        self.stats["update_s"] += time.perf_counter() - start
        for p in params:
            del self.of[id(p)]
            self.storages.pop(_storage(p), None)
        if self._zero is not None:
            zero_grad_subset(self.optimizer, self._zero_grad, params, self._zero)
        if not self.exchanges:
            step = self._step_info[1]
            self._step_info = self._zero = None
            self._unwatch()
            self.core.end_step(step)

    def zero_grad(self, set_to_none):
        """zero_grad() while updates are pending: the gradients a pending update still reads
        are zeroed once it is applied, the others now."""
        self._zero = set_to_none
        done = [p for group in self.optimizer.param_groups for p in group["params"]
                if id(p) not in self.of]
        zero_grad_subset(self.optimizer, self._zero_grad, done, set_to_none)

    def abandon(self):
        """Wait for the pending exchanges (their results dropped) and forget them."""
        for exchange in self.exchanges.values():
            self.core.drop(exchange)
        self.exchanges, self.of, self.storages = {}, {}, {}
        self._step_info = self._zero = None
        self._unwatch()

    def _unwatch(self):
        if self.gate is not None:
            self.gate.guard.unwatch()


class ReadGuard(TorchFunctionMode):
    """While watching (between step() and the next forward), any torch function that touches
    a pending parameter, or a tensor that shares its memory, applies every pending update
    first. It sits low on torch's stack of function modes (just above a default device's
    DeviceContext, which must stay at the bottom), so that a mode the user enters and leaves
    meanwhile pops itself, not the guard; unwatch() takes it out from wherever it is.
    `quiet` counts the optimizer's own work on the parameters, which it lets through."""

    def __init__(self, pending):
        super().__init__()
        self.pending = pending       # its `of` and `storages`: what is still pending
        self.active = False
        self.quiet = 0

    def watch(self):
        """Watch reads of the pending parameters (and of tensors that share their memory)."""
        if not self.active:
            above = [_pop_mode() for _ in _get_current_function_mode_stack()]
            low = [m for m in above[-1:] if isinstance(m, DeviceContext)]
            for mode in low + [self] + [m for m in reversed(above) if m not in low]:
                _push_mode(mode)
            self.active = True

    def unwatch(self):
        if self.active:
            self.active = False
            above = []
            for _ in _get_current_function_mode_stack():
                mode = _pop_mode()
                if mode is self:
                    break
                above.append(mode)
            for mode in reversed(above):
                _push_mode(mode)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and not self.quiet and self._touches(args, kwargs):
            self.pending.flush()
        return func(*args, **kwargs)

    def _touches(self, args, kwargs):
        of, storages = self.pending.of, self.pending.storages
        for value in (*args, *kwargs.values()):
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(t, torch.Tensor) and (id(t) in of or _storage(t) in storages):
                    return True
        return False


def _storage(tensor):
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):      # a tensor without storage (meta, fake)
        return None


class ForwardGate:
    """Hooks on a model for Pending: before a module's forward, its own parameters' pending
    updates (not its children's: they have hooks of their own); before any module's
    state_dict(), every pending update; around the model's own forward, the ReadGuard stands
    aside, and what the forward did not use is applied when it returns."""

    def __init__(self, model, pending):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"schedule='overlap' needs model=, the torch.nn.Module the "
                             f"parameters belong to (its forward waits per layer), got "
                             f"{type(model).__name__}")
        self.pending = pending
        self.guard = ReadGuard(pending)
        flush = _ModuleHook(lambda *_: pending.flush())
        self.handles = [model.register_forward_pre_hook(
                            _ModuleHook(lambda *_: self.guard.unwatch()), prepend=True),
                        model.register_forward_hook(flush)]
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False)]
            if own:
                self.handles.append(module.register_forward_pre_hook(_ModuleHook(
                    lambda _module, _inputs, own=own: pending.before_forward(own))))
            self.handles.append(module.register_state_dict_pre_hook(flush))
        pending.gate = self

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.guard.unwatch()
        self.pending.gate = None


class _ModuleHook:
    """A hook the gate puts on a module. A copy of the module (torch.save(model),
    copy.deepcopy) carries an inert one instead: the copy's parameters are not this
    optimizer's, and the optimizer (its engine, its threads) is not to be pickled."""
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args) if self.fn is not None else None

    def __reduce__(self):
        return (_ModuleHook, (None,))

    def __deepcopy__(self, memo):
        return _ModuleHook(None)
