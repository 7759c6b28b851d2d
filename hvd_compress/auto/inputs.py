"""The planner's inputs as a job last saw them: the links as its own steps run them
(busy_links, after without_steal), and the record of them that plan_report() keeps (summary)
read back into planner.Measurements (from_summary), so that `python -m hvd_compress.auto
--report` re-decides a job's plan from its record, exactly (docs/planner.md, "In the job" and
"The command"). Pure: no torch, no Horovod."""
import dataclasses
import math

from ..costmodel.model import Link
from . import planner

__all__ = ["BUSY_FACTOR_MAX", "without_steal", "busy_links", "summary", "from_summary",
           "replay"]

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


def summary(m: planner.Measurements):
    """The measurements as JSON-able numbers, for plan_report() and the lab's manifest."""
    def affine(x):
        return {"a": x.a, "b": x.b}
    return {
        "n": m.n, "backward_s": m.backward_s, "fixed_s": m.fixed_s,
        "ready_s": {b.name: b.ready_s for b in m.buckets},
        "links": {c: {"alpha": f.alpha, "beta": f.beta, "r2": getattr(f, "r2", math.nan)}
                  for c, f in m.links.items()},
        "codecs": {t: {"encode": affine(c.encode), "reduce": affine(c.reduce),
                       "decode": affine(c.decode)} for t, c in m.codecs.items()},
        "errors": {f"{b} {s}": e for (b, s), e in sorted(m.errors.items())},
        "links_cpu": {c: affine(x) for c, x in m.links_cpu.items()}, "cpu_share": m.cpu_share,
    }


def from_summary(measurements, buckets):
    """planner.Measurements from summary()'s dict (`measurements`, as plan_report() and the
    lab's manifest keep it) and the report's buckets ([{name, bytes}] or [(name, bytes)], in
    launch order): the links timed alone, as `combine` gave them to busy_links. Raises
    ValueError where the record is not one (a key missing, a bucket without a ready time)."""
    try:
        ready = measurements["ready_s"]
        layout = [(b["name"], b["bytes"]) if isinstance(b, dict) else tuple(b) for b in buckets]
        order = [planner.Bucket(name, int(nbytes), float(ready[name])) for name, nbytes in layout]

        def affine(x):
            return planner.Affine(float(x["a"]), float(x["b"]))

        codecs = {t: planner.CodecCost(encode=affine(c["encode"]), reduce=affine(c["reduce"]),
                                       decode=affine(c["decode"]))
                  for t, c in measurements["codecs"].items()}
        errors = {}
        for key, err in measurements["errors"].items():
            bucket, scheme_name = key.rsplit(" ", 1)
            errors[(bucket, scheme_name)] = math.nan if err is None else float(err)
        return planner.Measurements(
            int(measurements["n"]), tuple(order), float(measurements["backward_s"]),
            {c: Link(float(f["alpha"]), float(f["beta"]))
             for c, f in measurements["links"].items()},
            codecs, errors, fixed_s=float(measurements["fixed_s"]),
            links_cpu={c: affine(x) for c, x in measurements.get("links_cpu", {}).items()},
            cpu_share=float(measurements.get("cpu_share", 0.0)))
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"not a plan report's measurements: {err!r} missing or malformed") \
            from None


def replay(report, margin=None):
    """(measurements as the search saw them, busy factor, planner.Plan) re-decided from a
    plan_report() dict: its measurements read back, the busy factor fitted again to the step
    it was measured at on the plan then in force, searched with the report's candidates, error
    bound and margin (or `margin`). The same inputs give the same plan (planner, "Determinism"), so this is
    the job's decision, unless a trial then kept a rival. Raises ValueError where the report
    holds no measurements (one rank, or no calibration succeeded)."""
    measurements = report.get("measurements") or {}
    if not measurements.get("links"):
        raise ValueError("the report holds no measurements to plan from (one rank, or no "
                         "calibration succeeded: see its events)")
    settings = report.get("settings") or {}
    timed = from_summary(measurements, report["buckets"])
    in_force = measurements.get("measured_on") or ["none:allreduce"] * len(timed.buckets)
    m, busy = busy_links(timed, in_force, float(measurements["measured_step_s"]))
    plan = planner.search(m, tuple(settings.get("candidates", planner.DEFAULT_CANDIDATES)),
                          settings.get("error_bound", planner.ERROR_BOUND),
                          settings.get("margin", planner.TIE_MARGIN) if margin is None
                          else margin)
    return m, busy, plan
