"""Compression.auto(objective="time_to_accuracy") (hvd_compress/auto/objective.py, shadow.py):
its settings, its shadows' arithmetic in one process, and, on real ranks (Horovod: 2 ranks on
Gloo, 2 and 4 on MPI; torch.distributed through the DDP hook: 2 and 4), the decisions: alike on
every rank, a lossy method that pays switched to, the accuracy guard refusing top-k 0.1%, a
regime change sending the value codecs again, a resumed job equal to the uninterrupted one.
The link is emulated by step times injected through `step_s=` (tests/workers/auto_tta_checks.py)."""
import json
import math

import pytest
import torch

import hvd_compress as hc
from hvd_compress.auto import convergence
from hvd_compress.auto.records import PlanReport
from hvd_compress.auto.shadow import Shadows
from hvd_compress.exchange.fusion import Bucket
from hvd_compress.methods.powersgd import approximate, initial_q

import ddprun
from hvdrun import across_ranks, passed_checks


# ---------------------------------------------------------------- settings

@pytest.mark.unit
def test_the_default_objective_is_the_step_and_time_to_accuracy_is_asked_for():
    assert hc.Compression.auto.objective == "step_time"
    auto = hc.Compression.auto(objective="time_to_accuracy", methods=["topk0.10", "powersgd2"],
                               step_s={"value": 0.05, "topk0.1": 0.01})
    assert auto.methods == ("topk0.1", "powersgd2") and auto.step_s == {"value": 0.05,
                                                                          "topk0.1": 0.01}
    assert auto == hc.Compression.auto(objective="time_to_accuracy",
                                       methods=("topk0.1", "powersgd2"),
                                       step_s={"topk0.1": 0.01, "value": 0.05})
    assert hash(auto) == hash(auto(interval=convergence.INTERVAL))
    assert hc.Compression.auto(objective="time_to_accuracy").methods == \
        convergence.DEFAULT_METHODS


@pytest.mark.unit
@pytest.mark.parametrize("options, match", [
    ({"objective": "accuracy"}, "objective must be one of step_time, time_to_accuracy"),
    ({"methods": ["topk2"]}, "top-k ratio must be in"),
    ({"methods": ["bit8"]}, "not a method auto can switch to"),
    ({"methods": ["powersgd0"]}, "PowerSGD rank must be >= 1"),
    ({"step_s": {"topk0.5": 0.1}}, "'topk0.5' is no candidate"),
    ({"step_s": {"value": 0}}, "must be a number of seconds > 0"),
    ({"step_s": {"value": math.nan}}, "must be a number of seconds > 0"),
    ({"step_s": [0.1]}, "a dict of mode -> seconds"),
    ({"step_s": "/nonexistent/steps.json"}, "cannot read step times"),
    ({"interval": 1}, "interval must be a whole number of steps >= 2"),
    ({"r_min": 0}, r"r_min must be in \(0, 1\]"),
])
def test_bad_time_to_accuracy_settings_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        hc.Compression.auto(**{"objective": "time_to_accuracy", **options})


@pytest.mark.unit
def test_step_times_are_read_from_a_json_file(tmp_path):
    path = tmp_path / "link.json"
    path.write_text(json.dumps({"value": 0.053, "powersgd4": 0.047}))
    auto = hc.Compression.auto(objective="time_to_accuracy", step_s=str(path))
    assert auto.step_s == {"value": 0.053, "powersgd4": 0.047}


@pytest.mark.unit
def test_the_plan_report_carries_the_objective_through_its_dict():
    report = PlanReport(plan="", phase="planned", buckets=(), objective={"mode": "topk0.1"})
    again = PlanReport.from_dict(report.to_dict())
    assert again.objective == {"mode": "topk0.1"}
    assert "objective" not in PlanReport(plan="", phase="planned", buckets=()).to_dict()


# ---------------------------------------------------------------- the shadows, one process

def _buckets():
    tensors = [torch.zeros(32, 40), torch.zeros(32), torch.zeros(8, 32)]
    return [b for _, b in Bucket.plan(["a", "b", "c"], tensors, 1 << 20)]


