"""Tiny assertion log for worker modules that run under horovodrun.

Each rank appends one line per passed check to $HVDC_CHECK_DIR/rank<r>.txt (stdout of several
MPI ranks interleaves on one line, so the tests read these files instead), and raises
CheckFailed on the first failure. The driver (suite.py) frames each module's checks with
BEGIN/END lines and writes a FAILED line (and the traceback beside it) when a module raises,
so the test side can tell a module that passed from one that failed, was cut short, or never
ran (tests/hvdrun.py reads the logs). Without $HVDC_CHECK_DIR (run by hand) each passed check
is printed instead, one line per rank, so a compressor's author can run the checks alone:

    PYTHONPATH=docs/examples horovodrun -np 2 python tests/workers/checks.py e2m1_example:E2M1Compressor
"""
import os
import time
import traceback
from pathlib import Path

BEGIN, END, FAILED, DONE = "## BEGIN ", "## END ", "## FAILED ", "ALL CHECKS DONE"

_rank = None


class CheckFailed(AssertionError):
    """A check that did not hold: carries its name and detail for the FAILED line."""

    def __init__(self, name, detail):
        super().__init__(f"rank {_rank}: {name} failed {detail}")
        self.check, self.detail = name, detail


def start(rank):
    global _rank
    _rank = rank
    if _path() is not None:
        _path().write_text("")


def _path(suffix="txt"):
    """This rank's log under $HVDC_CHECK_DIR, or None when the checks run by hand."""
    folder = os.environ.get("HVDC_CHECK_DIR")
    return Path(folder) / f"rank{_rank}.{suffix}" if folder else None


def _write(line):
    if _path() is None:
        print(f"rank {_rank}: {line}", flush=True)
        return
    with open(_path(), "a") as f:          # closed at once: a rank killed next still left it
        f.write(line + "\n")


def check(name, cond, detail=""):
    if not cond:
        raise CheckFailed(name, detail)
    _write(name)


def begin(module):
    _write(f"{BEGIN}{time.time():.6f} {module}")          # times: what each module costs


def end(module):
    _write(f"{END}{time.time():.6f} {module}")


def failed(module, err):
    """Record why `module` stopped on this rank: one line for the test's message, with the time
    (the first rank to fail is the cause, the others may fail because it left), and the whole
    traceback in rank<r>.traceback."""
    if isinstance(err, CheckFailed):
        what = f"check {err.check!r} failed: {err.detail}"
    else:
        what = f"{type(err).__name__}: {err}"
    _write(f"{FAILED}{time.time():.6f} {module}: " + " ".join(what.split()))
    if _path() is not None:
        _path("traceback").write_text("".join(traceback.format_exception(type(err), err, err.__traceback__)))


def done():
    _write(DONE)


def main(run):
    """A worker module run alone (python tests/workers/<module>.py under horovodrun)."""
    import horovod.torch as hvd
    hvd.init()
    start(hvd.rank())
    run(hvd)
    done()


def same_everywhere(tensors):
    """Do all ranks hold the same bits in these tensors? Their bytes, one row a rank, in one
    allgather (allgather_object takes two collectives and a pickle: a collective costs tens of
    milliseconds under Gloo with 4 ranks on 2 cores); ranks whose tensors differ in size fail
    too (Horovod refuses rows of different widths)."""
    import horovod.torch as hvd
    import torch
    mine = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    everyone = hvd.allgather(mine.reshape(1, -1), name="checks.same_everywhere")
    return bool((everyone == everyone[0]).all())


def trains(tag, compression, steps=10):
    """A small MLP trained by hc.DistributedOptimizer with `compression` on this rank's data:
    checks that the ranks end with identical parameters and that the loss fell. Ten steps, not
    20 or 30: on these fixed batches every loss after the first step is below the first, on
    every rank, with int8, 1-bit, top-k, PowerSGD and bfloat16 at 2 and 4 ranks (at step 10,
    0.88-0.96 of the first; measured), and each step is a collective round or two."""
    import torch
    import hvd_compress as hc
    import horovod.torch as hvd
    if _rank is None:                      # called on its own, not from a job's module
        start(hvd.rank())
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


if __name__ == "__main__":
    # horovodrun -np 2 python tests/workers/checks.py MODULE:CLASS [STEPS]: a compressor of your
    # own trained on every rank (its module on PYTHONPATH); a failed check raises CheckFailed
    import importlib
    import sys
    import horovod.torch as hvd
    hvd.init()
    module, _, attr = sys.argv[1].partition(":")
    compressor = getattr(importlib.import_module(module), attr)
    trains(attr, compressor, steps=int(sys.argv[2]) if len(sys.argv) > 2 else 10)
