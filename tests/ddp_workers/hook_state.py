"""The hook's state in a checkpoint (tests/ddprun.py, 2 ranks): training that stops, saves the
model, the optimizer and HookState.compression_state_dict(), and goes on in a fresh DDP model from that
checkpoint ends with exactly the bits of training that never stopped (bit8 with error
feedback: the residuals; PowerSGD: Q and residuals), auto takes its plan up again, residuals
saved under one bucket layout reach another (by parameter name), and a state saved for one
scheme is refused by another.

DDP rebuilds its buckets after the first step, so a restarted job's first step may cut them
otherwise than the uninterrupted job did; find_unused_parameters=True keeps DDP's first
buckets (no rebuild), so the resumed steps see the same buckets and can be compared bit for
bit."""
import io
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import hvd_compress.ddp as hcd
from hvd_compress.compression import Compression
import checks
from hook_checks import Net, batches

STEPS, SAVE_AT = 6, 3


def steps(ddp, opt, data):
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()


def params(ddp):
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])


def run(dist):
    rank = dist.get_rank()
    data = (batches(rank) * 2)[:STEPS]
    for label, compression, route in (("bit8:alltoall+ef", "bit8", "alltoall"),
                                      ("powersgd", Compression.powersgd(1), None),
                                      # saved in its plain steps: the count must come back
                                      ("powersgd:start4", Compression.powersgd(
                                          1, start_iter=SAVE_AT + 1, init="ddp"), None),
                                      ("auto", Compression.auto(warmup_steps=2, trial_steps=0), None)):
        ddp, state, opt = _with_state(compression, route, label)
        save_at = SAVE_AT + (2 if label == "auto" else 0)   # auto: its plan made first
        steps(ddp, opt, data[:save_at])
        buffer = io.BytesIO()
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                    "hook": state.compression_state_dict()}, buffer)
        steps(ddp, opt, data[save_at:])
        straight = params(ddp)
        saved = state.compression_state_dict()

        buffer.seek(0)
        ckpt = torch.load(buffer, weights_only=False)
        ddp2, state2, opt2 = _with_state(compression, route, label)
        ddp2.module.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
        state2.load_compression_state_dict(ckpt["hook"])
        if label == "auto":
            # the plan is for DDP's buckets, which the hook meets in the first resumed step
            steps(ddp2, opt2, data[save_at:save_at + 1])
            checks.check(f"{label}: the plan is restored",
                         saved.get("communicator") is not None
                         and state2.communicator.state_dict() == saved["communicator"])
            continue
        steps(ddp2, opt2, data[save_at:])
        checks.check(f"{label}: resumed from the checkpoint = never stopped, bit for bit",
                     torch.equal(params(ddp2), straight))
        if label.endswith("+ef"):
            checks.check(f"{label}: residuals saved by parameter",
                         set(ckpt["hook"]["residuals"]) == {n for n, _ in ddp.module.named_parameters()})
            check_other_layout(ckpt, data)
        if label == "powersgd":
            checks.check(f"{label}: Q saved", len(ckpt["hook"]["communicator"]["qs"]) > 0)
        if label == "powersgd:start4":
            counts = ckpt["hook"]["communicator"]["counts"]
            checks.check(f"{label}: each tensor's count of plain steps saved",
                         set(counts.values()) == {SAVE_AT} and not ckpt["hook"]["communicator"]["qs"])
    pinned(rank, data)
    other = hcd.HookState("bit16")
    try:
        other.load_compression_state_dict(hcd.HookState("bit8").compression_state_dict())
        checks.check("a state of another scheme is refused", False)
    except ValueError as err:
        checks.check("a state of another scheme is refused", "bit8" in str(err))


def pinned(rank, data):
    """Compression.auto(plan=a plan report's file): the plan another job measured is in force
    from the first step, nothing measured, alike on every rank; a job resumed from a
    checkpoint equals the one that never stopped, bit for bit; a plan for other buckets is
    refused by the second step (DDP's rebuilt buckets are final), on every rank."""
    ddp, state, opt = _with_state(Compression.auto(warmup_steps=2, trial_steps=0), None, "auto")
    steps(ddp, opt, data)
    report = state.plan_report()
    path = Path(os.environ["HVDC_CHECK_DIR"]) / f"plan-rank{rank}.json"
    path.write_text(json.dumps(report.to_dict()))
    auto = Compression.auto(plan=str(path))
    ddp, state, opt = _with_state(auto, None, "auto")
    steps(ddp, opt, data[:1])
    first = state.communicator.labels
    steps(ddp, opt, data[1:SAVE_AT])
    buffer = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                "hook": state.compression_state_dict()}, buffer)
    steps(ddp, opt, data[SAVE_AT:])
    again = state.plan_report()
    checks.check("pinned: the plan is in force from the first step, nothing measured",
                 report.plan and first == report.labels and again.plan == report.plan
                 and again.calibrations == 0 and again.phase == "planned",
                 f"{report.plan!r} {first} {again.plan!r} {again.calibrations}")
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=False)
    ddp2, state2, opt2 = _with_state(auto, None, "auto")
    ddp2.module.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    state2.load_compression_state_dict(ckpt["hook"])
    steps(ddp2, opt2, data[SAVE_AT:])
    checks.check("pinned: resumed = never stopped, bit for bit", torch.equal(params(ddp2),
                                                                          params(ddp)))
    ddp, state, opt = _with_state(Compression.auto(plan=[("ddp.0.7", 28, "bit8:allgather")]),
                                  None, "auto")
    try:
        steps(ddp, opt, data[:2])
        refused = ""
    except Exception as err:                     # raised in the hook, through DDP's backward
        refused = str(err)
    checks.check("pinned: a plan for other buckets is refused, naming them",
                 "the plan is for buckets" in refused and "ddp.0.7" in refused, refused[:300])


def _with_state(compression, route, label, bucket_cap_mb=0.01):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=bucket_cap_mb,
                                                    find_unused_parameters=True)
    state = hcd.HookState(compression, route, error_feedback=True if label.endswith("+ef") else None,
                          model=ddp)
    ddp.register_comm_hook(state, hcd.hook)
    return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)


def check_other_layout(ckpt, data):
    """bit8 residuals saved under small buckets, loaded into a DDP model with one large bucket:
    its first exchange compensates with its parameters' saved pieces, in its own order."""
    ddp, state, opt = _with_state("bit8", "alltoall", "+ef", bucket_cap_mb=25)
    state.load_compression_state_dict(ckpt["hook"])
    used = {}
    compensate = state.memory.compensate

    def spy(name, x, inplace=False):
        if name in state.memory.residuals and name not in used:
            used[name] = state.memory.residuals[name].clone()
        return compensate(name, x, inplace)
    state.memory.compensate = spy
    steps(ddp, opt, data[:1])
    layouts = list(state._layouts.values())
    want = torch.cat([ckpt["hook"]["residuals"][n] for n in layouts[0].names])
    checks.check("residuals reach another bucket layout by parameter name",
                 len(layouts) == 1 and len(used) == 1 and torch.equal(next(iter(used.values())), want))
