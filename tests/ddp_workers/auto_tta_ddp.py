"""Compression.auto(objective="time_to_accuracy") through the DDP hook (tests/ddprun.py, 2 and
4 ranks): DDP's own buckets, torch.distributed's collectives, the same front core. The link
emulated by step times injected (`step_s=`): every rank decides alike, a lossy method that
pays is switched to after the first (critical) interval and the accuracy guard refuses top-k
0.1%, the weights stay the same on every rank, and the choice state survives a checkpoint
(the hook's compression_state_dict)."""
import io

import torch
import torch.nn.functional as F
from torch import nn

import hvd_compress.ddp as hcd
from hvd_compress.auto import convergence
from hvd_compress.compression import Compression
import checks

INTERVAL = 10
METHODS = ("int8", "powersgd4", "topk0.1", "topk0.001")
STEP_S = {"value": 1.0, "int8": 0.05, "powersgd4": 0.04, "topk0.1": 0.04, "topk0.001": 0.001}
STEPS = 32


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                         nn.Linear(64, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 100, generator=g)
    return x, x[:, :4] * 0.5 + 0.1 * torch.randn(16, 4, generator=g)


def job():
    ddp = nn.parallel.DistributedDataParallel(net(), bucket_cap_mb=0.05,
                                              find_unused_parameters=True)   # no rebuild
    auto = Compression.auto(warmup_steps=3, trial_steps=0, objective="time_to_accuracy",
                            methods=METHODS, step_s=STEP_S, interval=INTERVAL)
    state = hcd.HookState(auto, model=ddp)
    ddp.register_comm_hook(state, hcd.hook)
    return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)


def train(rank, ddp, opt, first, last):
    for step in range(first, last):
        x, y = batch(rank, step)
        opt.zero_grad()
        (ddp(x) - y).square().mean().backward()
        opt.step()


def params(ddp):
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])


def objective(state):
    return state.plan_report().to_dict()["objective"]


def run(dist):
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp, state, opt = job()
    save_at = 25
    train(rank, ddp, opt, 0, save_at)
    buffer = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                "hook": state.compression_state_dict()}, buffer)
    train(rank, ddp, opt, save_at, STEPS)
    made = objective(state)
    every = [None] * n
    dist.all_gather_object(every, made)
    checks.check("ddp.tta.same_decisions_on_every_rank", all(o == every[0] for o in every))
    mine = params(ddp)
    weights = [torch.zeros_like(mine) for _ in range(n)]
    dist.all_gather(weights, mine)
    checks.check("ddp.tta.identical_weights", all(torch.equal(w, mine) for w in weights))
    windows = made["windows"]
    checks.check("ddp.tta.first_interval_critical", windows[0]["critical"])
    calm = [w for w in windows if not w["critical"]]
    checks.check("ddp.tta.a_calm_window", bool(calm), str(windows))
    first = calm[0]
    chosen = convergence.choose(first["step_s"], first["pooled"], first["mode"])
    checks.check("ddp.tta.switches_to_a_lossy_method_that_pays",
                 chosen != "value" and first["next"] == chosen
                 and made["switches"][0][:3] == [first["step"], "value", chosen], str(made))
    checks.check("ddp.tta.guard_refuses_topk_0.1_percent",
                 all(w["next"] != "topk0.001" for w in windows) and
                 all(w["ratios"].get("topk0.001", 0.0) < convergence.R_MIN for w in windows),
                 str([w["ratios"].get("topk0.001") for w in windows]))
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=False)
    ddp2, state2, opt2 = job()
    ddp2.module.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    state2.load_compression_state_dict(ckpt["hook"])
    train(rank, ddp2, opt2, save_at, save_at + 1)
    checks.check("ddp.tta.mode_restored_from_the_checkpoint",
                 objective(state2)["mode"] == ckpt["hook"]["communicator"]["auto_tta"]["state"]
                 ["mode"] != "value", str(objective(state2)["mode"]))
