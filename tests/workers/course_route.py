"""Run under horovodrun (tests/workers/suite.py, or alone): the course's in-tree route (patched
Horovod) against stock behaviour and against the plugin. Logs each check that holds
(checks.py); raises on the first failure."""
import torch
import horovod.torch as hvd
from horovod.torch import mpi_ops       # its synchronize: the one tests/workers/suite.py sets
from horovod.torch.compression import FP16Compressor, NoneCompressor

import checks
from checks import check

import hvd_compress
from hvd_compress.exchange.routes import make_communicator


def same_on_all_ranks(t, name):
    everyone = hvd.allgather(t.reshape(1, -1).contiguous(), name=name)
    return all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))


def train(wrap, steps=20):
    """A course-style script's training loop; returns the parameters and each step's loss
    averaged over the ranks (one allreduce of them all at the end: a collective a step would
    only add Horovod's latency, which is most of a step here)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = wrap(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(100 + hvd.rank())
    w_true = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 20, generator=data)
        y = (x @ w_true).argmax(1)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    losses = hvd.allreduce(torch.stack(losses), name="losses").tolist()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses


def run(hvd):
    RANK = hvd.rank()
    # 1. The course's names exist and are the plugin's classes; Horovod's own are untouched.
    check("names.bit8_is_plugin", hvd.Compression.bit8 is hvd_compress.Compression.bit8)
    check("names.bit16_is_plugin", hvd.Compression.bit16 is hvd_compress.Compression.bit16)
    check("names.none_fp16_stock", hvd.Compression.none is NoneCompressor and hvd.Compression.fp16 is FP16Compressor)

    # 2. Stock behaviour: none and fp16 still go through allreduce, identical to a plain allreduce.
    #    The plain references are launched together and waited for once (Horovod negotiates
    #    them in one go); the calls under test go one by one, as a script makes them.
    g = torch.Generator().manual_seed(RANK)
    cases = []
    for dtype in (torch.float32, torch.float64, torch.float16):
        for shape in ((17,), (4, 5), (), (2, 3, 7)):
            t = torch.randn(shape, generator=g).to(dtype)
            for op in (hvd.Average, hvd.Sum):
                tag = f"stock.{dtype}.{shape}.{op}"
                cases.append((tag, t, op, hvd.allreduce_async(t, op=op, name=tag + ".plain"),
                              hvd.allreduce_async(t.to(torch.float16), op=op, name=tag + ".plain16")))
    for tag, t, op, plain, plain16 in cases:
        out = hvd.allreduce(t, compression=hvd.Compression.none, op=op, name=tag + ".none")
        ref = mpi_ops.synchronize(plain)
        check(f"{tag}.none_identical", out.shape == t.shape and torch.equal(out, ref))
        out = hvd.allreduce(t, compression=hvd.Compression.fp16, op=op, name=tag + ".fp16")
        ref = mpi_ops.synchronize(plain16).to(t.dtype)
        check(f"{tag}.fp16_identical", out.shape == t.shape and out.dtype == t.dtype and torch.equal(out, ref))

    # 3. hvd.allreduce with bit8/bit16 equals the plugin's allgather reduction.
    for comp in (hvd.Compression.bit8, hvd.Compression.bit16):
        for op in (hvd.Average, hvd.Sum):
            t = torch.randn(1001, generator=g) * 1e-3
            out = hvd.allreduce(t, compression=comp, op=op, name=f"route.{comp.name}.{op}")
            ref = make_communicator(comp, "allgather", op, scale_block=None).reduce(
                [t], [f"plugin.{comp.name}.{op}"])[0]
            check(f"allreduce.{comp.name}.{op}.equals_plugin", torch.equal(out, ref))
            check(f"allreduce.{comp.name}.{op}.same_on_all_ranks", same_on_all_ranks(out, f"same.{comp.name}.{op}"))

    # 4. A course-style script: hvd.DistributedOptimizer(compression=hvd.Compression.bit8) trains,
    #    and lands on the same parameters, bit for bit, as the plugin's optimizer.
    for comp in (hvd.Compression.bit8, hvd.Compression.bit16):
        course, losses = train(lambda m, o: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters(),
                                                                     compression=comp))
        plugin, _ = train(lambda m, o: hvd_compress.DistributedOptimizer(o, named_parameters=m.named_parameters(),
                                                                         compression=comp, route="allgather",
                                                                         scale_block=None))
        check(f"optimizer.{comp.name}.loss_decreases", losses[-1] < 0.5 * losses[0], f"{losses[0]} -> {losses[-1]}")
        check(f"optimizer.{comp.name}.same_on_all_ranks", same_on_all_ranks(course, f"opt.{comp.name}"))
        check(f"optimizer.{comp.name}.equals_plugin", torch.equal(course, plugin),
              f"max diff {(course - plugin).abs().max()}")


if __name__ == "__main__":
    checks.main(run)
