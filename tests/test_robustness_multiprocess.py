"""Odd gradients and disagreeing ranks across 2 real ranks (horovodrun, Gloo and MPI): the odd
gradients in the shared job of each configuration (tests/hvdrun.py), the disagreeing ranks in
the jobs that must fail (tests/hvdrun.py's MUST_FAIL), never in a shared one."""
import pytest

from hvdrun import across_ranks, must_fail_job, passed_checks, uses_must_fail_job

pytestmark = pytest.mark.multiprocess


@across_ranks("odd_gradients")
def test_odd_gradients_across_two_ranks(controller, np, request):
    names = passed_checks(request)
    for route in ("none.None", "fp16.None", "bit8.allgather", "bit8.alltoall", "bit16.allgather", "bit16.alltoall"):
        for what in ("nan_stays_nan", "inf_stays_inf", "sparse_refused_clearly", "only_rank0.value"):
            assert f"{route}.{what}" in names


@pytest.mark.parametrize("case", ["compression", "shape"])
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
@uses_must_fail_job("{controller}-fails")
def test_disagreeing_ranks_fail_clearly_on_every_rank(case, controller, request):
    """Both disagreements run first in the job whose rank 1 then fails a check on purpose
    (tests/hvdrun.py's MUST_FAIL); every rank must refuse each, naming the disagreement: the
    rank checks the refusal's text itself (tests/workers/disagreeing_ranks.py), and the job's
    logs say that every rank passed the same checks."""
    job = must_fail_job(request)
    names, problem = job.module_checks("disagreeing_ranks")
    assert names is not None, problem
    assert {f"{case}.refused", f"{case}.refusal_names_the_disagreement"} <= set(names), names
    assert all(log.seconds["disagreeing_ranks"] < 120 for log in job.logs)    # refused, not hung
