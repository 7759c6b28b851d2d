"""Run under horovodrun (tests/workers/suite.py, or alone): DistributedOptimizer's
schedule="overlap" (hvd_compress/overlap.py) on real ranks.

- For every registered scheme (each route it lists) and SGD with momentum, and for Adam and
  AdamW on a few, with a learning-rate schedule stepped between steps: the parameters after
  several steps are bit-identical to schedule="wait"'s, and so is the optimizer's state.
- step() returns before any parameter moves (the buckets are pending), and the next forward
  applies them; model.state_dict() and optimizer.state_dict() see every update first; a
  zero_grad() with pending updates (set_to_none either way) zeroes them after their update.
- The fallbacks: an optimizer whose step is not known to be elementwise, and a step with a
  closure, wait for every bucket, say so once, and give the waiting schedule's bits.
- Compression.auto runs overlapped: a pinned mixed plan gives the waiting schedule's bits;
  left to itself it plans (alike on every rank) at a step boundary after every update, on
  the overlapped schedule's timeline (the next forward's needs measured).
Priority on the wire (a large bucket in chunks) is tests/workers/overlap_priority.py's.
The model is the exchange checks' (a layer only rank 0 uses on odd steps: a module whose
forward does not run on a rank has its update applied at the next backward), with buckets small
enough that it has several.
"""
import copy
import io
import math
import warnings

import torch

import checks
from checks import check

import hvd_compress as hc
from hvd_compress import registry
from hvd_compress.auto.records import Decision
import exchange_checks
from exchange_checks import Model

STEPS = 4
FUSION = 600                 # bytes: this model's 5 tensors in 3-4 buckets


def compressions():
    """(label, compression, route) for every registered scheme at each of its routes."""
    for entry in registry.schemes().values():
        compression = entry.load()
        if entry.parameter is not None:
            compression = compression(entry.parameter)
        for route in entry.routes:
            yield f"{entry.name}.{route.value}", compression, route.value


def train(schedule, compression, route, make=None, zero_none=True, closure=False,
          peek=None, steps=STEPS):
    """(parameters, optimizer state) after `steps` steps, the schedule stepped each step."""
    torch.manual_seed(0)
    model = Model()
    base = (make or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)))(model.parameters())
    extra = {"model": model} if schedule == "overlap" else {}
    opt = hc.DistributedOptimizer(base, model.named_parameters(), compression=compression,
                                  route=route, fusion_threshold_bytes=FUSION, schedule=schedule,
                                  **extra)
    if hasattr(compression, "reseed"):   # int8's rounding stream from its start (after the
        compression.reseed()             # codec's warm-up, which the first optimizer runs)
    lr = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    exchange_checks.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(exchange_checks.RANK)
    for step in range(steps):
        opt.zero_grad(set_to_none=zero_none)
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 4, (32,), generator=g)

        def loss():
            return torch.nn.functional.cross_entropy(model(x, step), y)
        loss().backward()
        if peek is not None:
            peek("before", step, model, opt)
        if closure:
            opt.step(lambda: loss())
        else:
            opt.step()
        if peek is not None:
            peek("after", step, model, opt)
        lr.step()
    params = torch.cat([v.reshape(-1) for v in model.state_dict().values()])
    state = opt.state_dict()["state"]
    flat = [t.reshape(-1).float() for k in sorted(state) for _, t in sorted(state[k].items())
            if isinstance(t, torch.Tensor)]          # by index: entries are made in another order
    opt.close()
    return params, torch.cat(flat) if flat else torch.zeros(0)


def train_auto(schedule, labels=None, steps=STEPS, warmup=3):
    """(parameters, optimizer state, plan report) after `steps` steps of Compression.auto:
    with `labels` a plan pinned from the start (a label per bucket, as a checkpoint restores
    it), else the job's own warm-up, calibration and plan."""
    torch.manual_seed(0)
    model = Model()
    extra = {"model": model} if schedule == "overlap" else {}
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(),
                                  compression=hc.Compression.auto(warmup_steps=warmup,
                                                                  trial_steps=0),
                                  fusion_threshold_bytes=FUSION, schedule=schedule, **extra)
    if labels is not None:
        layout = [[b.name, b.bytes] for b in opt.plan_report().buckets]
        pinned = Decision(tuple(labels[i % len(labels)] for i in range(len(layout))), 1.0)
        opt.load_compression_state_dict({"residuals": {}, "communicator": {"auto_plan": {
            "buckets": layout, "decision": pinned.to_dict()}}})
    exchange_checks.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(exchange_checks.RANK)
    for step in range(steps):
        opt.zero_grad()
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 4, (32,), generator=g)
        torch.nn.functional.cross_entropy(model(x, step), y).backward()
        opt.step()
    params = torch.cat([v.reshape(-1) for v in model.state_dict().values()])
    state = opt.state_dict()["state"]
    flat = [t.reshape(-1).float() for k in sorted(state) for _, t in sorted(state[k].items())
            if isinstance(t, torch.Tensor)]
    report = opt.plan_report()
    opt.close()
    return params, torch.cat(flat) if flat else torch.zeros(0), report


