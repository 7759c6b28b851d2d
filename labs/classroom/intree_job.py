"""The in-tree route on every rank, from a plain Horovod script: does the student's patched
Horovod's `hvd.Compression.bit8` / `.bit16` average like the kit's own compressors?

    PYTHONPATH=<student's Horovod>:<kit> horovodrun -np 2 --gloo python -m labs.classroom.intree_job OUT

Writes OUT/rank<R>.json. Where the student's Horovod is the one the grader's ranks run, the
grader's 2-rank job calls run_checks itself (labs.classroom.rank_job), with no launch of its own.
"""
import json
import sys
from pathlib import Path

import torch

import horovod.torch as hvd

from labs.classroom.checks import error_text
from labs.classroom.rank_job import rank_input


def allreduce_check(name):
    """hvd.allreduce(x, compression=hvd.Compression.<name>) against the average of every
    rank's packet decoded by the kit's compressor, and the same on every rank."""
    import compression                                   # the kit's module (on PYTHONPATH)
    kit_compressor = getattr(compression, {"bit8": "Bit8Compressor", "bit16": "Bit16Compressor"}[name])
    hvd_compressor = getattr(hvd.Compression, name)
    got = hvd.allreduce(rank_input(hvd.rank()), compression=hvd_compressor, name=f"intree.{name}")
    total = torch.zeros(1000)
    for r in range(hvd.size()):
        packet, ctx = kit_compressor.compress(rank_input(r))
        total += kit_compressor.decompress(packet, ctx).float()
    want = total / hvd.size()
    every = hvd.allgather(got.reshape(1, -1), name=f"intree.check.{name}")
    return {"ok": bool(torch.equal(got, want)) and bool((every == every[0]).all()),
            "max_error": float((got - want).abs().max()), "error": None}


def optimizer_check():
    """One hvd.DistributedOptimizer step with compression=bit8: the ranks' weights stay equal."""
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.bit8)
    torch.manual_seed(1 + hvd.rank())
    model(torch.randn(8, 10)).sum().backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.reshape(1, -1), name="intree.optimizer")
    return {"ok": bool((every == every[0]).all()), "error": None}


def run_checks():
    """This rank's record: both allreduces and the optimizer, each error a finding (also run
    inside the grader's 2-rank job, labs.classroom.rank_job, with the kit on the path)."""
    record = {"horovod": hvd.__file__}
    for key, run in (("bit8", lambda: allreduce_check("bit8")),
                     ("bit16", lambda: allreduce_check("bit16")),
                     ("optimizer", optimizer_check)):
        try:
            record[key] = run()
        except Exception as err:
            record[key] = {"ok": False, "error": error_text(err)}
    return record


def main(out):
    hvd.init()
    record = run_checks()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
