"""The hook's state in a checkpoint (tests/ddprun.py, 2 ranks): training that stops, saves the
model, the optimizer and HookState.state_dict(), and goes on in a fresh DDP model from that
checkpoint ends with exactly the bits of training that never stopped (bit8 with error
feedback: the residuals; PowerSGD: Q and residuals; auto: its plan), and a state saved for one
scheme is refused by another."""
import io

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
                                      ("auto", Compression.auto(warmup_steps=2), None)):
        ddp, state, opt = _with_state(compression, route, label)
        steps(ddp, opt, data[:SAVE_AT])
        buffer = io.BytesIO()
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                    "hook": state.state_dict()}, buffer)
        steps(ddp, opt, data[SAVE_AT:])
        straight = params(ddp)
        saved = state.state_dict()

        buffer.seek(0)
        ckpt = torch.load(buffer, weights_only=False)
        ddp2, state2, opt2 = _with_state(compression, route, label)
        ddp2.module.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
        state2.load_state_dict(ckpt["hook"])
        steps(ddp2, opt2, data[SAVE_AT:])
        checks.check(f"{label}: resumed from the checkpoint = never stopped, bit for bit",
                     torch.equal(params(ddp2), straight))
        if label.endswith("+ef"):
            checks.check(f"{label}: residuals saved", len(ckpt["hook"]["residuals"]) > 0)
        if label == "powersgd":
            checks.check(f"{label}: Q saved", len(ckpt["hook"]["communicator"]["qs"]) > 0)
        if label == "auto":
            checks.check(f"{label}: the plan is restored",
                         state2.communicator.labels == state.communicator.labels
                         and saved.get("communicator") is not None)
    other = hcd.HookState("bit16")
    try:
        other.load_state_dict(hcd.HookState("bit8").state_dict())
        checks.check("a state of another scheme is refused", False)
    except ValueError as err:
        checks.check("a state of another scheme is refused", "bit8" in str(err))


def _with_state(compression, route, label):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=0.01)
    state = hcd.HookState(compression, route, error_feedback=True if label.endswith("+ef") else None,
                          model=ddp)
    ddp.register_comm_hook(state, hcd.hook)
    return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
