"""Odd gradients and disagreeing ranks across 2 real ranks (horovodrun, Gloo and MPI): the odd
gradients in the shared job of each configuration (tests/hvdrun.py), the disagreeing ranks in
launches of their own (they must fail)."""
import re
import subprocess
import sys
import time

import pytest

from labs.kit.launch import horovodrun_command, launch_env
from hvdrun import WORKERS, across_ranks, passed_checks

pytestmark = pytest.mark.multiprocess


@across_ranks("odd_gradients")
def test_odd_gradients_across_two_ranks(controller, np, request):
    names = passed_checks(request)
    for route in ("none.None", "fp16.None", "bit8.allgather", "bit8.alltoall", "bit16.allgather", "bit16.alltoall"):
        for what in ("nan_stays_nan", "inf_stays_inf", "sparse_refused_clearly", "only_rank0.value"):
            assert f"{route}.{what}" in names


CASES = {"compression": "compression: rank 0 has 'bit8', rank 1 has 'none'",
         "shape": "parameters: rank 0 has"}
_LAUNCHES = {}          # controller -> (exit status, output, seconds): one launch, both cases


def disagreeing_launch(controller):
    """Both disagreements in one 2-rank job (tests/workers/disagreeing_ranks.py says why they
    cannot interfere), launched by the first test of the controller."""
    if controller not in _LAUNCHES:
        start = time.monotonic()
        proc = subprocess.run(horovodrun_command(2, [sys.executable, str(WORKERS / "disagreeing_ranks.py"),
                                                     *CASES], controller),
                              env=launch_env(), capture_output=True, text=True, timeout=300)
        _LAUNCHES[controller] = (proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start)
    return _LAUNCHES[controller]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_disagreeing_ranks_fail_clearly_on_every_rank(case, controller):
    returncode, out, seconds = disagreeing_launch(controller)
    assert returncode != 0, out[-3000:]
    assert f"case {case}: was not stopped" not in out, out[-3000:]
    refusals = re.findall(rf"rank (\d) case {case}: refused: (.*)$", out, flags=re.MULTILINE)
    assert sorted(r for r, _ in refusals) == ["0", "1"], out[-3000:]
    for _, why in refusals:
        assert why.startswith("hvd_compress.DistributedOptimizer: ranks disagree") and CASES[case] in why, why
    assert seconds < 120
