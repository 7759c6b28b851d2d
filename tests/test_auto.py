"""Compression.auto (hvd_compress/auto/settings.py, calibration.py, communicator.py, records.py):
the settings, one step's pace, every rank's measurements combined into one, the decision on
rank 0 (a plan, or a fallback with its reason, never an exception), the records' round trip
(the committed plan reports re-decided to the bit), the plan's state round trip; and, on real
ranks (tests/workers/auto_checks.py), training, mixed plans, re-planning and bad calibrations.
Read through the public records (records.Decision, PlanReport) and the communicator's
`status`, never its private attributes."""
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import pytest
import torch

import hvd_compress as hc
from hvd_compress.auto import calibration, planner, inputs, trial
from hvd_compress.auto.records import (Decision, Host, MeasurementsRecord, Pace, PlanReport,
                                      RankMeasurements, StepSample)
from hvd_compress.auto.settings import Auto, WARMUP_STEPS
from hvd_compress.auto.communicator import FLOAT32, AutoCommunicator, Phase, decide, judge
from hvd_compress.exchange.routes import make_communicator
from hvd_compress.costmodel import methods
from hvd_compress.costmodel.model import Link
from hvdrun import across_ranks, passed_checks

MiB = 1 << 20


# ---------------------------------------------------------------- the settings

@pytest.mark.unit
def test_auto_is_usable_bare_and_with_options():
    bare = hc.Compression.auto
    assert isinstance(bare, Auto) and bare.name == "auto"
    assert bare.candidates == planner.DEFAULT_CANDIDATES and bare.warmup_steps == WARMUP_STEPS
    assert (bare.error_bound, bare.margin, bare.replan_every) == (
        planner.ERROR_BOUND, planner.TIE_MARGIN, planner.REPLAN_EVERY)
    other = hc.Compression.auto(warmup_steps=9, margin=0.0, candidates=["bit8"])
    assert other.candidates == ("none:allreduce", "bit8:allgather")    # float32 always there
    assert (other.warmup_steps, other.margin) == (9, 0.0) and bare.warmup_steps == WARMUP_STEPS
    assert other == Auto(warmup_steps=9, margin=0.0, candidates=["bit8"]) and other != bare


@pytest.mark.unit
@pytest.mark.parametrize("options, match", [
    ({"warmup_steps": 1}, "warmup_steps"), ({"margin": 1.0}, "margin"),
    ({"error_bound": -1}, "error_bound"), ({"replan_every": 0}, "replan_every"),
    ({"candidates": ["topk"]}, "codec of values"), ({"candidates": ["bit8:allreduce"]}, "route"),
])
def test_auto_refuses_bad_settings(options, match):
    with pytest.raises(ValueError, match=match):
        hc.Compression.auto(**options)


@pytest.mark.unit
def test_auto_declares_its_communicator_as_top_k_and_powersgd_do():
    """make_communicator builds auto's communicator from the compression's own factory, with
    the optimizer's fusion threshold and scale block; a route is refused (auto chooses one per
    bucket)."""
    comm = make_communicator(hc.Compression.auto(margin=0.0), None, fusion_threshold_bytes=8192,
                             scale_block=128)
    assert isinstance(comm, AutoCommunicator) and comm.route is None
    assert (comm.fusion_threshold_bytes, comm.scale_block) == (8192, 128)
    assert comm.settings == hc.Compression.auto(margin=0.0) and comm.phase == Phase.MEASURING
    with pytest.raises(ValueError, match="chooses each bucket's route"):
        make_communicator(hc.Compression.auto, "allgather")
    with pytest.raises(ValueError, match="block scales"):
        make_communicator(hc.Compression.auto, scale_block=None)


# ---------------------------------------------------------------- one step's pace

@pytest.mark.unit
def test_a_steps_pace_subtracts_hook_work_and_splits_the_step():
    # backward from t=10.0 to 10.5; bucket 1 launched first (at 10.1, 0.02 s of hook work),
    # bucket 0 at 10.3 (0.05 s); the exchange waited until 10.6; the step lasted 1.0 s
    s = calibration.step_sample(1.0, 10.0, 10.5, 10.6, [(10.3, 0.05), (10.1, 0.02)])
    assert s.ready_s == pytest.approx((0.28, 0.1))
    assert s.backward_s == pytest.approx(0.43) and s.wait_s == pytest.approx(0.1)
    assert s.fixed_s == pytest.approx(0.4)
    assert calibration.step_sample(1.0, None, 10.5, 10.6, [(10.3, 0.0)]) is None
    assert calibration.step_sample(1.0, 10.0, 10.5, 10.6, [(10.3, 0.0), None]) is None


@pytest.mark.unit
def test_pace_summary_discards_the_first_step_and_takes_medians():
    def s(step, ready):
        return StepSample(step, step / 2, 0.0, step / 2, (ready,))
    out = calibration.pace_summary([s(9.0, 9.0), s(1.0, 0.1), None, s(3.0, 0.3), s(2.0, 0.2)])
    assert out == Pace(2.0, 1.0, 0.0, 1.0, (0.2,), 3)
    with pytest.raises(ValueError, match="no complete step"):
        calibration.pace_summary([s(1.0, 0.1), None])


@pytest.mark.unit
def test_the_next_forwards_pace_is_taken_from_its_applies_waits_excluded():
    # step() at 10.5; bucket 1 applied by the forward's first hook at 10.52, taking 0.03 s
    # (its wait and decode); bucket 0 by a later hook at 10.60 with bucket 2 (0.01 s each)
    applies = [(1, 10.52, 0.03), (0, 10.60, 0.01), (2, 10.60, 0.01)]
    needed, waited = calibration.forward_needs(applies, 10.5, 3)
    assert needed == pytest.approx((0.07, 0.02, 0.07)) and waited == pytest.approx(0.05)
    assert calibration.forward_needs(applies[:2], 10.5, 3) == (None, pytest.approx(0.04))
    # an apply from before step() returned is an abandoned step's: left out
    stale = [(0, 10.2, 0.5)] + applies
    assert calibration.forward_needs(stale, 10.5, 3) == calibration.forward_needs(applies, 10.5, 3)
    # the step's wait is what the applies took (step() returned at once), not until the last
    s = calibration.step_sample(1.0, 10.0, 10.5, 10.61, [(10.3, 0.05), (10.1, 0.02), (10.4, 0.0)],
                                applies)
    assert s.needed_s == pytest.approx((0.07, 0.02, 0.07)) and s.wait_s == pytest.approx(0.05)
    assert s.fixed_s == pytest.approx(1.0 - 0.5 - 0.05)
    assert calibration.step_sample(1.0, 10.0, 10.5, 10.61, [(10.3, 0.05)] * 3,
                                   applies[:2]) is None
    # waiting: no needs
    assert calibration.step_sample(1.0, 10.0, 10.5, 10.6, [(10.3, 0.05)]).needed_s == ()


@pytest.mark.unit
def test_pace_summary_keeps_the_forwards_needs_where_every_step_measured_them():
    def s(step, needed=(0.01, 0.02)):
        return StepSample(step, step / 2, 0.0, step / 2, (0.1, 0.2), needed)
    out = calibration.pace_summary([s(9.0), s(1.0, (0.01, 0.03)), s(3.0, (0.03, 0.05)), s(2.0)])
    assert out.needed_s == pytest.approx((0.01, 0.03))
    assert calibration.pace_summary([s(9.0), s(1.0), s(2.0, ())]).needed_s == ()
    assert Pace.from_dict(out.to_dict()) == out
    waiting = calibration.pace_summary([s(9.0, ()), s(1.0, ())])
    assert "needed_s" not in waiting.to_dict() and Pace.from_dict(waiting.to_dict()) == waiting


