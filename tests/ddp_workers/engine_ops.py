"""TorchEngine on real Gloo ranks: every operation the communicators use gives what the engine's
contract says (hvd_compress/engine/base.py), checked against values every rank can compute
alone: average = DDP's divide-then-sum, bit for bit; allgather rows in rank order; alltoall of
unequal splits; a blocking allgather of unequal first dimensions; objects; poll and wait."""
import torch

from hvd_compress.engine.base import AVERAGE, SUM
from hvd_compress.engine.distributed import TorchEngine
import checks


def values(r, numel=1001):
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + r))


def run(dist):
    eng = TorchEngine()
    n, me = eng.size(), eng.rank()
    checks.check("size and rank", (n, me) == (dist.get_world_size(), dist.get_rank()))

    # allreduce, average: each rank divides by n, then the group sums (DDP's allreduce_hook)
    x = values(me)
    h = eng.allreduce_async_(x, "avg", AVERAGE)
    got = eng.wait(h)
    ref = values(0) / n
    for r in range(1, n):
        ref = ref + values(r) / n
    # a sum's order inside Gloo's ring may differ from 0..n-1 at n > 2: compare with DDP itself
    ddp = values(me)
    ddp.div_(n)
    dist.all_reduce(ddp)
    checks.check("allreduce average = DDP's divide-then-sum, bit for bit", torch.equal(got, ddp))
    checks.check("allreduce average close to the mean", torch.allclose(got, ref, atol=1e-6))
    checks.check("allreduce is in place", got.data_ptr() == x.data_ptr())
    s = torch.full((3,), float(me + 1))
    checks.check("allreduce sum", torch.equal(eng.wait(eng.allreduce_async_(s, "sum", SUM)),
                                              torch.full((3,), float(n * (n + 1) // 2))))

    # allgather: equal shapes, rows in rank order, uint8 as the packet routes send
    msg = torch.full((5,), me, dtype=torch.uint8)
    h = eng.allgather_async(msg, "gather")
    out = eng.synchronize(h)
    checks.check("allgather rows in rank order",
                 torch.equal(out.view(n, 5), torch.arange(n, dtype=torch.uint8)[:, None].expand(n, 5)))
    checks.check("poll after synchronize says done", eng.poll(h))
    two = torch.full((2, 3), float(me))
    g2 = eng.wait(eng.allgather_async(two, "gather2d"))
    checks.check("allgather of 2-D rows", g2.shape == (2 * n, 3) and
                 torch.equal(g2[::2, 0], torch.arange(n, dtype=torch.float32)))

    # alltoall with unequal splits (the same on every rank, as the two-phase route sends)
    splits = [k + 1 for k in range(n)]
    send = torch.cat([torch.full((k + 1,), 10 * me + k, dtype=torch.uint8) for k in range(n)])
    received, rsplits = eng.wait(eng.alltoall_async(send, torch.tensor(splits, dtype=torch.int32), "a2a"))
    want = torch.cat([torch.full((me + 1,), 10 * r + me, dtype=torch.uint8) for r in range(n)])
    checks.check("alltoall: chunk k of every rank to rank k", torch.equal(received, want))
    checks.check("alltoall: received splits", rsplits.tolist() == [me + 1] * n)
    try:
        eng.alltoall_async(send, [1] * n, "bad")
        checks.check("alltoall refuses splits that do not cut the tensor", False)
    except ValueError as err:
        checks.check("alltoall refuses splits that do not cut the tensor", "splits" in str(err))

    # blocking allgather, first dimensions differing by rank
    rows = torch.full((me + 1, 2), float(me))
    every = eng.allgather(rows, "rows")
    want = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(n)])
    checks.check("allgather of unequal first dimensions", torch.equal(every, want))

    # objects: auto's plan and measurements
    checks.check("allgather_object", eng.allgather_object({"r": me}, "obj") == [{"r": r} for r in range(n)])
    plan = {"labels": ["bit8:alltoall"], "from": me}
    got = eng.broadcast_object(plan if me == n - 1 else None, root_rank=n - 1, name="plan")
    checks.check("broadcast_object from the last rank", got == {"labels": ["bit8:alltoall"], "from": n - 1})
    checks.check("parse_op", eng.parse_op(AVERAGE) == AVERAGE and eng.parse_op("max") is None)

    # allgather of rows whose count differs by rank, the counts known to all (two-phase route)
    sizes = [r + 2 for r in range(n)]
    mine = torch.full((me + 2,), me, dtype=torch.uint8)
    got = eng.wait(eng.allgather_async(mine, "sized", sizes=sizes))
    checks.check("allgather with known unequal sizes",
                 torch.equal(got, torch.cat([torch.full((r + 2,), r, dtype=torch.uint8) for r in range(n)])))

    # a large allgather goes in pieces on Gloo (distributed.GATHER_PIECE_BYTES): the same rows,
    # in rank order, equal or padded to known unequal sizes, 1-D bytes and 2-D floats
    from hvd_compress.engine import distributed
    checks.check("gathers are whole unless in_pieces is set", not eng.in_pieces
                 and eng._gather_pieces(torch.zeros(1 << 20, dtype=torch.uint8)) == 1)
    eng.in_pieces = True
    g = torch.Generator().manual_seed(me)
    big = torch.randint(0, 256, (300_001 + 1000 * me,), dtype=torch.uint8, generator=g)
    every = [torch.randint(0, 256, (300_001 + 1000 * r,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(r)) for r in range(n)]
    checks.check("a large allgather goes in pieces", eng._gather_pieces(big) > 1,
                 f"{eng._gather_pieces(big)}")
    got = eng.wait(eng.allgather_async(big, "big", sizes=[e.numel() for e in every]))
    checks.check("a large allgather in pieces: the rows in rank order, sizes cut back",
                 torch.equal(got, torch.cat(every)))
    rows2 = torch.arange(40_000 * 3, dtype=torch.float32).view(40_000, 3) + 1e6 * me
    got2 = eng.wait(eng.allgather_async(rows2, "big2d"))
    checks.check("a large allgather of 2-D rows in pieces",
                 torch.equal(got2, torch.cat([rows2 - 1e6 * me + 1e6 * r for r in range(n)])))
    pieces = eng._gather_pieces(big)
    distributed.GATHER_MOST_PIECES, most = 1, distributed.GATHER_MOST_PIECES
    try:
        whole = eng.wait(eng.allgather_async(big, "whole", sizes=[e.numel() for e in every]))
    finally:
        distributed.GATHER_MOST_PIECES = most
    checks.check("pieces and one piece give the same bits", pieces > 1 and torch.equal(whole, got))

    # ... and so does a large alltoall, with unequal splits (the same on every rank)
    splits = [200_000 + 7 * k for k in range(n)]
    send = torch.randint(0, 1 << 30, (sum(splits),), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(me))
    received, rsplits = eng.wait(eng.alltoall_async(send, splits, "a2a-big"))
    distributed.GATHER_MOST_PIECES, most = 1, distributed.GATHER_MOST_PIECES
    try:
        whole, _ = eng.wait(eng.alltoall_async(send, splits, "a2a-whole"))
    finally:
        distributed.GATHER_MOST_PIECES = most
    def chunk_of(r):               # rank r's chunk for this rank, drawn as rank r drew it
        theirs = torch.randint(0, 1 << 30, (sum(splits),), dtype=torch.int32,
                               generator=torch.Generator().manual_seed(r))
        return theirs[sum(splits[:me]):sum(splits[:me + 1])]
    checks.check("a large alltoall in pieces: chunk k of every rank to rank k",
                 eng._gather_pieces(send) > 1 and rsplits.tolist() == [splits[me]] * n
                 and torch.equal(received, torch.cat([chunk_of(r) for r in range(n)])))
    checks.check("a large alltoall: pieces and one piece give the same bits",
                 torch.equal(received, whole))
    eng.in_pieces = False
    checks.check("large collectives are timed, by the bytes this rank sent",
                 n == 1 or (len(eng.sent_times) >= 2 and all(t > 0 for _, t in eng.sent_times)
                            and (300_001 + 1000 * (n - 1)) * (n - 1) in [b for b, _ in eng.sent_times]),
                 f"{eng.sent_times}")
