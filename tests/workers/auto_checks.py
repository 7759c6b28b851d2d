"""Run under horovodrun (tests/workers/suite.py, or alone): Compression.auto on real ranks
(hvd_compress/auto/communicator.py, calibration.py). A small model trains with auto: it measures,
plans, and every rank ends with the same plan and the same bits; a given mixed plan's step
equals the float32 allreduce within its schemes' error bound; a rank whose calibration raises,
or yields non-finite numbers, or disagrees wildly, makes every rank fall back and train on;
a re-plan decision is taken at the same step, alike, on every rank; the plan survives a
checkpoint; reset (elastic) measures again; the trial runs the plan and its rivals step by step
alike on every rank and keeps one of them, the same everywhere (the other checks run without
it: trial_steps=0). Read through the optimizer's plan_report() (records.PlanReport) and the
communicator's public `labels` and `phase`."""
import dataclasses
import json
import math
import os
import statistics
import tempfile
from pathlib import Path

import torch

import hvd_compress as hc
from hvd_compress.auto import calibration, planner, trial
from hvd_compress.engine.horovod import horovod_engine
from hvd_compress.exchange.bucketing import groups_by_size
import checks

FLOAT32 = "none:allreduce"
FUSION = 4096            # four buckets of the net below (one of 656 B, three single tensors)
# Warm-up steps of every plan here: the median of the last four sets a rank's pace. With three
# (a median of two), one step slowed by a loaded machine made the ranks' medians differ by more
# than calibration.DISAGREE_FACTOR and the job fell back where the checks expect a plan (main's
# mpi-2 job, load average above 20: 0.0135 s against 0.0040 s).
WARMUP = 5


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def data(hvd, step=0):
    gen = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(16, 20, generator=gen), torch.randn(16, 4, generator=gen)


def optimizer(model, **options):
    auto = hc.Compression.auto(warmup_steps=WARMUP, **{"trial_steps": 0, **options})
    return hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=auto,
                                   fusion_threshold_bytes=FUSION)


def train(hvd, model, opt, steps, first=0):
    stats = []
    for step in range(first, first + steps):
        x, y = data(hvd, step)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
        stats.append(opt.pop_stats())
    return stats


def same_on_every_rank(hvd, value):
    every = hvd.allgather_object(value)
    return all(v == every[0] for v in every), every


def events(stats):
    return [s["plan_event"] for s in stats if s["plan_event"]]


