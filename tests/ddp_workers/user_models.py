"""The DDP hook as a user runs it (tests/ddprun.py, 2 ranks): models the project never trained
(a small Transformer; a ResNet with BatchNorm, whose buffers DDP broadcasts every forward),
under DDP's options (bucket_cap_mb, gradient_as_bucket_view, static_graph,
find_unused_parameters), no_sync (gradient accumulation), join (uneven inputs), bfloat16
parameters and a checkpoint resumed in a fresh DDP model.

- `none` and `fp16` equal DDP's own allreduce and fp16_compress_hook bit for bit, in every
  case;
- every scheme (bit8, bit8 with error feedback, PowerSGD, auto) leaves every rank with the same
  bits, and finite;
- bit8 with error feedback resumed from a checkpoint (DDP's rebuild after the resume, no
  find_unused_parameters) equals the run that never stopped, bit for bit, BatchNorm's running
  statistics included."""
import io

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import hvd_compress.ddp as hcd
from hvd_compress.compression import Compression
import checks
import engine_cases as cases

STEPS = 4


class Transformer(nn.Module):
    """Token embeddings, two encoder layers, a classifier of the mean token."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))

    @staticmethod
    def batch(g):
        return torch.randint(0, 50, (8, 12), generator=g), torch.randint(0, 5, (8,), generator=g)


class ResNet(nn.Module):
    """A stem and one residual block, BatchNorm after every convolution."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        h = self.stem(x)
        h = F.relu(h + self.block(h))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))

    @staticmethod
    def batch(g):
        return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


MODELS = {"transformer": Transformer, "resnet": ResNet}
OPTIONS = {"defaults": {}, "bucket_cap_mb": {"bucket_cap_mb": 0.01},
           "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
           "static_graph": {"static_graph": True},
           "find_unused_parameters": {"find_unused_parameters": True}}


def stock(kind):
    """DDP's own: no hook (its allreduce) or fp16_compress_hook."""
    if kind == "none":
        return None
    return lambda ddp: ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)


def ours(compression, **kw):
    return lambda ddp: hcd.register(ddp, compression, **kw)


def make(model, options, register, dtype=torch.float32):
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(MODELS[model]().to(dtype), **options)
    _PARAMS[0] = sum(p.numel() for p in ddp.module.parameters())
    state = register(ddp) if register is not None else None
    return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def batches(model, rank, steps=STEPS, dtype=torch.float32):
    g = torch.Generator().manual_seed(300 + rank)
    out = []
    for _ in range(steps):
        x, y = MODELS[model].batch(g)
        out.append((x.to(dtype) if x.is_floating_point() else x, y))
    return out


