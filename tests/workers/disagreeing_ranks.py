"""A worker module for the jobs that must fail (tests/hvdrun.py's MUST_FAIL, not the shared
SUITE): ranks that disagree (compression, a parameter's shape) must make
hc.DistributedOptimizer refuse, on every rank, with a clear RuntimeError that names the
disagreement, instead of hanging in a collective. A case that went through fails a check naming
it and the rank; one that hung would leave the job without a log line until it is killed.

It runs first in its job, before a rank fails on purpose: the ranks' agreement check
(FrontCore.agree) is one allgather_object that every rank completes before every
rank raises, so a refusal leaves Horovod as it found it and the next case (and module) starts
clean. Each rank also prints its refusal, for the launcher's output."""
import torch

import hvd_compress as hc
import checks

REFUSAL = "hvd_compress.DistributedOptimizer: ranks disagree"
# case -> what the refusal must say (rank 1 is the odd one out, of 2 ranks)
CASES = {"compression": "compression: rank 0 has 'bit8', rank 1 has 'none'",
         "shape": "parameters: rank 0 has"}


def disagree(case, rank):
    """Build the optimizer with `case`'s disagreement on rank 1; the refusal's text, or None."""
    compression = hc.Compression.bit8
    width = 8
    if case == "compression" and rank == 1:
        compression = hc.Compression.none        # rank 1 sends float32, the others 8-bit codes
    elif case == "shape" and rank == 1:
        width = 9                                # same parameter name, different shape
    model = torch.nn.Linear(width, 3)
    try:
        hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(), compression=compression)
    except RuntimeError as err:
        return str(err)
    return None


def run(hvd):
    rank = hvd.rank()
    for case, detail in CASES.items():
        why = disagree(case, rank)
        print(f"rank {rank} case {case}: " + (f"refused: {why}" if why else "was not stopped"), flush=True)
        checks.check(f"{case}.refused", why is not None, "was not stopped")
        checks.check(f"{case}.refusal_names_the_disagreement", why.startswith(REFUSAL) and detail in why, why)


if __name__ == "__main__":
    checks.main(run)
