"""hvd_compress.fsdp under FSDP2's other configurations, on real Gloo ranks
(tests/test_fsdp_configs.py starts them through tests/ddprun.py): HSDP (a 2-D mesh, 2 replicas
of 2 shards, 4 ranks), gradient accumulation without reduction (set_requires_gradient_sync),
a module whose parameters do not all get a gradient, and parameters sharded on dim 1
(shard_placement_fn). In each: `none` equals FSDP2's own reduce-scatter bit for bit after
several steps; every codec leaves every rank (HSDP's replicas too) with the same parameters;
and error feedback neither drops nor double-counts a residual, by its telescoping sum: with the
weights held still (no optimizer step), the reduced gradients summed over the steps plus the
residuals' correction left at the end (every rank's residual of this shard, summed, over the
reduce's divisor D) equal FSDP2's own reduced gradients summed, to float32 rounding.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

import hvd_compress.fsdp as hcf
from checks import check
from fsdp_workers.fsdp_checks import (CODECS, Net, batches, folder, full, local,
                                      same_on_every_rank, steps)

STEPS = 4
# |sum of reduced + correction - FSDP2's sum| over max |FSDP2's sum|: float32 rounding of a
# few sums (~1e-7 each); a dropped or doubled residual is a codec's rounding (~1e-2)
IDENTITY = 1e-5


class Head(nn.Module):
    """`out`, `side` (added to it on even steps only) and `spare` (never used)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(30, 5)
        self.side = nn.Linear(30, 5)
        self.spare = nn.Parameter(torch.randn(7))

    def forward(self, h, side):
        return self.out(h) + self.side(h) if side else self.out(h)


class Uneven(nn.Module):
    """fc1 and fc2 (a Head) each a fully_shard module: FSDP2 reduces fc2's parameters without
    `side` on odd steps and without `spare` on every step."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 30)
        self.fc2 = Head()
        self.step = 0

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)), self.step % 2 == 0)


def sharded(model_cls, mesh, mp=None, placement=None):
    torch.manual_seed(0)
    net = model_cls()
    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    if placement is not None:
        kw["shard_placement_fn"] = placement
    for layer in [m for name, m in net.named_children()]:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, **kw)
    fully_shard(net, **kw)
    return net


def on_dim1(param):
    """Shard(1) where dim 1 divides evenly on 2 and 4 ranks (fc1.weight 300 x 12, fc2.weight
    35 x 300, fc3.weight 5 x 35 stays on dim 0): FSDP2 shards another dim only evenly."""
    return Shard(1) if param.ndim == 2 and param.shape[1] % 4 == 0 else Shard(0)


def train(net, data, micro=1, momentum=0.9):
    """SGD with momentum, `micro` batches accumulated a step (gradient sync on the last)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=momentum)
    for t in range(0, len(data), micro):
        opt.zero_grad()
        for i, (x, y) in enumerate(data[t:t + micro]):
            net.set_requires_gradient_sync(i == micro - 1)
            if hasattr(net, "step"):
                net.step = t // micro
            F.cross_entropy(net(x), y).backward()
        opt.step()
    return net


def none_is_fsdp2(label, make, data, **kw):
    """`none` equals FSDP2's own reduce-scatter after the steps, bit for bit (and the steps
    moved the weights)."""
    default = local(train(make(), data, **kw))
    net = make()
    state = hcf.register(net, "none")
    ours = local(train(net, data, **kw))
    check(f"{label}: none = FSDP2's default after {len(data)} batches, bit for bit",
          torch.equal(default, ours) and not torch.equal(local(make()), ours)
          and state.steps > 0, f"max difference {(default - ours).abs().max().item()}")


def shard_of(state, net, divisor):
    """This rank's shard of the residuals' correction, per parameter: every rank's piece of this
    shard (world order, float32), summed, over `divisor`, cut to the local shard's values."""
    world = dist.get_world_size()
    every = [None] * world
    dist.all_gather_object(every, state.compression_state_dict()["residuals"])
    k, n = state.engine.rank(), state.engine.size()
    out = {}
    for fqn, p in net.named_parameters():
        shard = p.detach().to_local()
        pieces = [r[f"{fqn}#shard{k}of{n}"] for r in every if f"{fqn}#shard{k}of{n}" in r]
        total = torch.zeros(shard.numel()) if not pieces else pieces[0].clone()
        for piece in pieces[1:]:
            total += piece
        out[fqn] = (total[:shard.numel()] / divisor).reshape(shard.shape)
    return out


def shard_grads(net):
    return {fqn: (p.grad.to_local() if p.grad is not None else
                  torch.zeros_like(p.detach().to_local())).detach().clone()
            for fqn, p in net.named_parameters()}