def run(hvd):
    legal = set(planner.DEFAULT_CANDIDATES)

    # 1. train with auto: measure, plan, apply; same plan and bits everywhere
    model = net()
    opt = optimizer(model, replan_every=planner.REPLAN_WINDOW)   # checked in 3. below
    stats = train(hvd, model, opt, WARMUP + 6)
    report = opt.plan_report()
    checks.check("trains.four_buckets", len(report.buckets) == 4, str(report.buckets))
    checks.check("trains.float32_before_the_plan",
                 all(s["plan"] == "" for s in stats[:WARMUP - 1]) and
                 math.isnan(stats[0]["plan_predicted_s"]), str(stats[:WARMUP]))
    checks.check("trains.events", events(stats)[:2] == ["calibrating", "planned"],
                 str(events(stats)))
    labels = stats[-1]["plan"].split(" ")
    checks.check("trains.plan_labels_legal", len(labels) == 4 and set(labels) <= legal, str(labels))
    checks.check("trains.plan_in_report", report.plan == stats[-1]["plan"] and
                 report.labels == labels and report.phase == "planned")
    checks.check("trains.prediction_and_measurement", math.isfinite(stats[-1]["plan_predicted_s"])
                 and stats[-1]["plan_predicted_s"] > 0 and stats[-1]["plan_measured_s"] > 0,
                 str(stats[-1]))
    agree, every = same_on_every_rank(hvd, (stats[-1]["plan"], stats[-1]["plan_predicted_s"]))
    checks.check("trains.same_plan_on_every_rank", agree, str(every))
    checks.check("trains.identical_weights", checks.same_everywhere(list(model.parameters())))
    cost = report.calibration_s
    checks.check("trains.calibration_cost_recorded", report.calibrations == 1 and 0 < cost < 30,
                 str(cost))
    links = report.measurements.links
    checks.check("trains.links_fitted", set(links) == set(calibration.LINK_COLLECTIVES) and
                 all(v.alpha >= 0 and v.beta >= 0 for v in links.values()), str(links))
    cpu, hosts = report.measurements.links_cpu, hvd.allgather_object(calibration.host())
    checks.check("trains.links_cpu_fitted_and_the_share_counted",
                 set(cpu) == set(calibration.LINK_COLLECTIVES)
                 and all(v.a >= 0 and v.b >= 0 and v.a + v.b > 0 for v in cpu.values())
                 and report.measurements.cpu_share == calibration.cpu_share(hosts),
                 f"{cpu} share {report.measurements.cpu_share} hosts {hosts}")
    hvd.allgather_object(cost, name="auto.cost")      # the cost, logged below by the test
    if hvd.rank() == 0:
        print(f"auto calibration cost: {cost:.4f} s, plan {report.plan}", flush=True)

    # 1b. the link's sizes: grown past the two where those hide a byte's cost, alike everywhere
    caps = {c: 1 << 20 for c in calibration.LINK_COLLECTIVES}
    saved = calibration.LINK_GROW_MAX_S, calibration.LINK_RESOLVED_RATIO
    calibration.LINK_GROW_MAX_S = calibration.LINK_RESOLVED_RATIO = math.inf   # always grow
    try:
        rows = calibration.time_collectives(horovod_engine(), (4096, 65536), reps=1, caps=caps, budget_s=0)
    finally:
        calibration.LINK_GROW_MAX_S, calibration.LINK_RESOLVED_RATIO = saved
    n = hvd.size()
    want = [calibration.whole_size(b, n) for b in (4096, 65536, 1 << 18, 1 << 20)]
    sizes = {c: [b for c2, _, b, *_ in rows if c2 == c] for c in calibration.LINK_COLLECTIVES}
    checks.check("links.grow_to_the_cap", all(v == want for v in sizes.values()), str(sizes))
    rows = calibration.time_collectives(horovod_engine(), (4096, 65536), caps=caps)
    every = hvd.allgather_object(rows, name="auto.link_rows")
    agree, _ = same_on_every_rank(hvd, [(c, b) for c, _, b, *_ in rows])
    ruled = True
    for c in calibration.LINK_COLLECTIVES:
        sizes = sorted({b for c2, _, b, *_ in rows if c2 == c})
        fastest = {b: min(statistics.median(t for c2, _, b2, t, *_ in r if (c2, b2) == (c, b))
                          for r in every) for b in sizes}
        for i, size in enumerate(sizes[1:], 1):
            grown = calibration.next_link_size(size, fastest[sizes[0]], fastest[size], caps[c])
            ruled &= (grown is not None) == (i < len(sizes) - 1)
    checks.check("links.grown_by_the_rule_alike_everywhere", agree and ruled,
                 str(sorted({(c, b) for c, _, b, *_ in rows})))
    # each size's repetitions: LINK_REPS, and at the two sizes asked for as many more as the
    # budget holds at the slowest rank's median of the first LINK_REPS - 1 (what the last of
    # them carried to every rank); a grown size LINK_REPS
    counts, want_counts = {}, {}
    for c, _, b, *_ in rows:
        counts[(c, b)] = counts.get((c, b), 0) + 1
    asked = {calibration.whole_size(b, n) for b in (4096, 65536)}
    for (c, b) in counts:
        if b not in asked:
            want_counts[(c, b)] = calibration.LINK_REPS
            continue
        carried = [calibration.carried_units(c, statistics.median(
            [t for c2, _, b2, t, *_ in r if (c2, b2) == (c, b)][:calibration.LINK_REPS - 1]))
            for r in every]
        want_counts[(c, b)] = calibration.LINK_REPS + calibration.more_link_reps(
            calibration.LINK_REPS, max(carried) * calibration.CARRY_UNIT_S[c])
    checks.check("links.more_repetitions_where_cheap", counts == want_counts
                 and any(v > calibration.LINK_REPS for v in counts.values()),
                 f"{counts} want {want_counts}")

    # 2. a given mixed plan (restored from a state): the step equals float32's within bounds
    mixed = ["bit8:allgather", "bit16:alltoall", "fp16:allreduce", "bit8:alltoall"]
    state = opt.compression_state_dict()
    state["communicator"]["auto_plan"]["decision"] = dict(
        state["communicator"]["auto_plan"]["decision"], labels=mixed, predicted_s=1e-6)
    opt.load_compression_state_dict(state)
    x, y = data(hvd, 99)
    params = list(model.parameters())
    local = torch.autograd.grad((model(x) - y).square().mean(), params)   # no hooks fire
    ref = [hvd.allreduce(g, name=f"auto.ref.{i}") for i, g in enumerate(local)]
    opt.zero_grad()
    (model(x) - y).square().mean().backward()
    opt.synchronize()
    index = {p: i for i, p in enumerate(params)}
    # each bucket's parameters: backward order fused at FUSION (exchange/bucketing.py's rule,
    # the optimizer's), checked against the buckets the plan report names
    order = list(model.named_parameters())[::-1]
    buckets = [[order[i] for i in group]
               for group in groups_by_size([p.numel() for _, p in order], FUSION)]
    checks.check("mixed.buckets_as_reported",
                 [(m[0][0], 4 * sum(p.numel() for _, p in m)) for m in buckets] ==
                 [(b.name, b.bytes) for b in opt.plan_report().buckets], str(buckets))
    for b, (label, members) in enumerate(zip(mixed, buckets)):
        got = torch.cat([p.grad.reshape(-1) for _, p in members])
        want = torch.cat([ref[index[p]].reshape(-1) for _, p in members])
        norms = hvd.allgather_object(float(torch.cat([local[index[p]].reshape(-1)
                                                      for _, p in members]).norm()))
        err = float((got - want).norm()) / max(sum(norms) / len(norms), 1e-30)
        checks.check(f"mixed.bucket{b}.{label}.within_bound", err <= 2 * planner.ERROR_BOUND,
                     f"relative error {err:.3g}")
        checks.check(f"mixed.bucket{b}.{label}.compressed", not torch.equal(got, want))
    with opt.skip_synchronize():
        opt.step()
    stats = opt.pop_stats()
    checks.check("mixed.plan_shown", stats["plan"] == " ".join(mixed), stats["plan"])
    stats = train(hvd, model, opt, 3, first=100)
    checks.check("mixed.identical_weights", checks.same_everywhere(list(model.parameters())))

    # 3. the re-plan decision (prediction 1e-6 s: far off) at the same step everywhere
    opt.load_compression_state_dict(state)
    stats = train(hvd, model, opt, planner.REPLAN_WINDOW, first=200)
    replans = [i for i, s in enumerate(stats) if "replanned" in s["plan_event"]]
    check = opt.plan_report().last_replan_check
    agree, every = same_on_every_rank(hvd, (replans, check))
    checks.check("replan.same_decision_on_every_rank", agree, str(every))
    checks.check("replan.decided_at_the_window", replans == [planner.REPLAN_WINDOW - 1]
                 and check.now, f"{replans} {check}")
    stats = train(hvd, model, opt, WARMUP, first=300)
    checks.check("replan.planned_again", "planned" in events(stats), str(events(stats)))
    # measured under the mixed plan, each bucket's error for its own scheme is the gradient's
    # as sent, not the reduced result's (which has been through that codec: fp16 measured 0)
    report = opt.plan_report()
    errs, names = report.measurements.errors, [b.name for b in report.buckets]
    own = {(name, label.split(':')[0]): errs.get((name, label.split(':')[0]))
           for name, label in zip(names, mixed)}
    checks.check("replan.errors_of_the_gradient_as_sent",
                 all(e is not None and 1e-6 < e <= planner.ERROR_BOUND for e in own.values()),
                 str(own))
    checks.check("replan.identical_weights", checks.same_everywhere(list(model.parameters())))

    # 3b. error feedback: a lossy bucket keeps a residual; moved to float32 it carries it once
    ef_model = net()
    ef = hc.DistributedOptimizer(torch.optim.SGD(ef_model.parameters(), lr=0.05),
                                 named_parameters=ef_model.named_parameters(),
                                 compression=hc.Compression.auto(warmup_steps=WARMUP,
                                                                 trial_steps=0),
                                 fusion_threshold_bytes=FUSION, error_feedback=True)
    train(hvd, ef_model, ef, WARMUP)                  # planned (float32 here, most likely)
    mixed_state = ef.compression_state_dict()
    mixed_state["communicator"]["auto_plan"]["decision"] = dict(
        mixed_state["communicator"]["auto_plan"]["decision"], labels=mixed)
    mixed_state["residuals"] = {}
    ef.load_compression_state_dict(mixed_state)
    train(hvd, ef_model, ef, 2, first=500)
    kept = ef.compression_state_dict()["residuals"]
    checks.check("ef.lossy_buckets_keep_residuals", len(kept) >= 3 and
                 any(float(r.abs().max()) > 0 for r in kept.values()), str(list(kept)))
    plain = dict(mixed_state["communicator"]["auto_plan"]["decision"], labels=[FLOAT32] * 4)
    ef.load_compression_state_dict({"residuals": kept, "communicator": {"auto_plan": dict(
        mixed_state["communicator"]["auto_plan"], decision=plain)}})
    train(hvd, ef_model, ef, 1, first=600)
    left = ef.compression_state_dict()["residuals"]
    checks.check("ef.float32_carries_them_once", all(float(r.abs().max()) == 0
                                                      for r in left.values()), str(list(left)))
    checks.check("ef.identical_weights", checks.same_everywhere(list(ef_model.parameters())))

    # 4. a checkpoint's plan is taken up without measuring
    state = opt.compression_state_dict()
    other = optimizer(model)
    other.load_compression_state_dict(state)
    stats = train(hvd, model, other, 2, first=400)
    checks.check("resume.plan_restored", stats[0]["plan"] == " ".join(
        state["communicator"]["auto_plan"]["decision"]["labels"]) and
        other.plan_report().calibrations == 0, str(stats[0]))

    # 5. reset (elastic): float32, then measured and planned again
    other.reset_compression_state()
    stats = train(hvd, model, other, WARMUP)
    checks.check("reset.measures_again", stats[0]["plan"] == "" and
                 stats[-1]["plan_event"] == "planned", str(events(stats)))
    # the first plan after it is judged once after REPLAN_FIRST of its steps, not REPLAN_EVERY
    train(hvd, model, other, planner.REPLAN_FIRST - 1, first=450)
    before = other.plan_report().last_replan_check
    train(hvd, model, other, 1, first=450 + planner.REPLAN_FIRST)
    check = other.plan_report().last_replan_check
    agree, every = same_on_every_rank(hvd, check)
    checks.check("reset.first_plan_judged_early",
                 planner.REPLAN_FIRST < other.communicator.settings.replan_every
                 and before is None and check is not None and agree, f"{before} {every}")

    # 6. bad measurements on one rank: every rank falls back, warns once, trains on
    for tag, spoil in (("raises", _raising), ("non_finite", _non_finite),
                       ("disagrees", _disagreeing)):
        model = net()
        opt = optimizer(model)
        saved = {name: getattr(calibration, name) for name in ("time_codecs", "pace_summary")}
        if hvd.rank() == hvd.size() - 1:
            spoil()
        try:
            stats = train(hvd, model, opt, WARMUP + 2)
        finally:
            for name, fn in saved.items():
                setattr(calibration, name, fn)
        said = [e for e in events(stats) if e.startswith("fallback")]
        agree, every = same_on_every_rank(hvd, said)
        checks.check(f"bad.{tag}.every_rank_falls_back", len(said) == 1 and agree, str(every))
        checks.check(f"bad.{tag}.float32", stats[-1]["plan"] == "" and
                     opt.communicator.labels == ["none:allreduce"] * 4, str(stats[-1]))
        checks.check(f"bad.{tag}.identical_weights",
                     checks.same_everywhere(list(model.parameters())))
    checks.check("bad.reason_recorded", "disagree" in said[0], said[0])

    # 7. the trial: every fixed plan is a rival (margin inf), one timed step each
    real = trial.contenders
    trial.contenders = lambda *a, **k: real(*a, **dict(k, margin=math.inf))
    used, stats = [], []                  # the labels each step ran on, read before it
    try:
        model = net()
        opt = optimizer(model, trial_steps=1)
        for step in range(WARMUP + 2 * (trial.TRIAL_RIVALS + 1)):
            used.append(opt.communicator.labels)
            stats += train(hvd, model, opt, 1, first=step)
    finally:
        trial.contenders = real
    report = opt.plan_report()
    record = report.trial
    tried = record.contenders if record else ()
    steps = 2 * len(tried)
    checks.check("trial.ran", len(tried) >= 2 and record.steps == steps, str(record))
    flat = "; ".join(events(stats)).split("; ")
    checks.check("trial.events", flat[0] == "calibrating" and flat[1].startswith(
        f"trial: the plan and {len(tried) - 1} rival(s)") and flat[2].startswith("trial: ")
        and flat[3] == "planned", str(flat))
    first = next((i for i, s in enumerate(stats) if s["plan"]), None)
    checks.check("trial.plan_shown_once_kept", first == WARMUP + steps - 1, f"{first} {steps}")
    sent = {s["bytes_sent"] for s in stats[WARMUP:WARMUP + steps]}
    checks.check("trial.steps_ran_the_contenders", len(sent) >= 2, str(sent))
    kept = next((c for c in tried if c.name == record.chosen), None)
    checks.check("trial.kept_a_contender_with_the_models_prediction",
                 kept is not None and list(kept.labels) == report.plan.split(" ") and
                 record.predicted_untried_s == kept.predicted_s and
                 report.predicted_s == kept.predicted_s + record.fixed_shift_s,
                 str(record))
    checks.check("trial.cost_counted", record is not None
                 and 0 <= record.cost_s <= report.calibration_s, f"{record} {report.calibration_s}")
    agree, every = same_on_every_rank(hvd, (report.plan, record and record.chosen,
                                            [c.measured_s for c in tried]))
    checks.check("trial.same_verdict_on_every_rank", agree, str(every))
    checks.check("trial.identical_weights", checks.same_everywhere(list(model.parameters())))
    # the trial changes nothing but each step's schemes: the same labels, forced step by step
    # on a fresh model (no calibration, no trial), give the very same weights (the lab's
    # one-epoch run with the trial, replayed so, gave its losses bit for bit:
    # results/step-auto-trial/README.md)
    replay_model = net()
    replay = optimizer(replay_model)
    saved = opt.compression_state_dict()["communicator"]["auto_plan"]
    for step, labels in enumerate(used):
        replay.load_compression_state_dict({"residuals": {}, "communicator": {"auto_plan": dict(
            saved, decision=dict(saved["decision"], labels=labels))}})
        train(hvd, replay_model, replay, 1, first=step)
    checks.check("trial.changes_only_each_steps_schemes",
                 all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                       replay_model.parameters())),
                 str(sorted({" ".join(x) for x in used})))
    pinned(hvd, [(b.name, b.bytes) for b in report.buckets])