# Reads outside a forward, by the means a user has, each right after step() (one a step, the
# buckets pending): what they read -> a tensor to compare with the waiting schedule's.
READS = {
    "parameters_cloned": lambda model, opt: torch.cat([p.clone().reshape(-1)
                                                       for p in model.parameters()]),
    "data": lambda model, opt: torch.cat([p.data.reshape(-1) for p in model.parameters()]),
    "grad": lambda model, opt: torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                          if p.grad is not None]),
    "norm": lambda model, opt: torch.stack([p.norm() for p in model.parameters()]),
    "deepcopy": lambda model, opt: torch.cat([p.reshape(-1) for p in
                                              copy.deepcopy(model).parameters()]),
    "torch_save": lambda model, opt: torch.cat([p.reshape(-1) for p in _saved(model)]),
    "by_hand": lambda model, opt: torch.nn.functional.linear(torch.ones(1, 20), model.a.weight,
                                                             model.a.bias),
    "eval_forward": lambda model, opt: _evaluated(model),
    "inside_a_mode": lambda model, opt: _in_a_mode(model),
}


def _saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False).parameters()


def _evaluated(model):
    model.eval()
    with torch.no_grad():
        out = model(torch.ones(3, 20), 0)
    model.train()
    return out


def _in_a_mode(model):
    with torch.device("cpu"):                # a mode entered after step(), left before the forward
        return torch.cat([p.clone().reshape(-1) for p in model.parameters()])


def reads_see_every_update():
    """Each read of READS right after step() sees every update of that step, as under the
    waiting schedule, whatever the buckets still pending; the parameters end as the wait's."""
    wanted, got, pending = {}, {}, {}

    def read(table, check_pending=False):
        def peek(phase, step, model, opt):
            if phase != "after":
                return
            name = list(READS)[step % len(READS)]
            if check_pending:
                pending[name] = len(opt._pending.exchanges)
            table.setdefault(name, []).append(READS[name](model, opt).detach().clone())
        return peek
    steps = 2 * len(READS)
    waited = train("wait", hc.Compression.bit8, "allgather", peek=read(wanted), steps=steps)
    overlapped = train("overlap", hc.Compression.bit8, "allgather", peek=read(got, True),
                       steps=steps)
    for name in READS:
        check(f"overlap.reads.{name}.sees_every_update",
              pending[name] > 0 and all(map(torch.equal, wanted[name], got[name])),
              f"pending {pending[name]}, max diff "
              f"{max((a - b).abs().max().item() for a, b in zip(wanted[name], got[name]))}")
    same("overlap.reads.bit_identical_to_wait", waited, overlapped)


def same(label, a, b):
    check(label, torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]),
          f"parameters max diff {(a[0] - b[0]).abs().max()}, state equal {torch.equal(a[1], b[1])}")


