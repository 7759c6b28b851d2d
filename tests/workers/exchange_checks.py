"""Run under horovodrun (tests/workers/suite.py, or alone): checks the compressed gradient
exchange across real ranks.

Every rank logs each check that holds (tests/workers/checks.py) and raises on the first that
does not; tests/test_exchange_multiprocess.py reads the logs of the jobs with 2, 3 and 4 ranks
under Gloo and MPI. The optimizer's checks (check_optimizer, below) run as a module of their own,
exchange_optimizer.py, at 2 and 4 ranks. With more than 2 ranks the job runs with HOROVOD_FUSION_THRESHOLD=0
(tests/hvdrun.py says why).
"""
import torch
import horovod.torch as hvd
from horovod.torch import mpi_ops       # its synchronize: the one tests/workers/suite.py sets

import checks
from checks import check

import hvd_compress as hc
from hvd_compress.codecs import SCALE_BLOCK
from hvd_compress.exchange.bucketing import chunk_bounds
from hvd_compress.exchange.routes import make_communicator

N = RANK = None                   # this job's world size and rank, set by run()


def rank_tensors(seed):
    """Gradient-like tensors, different on every rank; sizes not divisible by n, 0-d, empty."""
    g = torch.Generator().manual_seed(1000 * seed + RANK)
    shapes = [(1000,), (7,), (3, 5), (), (0,), (2, 3, 4), (1,)]
    scales = [1e-3, 1e-5, 1.0, 3e-2, 1.0, 1e-7, 5.0]
    return [torch.randn(s, generator=g) * c for s, c in zip(shapes, scales)]


def gather_inputs(tensors):
    """Every rank's copy of every tensor: list over tensors of (n, numel) float32 (launched
    together, waited for once: one negotiation, not one a tensor)."""
    handles = [hvd.allgather_async(t.reshape(1, -1).contiguous(), name=f"inputs.{i}")
               for i, t in enumerate(tensors)]
    return [mpi_ops.synchronize(h) for h in handles]


def blocks_of(numel, block):
    """(start, stop) of each scale block: `block` values, or the whole range for None."""
    block = block or max(numel, 1)
    return [(a, min(a + block, numel)) for a in range(0, numel, block)]


def decoded(comp, x, block):
    """x through the codec, block by block, by the per-tensor interface (compress a block as a
    tensor of its own): an independent way to the values the bucket path must produce."""
    out = torch.empty_like(x)
    for a, b in blocks_of(x.numel(), block):
        out[a:b] = comp.decode_packet(comp.compress(x[a:b])[0])
    return out


def simulate_allgather(comp, rows, average, block):
    """What the allgather route must produce: decode each rank's codes, float32 rank-order sum."""
    total = decoded(comp, rows[0], block).clone()
    for r in range(1, N):
        total += decoded(comp, rows[r], block)
    return total / N if average and N > 1 else total


def simulate_alltoall(comp, rows, average, block):
    """Two-phase, done on one process: per chunk (cut on block boundaries), reduce decoded
    codes, re-encode, decode."""
    out = torch.empty(rows.shape[1])
    for a, b in chunk_bounds(rows.shape[1], N, block or 1):
        reduced = simulate_allgather(comp, rows[:, a:b], average, block)
        out[a:b] = decoded(comp, reduced, block)
    return out


def float64_reference(comp, rows, average, block):
    """Decoded codes summed in float64: the true sum of what the ranks sent."""
    total = torch.zeros(rows.shape[1], dtype=torch.float64)
    for r in range(N):
        total += decoded(comp, rows[r], block).double()
    return total / N if average else total


def same_on_all_ranks(t, name):
    return bits_agree(t, hvd.allgather(t.reshape(1, -1).contiguous(), name=name))


def bits_agree(t, everyone):
    """Does every rank's row of `everyone` (an allgather of t) hold t's bits?"""
    return all(torch.equal(everyone[0].view(torch.int32 if t.dtype == torch.float32 else t.dtype),
                           everyone[r].view(torch.int32 if t.dtype == torch.float32 else t.dtype))
               for r in range(N))