# ---------------------------------------------------------------- every rank's -> one

def rank_measurements(step=0.5, backward=0.3, ready=(0.05, 0.25), enc=1e-9, err=0.03,
                      sizes=(("fc.bias", 4 * MiB), ("conv.weight", 64 * 1024))):
    """A rank's measurements as the calibration gathers them (RankMeasurements.to_dict()'s
    form: a test spoils one field of it, `records` reads it back)."""
    codec = {"encode": [[b, 1e-4 + enc * b] for _, b in sizes],
             "decode": [[b, 1e-4 + enc * b] for _, b in sizes]}
    codecs = {t: dict(codec, reduce=[[b, 1e-4] for _, b in sizes]) if t.endswith("alltoall")
              else dict(codec) for t in planner.DEFAULT_CANDIDATES if t != FLOAT32}
    return {"buckets": [list(x) for x in sizes],
            "pace": {"step_s": step, "backward_s": backward, "wait_s": 0.1,
                     "fixed_s": step - backward - 0.1, "ready_s": list(ready), "steps": 5},
            "codecs": codecs,
            "errors": {name: {"fp16": 2e-4, "bit16": 2e-4, "bit8": err} for name, _ in sizes}}


def records(ranks):
    """The gathered dicts read back, as rank 0's decide() reads them."""
    return [RankMeasurements.from_dict(r) for r in ranks]


def link_rows(rate_bit_s, alpha=1e-3, n=2, slower=1.0):
    link = Link.from_bandwidth(alpha, rate_bit_s / 8)
    rows = []
    for c in calibration.LINK_COLLECTIVES:
        cost = {"allreduce_fp16": "allreduce"}.get(c, c)
        for size in (4096, 256 * 1024):
            t = methods.COLLECTIVE_COSTS[cost](n, size).seconds(link)
            rows += [(c, n, size, t * slower)] * 3
    return rows


@pytest.mark.unit
def test_combine_takes_the_slowest_pace_and_each_collectives_fastest_rank():
    ranks = [rank_measurements(), rank_measurements(step=0.6, backward=0.35, ready=(0.02, 0.3),
                                                    enc=2e-9, err=0.04)]
    m = calibration.combine(records(ranks), [link_rows(100e6), link_rows(100e6, slower=1.5)], 2)
    assert [b.ready_s for b in m.buckets] == [0.05, 0.3] and m.backward_s == 0.35
    assert m.fixed_s == pytest.approx(0.6 - 0.35 - 0.1)
    assert m.errors[("fc.bias", "bit8")] == 0.04
    assert m.codecs["bit8:allgather"].encode.b == pytest.approx(2e-9, rel=1e-6)
    fit = m.links["allreduce"]                         # the faster rank's rows: the real link
    assert fit.alpha == pytest.approx(1e-3, rel=1e-6) and fit.beta == pytest.approx(8 / 100e6, rel=1e-6)


@pytest.mark.unit
def test_the_jobs_step_is_the_ranks_mean_not_the_slowest_ranks():
    """Four ranks end every step together (at k * 0.1 s) but each runs again a little later,
    by its own delay: each rank's step is 0.1 s plus its delay now minus its delay the step
    before. The slowest rank's time of each step keeps only the delays' growth: 0.12-0.13 s
    here; their mean is the step, 0.1 s."""
    delays = [[0.0, 0.02, 0.0, 0.03, 0.0, 0.01], [0.01, 0.0, 0.02, 0.0, 0.03, 0.0],
              [0.0, 0.0, 0.01, 0.02, 0.0, 0.01], [0.02, 0.01, 0.0, 0.0, 0.02, 0.0]]
    ends = [[k * 0.1 + d for k, d in enumerate(rank)] for rank in delays]
    per_rank = [[b - a for a, b in zip(e, e[1:])] for e in ends]
    each_step = list(zip(*per_rank))
    slowest = [max(step) for step in each_step]
    assert statistics.median(slowest) > 0.115
    assert [calibration.job_step_s(step) for step in each_step] == pytest.approx([0.1] * 5,
                                                                                 abs=0.011)
    assert calibration.job_step_s([0.5, 0.7]) == pytest.approx(0.6)


@pytest.mark.unit
def test_the_busy_factor_is_fitted_to_the_jobs_step_not_the_slowest_ranks():
    """Ranks whose median warm-up steps read 0.5 and 0.7 s: float32, the plan in force, is
    predicted at their mean, 0.6 s (the fast link alone predicts less, so k > 1)."""
    ranks = [rank_measurements(), rank_measurements()]
    ranks[1]["pace"]["step_s"] = 0.7
    d = decide(Auto(), ranks, [link_rows(1e9)] * 2, [], 2)
    assert d.ok and d.measurements.busy_factor > 1
    assert d.fixed_plans_s[FLOAT32] == pytest.approx(0.6, rel=1e-6)
    assert d.measurements.measured_on == (FLOAT32,) * 2        # the plan the pace ran on


@pytest.mark.unit
def test_combine_keeps_launch_order_ready_times_non_decreasing():
    m = calibration.combine(records([rank_measurements(ready=(0.2, 0.1))]), [link_rows(1e9)], 2)
    assert [b.ready_s for b in m.buckets] == [0.2, 0.2]


@pytest.mark.unit
@pytest.mark.parametrize("spoil, match", [
    (lambda r: r[1]["buckets"].reverse(), "buckets differ"),
    (lambda r: r[1]["pace"].update(step_s=5.0), "ranks disagree"),
    (lambda r: r[1]["pace"].update(backward_s=math.nan), "not a finite time"),
    (lambda r: r[0]["codecs"]["bit8:allgather"]["encode"][0].__setitem__(1, math.inf),
     "not a finite time"),
])
def test_combine_refuses_measurements_it_cannot_plan_from(spoil, match):
    ranks = [rank_measurements(), rank_measurements()]
    spoil(ranks)
    with pytest.raises(ValueError, match=match):
        calibration.combine(records(ranks), [link_rows(1e9)] * 2, 2)


# ---------------------------------------------------------------- the decision

@pytest.mark.unit
def test_a_slow_link_compresses_the_big_bucket_a_fast_one_keeps_float32():
    # backward ends at 20 ms: the 4 MiB bucket's exchange (340 ms in float32 at 100 Mbit/s,
    # 84 ms as bit8 by allgather) is the exposed tail
    ranks = [rank_measurements(backward=0.02, ready=(0.01, 0.02))] * 2
    slow = decide(Auto(), ranks, [link_rows(100e6)] * 2, [], 2)
    assert slow.ok and slow.labels[0].startswith("bit8"), slow.labels
    assert slow.predicted_s < slow.fixed_plans_s[FLOAT32] / 1.5
    fast = decide(Auto(), ranks, [link_rows(100e9, alpha=1e-5)] * 2, [], 2)
    assert fast.ok and fast.labels == (FLOAT32, FLOAT32), fast.labels
    for d in (slow, fast):                            # never predicted slower than a fixed plan
        assert d.predicted_s <= min(d.fixed_plans_s.values()) * (1 + Auto().margin) + 1e-12


@pytest.mark.unit
def test_the_accuracy_guard_refuses_bit8_over_the_bound():
    ranks = [rank_measurements(err=0.2), rank_measurements(err=0.2)]
    d = decide(Auto(), ranks, [link_rows(100e6)] * 2, [], 2)
    assert d.ok and not any(t.startswith("bit8") for t in d.labels), d.labels
    assert "error 0.2 > bound" in d.refused["fc.bias bit8:allgather"]


