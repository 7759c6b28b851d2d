"""hvd_compress.ddp's hook on real Gloo ranks (tests/ddprun.py): equal bit for bit to DDP's own
hooks where it should be (none = DDP's default allreduce, fp16 = fp16_compress_hook), every
registered scheme and route (top-k, PowerSGD, auto) training a real DDP model with every rank
holding the same bits, the buckets of engine_cases.py through the hook (their digests written
for test_ddp.py to compare with Horovod's), and clear errors for bad input and disagreeing
ranks."""
import json
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import hvd_compress.ddp as hcd
from hvd_compress.engine import distributed as hcd_engine
from hvd_compress import registry
from hvd_compress.compressors import Int8Compressor
from hvd_compress.compression import Compression
import checks
import engine_cases as cases

STEPS = 4


class Net(nn.Module):
    """Small, with buckets DDP will cut in several (bucket_cap_mb below)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc1 = nn.Linear(4 * 6 * 6, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv(x)).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def batches(rank):
    g = torch.Generator().manual_seed(500 + rank)
    return [(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(STEPS)]


def train(rank, register=None, steps=STEPS):
    """A DDP model trained `steps` steps from seed 0 with `register(ddp)` called first; its
    parameters, flattened, and the hook state register returned."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=0.01)
    state = register(ddp) if register is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(rank)[:steps]:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]), state


def wide(rank, below_bits_per_s, steps=5):
    """bit8 allgather on a net whose bucket is large enough to be timed (engine sent_times)
    and cut, with the piece decision's threshold set: (parameters, whether in pieces)."""
    most, hcd.PIECES_BELOW_BITS_PER_S = hcd.PIECES_BELOW_BITS_PER_S, below_bits_per_s
    try:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 10)))
        state = hcd.register(ddp, "bit8", "allgather")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            opt.zero_grad()
            x, y = torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    finally:
        hcd.PIECES_BELOW_BITS_PER_S = most
    done = not state.engine.timed and len(state.engine.sent_times) <= hcd_engine.TIMES_KEPT
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]), \
        state.engine.in_pieces and done


def ours(compression, route=None, **kw):
    def register(ddp):
        return hcd.register(ddp, compression, route, **kw)
    return register


def powersgd_grouped_and_alone(engine, rank, steps=3):
    """The same tensors (matrices and vectors) over `steps` steps through PowerSGD's grouped
    start (a DDP bucket's three allreduces) and tensor by tensor: (grouped, alone) results."""
    from hvd_compress.exchange.fusion import Bucket
    from hvd_compress.methods.powersgd import PowerSGD
    shapes = {"w1": (16, 9), "b1": (16,), "w2": (10, 4, 3, 3), "b2": (10,), "w3": (7, 5)}
    g = torch.Generator().manual_seed(700 + rank)
    grads = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(steps)]
    out = []
    for grouped in (True, False):
        comm = PowerSGD(2).communicator(engine=engine)
        for step in grads:
            buckets = [Bucket(k, [k], [v], flat=False) for k, v in step.items()]
            for b, v in zip(buckets, step.values()):
                b.put(0, v.clone())
            exchanges = [comm.start_group(buckets)] if grouped else [comm.start(b) for b in buckets]
            comm.advance(exchanges)
            for ex in exchanges:
                comm.finish(ex)
        out.append([b.tensor for b in buckets] + [comm.qs[k] for k in sorted(comm.qs)])
    return out


def same_everywhere(engine, tensor):
    every = engine.allgather_object(cases.digest([tensor]), "digest")
    return all(d == every[0] for d in every)


