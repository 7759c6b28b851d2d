"""Tiny assertion log for worker scripts that run under horovodrun.

Each rank appends `name` per passed check to $HVDC_CHECK_DIR/rank<r>.txt (stdout of several
MPI ranks interleaves on one line, so the tests read these files instead), and raises on the
first failure so the launcher exits non-zero.
"""
import os

_rank = None


def start(rank):
    global _rank
    _rank = rank
    _path().write_text("")


def _path():
    from pathlib import Path
    return Path(os.environ["HVDC_CHECK_DIR"]) / f"rank{_rank}.txt"


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"rank {_rank}: {name} failed {detail}")
    with open(_path(), "a") as f:
        f.write(name + "\n")


def done():
    check("ALL CHECKS DONE", True)


def same_everywhere(tensors):
    """Do all ranks hold the same bits in these tensors?"""
    import horovod.torch as hvd
    import torch
    everywhere = hvd.allgather_object([t.detach().clone() for t in tensors])
    return all(torch.equal(a, b) for other in everywhere for a, b in zip(other, everywhere[0]))


def trains(tag, compression, steps=30):
    """A small MLP trained by hc.DistributedOptimizer with `compression` on this rank's data:
    checks that the ranks end with identical parameters and that the loss fell."""
    import torch
    import hvd_compress as hc
    import horovod.torch as hvd
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), compression=compression)
    gen = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(32, 10, generator=gen), torch.randn(32, 3, generator=gen)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    check(f"{tag}.identical_on_all_ranks", same_everywhere(list(model.parameters())))
    check(f"{tag}.loss_falls", losses[-1] < losses[0], f"{losses[0]} -> {losses[-1]}")