@pytest.mark.unit
def test_a_failed_or_bad_calibration_is_a_fallback_with_its_reason_not_an_exception():
    ranks = [rank_measurements(), rank_measurements()]
    d = decide(Auto(), ranks, [link_rows(1e9)] * 2, ["rank 1: RuntimeError: boom"], 2)
    assert d == Decision.fallback("calibration failed: rank 1: RuntimeError: boom")
    assert d.to_dict() == {"ok": False, "reason": "calibration failed: rank 1: RuntimeError: boom"}
    ranks[1]["pace"]["step_s"] = math.nan
    d = decide(Auto(), ranks, [link_rows(1e9)] * 2, [], 2)
    assert not d.ok and "ValueError" in d.reason and "median step" in d.reason
    d = decide(Auto(), [rank_measurements()] * 2, [[("allgather", 2, 4096, 1e-3)]] * 2, [], 2)
    assert not d.ok and "no plan from the measurements" in d.reason


@pytest.mark.unit
def test_the_same_measurements_give_the_same_decision():
    ranks = [rank_measurements(), rank_measurements(step=0.55)]
    a = decide(Auto(), ranks, [link_rows(100e6)] * 2, [], 2)
    b = decide(Auto(), [dict(r) for r in ranks[::-1]], [link_rows(100e6)] * 2, [], 2)
    assert a == b
    # what rank 0 broadcasts (and a checkpoint keeps) reads back as the same decision
    assert json.dumps(Decision.from_dict(json.loads(json.dumps(a.to_dict()))).to_dict()) == \
        json.dumps(a.to_dict())