def _stream(steps, numel, seed=0):
    """Gradients with a common direction and noise around it, as steps of SGD give."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(numel, generator=gen)
    return [mean + 0.5 * torch.randn(numel, generator=gen) for _ in range(steps)]


def _ratios(methods, steps=30):
    buckets = _buckets()
    shadows = Shadows(methods)
    progress = convergence.Progress()
    for g in _stream(steps, buckets[0].numel):
        products = shadows.products([g])
        if products is not None:
            progress.add(*products)
        shadows.step([g], [g], buckets)
    return progress.ratios()


@pytest.mark.unit
def test_a_method_that_sends_everything_makes_float32s_progress():
    ratios = _ratios(("topk1", "int8"))
    assert ratios["topk1"] == pytest.approx(1.0, abs=1e-6)
    assert 0.97 < ratios["int8"] < 1.03


@pytest.mark.unit
def test_the_sparser_the_top_k_the_less_progress_and_0_1_percent_fails_the_guard():
    ratios = _ratios(("topk0.5", "topk0.1", "topk0.001"))
    assert ratios["topk0.5"] > ratios["topk0.1"] > ratios["topk0.001"]
    assert ratios["topk0.001"] < convergence.R_MIN


@pytest.mark.unit
def test_powersgd_is_linear_in_the_ranks_matrices_so_its_shadow_reads_the_average():
    """PowerSGD's round over n ranks' matrices from a shared Q is its round on their mean: the
    shadow computed on the averaged gradient is the method's, on every rank alike."""
    gen = torch.Generator().manual_seed(3)
    ranks = [torch.randn(32, 40, generator=gen) for _ in range(4)]
    q = initial_q("w", 40, 2, 0)
    over_ranks, q1 = approximate(ranks, q)
    on_mean, q2 = approximate([sum(ranks) / 4], q)
    assert torch.allclose(over_ranks, on_mean, atol=1e-5) and torch.allclose(q1, q2, atol=1e-5)


@pytest.mark.unit
def test_a_reset_method_starts_again_with_nothing_unsent():
    buckets = _buckets()
    shadows = Shadows(("topk0.1",))
    g = _stream(1, buckets[0].numel)[0]
    shadows.step([g], [g], buckets)
    assert float(shadows.residual["topk0.1"][0].norm()) > 0
    shadows.reset("topk0.1")
    assert shadows.residual["topk0.1"] == {}


@pytest.mark.unit
def test_the_grids_composition_follows_each_switch_from_the_next_step():
    from labs.bench.tta_auto import modes_by_step
    switches = [[3, "value", "topk0.1", "why"], [5, "topk0.1", "value", "critical"]]
    assert modes_by_step(switches, 7) == ["value"] * 3 + ["topk0.1"] * 2 + ["value"] * 2
    assert modes_by_step([], 2) == ["value", "value"]


# ---------------------------------------------------------------- on real ranks

@pytest.mark.multiprocess
@across_ranks("auto_tta_checks")
def test_time_to_accuracy_on_horovod_ranks(controller, np, request):
    names = passed_checks(request)
    for what in ("tta.same_decisions_on_every_rank", "tta.identical_weights",
                 "tta.first_interval_critical", "tta.a_calm_window_before_the_change",
                 "tta.switches_to_a_lossy_method_that_pays", "tta.switch_recorded_at_the_window",
                 "tta.guard_refuses_topk_0.1_percent", "tta.regime_change_is_critical",
                 "tta.regime_change_switches_back_to_value", "tta.resume.saved_in_a_lossy_mode",
                 "tta.resume.equals_uninterrupted", "tta.resume.same_switches",
                 "tta.resume.pinned_plan_in_force", "tta.probe.same_on_every_rank",
                 "tta.probe.ran_and_came_back", "tta.probe.step_measured"):
        assert what in names, what


@pytest.mark.multiprocess
@ddprun.across_sizes("auto_tta_ddp")
def test_time_to_accuracy_through_the_ddp_hook(np, request):
    names = ddprun.passed_checks(request)
    for what in ("ddp.tta.same_decisions_on_every_rank", "ddp.tta.identical_weights",
                 "ddp.tta.first_interval_critical", "ddp.tta.a_calm_window",
                 "ddp.tta.switches_to_a_lossy_method_that_pays",
                 "ddp.tta.guard_refuses_topk_0.1_percent",
                 "ddp.tta.mode_restored_from_the_checkpoint"):
        assert what in names, what
