"""Run under horovodrun: checks the compressed gradient exchange across real ranks.

Every rank logs each check that holds (tests/workers/checks.py) and raises (non-zero exit) on
the first that does not; tests/test_exchange_multiprocess.py launches it with 2, 3 and 4
ranks under Gloo and MPI and reads the logs.
"""
import sys

import torch
import horovod.torch as hvd

import checks
from checks import check

import hvd_compress as hc
from hvd_compress.communicators import make_communicator, _chunk_bounds

hvd.init()
N, RANK = hvd.size(), hvd.rank()
checks.start(RANK)




def rank_tensors(seed):
    """Gradient-like tensors, different on every rank; sizes not divisible by n, 0-d, empty."""
    g = torch.Generator().manual_seed(1000 * seed + RANK)
    shapes = [(1000,), (7,), (3, 5), (), (0,), (2, 3, 4), (1,)]
    scales = [1e-3, 1e-5, 1.0, 3e-2, 1.0, 1e-7, 5.0]
    return [torch.randn(s, generator=g) * c for s, c in zip(shapes, scales)]


def gather_inputs(tensors):
    """Every rank's copy of every tensor: list over tensors of (n, numel) float32."""
    return [hvd.allgather(t.reshape(1, -1).contiguous(), name=f"inputs.{i}") for i, t in enumerate(tensors)]


def simulate_allgather(comp, rows, average):
    """What the allgather route must produce: decode each rank's packet, float32 rank-order sum."""
    total = comp.decode_packet(comp.compress(rows[0])[0]).clone()
    for r in range(1, N):
        total += comp.decode_packet(comp.compress(rows[r])[0])
    return total / N if average and N > 1 else total


def simulate_alltoall(comp, rows, average):
    """Two-phase, done on one process: per chunk, reduce decoded codes, re-encode, decode."""
    out = torch.empty(rows.shape[1])
    for a, b in _chunk_bounds(rows.shape[1], N):
        reduced = simulate_allgather(comp, rows[:, a:b], average)
        out[a:b] = comp.decode_packet(comp.compress(reduced)[0])
    return out


def float64_reference(comp, rows, average):
    """Decoded codes summed in float64: the true sum of what the ranks sent."""
    total = torch.zeros(rows.shape[1], dtype=torch.float64)
    for r in range(N):
        total += comp.decode_packet(comp.compress(rows[r])[0]).double()
    return total / N if average else total


def same_on_all_ranks(t, name):
    everyone = hvd.allgather(t.reshape(1, -1).contiguous(), name=name)
    return all(torch.equal(everyone[0].view(torch.int32 if t.dtype == torch.float32 else t.dtype),
                           everyone[r].view(torch.int32 if t.dtype == torch.float32 else t.dtype))
               for r in range(N))


def check_packet_routes():
    for comp in (hc.Compression.bit8, hc.Compression.bit16):
        for reduction in ("allgather", "alltoall"):
            for op, average in ((hvd.Average, True), (hvd.Sum, False)):
                tensors = rank_tensors(seed=len(reduction) + (2 if average else 0))
                inputs = gather_inputs(tensors)
                fused = make_communicator(comp, reduction, op).reduce(tensors, [f"t{i}" for i in range(len(tensors))])
                unfused = make_communicator(comp, reduction, op, fusion_threshold_bytes=0).reduce(
                    tensors, [f"u{i}" for i in range(len(tensors))])
                simulate = simulate_allgather if reduction == "allgather" else simulate_alltoall
                tag = f"{comp.name}.{reduction}.{'avg' if average else 'sum'}"
                for i, (t, out, rows) in enumerate(zip(tensors, fused, inputs)):
                    check(f"{tag}.t{i}.shape_dtype", out.shape == t.shape and out.dtype == t.dtype)
                    expected = simulate(comp, rows, average).view(t.shape)
                    check(f"{tag}.t{i}.equals_simulation", torch.equal(out, expected),
                          f"max diff {(out - expected).abs().max() if out.numel() else 0}")
                    check(f"{tag}.t{i}.fusion_same_as_unfused", torch.equal(out, unfused[i]))
                    check(f"{tag}.t{i}.same_on_all_ranks", same_on_all_ranks(out, f"{tag}.same.{i}"))
                    if reduction == "allgather":
                        ref = float64_reference(comp, rows, average).view(t.shape)
                        bound = N * 2.0 ** -23 * float(rows.abs().sum(0).max()) if rows.numel() else 0.0
                        err = float((out.double() - ref).abs().max()) if out.numel() else 0.0
                        check(f"{tag}.t{i}.float64_reference", err <= bound, f"err {err} > {bound}")


def check_allreduce_routes():
    tensors = rank_tensors(seed=7)[:3]
    for comp in (hc.Compression.none, hc.Compression.fp16):
        for op in (hvd.Average, hvd.Sum):
            outs = make_communicator(comp, None, op).reduce([t.clone() for t in tensors],
                                                             [f"{comp.__name__}.{op}.{i}" for i in range(3)])
            for i, t in enumerate(tensors):
                c, ctx = comp.compress(t.clone())
                ref = comp.decompress(hvd.allreduce(c, op=op, name=f"ref.{comp.__name__}.{op}.{i}"), ctx)
                check(f"allreduce.{comp.__name__}.{op}.t{i}.identical_to_hvd_allreduce", torch.equal(outs[i], ref))


def train(make_optimizer, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = make_optimizer(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(RANK)
    for _ in range(steps):
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 4, (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_optimizer():
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for comp, name in ((hc.Compression.none, "none"), (hc.Compression.fp16, "fp16")):
        ours = train(lambda m: hc.DistributedOptimizer(sgd(m), m.named_parameters(), compression=comp))
        stock = train(lambda m: hvd.DistributedOptimizer(sgd(m), m.named_parameters(), compression=comp))
        check(f"optimizer.{name}.identical_to_hvd_DistributedOptimizer", torch.equal(ours, stock),
              f"max diff {(ours - stock).abs().max()}")
    for comp in (hc.Compression.bit8, hc.Compression.bit16):
        for reduction in ("allgather", "alltoall"):
            for ef in (False, True):
                params = train(lambda m: hc.DistributedOptimizer(
                    sgd(m), m.named_parameters(), compression=comp, reduction=reduction, error_feedback=ef))
                tag = f"optimizer.{comp.name}.{reduction}.ef{int(ef)}"
                check(f"{tag}.finite", bool(torch.isfinite(params).all()))
                check(f"{tag}.same_on_all_ranks", same_on_all_ranks(params, tag))


check_allreduce_routes()
check_packet_routes()
check_optimizer()
checks.done()
sys.exit(0)
