"""Error feedback through DDP's rebuild of its buckets (tests/ddprun.py, 2 ranks).

After its first step DDP rebuilds its buckets in the order the gradients became ready: with
one bucket it keeps the bucket's index and size and reorders the parameters inside it. The
residuals must follow the parameters, by name, through that rebuild:

- element by element: each rank trains in a process group of its own (world size 1, so what
  it sends decoded is exactly the reduced gradient DDP writes into .grad), and every step,
  for every parameter, residual = (its local gradient + its previous residual) - its .grad,
  the very arithmetic of error feedback, keyed by parameter name;
- end to end: 2 ranks, DDP's default options (no find_unused_parameters, so the rebuild
  happens in the first step of the uninterrupted run and again in the first step after the
  resume), a run stopped, saved and resumed in a fresh DDP model equals the run that never
  stopped, bit for bit."""
import io

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_compress.ddp as hcd
import checks

STEPS, SAVE_AT = 5, 2
ONE_BUCKET_MB = 25


class Net(nn.Module):
    """Layers of different sizes, so that a reordered bucket cuts other blocks of scales."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 48)
        self.fc2 = nn.Linear(48, 24)
        self.fc3 = nn.Linear(24, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def data(rank, steps=STEPS):
    g = torch.Generator().manual_seed(900 + rank)
    return [(torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(steps)]


def make(scheme, group=None, **ddp_options):
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net(), process_group=group,
                                              bucket_cap_mb=ONE_BUCKET_MB, **ddp_options)
    state = hcd.HookState(scheme, error_feedback=True, model=ddp, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    return ddp, state, opt


def residuals(state):
    return {k: v.reshape(-1).clone() for k, v in state.compression_state_dict()["residuals"].items()}


def follows_parameters(scheme, group):
    """Every step's residuals against error feedback's own arithmetic, by parameter name;
    the orders in which DDP handed the parameters (the rebuild must have reordered them)."""
    ddp, state, opt = make(scheme, group)
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    local, orders = {}, []

    def spy(state, bucket):
        buffer, offset = bucket.buffer(), 0
        orders.append([names[id(p)] for p in bucket.parameters()])
        for p in bucket.parameters():
            local[names[id(p)]] = buffer[offset:offset + p.numel()].clone()
            offset += p.numel()
        return hcd.hook(state, bucket)
    ddp.register_comm_hook(state, spy)
    previous = {n: torch.zeros(p.numel()) for n, p in ddp.module.named_parameters()}
    worst = 0.0
    for x, y in data(0):
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        now = residuals(state)
        for n, p in ddp.module.named_parameters():
            want = (local[n] + previous[n]) - p.grad.reshape(-1)
            worst = max(worst, (now[n] - want).abs().max().item())
        previous = now
        opt.step()
    return worst, orders


def train(ddp, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()


def params(ddp):
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])


def resumed_equals_straight(scheme, rank):
    batches = data(rank)
    ddp, state, opt = make(scheme)
    ddp.register_comm_hook(state, hcd.hook)
    train(ddp, opt, batches[:SAVE_AT])
    buffer = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                "hook": state.compression_state_dict()}, buffer)
    train(ddp, opt, batches[SAVE_AT:])
    straight = params(ddp)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    ddp2, state2, opt2 = make(scheme)
    ddp2.module.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    state2.load_compression_state_dict(saved["hook"])
    ddp2.register_comm_hook(state2, hcd.hook)
    train(ddp2, opt2, batches[SAVE_AT:])
    return (params(ddp2) - straight).abs().max().item()


def run(dist):
    rank, n = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(n)][rank]       # every rank makes every group
    for scheme in ("bit8", "onebit"):
        worst, orders = follows_parameters(scheme, alone)
        checks.check(f"{scheme}: DDP's rebuild reordered the parameters of its one bucket",
                     len({tuple(o) for o in orders}) == 2 and sorted(orders[0]) == sorted(orders[-1]),
                     f"{orders[:2]}")
        checks.check(f"{scheme}: every step's residuals follow their parameters by name, "
                     "element by element", worst == 0.0, f"worst {worst:.3g}")
        gap = resumed_equals_straight(scheme, rank)
        checks.check(f"{scheme}: resumed without find_unused_parameters = never stopped, "
                     "bit for bit", gap == 0.0, f"largest difference {gap:.3g}")