def step(ddp, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(ddp(x).float(), y).backward()
    opt.step()


def train(model, options, register, rank, dtype=torch.float32, accumulate=1):
    """Parameters and buffers after STEPS steps (each of `accumulate` micro-batches, all but
    the last under no_sync)."""
    ddp, _, opt = make(model, options, register, dtype)
    data = batches(model, rank, STEPS * accumulate, dtype)
    for i in range(STEPS):
        opt.zero_grad()
        for j, (x, y) in enumerate(data[i * accumulate:(i + 1) * accumulate]):
            if j < accumulate - 1:
                with ddp.no_sync():
                    F.cross_entropy(ddp(x).float(), y).backward()
            else:
                F.cross_entropy(ddp(x).float(), y).backward()
        opt.step()
    return flat(ddp)


def flat(ddp):
    """Parameters, then floating buffers (BatchNorm's running statistics: each rank updates
    its own in every forward, after DDP broadcast rank 0's)."""
    return torch.cat([t.detach().float().reshape(-1) for t in [*ddp.module.parameters(),
                                                              *ddp.module.buffers()]
                      if t.is_floating_point()])


def same_everywhere(dist, tensor):
    """The parameters' bits (the head of `tensor`, see flat) equal on every rank."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, cases.digest([tensor[:_PARAMS[0]]]))
    return all(d == every[0] for d in every)


_PARAMS = [0]          # how many values of flat() are parameters (set by make)


def joined(model, register, rank):
    """Rank 1 runs out of data two steps early; ddp.join() shadows its collectives."""
    ddp, _, opt = make(model, {}, register)
    data = batches(model, rank)[:STEPS - 2 * rank]
    with ddp.join():
        for x, y in data:
            step(ddp, opt, x, y)
    return flat(ddp)


def resumed(model, rank):
    """bit8 with error feedback: stopped after 2 steps, saved, resumed in a fresh DDP model;
    the largest difference from the run that never stopped."""
    register = ours("bit8", error_feedback=True)
    data = batches(model, rank)
    ddp, state, opt = make(model, {}, register)
    for x, y in data[:2]:
        step(ddp, opt, x, y)
    buffer = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                "hook": state.compression_state_dict()}, buffer)
    for x, y in data[2:]:
        step(ddp, opt, x, y)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    ddp2, state2, opt2 = make(model, {}, register)
    ddp2.module.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    state2.load_compression_state_dict(saved["hook"])
    for x, y in data[2:]:
        step(ddp2, opt2, x, y)
    return (flat(ddp2) - flat(ddp)).abs().max().item()


def run(dist):
    rank = dist.get_rank()
    for model in MODELS:
        for name, options in OPTIONS.items():
            case = f"{model}, {name}"
            for kind in ("none", "fp16"):
                theirs = train(model, options, stock(kind), rank)
                mine = train(model, options, ours(kind), rank)
                checks.check(f"{case}: {kind} = DDP's own, bit for bit", torch.equal(theirs, mine),
                             f"{(theirs - mine).abs().max().item():.3g}")
            for label, register in (("bit8", ours("bit8")),
                                    ("bit8+ef", ours("bit8", error_feedback=True)),
                                    ("powersgd", ours(Compression.powersgd(1))),
                                    ("auto", ours(Compression.auto(warmup_steps=2)))):
                params = train(model, options, register, rank)
                checks.check(f"{case}: {label}: every rank holds the same bits, finite",
                             bool(torch.isfinite(params).all()) and same_everywhere(dist, params))
        for kind in ("none", "fp16"):
            checks.check(f"{model}, no_sync: {kind} = DDP's own, bit for bit", torch.equal(
                train(model, {}, stock(kind), rank, accumulate=2),
                train(model, {}, ours(kind), rank, accumulate=2)))
        params = train(model, {}, ours("bit8", error_feedback=True), rank, accumulate=2)
        checks.check(f"{model}, no_sync: bit8+ef: every rank holds the same bits",
                     same_everywhere(dist, params))
        checks.check(f"{model}, join: none = DDP's own, bit for bit",
                     torch.equal(joined(model, None, rank), joined(model, ours("none"), rank)))
        params = joined(model, ours("bit8", error_feedback=True), rank)
        checks.check(f"{model}, join: bit8+ef: every rank holds the same bits, finite",
                     bool(torch.isfinite(params).all()) and same_everywhere(dist, params))
        gap = resumed(model, rank)
        checks.check(f"{model}, checkpoint: bit8+ef resumed = never stopped, bit for bit",
                     gap == 0.0, f"{gap:.3g}")
    theirs = train("resnet", {}, None, rank, dtype=torch.bfloat16)
    checks.check("resnet, bfloat16: none = DDP's own, bit for bit",
                 torch.equal(theirs, train("resnet", {}, ours("none"), rank, dtype=torch.bfloat16)))
    params = train("resnet", {}, ours("bit8"), rank, dtype=torch.bfloat16)
    checks.check("resnet, bfloat16: bit8: every rank holds the same bits, finite",
                 bool(torch.isfinite(params).all()) and same_everywhere(dist, params))
