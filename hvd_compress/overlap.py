"""schedule="overlap": each bucket's parameters are updated as soon as the bucket is reduced,
and the next forward waits per layer for its own parameters, not for the whole step (issue 46).

Why: with the waiting schedule `step()` waits for every bucket before any parameter moves, and
the next forward starts only after that, although its first layers need only their own small
buckets; the wire idles while the next forward waits. Here `step()` returns at once; a forward
pre-hook on each module finishes the buckets that hold that module's own parameters and applies
their update (the wrapped optimizer's own rule, over its param_groups restricted to those
parameters, with the hyperparameters the groups had at step(): the same arithmetic, only later,
so the parameters are bit-identical to the waiting schedule's).

This module holds what does not depend on the exchange: which optimizers can be stepped a
bucket at a time, the restricted step, and the hooks on the model (DistributedOptimizer in
optimizer.py drives them).
"""
import torch

__all__ = ["ELEMENTWISE", "why_not_overlap", "group_settings", "step_subset",
           "zero_grad_subset", "ForwardGate"]

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


class ForwardGate:
    """Hooks on a model: before a module's forward, `before(params)` with the module's own
    parameters (not its children's: they have hooks of their own); before any module's
    state_dict(), `flush()`, so that a checkpoint or a broadcast sees every update."""

    def __init__(self, model, before, flush):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"schedule='overlap' needs model=, the torch.nn.Module the "
                             f"parameters belong to (its forward waits per layer), got "
                             f"{type(model).__name__}")
        self.handles = []
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False)]
            if own:
                self.handles.append(module.register_forward_pre_hook(
                    lambda _module, _inputs, own=own: before(own)))
            self.handles.append(module.register_state_dict_pre_hook(
                lambda *_: flush()))

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