def summed(make, register, data, micro, reduce_all=None):
    """Per parameter, this rank's reduced gradient shards summed over the steps, the weights
    held still (no optimizer step): FSDP2's own (register None) or a front's; the front too."""
    net = make()
    state = register(net) if register is not None else None
    total = None
    for t in range(0, len(data), micro):
        for i, (x, y) in enumerate(data[t:t + micro]):
            last = i == micro - 1
            if reduce_all is None:
                net.set_requires_gradient_sync(last)
            else:                        # HSDP: reduce-scatter every batch, all-reduce the last
                net.set_requires_all_reduce(last)
            if hasattr(net, "step"):
                net.step = t // micro
            F.cross_entropy(net(x), y).backward()
        got = shard_grads(net)
        total = got if total is None else {k: total[k] + got[k] for k in total}
        net.zero_grad(set_to_none=True)
    return total, net, state


def largest(tensors):
    """max |value| over a dict of tensors (a rank's shard may be empty: 5 rows on 4 ranks)."""
    return max((t.abs().max().item() for t in tensors.values() if t.numel()), default=0.0)


def residuals_telescope(label, make, data, divisor, micro=1, reduce_all=None, scheme="bit8"):
    """Error feedback's identity: reduced gradients summed + the correction left = FSDP2's
    reduced gradients summed, to float32 rounding; without the correction they differ by the
    codec's rounding (the residuals hold something)."""
    exact, _, _ = summed(make, None, data, micro, reduce_all)
    ours, net, state = summed(make, lambda m: hcf.register(m, scheme, error_feedback=True),
                              data, micro, reduce_all)
    left = shard_of(state, net, divisor)
    scale, miss, bare = (largest(d) for d in (
        exact, {k: ours[k] + left[k] - exact[k] for k in exact},
        {k: ours[k] - exact[k] for k in exact}))
    every = [torch.empty(3) for _ in range(dist.get_world_size())]     # the worst rank's
    dist.all_gather(every, torch.tensor([miss, bare, scale]))
    miss, bare, scale = (max(e[i].item() for e in every) for i in range(3))
    if dist.get_rank() == 0:
        print(f"FIGURE {label}: {scheme}+ef telescoping: max |sum + correction - FSDP2's| "
              f"{miss:.3g}, without the correction {bare:.3g}, max |FSDP2's sum| {scale:.3g}",
              flush=True)
    check(f"{label}: {scheme}+ef's residuals telescope: reduced sums + correction = FSDP2's",
          miss <= IDENTITY * scale and bare > 100 * miss,
          f"max |difference| {miss}, without the correction {bare}, scale {scale}")
    return state


def every_codec_keeps_ranks_alike(label, make, data, groups=None, **kw):
    """After the steps, every rank holds the same full parameters, and ranks holding the same
    shard (HSDP's replicas: `groups`, lists of world ranks) the same shard, bit for bit."""
    for scheme in CODECS:
        for ef in ((False, True) if scheme != "fp16" else (False,)):
            tag = f"{scheme}{'+ef' if ef else ''}"
            net = make()
            hcf.register(net, scheme, error_feedback=ef or None)
            train(net, data, **kw)
            ok = same_on_every_rank(dist, full(net)) and bool(torch.isfinite(local(net)).all())
            if groups is not None:
                every = [None] * dist.get_world_size()      # shards differ in size
                dist.all_gather_object(every, local(net))
                ok = ok and all(torch.equal(every[g[0]], every[r]) for g in groups for r in g)
            check(f"{label}: {tag} leaves every rank with the same parameters", ok)


