"""Run under horovodrun (tests/workers/suite.py, or alone): Top-K on real ranks
(hvd_compress/methods/topk.py): through several steps with error feedback, every rank holds the same
bits, equal BIT FOR BIT to the one-process reference (select, scatter_sum in rank order, / n);
bytes counted equal the formula; the optimizer trains with it."""
import torch

import hvd_compress as hc
from hvd_compress.methods.topk import TopK, TopKCommunicator, scatter_sum, select
from hvd_compress.registry import topk_step_bytes
import checks

SHAPES = [(6, 4), (5,), (3, 2, 2, 2), (1000,), (1,)]
NAMES = [f"t{i}" for i in range(len(SHAPES))]


def grads(step, r):
    gen = torch.Generator().manual_seed(1000 * step + r)
    out = [torch.randn(s, generator=gen) for s in SHAPES]
    out[3][::7] = 0.5          # many ties at one magnitude
    return out


def run(hvd):
    rank, world = hvd.rank(), hvd.size()
    for ratio in (0.01, 0.1, 1.0):
        method = TopK(ratio)
        comm = TopKCommunicator(method)
        residual = {(r, n): torch.zeros(torch.Size(s).numel()) for r in range(world) for n, s in zip(NAMES, SHAPES)}
        for step in range(3):
            out = comm.reduce(grads(step, rank), NAMES)
            every = [grads(step, r) for r in range(world)]
            exact = True
            for i, (name, shape) in enumerate(zip(NAMES, SHAPES)):
                idxs, vals = [], []
                for r in range(world):
                    g = every[r][i].reshape(-1) + residual[(r, name)]
                    idx = select(g, method.k(g.numel()))
                    idxs.append(idx)
                    vals.append(g[idx])
                    left = g.clone()
                    left[idx] = 0
                    residual[(r, name)] = left
                ref = scatter_sum(idxs, vals, g.numel()).div_(world).view(shape) if world > 1 else \
                    scatter_sum(idxs, vals, g.numel()).view(shape)
                exact &= torch.equal(out[i], ref)
            checks.check(f"ratio{ratio}.step{step}.equals_reference_bit_for_bit", exact)
            checks.check(f"ratio{ratio}.step{step}.identical_on_all_ranks", checks.same_everywhere(out))
            sent = comm.pop_stats()["bytes_sent"]
            formula = topk_step_bytes([tuple(s) for s in SHAPES], world, ratio)
            checks.check(f"ratio{ratio}.step{step}.bytes_equal_formula", sent == formula, f"{sent} != {formula}")

    checks.trains("optimizer", hc.Compression.topk(0.1))


if __name__ == "__main__":
    checks.main(run)
