"""Run under horovodrun with the disagreements named on the command line (compression, shape),
one after another in the one job: on every rank hc.DistributedOptimizer must refuse each with a
clear RuntimeError instead of hanging in a collective.

One launch for all cases: the ranks' agreement check (optimizer._check_ranks_agree) is one
allgather_object that every rank completes before every rank raises, so a refusal leaves
Horovod as it found it and the next case starts clean; a case that hung would hang the job,
and one that went through prints "was not stopped" and makes the job succeed (the test fails
either way). Exit status 3 once every case was refused on this rank."""
import sys

import torch
import horovod.torch as hvd

import hvd_compress as hc


def disagree(case, rank):
    """Build the optimizer with `case`'s disagreement on rank 1; the refusal's text, or None."""
    compression = hc.Compression.bit8
    width = 8
    if case == "compression" and rank == 1:
        compression = hc.Compression.none        # rank 1 sends float32, the others 8-bit codes
    elif case == "shape" and rank == 1:
        width = 9                                # same parameter name, different shape
    elif case not in ("compression", "shape"):
        raise ValueError(f"no such case {case!r}")
    model = torch.nn.Linear(width, 3)
    try:
        hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(), compression=compression)
    except RuntimeError as err:
        return str(err)
    return None


def main(cases):
    hvd.init()
    rank = hvd.rank()
    refused = 0
    for case in cases:
        why = disagree(case, rank)
        if why is None:
            print(f"rank {rank} case {case}: was not stopped", flush=True)
        else:
            print(f"rank {rank} case {case}: refused: {why}", flush=True)
            refused += 1
    sys.exit(3 if refused == len(cases) else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