def hsdp(data):
    """4 ranks as 2 replicas of 2 shards: ranks (0, 1) and (2, 3) each shard the model, ranks
    0 and 2 (1 and 3) hold the same shard; FSDP2 all-reduces the reduced shards over them."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicas = [[0, 2], [1, 3]]
    for label, mp in (("float32", None),
                      ("reduce_dtype=float16", MixedPrecisionPolicy(reduce_dtype=torch.float16))):
        none_is_fsdp2(f"HSDP 2x2 ({label})", lambda: sharded(Net, mesh, mp), data)
    every_codec_keeps_ranks_alike("HSDP 2x2", lambda: sharded(Net, mesh), data, replicas)
    residuals_telescope("HSDP 2x2", lambda: sharded(Net, mesh), data, divisor=4)
    residuals_telescope("HSDP 2x2, all-reduce on the last of 2 batches",
                        lambda: sharded(Net, mesh), data, divisor=4, micro=2, reduce_all=True)

    # replicas that chose different codecs would all-reduce shards of different rounding:
    # the shard group of each agrees within itself, so the replicas must agree too
    try:
        hcf.register(sharded(Net, mesh), "bit8" if dist.get_rank() < 2 else "bit16")
        err = None
    except Exception as e:             # noqa: BLE001 - any error is read below
        err = e
    check("HSDP 2x2: replicas that register different codecs are refused on every rank",
          isinstance(err, RuntimeError) and "replicas" in str(err), repr(err))

    # checkpoints: the residuals differ on every one of the 4 ranks (replicas included)
    def fresh():
        net = sharded(Net, mesh)
        return net, torch.optim.Adam(net.parameters(), lr=0.01), \
            hcf.register(net, "bit8", error_feedback=True)
    net, opt, _ = fresh()
    steps(net, opt, data)
    straight = local(net)
    net, opt, state = fresh()
    steps(net, opt, data[:2])
    path = folder("ckpt-hsdp")
    hcf.save_checkpoint(path, net, opt, state)
    mine = state.compression_state_dict()["residuals"]
    net, opt, state = fresh()
    hcf.load_checkpoint(path, net, opt, state)
    back = state.compression_state_dict()["residuals"]
    check("HSDP 2x2: DCP gives every rank (each replica) its own residuals back",
          sorted(mine) == sorted(back) and all(torch.equal(mine[k], back[k]) for k in mine))
    steps(net, opt, data[2:])
    after = local(net)
    check("HSDP 2x2: bit8+ef resumed from DCP = never stopped, bit for bit",
          torch.equal(after, straight) and same_on_every_rank(dist, full(net)),
          f"max difference {(after - straight).abs().max().item()}")


def accumulation(data):
    """2 batches a step with set_requires_gradient_sync(False) on the first: FSDP2 keeps the
    unsharded gradient and reduces the sum once, on the last."""
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    none_is_fsdp2("accumulating 2 batches", lambda: sharded(Net, mesh), data, micro=2)
    net = sharded(Net, mesh)
    state = hcf.register(net, "bit8", error_feedback=True)
    calls = []
    comm = state.comms["fc2"]
    inner = comm.reduce_scatter
    comm.reduce_scatter = lambda *a: (calls.append(1), inner(*a))[1]
    train(net, data, micro=2)
    check("accumulating 2 batches: one reduce-scatter a module and a step, steps counted",
          len(calls) == len(data) // 2 and state.steps == len(data) // 2,
          f"{len(calls)} calls, {state.steps} steps")
    every_codec_keeps_ranks_alike("accumulating 2 batches", lambda: sharded(Net, mesh), data,
                                  micro=2)
    residuals_telescope("accumulating 2 batches", lambda: sharded(Net, mesh), data, divisor=n,
                        micro=2)


def unused(data):
    """fc2's `side` gets a gradient on even steps only, its `spare` never."""
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    none_is_fsdp2("a parameter without gradient", lambda: sharded(Uneven, mesh), data)
    every_codec_keeps_ranks_alike("a parameter without gradient",
                                  lambda: sharded(Uneven, mesh), data)
    state = residuals_telescope("a parameter without gradient", lambda: sharded(Uneven, mesh),
                                data, divisor=n)
    names = sorted(state.compression_state_dict()["residuals"])
    want = sorted(f"{p}#shard{k}of{n}" for p in ("fc1.weight", "fc1.bias", "fc2.out.weight",
                  "fc2.out.bias", "fc2.side.weight", "fc2.side.bias") for k in range(n))
    check("a parameter without gradient: residuals named by parameter and shard (none for "
          "the one never reduced)", names == want, str(names))

    # side's residual waits out the odd step untouched, and enters the next even one
    net = sharded(Uneven, mesh)
    state = hcf.register(net, "bit8", error_feedback=True)
    seen = []
    for t, (x, y) in enumerate(data[:3]):
        net.step = t
        F.cross_entropy(net(x), y).backward()
        net.zero_grad(set_to_none=True)
        seen.append(state.compression_state_dict()["residuals"])
    key, other = f"fc2.side.weight#shard0of{n}", f"fc2.out.weight#shard0of{n}"  # rows on 4
    check("a parameter without gradient keeps its residual through the step it misses, the "
          "others' change", torch.equal(seen[0][key], seen[1][key])
          and not torch.equal(seen[1][key], seen[2][key]) and bool(seen[0][key].abs().sum() > 0)
          and not torch.equal(seen[0][other], seen[1][other]))
    check("a parameter never given a gradient has no residual",
          not any(k.startswith("fc2.spare") for k in seen[2]))


def dim1(data):
    """fc1.weight and fc2.weight sharded on dim 1 (FSDP2's shard_placement_fn)."""
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    make = lambda: sharded(Net, mesh, placement=on_dim1)            # noqa: E731
    net = make()
    check("Shard(1): FSDP2 shards fc1.weight and fc2.weight on dim 1",
          [p.placements[0] for p in net.parameters()][:4:2] == [Shard(1), Shard(1)])
    none_is_fsdp2("Shard(1)", make, data)
    every_codec_keeps_ranks_alike("Shard(1)", make, data)
    residuals_telescope("Shard(1)", make, data, divisor=n)


def run(_dist):
    n = dist.get_world_size()
    data = batches(dist.get_rank(), STEPS)
    accumulation(data)
    unused(data)
    dim1(data)
    if n == 4:
        hsdp(data)