def run(hvd):
    exchange_checks.N, exchange_checks.RANK = hvd.size(), hvd.rank()
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    for label, comp, route in compressions():
        same(f"overlap.{label}.sgd.bit_identical_to_wait",
             train("wait", comp, route), train("overlap", comp, route))
        if label in ("none.allreduce", "bit8.allgather", "bit16.alltoall"):
            for name, make in (("adam", adam), ("adamw", adamw)):
                same(f"overlap.{label}.{name}.bit_identical_to_wait",
                     train("wait", comp, route, make), train("overlap", comp, route, make))
            same(f"overlap.{label}.zero_grad_in_place.bit_identical_to_wait",
                 train("wait", comp, route, zero_none=False),
                 train("overlap", comp, route, zero_none=False))

    # step() returns before any update; the next forward applies them; state_dict() flushes
    seen = {}

    def peek(phase, step, model, opt):
        if step != 1:
            return
        if phase == "before":
            seen["before"] = [p.detach().clone() for p in model.parameters()]
            return
        seen["pending"] = len(opt._pending.exchanges)
        with torch._C.DisableTorchFunction():    # a look the read guard does not see
            seen["moved_after_step"] = any(not torch.equal(a, p) for a, p in
                                           zip(seen.pop("before"), model.parameters()))
        x = torch.randn(2, 20)
        model.a(x)                           # a forward of one module applies its buckets only
        seen["a_applied"] = not any(id(p) in opt._pending.of for p in model.a.parameters())
        seen["b_still_pending"] = any(id(p) in opt._pending.of for p in model.b.parameters())
        model.state_dict()                   # ... and a state_dict() applies every one
        seen["flushed_by_state_dict"] = not opt._pending
    same("overlap.applied_early_bit_identical_to_wait",
         train("overlap", hc.Compression.bit8, "allgather", peek=peek),
         train("wait", hc.Compression.bit8, "allgather"))
    check("overlap.step_returns_with_buckets_pending", seen["pending"] >= 2, str(seen))
    check("overlap.step_moves_no_parameter", not seen["moved_after_step"], str(seen))
    check("overlap.forward_applies_its_own_buckets_only",
          seen["a_applied"] and seen["b_still_pending"], str(seen))
    check("overlap.state_dict_applies_every_update", seen["flushed_by_state_dict"], str(seen))

    reads_see_every_update()

    # the bound as a number: pop_stats gives the step, its compute floor and, with the link's
    # rate, the wire time of its bytes and step / max(floor, wire)
    for schedule in ("wait", "overlap"):
        popped = {}

        def pop(phase, step, model, opt):
            if phase == "after":
                popped[step] = opt.pop_stats(link_bits_per_s=1e8)
        train(schedule, hc.Compression.bit8, "allgather", peek=pop)
        first, later = popped[0], popped[STEPS - 1]
        tag = f"overlap.pop_stats.{schedule}"
        check(f"{tag}.first_step_has_no_interval", "step_s" not in first, str(first))
        check(f"{tag}.floor_under_step", 0 < later["compute_s"] <= later["step_s"], str(later))
        check(f"{tag}.wire_of_bytes_sent", later["bytes_sent"] > 0 and math.isclose(
            later["wire_s"], 8 * later["bytes_sent"] / 1e8), str(later))
        check(f"{tag}.step_over_bound", math.isclose(
            later["step_over_bound"], later["step_s"] / max(later["compute_s"], later["wire_s"])),
            str(later))

    # the fallbacks, said once, with the waiting schedule's bits
    class Clipped(torch.optim.SGD):
        def step(self, closure=None):
            torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 0.5)
            return super().step(closure)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        overlapped = train("overlap", hc.Compression.bit8, "allgather",
                           lambda ps: Clipped(ps, lr=0.1, momentum=0.9))
    falls = [w for w in said if "falls back to 'wait'" in str(w.message)]
    check("overlap.fallback.unknown_optimizer_said_once",
          len(falls) == 1 and "Clipped.step" in str(falls[0].message), [str(w.message) for w in said])
    same("overlap.fallback.unknown_optimizer_bit_identical_to_wait", overlapped,
         train("wait", hc.Compression.bit8, "allgather", lambda ps: Clipped(ps, lr=0.1, momentum=0.9)))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        overlapped = train("overlap", hc.Compression.bit8, "allgather", closure=True)
    closures = [w for w in said if "closure" in str(w.message)]
    check("overlap.fallback.closure_said_once", len(closures) == 1, [str(w.message) for w in said])
    same("overlap.fallback.closure_bit_identical_to_wait", overlapped,
         train("wait", hc.Compression.bit8, "allgather", closure=True))
    # Compression.auto overlapped: a pinned mixed plan gives the waiting schedule's bits; left
    # to itself it measures, plans at a boundary after every update, and prices the overlap
    mixed = ["bit8:allgather", "bit16:alltoall", "fp16:allreduce", "none:allreduce"]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = Model()
        opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      model.named_parameters(), compression=hc.Compression.auto,
                                      schedule="overlap", model=model)
    check("overlap.auto.runs_overlapped", opt.schedule == "overlap" and not any(
        "falls back" in str(w.message) for w in said), [str(w.message) for w in said])
    opt.close()
    waited, overlapped = train_auto("wait", mixed), train_auto("overlap", mixed)
    check("overlap.auto.pinned_plan_is_the_plan_run",
          waited[2].labels == overlapped[2].labels and len(set(overlapped[2].labels)) >= 3,
          f"{waited[2].labels} {overlapped[2].labels}")
    same("overlap.auto.pinned_plan_bit_identical_to_wait", waited[:2], overlapped[:2])
    params, _, report = train_auto("overlap", steps=8)
    every = exchange_checks.hvd.allgather_object((report.plan, report.phase, report.schedule))
    check("overlap.auto.plans_on_every_rank_alike", report.phase == "planned" and report.plan
          and all(e == every[0] for e in every), str(every))
    needed = report.measurements.needed_s if report.measurements is not None else None
    check("overlap.auto.prices_the_overlapped_schedule", report.schedule == "overlap" and
          needed is not None and set(needed) == {b.name for b in report.buckets}
          and all(math.isfinite(t) and t >= 0 for t in needed.values()), str(needed))
    check("overlap.auto.identical_weights", checks.same_everywhere([params]))
    check("overlap.auto.waiting_prices_the_waiting_schedule",
          train_auto("wait", steps=8)[2].schedule == "wait")
    try:
        hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                model.named_parameters(), schedule="overlap")
        refused = ""
    except ValueError as err:
        refused = str(err)
    check("overlap.without_model_refused_clearly", "model=" in refused, refused)


if __name__ == "__main__":
    checks.main(run)