def check_packet_routes():
    """Every route's buckets against the simulation. Each rank's inputs depend only on the seed
    (four of them), so they are gathered once a seed, not once a case; the buckets' bits from
    every rank are gathered in one go after the last case (a collective round under Gloo with
    4 ranks costs tens of milliseconds on 2 cores; the values checked are the same)."""
    inputs_of = {}                   # seed -> every rank's copy of every tensor
    pending = []                     # (check name, this rank's bucket, its allgather's handle)
    for comp in (hc.Compression.bit8, hc.Compression.bit16):
        for route in ("allgather", "alltoall"):
            for op, average in ((hvd.Average, True), (hvd.Sum, False)):
                for block, fusion in ((SCALE_BLOCK, None), (SCALE_BLOCK, 0), (None, None), (5, None)):
                    seed = len(route) + (2 if average else 0)
                    tensors = rank_tensors(seed=seed)
                    names = [f"t{i}" for i in range(len(tensors))]
                    if seed not in inputs_of:
                        inputs_of[seed] = gather_inputs(tensors)
                    inputs = inputs_of[seed]
                    comm = make_communicator(comp, route, op, fusion_threshold_bytes=fusion,
                                             scale_block=block)
                    tag = f"{comp.name}.{route}.{'avg' if average else 'sum'}.b{block}.f{fusion}"
                    out = comm.reduce(tensors, [f"{tag}.{n}" for n in names])
                    simulate = simulate_allgather if route == "allgather" else simulate_alltoall
                    groups = [group for group, _ in comm.plan(names, tensors)]
                    gots = [torch.cat([out[i].reshape(-1) for i in group]) for group in groups]
                    for group, got in zip(groups, gots):
                        rows = torch.cat([inputs[i] for i in group], dim=1)
                        expected = simulate(comp, rows, average, block)
                        where = f"{tag}.bucket{group[0]}"
                        check(f"{where}.equals_simulation", torch.equal(got, expected),
                              f"max diff {(got - expected).abs().max() if got.numel() else 0}")
                        pending.append((f"{where}.same_on_all_ranks", got, hvd.allgather_async(
                            got.reshape(1, -1), name=f"{where}.same")))
                        if route == "allgather":
                            ref = float64_reference(comp, rows, average, block)
                            bound = N * 2.0 ** -23 * float(rows.abs().sum(0).max()) if rows.numel() else 0.0
                            err = float((got.double() - ref).abs().max()) if got.numel() else 0.0
                            check(f"{where}.float64_reference", err <= bound, f"err {err} > {bound}")
                    for i, t in enumerate(tensors):
                        check(f"{tag}.t{i}.shape_dtype", out[i].shape == t.shape and out[i].dtype == t.dtype)
    for name, got, handle in pending:
        check(name, bits_agree(got, mpi_ops.synchronize(handle)))


def check_allreduce_routes():
    tensors = rank_tensors(seed=7)[:3]
    for comp in (hc.Compression.none, hc.Compression.fp16):
        for op in (hvd.Average, hvd.Sum):
            outs = make_communicator(comp, None, op).reduce([t.clone() for t in tensors],
                                                             [f"{comp.__name__}.{op}.{i}" for i in range(3)])
            # the references launched together, waited for once
            refs = []
            for i, t in enumerate(tensors):
                c, ctx = comp.compress(t.clone())
                refs.append((hvd.allreduce_async(c, op=op, name=f"ref.{comp.__name__}.{op}.{i}"), ctx))
            for i, (handle, ctx) in enumerate(refs):
                ref = comp.decompress(mpi_ops.synchronize(handle), ctx)
                check(f"allreduce.{comp.__name__}.{op}.t{i}.identical_to_hvd_allreduce", torch.equal(outs[i], ref))


class Model(torch.nn.Module):
    """Two layers, and a third that only rank 0 uses on odd steps: some parameters have no
    gradient on some ranks (dynamic graphs), as Horovod's optimizer must handle."""
    def __init__(self):
        super().__init__()
        self.a, self.b, self.extra = torch.nn.Linear(20, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x, step):
        h = torch.relu(self.a(x))
        out = self.b(h)
        return out + self.extra(h) if RANK == 0 and step % 2 else out