@pytest.mark.unit
@pytest.mark.parametrize("rate", [100e6, 100e9])
def test_a_plan_is_re_decided_from_its_record_alone(rate, tmp_path, capsys):
    """plan_report() (what the lab's manifest and bench_step's plans/ keep) holds every input of
    the decision: written to JSON and read back, inputs.replay and the CLI's --report
    re-decide the job's plan with the same predicted step, to the bit, and the busy factor."""
    from hvd_compress.auto import cli
    comm = AutoCommunicator(hc.Compression.auto())
    comm.plan(["fc.weight", "conv.weight"], [torch.zeros(MiB), torch.zeros(16 * 1024)])
    sizes = [(b.name, b.bytes) for b in comm.plan_report().buckets]
    ranks = [rank_measurements(backward=0.02, ready=(0.01, 0.02)[-len(sizes):], sizes=sizes)] * 2
    d = decide(comm.settings, ranks, [link_rows(rate)] * 2, [], 2)
    assert d.ok
    comm.apply_decision(d, 0.1)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(comm.plan_report().to_dict()))
    again = PlanReport.from_dict(json.loads(path.read_text()))        # NaN: compare as JSON
    assert json.dumps(again.to_dict()) == json.dumps(comm.plan_report().to_dict())
    m, busy, plan = inputs.replay(json.loads(path.read_text()))
    assert plan.schemes == d.labels and plan.predicted_s == d.predicted_s
    assert busy == d.measurements.busy_factor
    assert cli.main(["--report", str(path), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replayed"]["same_as_job"] and out["replayed"]["predicted_s"] == d.predicted_s
    assert out["job"]["plan"] == list(d.labels)
    assert out["fixed"][FLOAT32] == d.fixed_plans_s[FLOAT32]
    assert out["job"]["chosen_by"] == "the search"
    if rate < 1e9:                            # the slow link compresses the 4 MiB bucket
        assert d.labels[0].startswith("bit8"), d.labels
    # a trial that adopted a rival: the record says so, the search's plan is not the job's
    report = json.loads(path.read_text())
    report["trial"] = {"chosen": "fp16:allreduce everywhere", "reason": "fp16 adopted"}
    for bucket in report["buckets"]:
        bucket["label"] = "fp16:allreduce"
    path.write_text(json.dumps(report))
    assert cli.main(["--report", str(path), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["replayed"]["same_as_job"] and out["job"]["chosen_by"] == "trial: fp16 adopted"


@pytest.mark.unit
def test_a_record_without_measurements_is_refused_with_its_reason(tmp_path):
    from hvd_compress.auto import cli
    comm = communicator()
    with pytest.warns(RuntimeWarning, match="boom"):
        comm.apply_decision(Decision.fallback("calibration failed: rank 1: boom"), 0.1)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"plan_report": comm.plan_report().to_dict()}))
    with pytest.raises(SystemExit, match="no measurements to plan from"):
        cli.main(["--report", str(path)])
    path.write_text(json.dumps({"status": "complete"}))           # a run without auto
    with pytest.raises(SystemExit, match="no plan report in it"):
        cli.main(["--report", str(path)])
    with pytest.raises(ValueError, match="not a plan report's measurements"):
        MeasurementsRecord.from_dict({"n": 2})


# ---------------------------------------------------------------- on this rank, real tensors

@pytest.mark.unit
def test_codec_costs_and_errors_on_real_gradients():
    gen = torch.Generator().manual_seed(0)
    buffers = [torch.randn(70_000, generator=gen) * 1e-3, torch.zeros(512)]
    errs = calibration.measure_errors(buffers, ["big", "zero"], planner.DEFAULT_CANDIDATES, 256)
    assert 0.01 < errs["big"]["bit8"] < planner.ERROR_BOUND
    assert errs["big"]["bit16"] < 2 ** -11 and errs["big"]["fp16"] < 2 ** -10
    assert errs["zero"] == {"fp16": 0.0, "bit16": 0.0, "bit8": 0.0}
    bad = calibration.measure_errors([torch.tensor([1.0, math.nan])], ["nan"], ["bit8"], 256)
    assert math.isnan(bad["nan"]["bit8"])
    costs = calibration.time_codecs(buffers, planner.DEFAULT_CANDIDATES, 2, 256, reps=1)
    assert set(costs) == set(planner.DEFAULT_CANDIDATES) - {FLOAT32}
    for text, parts in costs.items():
        assert bool(parts["reduce"]) == text.endswith("alltoall"), text
        for points in parts.values():
            assert all(b > 0 and math.isfinite(s) and s > 0 for b, s in points), (text, points)
    assert [b for b, _ in costs["bit8:allgather"]["encode"]] == [280_000, 2048]
    assert torch.equal(buffers[1], torch.zeros(512))      # read, never written


# ---------------------------------------------------------------- the plan's state

def communicator(fusion=4096, **options):
    comm = AutoCommunicator(hc.Compression.auto(warmup_steps=3, **options),
                            fusion_threshold_bytes=fusion)
    tensors = [torch.zeros(1280), torch.zeros(64), torch.zeros(2048), torch.zeros(32)]
    comm.plan([f"t{i}" for i in range(4)], tensors)
    return comm


def plan(labels, predicted_s=0.2, **fields):
    """A decision by hand: a plan of `labels` (rank 0's decide() makes them from measurements)."""
    return Decision(tuple(labels), predicted_s, **fields)


@pytest.mark.unit
def test_the_plan_survives_a_checkpoint_and_reset_forgets_it():
    comm = communicator()
    assert comm.state_dict() is None and comm.labels == [FLOAT32] * 4
    stats = comm.pop_stats()
    assert stats["plan"] == "" and math.isnan(stats["plan_predicted_s"])
    assert stats["plan_event"] == "calibrating"
    labels = ["bit8:allgather", "bit16:alltoall", "fp16:allreduce", FLOAT32]
    comm.apply_decision(plan(labels, 0.25), 0.1)
    # each calibration's event says what it cost (their sum is the report's calibration_s)
    assert comm.plan_report().events[-1].to_dict() == {"step": 0, "event": "planned",
                                                        "calibration_s": 0.1}
    state = comm.state_dict()
    other = communicator()
    other.load_state_dict(state)
    assert other.labels == labels and other.pop_stats()["plan"] == " ".join(labels)
    assert other.status.plan == comm.status.plan == plan(labels, 0.25)
    report = other.plan_report()
    assert report.predicted_s == 0.25 and report.calibrations == 0 and report.labels == labels
    assert report.events[-1].to_dict() == {"step": 0,
                                           "event": "planned: restored from a checkpoint"}
    elsewhere = communicator(fusion=1 << 20)        # other buckets: the plan is not taken
    elsewhere.load_state_dict(state)
    assert elsewhere.labels == [FLOAT32] and elsewhere.state_dict() is None
    other.reset_state()
    stats = other.pop_stats()
    assert other.labels == [FLOAT32] * 4 and stats["plan"] == ""
    assert stats["plan_event"].endswith("calibrating (membership changed)")
    assert other.phase == Phase.MEASURING and other.status.plan is None


@pytest.mark.unit
def test_a_fallback_keeps_the_last_good_plan_and_warns_once():
    comm = communicator()
    labels = ["bit8:allgather", FLOAT32, FLOAT32, FLOAT32]
    comm.apply_decision(plan(labels), 0.1)
    with pytest.warns(RuntimeWarning, match="last good plan"):
        comm.apply_decision(Decision.fallback("calibration failed: rank 1: boom"), 0.2)
    assert comm.labels == labels and comm.phase == Phase.FALLBACK
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comm.apply_decision(Decision.fallback("again"), 0.3)
    events = comm.pop_stats()["plan_event"].split("; ")
    assert events[-2:] == ["fallback: calibration failed: rank 1: boom", "fallback: again"]
    assert [e.calibration_s for e in comm.plan_report().events[-3:]] == [0.1, 0.2, 0.3]


@pytest.mark.unit
def test_the_empty_step_before_training_is_no_warm_up_step():
    """Horovod's broadcast_optimizer_state calls step() once with zero gradients and no
    backward (labs/mnist.py does, before training): not a warm-up step, so that the first
    real step, the slow one, is the sample that pace_summary discards."""
    comm = communicator()                                   # warmup_steps=3
    comm.end_step(None, None)                               # broadcast_optimizer_state's step
    assert comm.status.samples == () and comm.pop_stats()["plan_event"] == "calibrating"
    began = time.perf_counter() - 0.2
    for i in range(len(comm.labels)):                       # what start() records per bucket
        comm.record_launch(i, began + 0.05, 0.0)
    comm.end_step(began, began + 0.1)                       # the first step of training
    samples = comm.status.samples
    assert len(samples) == 1 and samples[0].step_s > 0
    comm.end_step(None, None)        # from then on an incomplete step counts (pace leaves it out)
    assert len(comm.status.samples) == 2 and comm.status.samples[1] is None
    assert comm.phase == Phase.MEASURING and comm.status.steps == 3


@pytest.mark.unit
def test_a_paused_step_clock_leaves_the_next_step_out_of_what_the_plan_is_judged_on():
    """After pause_step_clock (an evaluation, a benchmark's other rows) the next step's time is
    not a step's: out of the drift window and of the steps counted to the first check."""
    comm = communicator()
    comm.apply_decision(plan([FLOAT32] * 4), 0.1)
    comm.end_step(None, None)                  # the clock's first end: no step before it
    for pause in (False, False, True, False, True, False):
        if pause:
            comm.pause_step_clock()
            time.sleep(0.05)                   # other work: it must not read as a step
        comm.end_step(None, None)
    status = comm.status
    assert len(status.measured) == 7 and status.since_plan == 4
    assert [math.isnan(t) for t in status.measured] == [True, False, False, True, False, True,
                                                        False]
    assert all(t < 0.05 for t in status.measured if not math.isnan(t))
    assert comm.plan_report().step_clock_pauses == 2


@pytest.mark.unit
def test_a_fallback_runs_on_the_kept_plan_as_adopting_it_does():
    """Falling back and adopting share one path (_run_on): after a failed re-calibration the
    kept plan is in force exactly as if adopted again (labels, plan, no trial, its steps
    measured afresh; the phase says which), and with no good plan float32 is, with no plan
    to show or save."""
    labels = ["bit8:allgather", FLOAT32, "fp16:allreduce", FLOAT32]
    good = plan(labels)
    fell, adopted = communicator(), communicator()
    for comm in (fell, adopted):
        comm.apply_decision(good, 0.1)
        for _ in range(3):
            comm.end_step(None, None)
    with pytest.warns(RuntimeWarning, match="last good plan"):
        fell.apply_decision(Decision.fallback("calibration failed: rank 1: boom"), 0.2)
    adopted.apply_decision(good, 0.2)

    def state(c):
        return (dataclasses.replace(c.status, phase=None), c.state_dict(),
                c.plan_report().plan)
    assert state(fell) == state(adopted) and fell.labels == labels
    assert (fell.phase, adopted.phase) == (Phase.FALLBACK, Phase.PLANNED)
    assert fell.status.last_good == good and fell.status.trial_times is None
    never = communicator()
    with pytest.warns(RuntimeWarning, match="float32 on every bucket"):
        never.apply_decision(Decision.fallback("calibration failed: rank 0: boom"), 0.1)
    assert never.labels == [FLOAT32] * 4 and never.state_dict() is None
    assert never.plan_report().phase == "fallback" and never.pop_stats()["plan"] == ""
    assert never.status.plan is None and never.status.last_good is None


# ---------------------------------------------------------------- on real ranks

@pytest.mark.multiprocess
@across_ranks("auto_checks")
def test_auto_across_ranks(controller, np, request):
    names = passed_checks(request)
    for what in ("trains.same_plan_on_every_rank", "trains.identical_weights",
                 "trains.plan_labels_legal", "trains.calibration_cost_recorded",
                 "trains.links_fitted", "trains.links_cpu_fitted_and_the_share_counted",
                 "links.grow_to_the_cap",
                 "links.grown_by_the_rule_alike_everywhere", "links.more_repetitions_where_cheap",
                 "mixed.identical_weights", "mixed.buckets_as_reported",
                 "mixed.plan_shown",
                 "replan.same_decision_on_every_rank", "replan.decided_at_the_window",
                 "replan.planned_again", "replan.errors_of_the_gradient_as_sent",
                 "resume.plan_restored", "reset.measures_again",
                 "reset.first_plan_judged_early",
                 "bad.reason_recorded", "ef.lossy_buckets_keep_residuals",
                 "ef.float32_carries_them_once", "ef.identical_weights", "trial.ran",
                 "trial.events", "trial.plan_shown_once_kept", "trial.steps_ran_the_contenders",
                 "trial.kept_a_contender_with_the_models_prediction", "trial.cost_counted",
                 "trial.same_verdict_on_every_rank", "trial.identical_weights",
                 "trial.changes_only_each_steps_schemes", "pinned.in_force_from_the_first_step",
                 "pinned.identical_weights", "pinned.bit8_everywhere_is_bit8",
                 "pinned.other_buckets_refused"):
        assert what in names, what
    for label in ("bit8:allgather", "bit16:alltoall", "fp16:allreduce", "bit8:alltoall"):
        assert sum(n.endswith(f"{label}.within_bound") for n in names) == 1, label
    for tag in ("raises", "non_finite", "disagrees"):
        for what in ("every_rank_falls_back", "float32", "identical_weights"):
            assert f"bad.{tag}.{what}" in names


@pytest.mark.unit
@pytest.mark.parametrize("size, small_s, large_s, cap, grown", [
    (256 << 10, 5e-3, 5e-3, 4718592, 1 << 20),       # 1 Gbit/s, 4 ranks: 256 KiB as slow as 4 KiB
    (1 << 20, 5e-3, 15e-3, 4718592, 4 << 20),        # 3x: the byte still hidden
    (4 << 20, 5e-3, 58e-3, 4718592, None),           # resolved (and over the time bound)
    (256 << 10, 1e-3, 31e-3, 4718592, None),         # 100 Mbit/s: 31x, resolved
    (256 << 10, 1e-3, 2e-3, 600 << 10, 600 << 10),   # grown no larger than the cap
    (256 << 10, 1e-3, 2e-3, 87 << 10, None),         # the job sends nothing larger
    (256 << 10, 20e-3, 60e-3, 4718592, None),        # a slow message: no time for a larger one
])
def test_a_link_is_timed_larger_only_where_two_sizes_hide_the_bytes_cost(size, small_s, large_s,
                                                                           cap, grown):
    assert calibration.next_link_size(size, small_s, large_s, cap) == grown


@pytest.mark.unit
@pytest.mark.parametrize("reps, slowest_median_s, budget_s, more", [
    (3, 1e-3, 0.03, 6),          # 1 Gbit/s, 4 ranks, 4 KiB: up to LINK_REPS_MAX (9) in all
    (3, 6e-3, 0.03, 5),          # as many as the budget holds
    (3, 0.2, 0.03, 0),           # 10 Mbit/s, 256 KiB: none
    (3, 1e-3, 0, 0),             # no budget, none
    (9, 1e-6, 0.03, 0),          # already at the most
    (3, 0.0, 0.03, 0),           # a time that is not one: none (never unbounded)
    (3, float("nan"), 0.03, 0),
])
def test_cheap_link_sizes_get_more_repetitions_within_a_budget(reps, slowest_median_s,
                                                                budget_s, more):
    assert calibration.more_link_reps(reps, slowest_median_s, budget_s) == more


@pytest.mark.unit
@pytest.mark.parametrize("collective", calibration.LINK_COLLECTIVES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_rank_reads_the_same_times_from_what_a_timed_collective_carried(collective, n):
    """The collective's own payload, done by hand (Horovod's average, its allgather and its
    alltoall of equal splits): every rank's median, in whole units, back on every rank."""
    size = calibration.whole_size(4096, n)
    seconds = [0.0, 1.2345e-3, 0.0299, 7.0][:n] + [3e-3] * max(0, n - 4)
    dtype = {"allreduce": torch.float32, "allreduce_fp16": torch.float16}.get(collective,
                                                                              torch.uint8)
    width = {"allreduce": 4, "allreduce_fp16": 2}.get(collective, 1)
    sent = []
    for rank, s in enumerate(seconds):
        t = torch.zeros(size // width, dtype=dtype)
        calibration.carry(collective, t, rank, n, s)
        sent.append(t)
    if collective.startswith("allreduce"):
        output = (torch.stack(sent).float().sum(0) / n).to(dtype)
    elif collective == "allgather":
        output = torch.cat(sent)
    else:                                            # rank 0's receipt: chunk 0 of each sender
        output = (torch.cat([t.view(n, -1)[0] for t in sent]), torch.full((n,), size // n))
    unit = calibration.CARRY_UNIT_S[collective]
    assert calibration.carried(collective, output, n) == [
        calibration.carried_units(collective, s) * unit for s in seconds]
    assert calibration.carried_units("allreduce_fp16", 7.0) == 2047      # held below 2048


@pytest.mark.unit
def test_the_link_grows_to_what_each_collective_carries_of_the_largest_bucket():
    caps = calibration.link_grow_caps(4718592)
    assert caps == {"allreduce": 4718592, "allreduce_fp16": 2359296, "allgather": 2359296,
                    "alltoall": 2359296}


@pytest.mark.unit
def test_a_link_whose_bytes_cost_nothing_measurable_gets_the_floor_not_zero():
    rows = [("allreduce", 2, 4096, 1e-3), ("allreduce", 2, 262144, 0.9e-3)]
    fit = planner.fit_links(rows)["allreduce"]
    assert fit.beta == planner.BETA_FLOOR and fit.clamped == "beta" and fit.link().beta > 0


@pytest.mark.unit
def test_the_busy_link_is_the_one_that_predicts_the_measured_step():
    m = calibration.combine(records([rank_measurements(backward=0.02, ready=(0.01, 0.02))]),
                            [link_rows(100e6)], 2)
    labels = [FLOAT32, FLOAT32]
    idle_step = planner.predict(m, labels).step_s
    busy, k = inputs.busy_links(m, labels, idle_step * 1.3)
    assert k > 1 and planner.predict(busy, labels).step_s == pytest.approx(idle_step * 1.3, rel=1e-6)
    assert busy.links["allreduce"].beta == pytest.approx(k * m.links["allreduce"].beta)
    same, k = inputs.busy_links(m, labels, idle_step * 0.9)   # faster than predicted: idle
    assert k == 1.0 and planner.predict(same, labels).step_s == pytest.approx(idle_step)


@pytest.mark.unit
def test_cpu_share_counts_the_compute_threads_per_core_of_the_most_crowded_machine():
    def h(machine, cores=2, threads=1):
        return Host(machine, cores, threads)
    assert calibration.cpu_share([h("a")] * 4) == 2.0           # 4 ranks on 2 cores
    assert calibration.cpu_share([h("a")] * 2) == 1.0
    assert calibration.cpu_share([h("a"), h("b")]) == 0.0       # a core left free on each
    assert calibration.cpu_share([h("a", 16, 4)] * 2 + [h("b")] * 3) == 1.5
    assert calibration.cpu_share([h("a"), None]) == 0.0         # a rank that did not say
    here = calibration.host()
    assert here.cores >= 1 and here.threads >= 1 and here.machine


@pytest.mark.unit
def test_combine_fits_each_collectives_cpu_from_the_ranks_medians():
    def with_cpu(rows, per_byte):
        return [(c, n, b, t, 1e-4 + per_byte * b) for c, n, b, t in rows]
    ranks = [dict(rank_measurements(), host=dataclasses.asdict(calibration.host()))
             for _ in range(2)]
    m = calibration.combine(records(ranks), [with_cpu(link_rows(1e9), 2e-9),
                                    with_cpu(link_rows(1e9), 4e-9)], 2)
    assert set(m.links_cpu) == set(calibration.LINK_COLLECTIVES)
    fit = m.links_cpu["allreduce"]                   # the median of the two ranks: 3e-9
    assert fit.a == pytest.approx(1e-4, rel=1e-6) and fit.b == pytest.approx(3e-9, rel=1e-6)
    assert calibration.combine(records([rank_measurements()]), [link_rows(1e9)], 2).links_cpu == {}
    bad = with_cpu(link_rows(1e9), 2e-9)
    bad[0] = bad[0][:4] + (math.nan,)
    with pytest.raises(ValueError, match="CPU"):
        calibration.combine(records(ranks), [bad, bad], 2)


@pytest.mark.unit
def test_the_pace_is_cleared_of_the_plan_in_forces_cpu_before_the_busy_link_is_fitted():
    rows = [(c, n, b, t, 5e-9 * b) for c, n, b, t in link_rows(1e9)]
    host = {"machine": "m", "cores": 2, "threads": 1}
    ranks = [dict(rank_measurements(ready=(0.01, 0.3)), host=host)] * 4
    m = calibration.combine(records(ranks),
                            [rows] * 4, 2)
    assert m.cpu_share == 2.0
    labels = [FLOAT32, FLOAT32]
    took = planner.predict(m, labels).stolen_s
    assert took[0] == 0 and took[1] > 0.01                 # fc.bias's allreduce, inside backward
    clean = inputs.without_steal(m, labels)
    assert clean.backward_s == pytest.approx(m.backward_s - took[-1])
    assert clean.buckets[1].ready_s == pytest.approx(0.3 - took[1])
    # the plan in force, predicted on the cleared pace, steps as it was measured
    measured = planner.predict(m, labels).step_s - took[-1]
    assert planner.predict(clean, labels).step_s == pytest.approx(measured, rel=1e-6)
    busy, k = inputs.busy_links(m, labels, measured)
    assert k == pytest.approx(1.0) and busy.backward_s == clean.backward_s


# ---------------------------------------------------------------- the trial (hvd_compress/auto/trial.py)

def tried(*rows):
    """Contenders from (name, predicted s, loss) rows; labels one per row, distinct."""
    return [trial.Contender(name, (f"x{i}",), predicted, loss)
            for i, (name, predicted, loss) in enumerate(rows)]


def times_for(medians, steps, first=1.0, jitter=0.0):
    """Step times along trial.schedule: `first` for the untimed round, then each contender's
    median with +-jitter around it (so the median is exactly that)."""
    order = trial.schedule(len(medians), steps)
    out, seen = [], [0] * len(medians)
    for k, j in enumerate(order):
        if k < len(medians):
            out.append(first)
            continue
        sign = (-1, 1, 0)[seen[j] % 3]
        seen[j] += 1
        out.append(medians[j] + sign * jitter)
    return out


@pytest.mark.unit
def test_the_trial_interleaves_the_contenders_the_first_round_untimed():
    assert trial.schedule(3, 2) == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert trial.schedule(2, 0) == [0, 1]
    order = trial.schedule(4, 5)                          # every place in a round, in turn
    assert sorted(order[4:]) == sorted([0, 1, 2, 3] * 5)
    assert {order[4 * r] for r in range(1, 5)} == {0, 1, 2, 3}
    # the untimed round's steps (10 s here) move no median
    v = trial.verdict(tried(("plan", 0.2, 0.0), ("b", 0.3, 5.0)),
                      times_for([0.2, 0.1], 3, first=10.0), 3)
    assert v.medians == (0.2, 0.1) and v.chosen == 1


@pytest.mark.unit
def test_the_trial_keeps_the_measured_fastest_against_the_models_choice():
    # the model put the plan first (0.20 s) and bit8 everywhere 16% behind; measured, bit8 is
    # 10% faster: it is kept, its cost is what the plan's steps took beyond bit8's median
    c = tried(("plan", 0.20, 1.0), ("bit8:allgather everywhere", 0.232, 3.0),
              ("none:allreduce everywhere", 0.25, 0.0))
    times = times_for([0.20, 0.18, 0.30], 5, first=0.25, jitter=0.01)
    v = trial.verdict(c, times, 5)
    assert v.chosen == 1 and v.medians == pytest.approx((0.20, 0.18, 0.30))
    assert v.lows == pytest.approx((0.19, 0.17, 0.29))    # the second fastest of five
    order = trial.schedule(3, 5)
    want = sum(t - 0.18 for j, t in zip(order, times) if j != 1)
    assert v.cost_s == pytest.approx(want)                # beyond the kept plan's median
    assert v.reason == "bit8:allgather everywhere adopted (170 ms, the plan 190 ms)"


@pytest.mark.unit
def test_a_neighbours_bursts_do_not_decide_the_trial():
    # bursts (40 ms) land on three of the plan's five steps and on two of the rival's: the
    # median would keep the rival, the second fastest sees the plan's own 13 ms
    c = tried(("plan", 0.02, 1.0), ("b", 0.02, 1.0))
    order = trial.schedule(2, 5)
    plan_steps, rival_steps = iter([0.040, 0.013, 0.040, 0.0131, 0.040]), \
        iter([0.040, 0.018, 0.018, 0.040, 0.0181])
    times = [0.05] * 2 + [next(plan_steps) if j == 0 else next(rival_steps) for j in order[2:]]
    v = trial.verdict(c, times, 5)
    assert v.medians[0] > v.medians[1] and v.chosen == 0
    assert trial.low([3.0, 1.0, 2.0, 5.0, 4.0]) == 2.0 and trial.low([2.0, 1.0]) == 1.0
    assert math.isnan(trial.low([]))


@pytest.mark.unit
def test_within_the_tie_the_less_lossy_plan_is_kept():
    c = tried(("plan", 0.20, 1.0), ("bit8:allgather everywhere", 0.21, 3.0))
    tie = trial.TRIAL_TIE
    v = trial.verdict(c, times_for([0.100 * (1 + tie / 2), 0.100], 5), 5)
    assert v.chosen == 0 and "within the 2% tie and less lossy" in v.reason
    assert v.reason.startswith("the plan kept (101 ms, bit8:allgather everywhere 100 ms)")
    v = trial.verdict(c, times_for([0.100 * (1 + 2 * tie), 0.100], 5), 5)
    assert v.chosen == 1                                  # beyond the tie: the faster
    v = trial.verdict(c, times_for([0.100 * (1 + tie / 2), 0.100], 5), 5, tie=0.0)
    assert v.chosen == 1                                  # no tie margin: the fastest alone
    # a rival that is less lossy and tied is taken over a faster, lossier plan
    c = tried(("plan", 0.20, 3.0), ("none:allreduce everywhere", 0.21, 0.0))
    v = trial.verdict(c, times_for([0.100, 0.101], 5), 5)
    assert v.chosen == 1 and "within the 2% tie of the fastest and less lossy" in v.reason


@pytest.mark.unit
def test_a_trial_without_usable_times_keeps_the_plan_and_bad_input_is_refused():
    c = tried(("plan", 0.2, 1.0), ("b", 0.3, 0.0))
    times = times_for([0.2, 0.1], 2)
    spoilt = [math.nan if j == 0 else t for j, t in zip(trial.schedule(2, 2), times)]
    v = trial.verdict(c, spoilt, 2)
    assert v.chosen == 0 and "no usable time" in v.reason and v.cost_s == 0.0
    one_bad = list(times)
    one_bad[3] = math.inf                                # rival's step lost: its other one counts
    assert trial.verdict(c, one_bad, 2).medians == (0.2, 0.1)
    with pytest.raises(ValueError, match="schedule of 6 steps"):
        trial.verdict(c, times[:-1], 2)


def planned_measurements(err=0.03):
    ranks = [rank_measurements(backward=0.02, ready=(0.01, 0.02), err=err)] * 2
    return calibration.combine(records(ranks), [link_rows(100e6)] * 2, 2)


@pytest.mark.unit
def test_the_rivals_are_the_fixed_plans_predicted_near_the_plan():
    m = planned_measurements()
    plan = planner.search(m)
    fixed = {t: planner.predict(m, planner.fixed_plan(m, t)).step_s
             for t in planner.DEFAULT_CANDIDATES}
    out = trial.contenders(m, plan.schemes, margin=0.30, rivals=3)
    assert out[0].name == "plan" and out[0].labels == plan.schemes
    assert out[0].predicted_s == pytest.approx(plan.predicted_s)
    assert out[0].loss == pytest.approx(plan.loss)
    rivals = out[1:]
    assert 1 <= len(rivals) <= 3 and len({c.labels for c in out}) == len(out)
    assert [c.predicted_s for c in rivals] == sorted(c.predicted_s for c in rivals)
    for c in rivals:
        text = c.name.split(" ")[0]
        assert c.labels == planner.fixed_plan(m, text) and c.name == f"{text} everywhere"
        assert c.predicted_s == pytest.approx(fixed[text])
        assert c.predicted_s <= plan.predicted_s * 1.30
    # every fixed plan within the margin is in, but for the cap and the plan itself
    near = [t for t, s in fixed.items() if s <= plan.predicted_s * 1.30
            and planner.fixed_plan(m, t) != plan.schemes]
    assert len(rivals) == min(3, len(near))
    assert trial.contenders(m, plan.schemes, margin=0.0, rivals=3)[1:] == [
        c for c in rivals if c.predicted_s <= plan.predicted_s]
    assert len(trial.contenders(m, plan.schemes, margin=10.0, rivals=5)) == 6


@pytest.mark.unit
def test_a_rival_never_takes_a_scheme_the_accuracy_guard_refuses():
    m = planned_measurements(err=0.2)                     # bit8 over the bound on every bucket
    out = trial.contenders(m, planner.search(m).schemes, margin=10.0, rivals=5)
    assert not any(t.startswith("bit8") for c in out for t in c.labels)
    assert all(math.isfinite(c.loss) for c in out)


@pytest.mark.unit
def test_the_decision_carries_the_rivals_to_try_and_trial_steps_0_tries_none():
    ranks = [rank_measurements(backward=0.02, ready=(0.01, 0.02))] * 2
    d = decide(Auto(trial_steps=5), ranks, [link_rows(100e6)] * 2, [], 2)
    assert d.ok and d.rivals[0].labels == d.labels
    assert d.rivals[0].predicted_s == pytest.approx(d.predicted_s)
    assert len(d.rivals) >= 2 and d.no_trial is None
    assert json.dumps(Decision.from_dict(json.loads(json.dumps(d.to_dict()))).to_dict()) == \
        json.dumps(d.to_dict())
    untried = decide(Auto(), ranks, [link_rows(100e6)] * 2, [], 2)     # the default: none
    assert untried.rivals == () and untried.no_trial == "trial_steps=0"
    assert untried.labels == d.labels
    with pytest.raises(ValueError, match="trial_steps"):
        Auto(trial_steps=-1)


@pytest.mark.unit
def test_trial_steps_switch_plans_at_step_boundaries_with_no_plan_shown_meanwhile():
    comm = communicator(trial_steps=5)
    labels = [("bit8:allgather",) * 4, (FLOAT32,) * 4, ("fp16:allreduce",) * 4]
    rivals = tuple(trial.Contender(n, x, 0.1, 0.0) for n, x in zip(("plan", "a", "b"), labels))
    comm.apply_decision(plan(labels[0], 0.1, rivals=rivals), 0.1)
    assert comm.plan_report().phase == "trial" and comm.phase == Phase.TRIAL
    assert comm.labels == list(labels[0])
    stats = comm.pop_stats()
    assert stats["plan"] == "" and stats["plan_event"].endswith(
        "trial: the plan and 2 rival(s), 5 timed steps each")
    order = trial.schedule(3, 5)
    for k in range(1, len(order)):                       # all but the last (it gathers)
        comm.end_step(None, None)
        assert comm.labels == list(labels[order[k]]), k
        assert comm.pop_stats()["plan"] == ""
    assert len(comm.status.trial_times) == len(order) - 1


@pytest.mark.unit
def test_rank_0s_verdict_takes_the_slowest_rank_each_step_and_never_raises():

    c = tried(("plan", 0.2, 1.0), ("b", 0.3, 0.0))
    fast = times_for([0.10, 0.20], 2)
    slow = times_for([0.30, 0.20], 2)                     # rank 1 is slower on the plan's steps
    v = judge(c, torch.tensor([fast, slow], dtype=torch.float64), 2, fixed_s=1.0)
    assert v.chosen == 1 and v.medians == pytest.approx((0.30, 0.20))
    assert v.step_s == pytest.approx(tuple(max(a, b) for a, b in zip(fast, slow)))
    assert v.shift_s == pytest.approx(((0.30 - 0.2) + (0.20 - 0.3)) / 2)
    assert trial.Verdict.from_dict(json.loads(json.dumps(v.to_dict()))) == v   # its broadcast
    v = judge(c, torch.tensor([fast[:-1]], dtype=torch.float64), 2)
    assert v.chosen == 0 and v.reason.startswith("the plan kept: no verdict (ValueError")
    assert v.shift_s == 0.0


@pytest.mark.unit
def test_the_trial_re_measures_the_fixed_time_common_to_every_plan():
    # predicted 36, 37, 40 ms; measured 20, 16, 21: the model's fixed time is ~17 ms too long
    c = tried(("plan", 0.036, 1.0), ("b", 0.037, 3.0), ("c", 0.040, 0.0))
    shift = trial.fixed_shift(c, (0.020, 0.016, 0.021), fixed_s=0.026)
    assert shift == pytest.approx(-0.019)                # the median residual (b's is -0.021)
    assert trial.fixed_shift(c, (0.020, 0.016, 0.021), fixed_s=0.010) == -0.010   # >= 0 left
    assert trial.fixed_shift(c, (0.050, math.nan, math.nan), fixed_s=0.026) == 0.0
    assert trial.fixed_shift(c, (0.046, 0.047, 0.050), fixed_s=0.026) == pytest.approx(0.010)


# ---------------------------------------------------------------- the committed records

RESULTS = Path(__file__).resolve().parents[1] / "results"
# The plans this version of the planner made, committed: re-decided from their records they
# must give the same plan and the same predicted step, to the bit.
CURRENT_PLANS = sorted((RESULTS / "step-auto-rerun" / "plans").glob("*.json")) + [
    RESULTS / "lab-auto-head" / "xeon-reps" / "np4-auto" / "manifest.json"] + sorted(
    (RESULTS / "step-bound" / "auto-overlap").glob("**/plans/*.json"))   # overlap's, and waiting


def committed_report(path):
    data = json.loads(path.read_text())
    return PlanReport.from_dict(data.get("plan_report", data))


@pytest.mark.unit
def test_every_committed_plan_report_loads_as_a_record():
    """Every plan report under results/ (bench_step's plans/, the lab's manifests), written by
    earlier versions too, reads back as a records.PlanReport."""
    paths = [p for p in RESULTS.rglob("*.json") if '"measured_step_s"' in p.read_text()]
    assert len(paths) >= 100
    for path in paths:
        report = committed_report(path)
        assert report.measurements is not None and report.buckets, path
        assert report.labels == [b["label"] for b in json.loads(path.read_text()).get(
            "plan_report", json.loads(path.read_text()))["buckets"]], path


@pytest.mark.unit
@pytest.mark.parametrize("path", CURRENT_PLANS, ids=lambda p: str(p.relative_to(RESULTS)))
def test_the_committed_plans_are_re_decided_to_the_bit(path):
    """The 16 cells of results/step-auto-rerun and the lab's xeon-reps run: the record's own
    measurements give its plan and its predicted step, bit for bit."""
    report = committed_report(path)
    _, busy, replayed = inputs.replay(report)
    assert list(replayed.schemes) == report.labels
    assert replayed.predicted_s == report.predicted_s
    assert busy == report.measurements.busy_factor


# ---------------------------------------------------------------- a plugin's scheme

@pytest.fixture
def int4():
    """tests/int4_scheme.py's sub-byte scheme, registered for this test only."""
    import int4_scheme
    int4_scheme.register()
    yield int4_scheme
    int4_scheme.unregister()


@pytest.mark.unit
def test_auto_takes_a_plugin_scheme_that_carries_values_and_guards_it_per_bucket(int4):
    """A scheme registered the documented way that says `carries_values` is among auto's
    candidates, by both its routes, with no edit to auto; its error is measured on each
    bucket exactly as bit8's is (encode_chunks, decode_chunks of the bucket); and the guard
    lets a bucket take it where that error is under the bound (the slow link then picks it:
    half bit8's bytes) and refuses it on a bucket where it is over."""
    candidates = hc.Compression.auto.candidates
    assert candidates[:len(planner.DEFAULT_CANDIDATES)] == planner.DEFAULT_CANDIDATES
    assert candidates[len(planner.DEFAULT_CANDIDATES):] == ("int4test:allgather",
                                                            "int4test:alltoall")
    assert hc.Compression.auto(candidates=["int4test"]).candidates == (FLOAT32,
                                                                       "int4test:allgather")
    # measured as the calibration measures every packet scheme
    gen = torch.Generator().manual_seed(0)
    grid = torch.randint(-7, 8, (70_000,), generator=gen).float() * 1e-3  # on int4's grid
    grid[::256] = 7e-3                                    # each block's amax: scale 1e-3 exact
    normal = torch.randn(70_000, generator=gen) * 1e-3     # 4 bits cannot carry a Gaussian
    errs = calibration.measure_errors([grid, normal], ["fc1.weight", "conv.weight"],
                                      candidates, 256)
    for x, name in ((grid, "fc1.weight"), (normal, "conv.weight")):
        message = torch.zeros(int4.Int4Compressor.message_bytes(x.numel(), 256), dtype=torch.uint8)
        int4.Int4Compressor.encode_chunks(x, message, [0, x.numel()], 256)
        y = int4.Int4Compressor.decode_chunks(message, [0, x.numel()], torch.empty_like(x), 256)
        assert errs[name]["int4test"] == float((y - x).norm()) / float(x.norm())
    assert errs["fc1.weight"]["int4test"] < 1e-6 < planner.ERROR_BOUND
    assert errs["conv.weight"]["int4test"] > planner.ERROR_BOUND
    # the planner on a slow link, measurements by hand as tests/test_planner.py builds them
    buckets = (planner.Bucket("fc1.weight", 4 * MiB, 0.010),
               planner.Bucket("conv.weight", 4 * MiB, 0.020))
    slow = Link.from_bandwidth(1e-3, 100e6 / 8)
    cost = planner.CodecCost(planner.Affine(1e-4, 1e-10), planner.Affine(1e-4, 1e-10),
                             planner.Affine(1e-4, 1e-10))
    errors = {(b.name, s): 2e-4 for b in buckets for s in ("fp16", "bit16")}
    errors.update({(b.name, "bit8"): 0.03 for b in buckets})
    errors.update({(name, "int4test"): row["int4test"] for name, row in errs.items()})
    m = planner.Measurements(2, buckets, 0.020, {c: slow for c in calibration.LINK_COLLECTIVES},
                             {t: cost for t in candidates if t != FLOAT32}, errors)
    plan = planner.search(m, candidates)
    assert plan.schemes[0].startswith("int4test:"), plan.schemes
    assert plan.schemes[1].startswith("bit8:"), plan.schemes
    assert "> bound" in plan.refused[("conv.weight", "int4test:allgather")]
    assert ("fc1.weight", "int4test:allgather") not in plan.refused
    # and the same measurements without the plugin among the candidates: bit8 on both
    assert planner.search(m, planner.DEFAULT_CANDIDATES).schemes[0].startswith("bit8:")


@pytest.mark.unit
def test_the_default_candidates_are_the_registrys_schemes_that_carry_values():
    from hvd_compress.auto.settings import NOT_BY_DEFAULT, default_candidates
    assert default_candidates() == planner.DEFAULT_CANDIDATES
    for name in NOT_BY_DEFAULT:                  # carry values, chosen only when named
        assert hc.Compression.auto(candidates=[name]).candidates[1].startswith(name + ":")
    with pytest.raises(ValueError, match="carries_values"):
        hc.Compression.auto(candidates=["onebit"])


def overlapped(rank, needed, chunks=None):
    """A rank's measurements (rank_measurements' dict) as taken under schedule="overlap"
    (the allgather routes' chunks: {label: {bucket: count}})."""
    return dict(rank, pace=dict(rank["pace"], needed_s=list(needed)), chunks=chunks or {})


@pytest.mark.unit
def test_combine_prices_the_overlapped_schedule_only_where_every_rank_measured_it():
    both = [overlapped(rank_measurements(), (0.03, 0.0)),
            overlapped(rank_measurements(), (0.04, 0.001))]
    m = calibration.combine(records(both), [link_rows(100e6)] * 2, 2)
    assert m.schedule == "overlap" and m.needed_s == (0.04, 0.001)    # the slowest rank's
    assert m.chunks == {}
    one = [both[0], rank_measurements()]
    assert calibration.combine(records(one), [link_rows(100e6)] * 2, 2).schedule == "wait"


@pytest.mark.unit
def test_an_overlapped_plan_is_reported_as_such_and_re_decided_from_its_record(tmp_path, capsys):
    from hvd_compress.auto import cli
    comm = AutoCommunicator(hc.Compression.auto())
    comm.plan(["fc.weight", "conv.weight"], [torch.zeros(MiB), torch.zeros(16 * 1024)])
    sizes = [(b.name, b.bytes) for b in comm.plan_report().buckets]
    ranks = [overlapped(rank_measurements(backward=0.02, ready=(0.01, 0.02), sizes=sizes),
                        (0.03, 0.0), {"bit8:allgather": {"fc.weight": 4}})] * 2
    d = decide(comm.settings, ranks, [link_rows(100e6)] * 2, [], 2)
    assert d.ok and d.measurements.schedule == "overlap"
    waiting = decide(comm.settings, [rank_measurements(backward=0.02, ready=(0.01, 0.02),
                                                       sizes=sizes)] * 2,
                     [link_rows(100e6)] * 2, [], 2)
    assert waiting.measurements.schedule == "wait"
    assert d.predicted_s != waiting.predicted_s          # priced on another timeline
    comm.apply_decision(d, 0.1)
    report = comm.plan_report()
    assert report.schedule == "overlap" and report.to_dict()["schedule"] == "overlap"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(report.to_dict()))
    again = PlanReport.from_dict(json.loads(path.read_text()))
    assert again.schedule == "overlap"
    assert again.measurements.needed_s == {"fc.weight": 0.03, "conv.weight": 0.0}
    assert again.measurements.chunks == {("fc.weight", "bit8:allgather"): 4}
    m, busy, plan = inputs.replay(again)
    assert m.needed_s == (0.03, 0.0)
    assert plan.schemes == d.labels and plan.predicted_s == d.predicted_s
    assert cli.main(["--report", str(path)]) == 0
    assert "schedule='overlap'" in capsys.readouterr().out
    # a record of an earlier version (no needs) reads back as the waiting schedule
    old = report.to_dict()
    del old["schedule"], old["measurements"]["needed_s"], old["measurements"]["schedule"]
    assert PlanReport.from_dict(old).schedule == "wait"
