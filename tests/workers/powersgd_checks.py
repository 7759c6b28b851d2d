"""Run under horovodrun (tests/workers/suite.py, or alone): PowerSGD on real ranks
(hvd_compress/methods/powersgd.py): every rank holds the same bits, equal (within float32 rounding:
Horovod's ring sums in its own order) to the one-process reference `powersgd.approximate` over
all ranks' gradients, through several steps of warm start and error feedback; at full rank it is
the exact mean; bytes counted equal the formula; the optimizer trains with it; its state
survives a save and load."""
import torch

import hvd_compress as hc
from hvd_compress.methods.powersgd import (PowerSGD, PowerSGDCommunicator, approximate, initial_q,
                                           matrix_shape)
from hvd_compress.registry import powersgd_step_bytes
import checks

SHAPES = [(6, 4), (5,), (3, 2, 2, 2), (8, 1), (1, 7), (16, 9)]
NAMES = [f"t{i}" for i in range(len(SHAPES))]


def grads(step, r):
    gen = torch.Generator().manual_seed(1000 * step + r)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def run(hvd):
    rank, world = hvd.rank(), hvd.size()
    for rk in (1, 2, 8):
        comm = PowerSGDCommunicator(PowerSGD(rank=rk))
        residual = {(r, n): torch.zeros(matrix_shape(s)) for r in range(world)
                    for n, s in zip(NAMES, SHAPES) if matrix_shape(s)}
        qs = {}
        for step in range(3):
            out = comm.reduce(grads(step, rank), NAMES)
            every = [grads(step, r) for r in range(world)]
            close = True
            for i, (name, shape) in enumerate(zip(NAMES, SHAPES)):
                nm = matrix_shape(shape)
                if nm is None:
                    ref = sum(g[i] for g in every) / world
                else:
                    comp = [every[r][i].reshape(nm) + residual[(r, name)] for r in range(world)]
                    q = qs.get(name, initial_q(name, nm[1], min(rk, *nm), 0))
                    approx, qs[name] = approximate(comp, q)
                    for r in range(world):
                        residual[(r, name)] = comp[r] - approx
                    ref = approx.view(shape)
                    if rk >= min(nm):       # full rank: the exact mean of the compensated gradients
                        close &= torch.allclose(approx, sum(comp) / world, rtol=1e-4, atol=1e-5)
                close &= torch.allclose(out[i], ref, rtol=1e-4, atol=1e-5)
            checks.check(f"rank{rk}.step{step}.equals_reference", close)
            checks.check(f"rank{rk}.step{step}.identical_on_all_ranks", checks.same_everywhere(out))
            stats = comm.pop_stats()
            checks.check(f"rank{rk}.step{step}.bytes_equal_formula",
                         stats["bytes_sent"] == powersgd_step_bytes(SHAPES, world, rk),
                         f"{stats['bytes_sent']} != {powersgd_step_bytes(SHAPES, world, rk)}")

    # state: a communicator loaded from another's state_dict continues with the same bits
    a = PowerSGDCommunicator(PowerSGD(rank=2))
    a.reduce(grads(0, rank), NAMES)
    b = PowerSGDCommunicator(PowerSGD(rank=2))
    b.load_state_dict(a.state_dict())
    out_a, out_b = a.reduce(grads(1, rank), NAMES), b.reduce(grads(1, rank), NAMES)
    checks.check("state_dict.resume_gives_same_bits", all(torch.equal(x, y) for x, y in zip(out_a, out_b)))

    # the optimizer with PowerSGD: trains, same parameters on every rank
    checks.trains("optimizer", hc.Compression.powersgd(2))


if __name__ == "__main__":
    checks.main(run)
