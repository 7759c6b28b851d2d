"""DistributedOptimizer's schedule="overlap" on 2 real ranks (Gloo; tests/workers/overlap_checks.py
in the shared job, tests/hvdrun.py): bit-identical to schedule="wait" for every registered scheme,
updates applied by the forward that needs them or by state_dict(), and the fallbacks; priority on
the wire (tests/workers/overlap_priority.py) at 2 and 4 ranks."""
import pytest

from hvd_compress import registry
from hvdrun import across_ranks, passed_checks

pytestmark = pytest.mark.multiprocess


@across_ranks("overlap_checks")
def test_overlap_is_bit_identical_to_waiting(controller, np, request):
    names = set(passed_checks(request))
    for entry in registry.schemes().values():
        for route in entry.routes:
            # int8 too, on the two-phase route: each bucket rounds from a stream of its own
            assert f"overlap.{entry.name}.{route.value}.sgd.bit_identical_to_wait" in names
    for label in ("none.allreduce", "bit8.allgather", "bit16.alltoall"):
        assert {f"overlap.{label}.adam.bit_identical_to_wait",
                f"overlap.{label}.adamw.bit_identical_to_wait",
                f"overlap.{label}.zero_grad_in_place.bit_identical_to_wait"} <= names
    assert {"overlap.step_returns_with_buckets_pending", "overlap.step_moves_no_parameter",
            "overlap.forward_applies_its_own_buckets_only",
            "overlap.state_dict_applies_every_update",
            "overlap.applied_early_bit_identical_to_wait"} <= names
    # any read outside a forward, by every means a user has, sees every update of the step
    reads = ("parameters_cloned", "data", "grad", "norm", "deepcopy", "torch_save", "by_hand",
             "eval_forward", "inside_a_mode")             # tests/workers/overlap_checks.py READS
    assert {f"overlap.reads.{name}.sees_every_update" for name in reads} <= names
    assert "overlap.reads.bit_identical_to_wait" in names
    for schedule in ("wait", "overlap"):              # the bound as a number
        assert {f"overlap.pop_stats.{schedule}.{what}" for what in (
            "first_step_has_no_interval", "floor_under_step", "wire_of_bytes_sent",
            "step_over_bound")} <= names


@across_ranks("overlap_priority")
def test_chunks_and_pieces_are_bit_identical_to_the_bucket_whole(controller, np, request):
    """Priority on the wire: the large bucket cut (allgather: chunks; two-phase: pieces, each
    an alltoall and an allgather, reduced on the sender's thread in order), the bits those of
    the bucket sent whole, for bit8, int8's stochastic rounding, bit16 and error feedback."""
    names = set(passed_checks(request))
    for label in ("bit8.allgather", "int8.allgather", "bit8.alltoall", "int8.alltoall",
                  "bit16.alltoall", "bit8.alltoall.error_feedback"):
        assert {f"overlap.priority.{label}.{what}" for what in (
            "large_bucket_chunked", "chunked_bit_identical_to_wait", "same_on_every_rank")} <= names
    assert {"overlap.priority.off_when_asked", "overlap.priority.default_with_a_model"} <= names


@across_ranks("overlap_checks")
def test_overlap_falls_back_to_waiting_and_says_so(controller, np, request):
    names = set(passed_checks(request))
    assert {"overlap.fallback.unknown_optimizer_said_once",
            "overlap.fallback.unknown_optimizer_bit_identical_to_wait",
            "overlap.fallback.closure_said_once", "overlap.fallback.closure_bit_identical_to_wait",
            "overlap.without_model_refused_clearly"} <= names


@across_ranks("overlap_checks")
def test_auto_runs_overlapped_bit_identical_to_waiting_and_prices_the_overlap(controller, np,
                                                                             request):
    names = set(passed_checks(request))
    assert {"overlap.auto.runs_overlapped", "overlap.auto.pinned_plan_is_the_plan_run",
            "overlap.auto.pinned_plan_bit_identical_to_wait",
            "overlap.auto.plans_on_every_rank_alike", "overlap.auto.prices_the_overlapped_schedule",
            "overlap.auto.identical_weights",
            "overlap.auto.waiting_prices_the_waiting_schedule"} <= names


@pytest.mark.parametrize("compression", ["bit8", "auto"])
def test_a_rank_that_dies_mid_step_makes_the_next_forward_raise_not_hang(tmp_path, compression):
    """Rank 1 leaves after its forward; rank 0 raises Horovod's error within seconds (in
    backward or step() where its launches fail, else in the next forward, which waits for
    the buckets) and leaves the optimizer with nothing pending
    (tests/workers/overlap_dying_rank.py); Compression.auto alike."""
    import json
    import subprocess
    import sys

    from conftest import ROOT
    from labs.kit.launch import horovodrun_command, launch_env
    script = ROOT / "tests" / "workers" / "overlap_dying_rank.py"
    cmd = horovodrun_command(2, [sys.executable, str(script), str(tmp_path), compression], "gloo",
                             cached_build_check=True)
    env = launch_env()
    env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = "60"
    subprocess.run(cmd, env=env, cwd=ROOT, timeout=240, capture_output=True)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["outcome"] == "raised" and "Horovod" in result["error"], result
    assert result["seconds"] < 60 and result["pending_after"] == 0, result
