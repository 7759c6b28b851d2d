"""The compressed exchange across real ranks: horovodrun with 2, 3 and 4 processes, Gloo and MPI.

The worker (tests/workers/exchange_checks.py) asserts on every rank that
- each packet route (bit8/bit16 x allgather/alltoall x Average/Sum x a scale per 256, per 5
  values or per tensor, fused and unfused) equals, bucket by bucket, the same reduction
  simulated on one process through the per-tensor interface (decode each rank's codes block by
  block, float32 rank-order sum, re-encode for the two-phase route), is within float32 rounding
  of the float64 sum of the decoded codes, and is bit-identical on all ranks;
- the two-phase route's advance() launches every bucket's phase 2, and buckets finished in
  reverse order give the bits of reduce();
- none/fp16 through our communicator are bit-identical to hvd.allreduce;
- hc.DistributedOptimizer with none/fp16 trains to bit-identical parameters as
  hvd.DistributedOptimizer, with 1 and 2 backward passes per step and a layer that only rank 0
  uses; bit8/bit16 (both routes, with and without error feedback) train to finite parameters
  identical on all ranks; exchanging from gradient hooks during backward gives the same bits as
  one exchange after backward (several buckets, so overlap is real); skip_synchronize works.
With more than 2 ranks a ring allreduce's summation order depends on how Horovod fused the
tensors, so those jobs disable Horovod's fusion (HOROVOD_FUSION_THRESHOLD=0) to compare bits.
The routes' checks (exchange_checks) run at 2, 3 and 4 ranks, the optimizer's
(exchange_optimizer) at 2 and 4: they depend on no world size. Each worker runs in the shared
job of its configuration (tests/hvdrun.py).
"""
import pytest

from hvdrun import across_ranks, passed_checks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]   # the exchange alone: a minute or more


@across_ranks("exchange_checks")
def test_exchange_across_ranks(controller, np, request):
    names = passed_checks(request)
    assert len(names) > 250, f"the worker ran only {len(names)} checks"
    for route in ("bit8.allgather", "bit8.alltoall", "bit16.allgather", "bit16.alltoall"):
        assert any(n.startswith(route) and n.endswith("equals_simulation") for n in names), route
    for comp in ("bit8", "bit16"):
        assert f"{comp}.alltoall.advance.every_phase2_launched" in names


@across_ranks("exchange_optimizer")
def test_optimizer_exchange_across_ranks(controller, np, request):
    names = passed_checks(request)
    for passes in (1, 2):
        assert f"optimizer.none.passes{passes}.identical_to_hvd_DistributedOptimizer" in names
    for route in ("bit8.allgather", "bit8.alltoall", "bit16.allgather", "bit16.alltoall"):
        assert f"optimizer.{route}.f600.hooks_equal_exchange_after_backward" in names
        for ef in (0, 1):
            assert {f"optimizer.{route}.ef{ef}.finite", f"optimizer.{route}.ef{ef}.same_on_all_ranks"} <= set(names)
    assert "optimizer.skip_synchronize.same_on_all_ranks" in names