def train(make_optimizer, steps=3, passes=1, exchange=None):
    """Parameters after `steps` steps of `passes` backward passes each; `exchange`, if given,
    replaces the optimizer's own exchange (called after backward with the model). Three steps:
    the layer only rank 0 uses has no gradient anywhere (step 0), on rank 0 only (step 1), and
    none again after it had one (step 2), with momentum carried through; more steps repeat
    these (five did, at a collective round a step)."""
    torch.manual_seed(0)
    model = Model()
    opt = make_optimizer(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(RANK)
    for step in range(steps):
        opt.zero_grad()
        for _ in range(passes):
            x, y = torch.randn(32, 20, generator=g), torch.randint(0, 4, (32,), generator=g)
            torch.nn.functional.cross_entropy(model(x, step), y).backward()
        if exchange:
            exchange(model)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def exchange_after_backward(comm):
    """The exchange without hooks: every gradient, last layer first, through comm.reduce."""
    def run(model):
        named = list(model.named_parameters())[::-1]
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = comm.reduce([p.grad for _, p in named], [n for n, _ in named])
        for (_, p), r in zip(named, grads):
            p.grad.copy_(r)
    return run


def check_optimizer():
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for comp, name in ((hc.Compression.none, "none"), (hc.Compression.fp16, "fp16")):
        for passes in (1, 2):
            ours = train(lambda m: hc.DistributedOptimizer(sgd(m), m.named_parameters(), compression=comp,
                                                           backward_passes_per_step=passes), passes=passes)
            stock = train(lambda m: hvd.DistributedOptimizer(sgd(m), m.named_parameters(), compression=comp,
                                                             backward_passes_per_step=passes), passes=passes)
            check(f"optimizer.{name}.passes{passes}.identical_to_hvd_DistributedOptimizer",
                  torch.equal(ours, stock), f"max diff {(ours - stock).abs().max()}")
    for comp in (hc.Compression.bit8, hc.Compression.bit16):
        for route in ("allgather", "alltoall"):
            # Overlap changes nothing: hooks during backward == one exchange after backward,
            # with several buckets (a 600-byte threshold splits this model into 3).
            hooked = {}
            for fusion in (600, None):
                hooked[fusion] = train(lambda m: hc.DistributedOptimizer(
                    sgd(m), m.named_parameters(), compression=comp, route=route,
                    error_feedback=False, fusion_threshold_bytes=fusion))
                comm = make_communicator(comp, route, fusion_threshold_bytes=fusion)
                plain = train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                              exchange=exchange_after_backward(comm))
                check(f"optimizer.{comp.name}.{route}.f{fusion}.hooks_equal_exchange_after_backward",
                      torch.equal(hooked[fusion], plain), f"max diff {(hooked[fusion] - plain).abs().max()}")
            for ef in (False, True):
                # without error feedback: the run just made with the default bucket size (the
                # same optimizer, trained again, gave the same bits: it was a run of its own)
                params = hooked[None] if not ef else train(lambda m: hc.DistributedOptimizer(
                    sgd(m), m.named_parameters(), compression=comp, route=route, error_feedback=True))
                tag = f"optimizer.{comp.name}.{route}.ef{int(ef)}"
                check(f"{tag}.finite", bool(torch.isfinite(params).all()))
                check(f"{tag}.same_on_all_ranks", same_on_all_ranks(params, tag))
    # An explicit synchronize() (to clip gradients), then step() under skip_synchronize().
    def clipped(m):
        opt = hc.DistributedOptimizer(sgd(m), m.named_parameters(), compression=hc.Compression.bit8)
        step = opt.step

        def step_after_clipping(closure=None):
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            with opt.skip_synchronize():
                return step(closure)
        opt.step = step_after_clipping
        return opt
    params = train(clipped)
    check("optimizer.skip_synchronize.same_on_all_ranks", same_on_all_ranks(params, "clip"))


def check_advance():
    """The two-phase route's advance() leaves no bucket in phase 1 (each phase 2 launched as its
    phase 1 completed, in any order), and finishing the buckets in reverse order then gives
    the bits of reduce()."""
    tensors = rank_tensors(seed=11)
    names = [f"adv{i}" for i in range(len(tensors))]
    for comp in (hc.Compression.bit8, hc.Compression.bit16):
        comm = make_communicator(comp, "alltoall", fusion_threshold_bytes=40)
        planned = comm.plan(names, tensors, prefix=f"{comp.name}.advance.")
        check(f"{comp.name}.alltoall.advance.several_buckets", len(planned) > 2, f"{len(planned)} buckets")
        exchanges = []
        for group, bucket in planned:
            for j, i in enumerate(group):
                bucket.put(j, tensors[i])
            exchanges.append(comm.start(bucket))
        comm.advance(exchanges)
        check(f"{comp.name}.alltoall.advance.every_phase2_launched", all(ex.phase == 2 for ex in exchanges),
              f"phases {[ex.phase for ex in exchanges]}")
        for ex in reversed(exchanges):
            comm.finish(ex)
        expected = make_communicator(comp, "alltoall", fusion_threshold_bytes=40).reduce(tensors, names)
        for (group, bucket), ex in zip(planned, exchanges):
            for j, i in enumerate(group):
                check(f"{comp.name}.alltoall.advance.t{i}.equals_reduce",
                      torch.equal(bucket.result(j).reshape(-1), expected[i].reshape(-1)))


def run(hvd):
    global N, RANK
    N, RANK = hvd.size(), hvd.rank()
    check_allreduce_routes()
    check_packet_routes()
    check_advance()


if __name__ == "__main__":
    checks.main(run)
