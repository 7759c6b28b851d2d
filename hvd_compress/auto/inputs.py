"""The planner's inputs as a job last saw them: the links as its own steps run them
(busy_links, after without_steal), and the record of them that plan_report() keeps (summary,
a records.MeasurementsRecord) read back into planner.Measurements, so that
`hvd-compress-plan --report` re-decides a job's plan from its record, exactly
(docs/planner.md, "In the job" and "The command"). Pure: no torch, no Horovod."""
import dataclasses
import math

from . import planner, records

__all__ = ["BUSY_FACTOR_MAX", "without_steal", "busy_links", "summary", "replay"]

# The most the busy link (while backward computes) is taken slower than the idle one.
BUSY_FACTOR_MAX = 20.0


def without_steal(m: planner.Measurements, labels):
    """The pace as backward would run with no collective beside it. The warm-up steps ran the
    plan in force (`labels`), whose collectives' CPU backward's pace already holds; the
    timeline adds each plan's own (planner, "The collectives' CPU"), so the plan in force's,
    as the timeline reckons it, is taken out of the ready times and backward's end."""
    t = planner.predict(m, labels)
    if not t.stolen_s[-1]:
        return m
    ready, last = [], 0.0
    for b, took in zip(m.buckets, t.stolen_s):
        last = max(last, b.ready_s - took)
        ready.append(dataclasses.replace(b, ready_s=last))
    return dataclasses.replace(m, buckets=tuple(ready),
                               backward_s=max(m.backward_s - t.stolen_s[-1], last))


def busy_links(m: planner.Measurements, labels, measured_step_s):
    """The links as the job's own steps run them. The collectives were timed alone, between
    steps, on idle cores; in the step, Horovod's thread competes with backward's compute for
    the cores (2 here), and a bucket waits for the poll. So every link is slowed by the one
    factor k >= 1 (alpha and beta alike) that makes the plan in force (`labels`, float32 at
    first) predict the step it was measured at; k = 1 where the timed links already predict it
    or more; at most BUSY_FACTOR_MAX. The pace is first cleared of the plan in force's CPU
    (without_steal). Returns (measurements, k); the links timed alone are in `summary`."""
    m = without_steal(m, labels)
    idle = {c: (f.link() if callable(getattr(f, "link", None)) else f) for c, f in m.links.items()}

    def with_factor(k):
        busy = {c: dataclasses.replace(x, alpha=x.alpha * k, beta=x.beta * k)
                for c, x in idle.items()}
        return dataclasses.replace(m, links=busy, links_idle=None)

    def step(k):
        return planner.predict(with_factor(k), labels).step_s

    if not (math.isfinite(measured_step_s) and step(1.0) < measured_step_s):
        return with_factor(1.0), 1.0
    if step(BUSY_FACTOR_MAX) <= measured_step_s:
        return with_factor(BUSY_FACTOR_MAX), BUSY_FACTOR_MAX
    low, high = 1.0, BUSY_FACTOR_MAX
    for _ in range(40):                      # the step grows with k (the fold is monotone)
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < measured_step_s else (low, mid)
    return with_factor(high), high


def summary(m: planner.Measurements, busy_factor=math.nan, measured_step_s=math.nan,
            measured_on=None) -> records.MeasurementsRecord:
    """The measurements as plan_report() keeps them (the links timed alone), with the busy
    factor and the step on the plan in force (`measured_on`) it was fitted to."""
    return records.MeasurementsRecord(
        m.n, m.backward_s, m.fixed_s, {b.name: b.ready_s for b in m.buckets},
        {c: records.LinkRecord(f.alpha, f.beta, getattr(f, "r2", math.nan))
         for c, f in m.links.items()},
        dict(m.codecs), dict(m.errors), dict(m.links_cpu), m.cpu_share, busy_factor,
        measured_step_s, None if measured_on is None else tuple(measured_on),
        None if m.needed_s is None else {b.name: t for b, t in zip(m.buckets, m.needed_s)},
        dict(m.chunks))


def replay(report, margin=None):
    """(measurements as the search saw them, busy factor, planner.Plan) re-decided from a plan
    report (records.PlanReport, or its dict): its measurements read back, the busy factor
    fitted again to the step it was measured at on the plan then in force, searched with the
    report's candidates, error bound and margin (or `margin`). The same inputs give the same
    plan (planner, "Determinism"), so this is the job's decision, unless a trial then kept a
    rival. Raises ValueError where the report holds no measurements (one rank, or no
    calibration succeeded)."""
    if not isinstance(report, records.PlanReport):
        report = records.PlanReport.from_dict(report)
    measured = report.measurements
    if measured is None or not measured.links:
        raise ValueError("the report holds no measurements to plan from (one rank, or no "
                         "calibration succeeded: see its events)")
    settings = report.settings
    timed = measured.planner_measurements([(b.name, b.bytes) for b in report.buckets])
    in_force = list(measured.measured_on or ["none:allreduce"] * len(timed.buckets))
    m, busy = busy_links(timed, in_force, measured.measured_step_s)
    plan = planner.search(m, tuple(settings.get("candidates", planner.DEFAULT_CANDIDATES)),
                          settings.get("error_bound", planner.ERROR_BOUND),
                          settings.get("margin", planner.TIE_MARGIN) if margin is None
                          else margin)
    return m, busy, plan