def run(dist):
    from hvd_compress.engine.distributed import TorchEngine
    engine = TorchEngine()
    rank, n = engine.rank(), engine.size()

    # ---- bit for bit with DDP's own hooks ----------------------------------------------------
    stock, _ = train(rank)
    mine, state = train(rank, ours("none"))
    checks.check("none hook = DDP's default allreduce, bit for bit", torch.equal(stock, mine))
    checks.check("the none hook ran", state.steps == STEPS and state.describe() == "none/allreduce")
    stock16, _ = train(rank, lambda ddp: ddp.register_comm_hook(None, default_hooks.fp16_compress_hook))
    mine16, _ = train(rank, ours("fp16"))
    checks.check("fp16 hook = fp16_compress_hook, bit for bit", torch.equal(stock16, mine16))
    checks.check("fp16 differs from float32 (the check can fail)", not torch.equal(stock16, stock))

    # ---- every registered scheme and route, and the methods, and auto -------------------------
    for name, entry in registry.schemes().items():
        for route in entry.routes:
            label = f"{name}:{route.value}"
            params, state = train(rank, ours(name, route.value))
            checks.check(f"{label}: trains, finite", bool(torch.isfinite(params).all()))
            checks.check(f"{label}: every rank holds the same bits", same_everywhere(engine, params))
            close = (params - stock).abs().max().item()
            checks.check(f"{label}: near float32 after {STEPS} steps", close < 0.5, f"{close}")
            stats = state.pop_stats()
            checks.check(f"{label}: counts bytes", stats["bytes_sent"] > 0 if n > 1 else True)
    # large gathers in pieces, decided from rank 0's timing of the whole ones (a slow link)
    whole, whole_in_pieces = wide(rank, 0.0)
    cut, cut_in_pieces = wide(rank, 1e18)
    checks.check("gather_pieces: rank 0's timing decides, alike on every rank (threshold 0: whole; 1e18: pieces)",
                 n == 1 or (not whole_in_pieces and cut_in_pieces and same_everywhere(
                     engine, torch.tensor([float(cut_in_pieces)]))))
    checks.check("gather_pieces: the same bits whole and in pieces", torch.equal(whole, cut))
    params, state = train(rank, ours(Compression.powersgd(1)))
    checks.check("powersgd rank 1: same bits everywhere", same_everywhere(engine, params))
    checks.check("powersgd keeps Q per parameter name",
                 any(k.startswith("fc1.") for k in state.communicator.qs))
    grouped, alone = powersgd_grouped_and_alone(engine, rank)
    label = "powersgd: a bucket's three allreduces = one or two per tensor"
    if n == 2:                      # a sum of two is the same in any order
        checks.check(label + ", bit for bit", all(map(torch.equal, grouped, alone)))
    else:                           # the collective may sum the concatenation in another order
        worst = max((g - a).abs().max().item() for g, a in zip(grouped, alone))
        checks.check(label + ", to rounding", worst < 1e-5, f"{worst}")
    checks.check("powersgd grouped: same bits everywhere", same_everywhere(engine, torch.cat(
        [g.reshape(-1) for g in grouped])))
    params, state = train(rank, ours(Compression.auto(warmup_steps=2)), steps=STEPS)
    checks.check("auto: trains, same bits everywhere",
                 bool(torch.isfinite(params).all()) and same_everywhere(engine, params))
    report = state.plan_report()
    checks.check("auto: reports its plan", report is not None and len(report.buckets) == 2
                 and all(b.label for b in report.buckets), f"{report!r}"[:300])

    # ---- the same flat buckets as on Horovod: digests for test_ddp.py -------------------------
    digests = {}
    for label, name, route, ef in cases.CASES:
        state = hcd.HookState(name, route, error_feedback=ef if name not in ("topk",) else None)
        Int8Compressor.reseed(0)         # after the communicator's warm-up, which encodes once
        results = []
        for step in range(cases.STEPS):
            flat = cases.bucket(step, rank)
            results.append(state.exchange(hcd.FlatBucket(flat, 0, True, cases.SHAPES)).wait().clone())
        digests[label] = cases.digest(results)
    every = engine.allgather_object(digests, "digests")
    checks.check("flat buckets: every rank holds the same bits", all(d == digests for d in every))
    Path(os.environ["HVDC_CHECK_DIR"], f"ddp-digests-rank{rank}.json").write_text(json.dumps(digests, indent=1))

    # ---- bad input: clear errors, no hang -----------------------------------------------------
    try:
        hcd.HookState("bit8", "allreduce")
        checks.check("a route the scheme does not have is refused", False)
    except ValueError as err:
        checks.check("a route the scheme does not have is refused", "allreduce" in str(err))
    try:
        hcd.HookState("fp16", error_feedback=True)
        checks.check("error feedback on an allreduce scheme is refused", False)
    except ValueError as err:
        checks.check("error feedback on an allreduce scheme is refused", "error_feedback" in str(err))
    state = hcd.HookState("bit8")
    try:
        state.exchange(hcd.FlatBucket(torch.arange(10), 0, True))
        checks.check("an integer bucket is refused", False)
    except ValueError as err:
        checks.check("an integer bucket is refused", "floating-point" in str(err))
    if n > 1:
        # ranks that disagree on the scheme: each raises, naming the difference, none hangs
        state = hcd.HookState("bit8" if rank == 0 else "bit16")
        try:
            state.exchange(hcd.FlatBucket(torch.ones(100), 0, True))
            checks.check("disagreeing ranks are refused", False)
        except RuntimeError as err:
            checks.check("disagreeing ranks are refused", "ranks disagree" in str(err)
                         and "bit8" in str(err) and "bit16" in str(err), str(err))
