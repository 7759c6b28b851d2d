"""The compressed exchange across real ranks: horovodrun with 2, 3 and 4 processes, Gloo and MPI.

The worker (tests/workers/exchange_checks.py) asserts on every rank that
- each packet route (bit8/bit16 x allgather/alltoall x Average/Sum) equals the same reduction
  simulated on one process (decode each rank's codes, float32 rank-order sum, re-encode for
  the two-phase route), is within float32 rounding of the float64 sum of the decoded codes,
  is identical with and without fusion, and is bit-identical on all ranks;
- none/fp16 through our communicator are bit-identical to hvd.allreduce;
- hc.DistributedOptimizer with none/fp16 trains to bit-identical parameters as
  hvd.DistributedOptimizer, and bit8/bit16 (both routes, with and without error feedback)
  train to finite parameters identical on all ranks.
With more than 2 ranks a ring allreduce's summation order depends on how Horovod fused the
tensors, so those runs disable Horovod's fusion (HOROVOD_FUSION_THRESHOLD=0) to compare bits.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_compress.launch import horovodrun_command, launch_env

WORKER = Path(__file__).parent / "workers" / "exchange_checks.py"


@pytest.mark.parametrize("controller,np", [("gloo", 2), ("gloo", 3), ("gloo", 4), ("mpi", 2), ("mpi", 4)])
def test_exchange_across_ranks(controller, np):
    env = launch_env()
    if np > 2:
        env["HOROVOD_FUSION_THRESHOLD"] = "0"
    proc = subprocess.run(horovodrun_command(np, [sys.executable, str(WORKER)], controller),
                          env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert out.count("ALL CHECKS DONE") == np, out[-3000:]
    oks = [line.split("CHECK ", 1)[1] for line in out.splitlines() if "CHECK " in line and line.endswith(" ok")]
    per_check = {}
    for name in oks:
        per_check[name] = per_check.get(name, 0) + 1
    assert len(per_check) > 200, "the worker ran fewer checks than it defines"
    assert all(count == np for count in per_check.values()), "a check passed on some ranks only"