def pinned(hvd, layout):
    """Compression.auto(plan=...): a plan report (or its file) pinned is in force from the
    first step, nothing measured, on every rank alike; bit8 pinned on every bucket is the
    fixed bit8 optimizer's exchange, bit for bit; a plan for other buckets is refused at
    construction, naming them."""
    mixed = ["bit8:allgather", "bit16:alltoall", "fp16:allreduce", "bit8:alltoall"]
    report = {"plan": " ".join(mixed), "buckets": [{"name": n, "bytes": b, "label": t}
                                                   for (n, b), t in zip(layout, mixed)]}
    path = Path(os.environ.get("HVDC_CHECK_DIR", tempfile.gettempdir())) / \
        f"pinned-plan-rank{hvd.rank()}.json"
    path.write_text(json.dumps(report))
    model = net()
    opt = optimizer(model, plan=str(path))
    stats = train(hvd, model, opt, 3)
    checks.check("pinned.in_force_from_the_first_step", all(s["plan"] == report["plan"]
                                                            for s in stats)
                 and opt.plan_report().calibrations == 0, str([s["plan"] for s in stats]))
    checks.check("pinned.identical_weights", checks.same_everywhere(list(model.parameters())))
    model, fixed_model = net(), net()
    train(hvd, model, optimizer(model, plan=[(n, b, "bit8:allgather") for n, b in layout]), 3)
    fixed = hc.DistributedOptimizer(torch.optim.SGD(fixed_model.parameters(), lr=0.05),
                                    named_parameters=fixed_model.named_parameters(),
                                    compression=hc.Compression.bit8,
                                    fusion_threshold_bytes=FUSION)
    train(hvd, fixed_model, fixed, 3)
    checks.check("pinned.bit8_everywhere_is_bit8", all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fixed_model.parameters())))
    try:
        optimizer(net(), plan=[("elsewhere", 4, "bit8:allgather")])
        refused = ""
    except ValueError as err:
        refused = str(err)
    checks.check("pinned.other_buckets_refused", "the plan is for buckets" in refused and
                 "elsewhere" in refused, refused)


def _raising():
    def fail(*args, **kwargs):
        raise RuntimeError("codec timing failed here")
    calibration.time_codecs = fail


def _non_finite():
    real = calibration.time_codecs

    def nan(*args, **kwargs):
        out = real(*args, **kwargs)
        for parts in out.values():
            for points in parts.values():
                for point in points:
                    point[1] = math.nan
        return out
    calibration.time_codecs = nan


def _disagreeing():
    real = calibration.pace_summary

    def slow(samples):
        out = real(samples)
        return dataclasses.replace(out, step_s=out.step_s * 100)
    calibration.pace_summary = slow


if __name__ == "__main__":
    checks.main(run)
