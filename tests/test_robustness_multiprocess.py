"""Odd gradients and disagreeing ranks across 2 real ranks (horovodrun, Gloo and MPI): the odd
gradients in the shared job of each configuration (tests/hvdrun.py), the disagreeing ranks in
launches of their own (they must fail)."""
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


@pytest.mark.parametrize("case,expected", [("compression", "compression: rank 0 has 'bit8', rank 1 has 'none'"),
                                           ("shape", "parameters: rank 0 has")])
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_disagreeing_ranks_fail_clearly_on_every_rank(case, expected, controller):
    start = time.monotonic()
    proc = subprocess.run(horovodrun_command(2, [sys.executable, str(WORKERS / "disagreeing_ranks.py"), case],
                                             controller),
                          env=launch_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "was not stopped" not in out
    assert out.count("refused: hvd_compress.DistributedOptimizer: ranks disagree") == 2, out[-3000:]
    assert expected in out
    assert time.monotonic() - start < 120
