"""What Compression.auto measures, decides and shows, as typed records: each rank's
measurements, the measurements a plan was chosen from, rank 0's decision, the trial's record
and the plan report (docs/planner.md, "The records"). Frozen: a record is what was measured or
decided, never edited afterwards. `to_dict` / `from_dict` only where a record leaves the
process: the calibration's gather, rank 0's broadcast, a checkpoint, the JSON of the lab's
manifest and of bench_step's plans/<cell>.json; `from_dict` also reads the records committed
by earlier versions (fields they lack take their defaults). Pure: no torch, no
Horovod (`hvd-compress-plan --report` reads them)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..costmodel.model import Link
from . import planner
from .trial import Contender

__all__ = ["StepSample", "Pace", "Host", "RankMeasurements", "LinkRecord", "MeasurementsRecord",
           "Decision", "TriedPlan", "TrialRecord", "BucketLabel", "Event", "ReplanCheck",
           "PlanReport"]


def _nan(value):
    return math.nan if value is None else float(value)


def _affine_dict(x: planner.Affine):
    return {"a": x.a, "b": x.b}


def _affine(d) -> planner.Affine:
    return planner.Affine(float(d["a"]), float(d["b"]))


@dataclass(frozen=True)
class StepSample:
    """One warm-up step's pace (calibration.step_sample): the step, backward's span less the
    hook work, the wait after it, the rest (fixed), and when each bucket was ready (s from
    backward's start, launch order); under schedule="overlap" when the next forward needed
    each bucket (s after step() returned, waits before it excluded; () when waiting)."""

    step_s: float
    backward_s: float
    wait_s: float
    fixed_s: float
    ready_s: tuple
    needed_s: tuple = ()


@dataclass(frozen=True)
class Pace:
    """A rank's warm-up, summed up (calibration.pace_summary): each quantity's median over the
    complete steps but the first, and how many steps that was."""

    step_s: float
    backward_s: float
    wait_s: float
    fixed_s: float
    ready_s: tuple
    steps: int
    needed_s: tuple = ()            # schedule="overlap": the next forward's need of each bucket

    def to_dict(self):
        out = {"step_s": self.step_s, "backward_s": self.backward_s, "wait_s": self.wait_s,
               "fixed_s": self.fixed_s, "ready_s": list(self.ready_s), "steps": self.steps}
        if self.needed_s:
            out["needed_s"] = list(self.needed_s)
        return out

    @classmethod
    def from_dict(cls, d):
        return cls(d["step_s"], d["backward_s"], d["wait_s"], d["fixed_s"], tuple(d["ready_s"]),
                   d["steps"], tuple(d.get("needed_s") or ()))


@dataclass(frozen=True)
class Host:
    """A rank's machine as calibration.cpu_share counts it: the kernel's boot id, the cores it
    may run on, its compute threads."""

    machine: str
    cores: int
    threads: int


@dataclass(frozen=True)
class RankMeasurements:
    """What one rank measured for a calibration (no collective): its buckets ((name, float32
    bytes), launch order), the plan its pace ran on, its machine, its pace, each lossy
    candidate's codec timings ({label: {"encode"|"reduce"|"decode": ((bytes, s), ...)}}) and
    each bucket's error per scheme ({bucket: {scheme: relative error}}). Every rank's is
    gathered (to_dict / from_dict: the gather's boundary) and calibration.combine makes one
    planner.Measurements of them."""

    buckets: tuple
    labels: tuple
    host: Host | None
    pace: Pace
    codecs: dict
    errors: dict
    chunks: dict = field(default_factory=dict)   # {label: {bucket: count}}: overlap's cut

    def to_dict(self):
        return {"buckets": [list(b) for b in self.buckets], "labels": list(self.labels),
                "chunks": {t: dict(row) for t, row in self.chunks.items()},
                "host": None if self.host is None else {"machine": self.host.machine,
                                                        "cores": self.host.cores,
                                                        "threads": self.host.threads},
                "pace": self.pace.to_dict(),
                "codecs": {t: {op: [list(p) for p in points] for op, points in parts.items()}
                           for t, parts in self.codecs.items()},
                "errors": {b: dict(row) for b, row in self.errors.items()}}

    @classmethod
    def from_dict(cls, d):
        host = d.get("host")
        return cls(tuple(tuple(b) for b in d["buckets"]), tuple(d.get("labels") or ()),
                   None if host is None else Host(host["machine"], host["cores"],
                                                  host["threads"]),
                   Pace.from_dict(d["pace"]),
                   {t: {op: tuple(tuple(p) for p in points) for op, points in parts.items()}
                    for t, parts in d["codecs"].items()},
                   {b: dict(row) for b, row in d["errors"].items()},
                   {t: {b: int(c) for b, c in row.items()}
                    for t, row in (d.get("chunks") or {}).items()})


@dataclass(frozen=True)
class LinkRecord:
    """A collective's link as timed alone (alpha s per message, beta s per byte as
    costmodel.fit counts bytes) and its fit's r2 (NaN where not known)."""

    alpha: float
    beta: float
    r2: float = math.nan


@dataclass(frozen=True)
class MeasurementsRecord:
    """The planner's inputs as a calibration saw them (inputs.summary makes one): the pace
    (backward, the rest of the step, each bucket's ready time), each collective's link timed
    alone and its CPU, each codec's cost, each (bucket, scheme)'s measured error; and what the
    busy factor was fitted to: the step `measured_step_s` on the plan then in force
    (`measured_on`; None in records older than that field: float32 everywhere). `needed_s`
    ({bucket name: s after step() returns}), when the next forward first needs each bucket,
    where the job ran schedule="overlap": the schedule its plans were priced on (`schedule`);
    None: the waiting schedule."""

    n: int
    backward_s: float
    fixed_s: float
    ready_s: dict                   # {bucket name: s from backward's start}
    links: dict                     # {collective: LinkRecord}
    codecs: dict                    # {label: planner.CodecCost}
    errors: dict                    # {(bucket name, scheme name): relative error}
    links_cpu: dict = field(default_factory=dict)     # {collective: planner.Affine}
    cpu_share: float = 0.0
    busy_factor: float = math.nan
    measured_step_s: float = math.nan
    measured_on: tuple | None = None
    needed_s: dict | None = None
    chunks: dict = field(default_factory=dict)      # {(bucket name, label): chunk count}

    @property
    def schedule(self):
        """The schedule the plans were priced on: "overlap" or "wait"."""
        return "wait" if self.needed_s is None else "overlap"

    def to_dict(self):
        out = {
            "n": self.n, "backward_s": self.backward_s, "fixed_s": self.fixed_s,
            "ready_s": dict(self.ready_s),
            "links": {c: {"alpha": f.alpha, "beta": f.beta, "r2": f.r2}
                      for c, f in self.links.items()},
            "codecs": {t: {"encode": _affine_dict(c.encode), "reduce": _affine_dict(c.reduce),
                           "decode": _affine_dict(c.decode)} for t, c in self.codecs.items()},
            "errors": {f"{b} {s}": e for (b, s), e in sorted(self.errors.items())},
            "links_cpu": {c: _affine_dict(x) for c, x in self.links_cpu.items()},
            "cpu_share": self.cpu_share, "busy_factor": self.busy_factor,
            "measured_step_s": self.measured_step_s,
            "measured_on": None if self.measured_on is None else list(self.measured_on),
            "schedule": self.schedule}
        if self.needed_s is not None:
            out["needed_s"] = dict(self.needed_s)
        if self.chunks:
            out["chunks"] = {f"{b} {t}": c for (b, t), c in sorted(self.chunks.items())}
        return out

    @classmethod
    def from_dict(cls, d):
        """The record from its dict; ValueError where it is not one (a key missing, a value
        of the wrong kind)."""
        try:
            errors = {}
            for key, err in d["errors"].items():
                bucket, scheme_name = key.rsplit(" ", 1)
                errors[(bucket, scheme_name)] = _nan(err)
            on = d.get("measured_on")
            needed = d.get("needed_s")
            return cls(
                int(d["n"]), float(d["backward_s"]), float(d["fixed_s"]),
                {name: float(t) for name, t in d["ready_s"].items()},
                {c: LinkRecord(float(f["alpha"]), float(f["beta"]), _nan(f.get("r2")))
                 for c, f in d["links"].items()},
                {t: planner.CodecCost(encode=_affine(c["encode"]), reduce=_affine(c["reduce"]),
                                      decode=_affine(c["decode"]))
                 for t, c in d["codecs"].items()},
                errors,
                links_cpu={c: _affine(x) for c, x in d.get("links_cpu", {}).items()},
                cpu_share=float(d.get("cpu_share", 0.0)),
                busy_factor=_nan(d.get("busy_factor")),
                measured_step_s=_nan(d.get("measured_step_s")),
                measured_on=None if on is None else tuple(on),
                needed_s=None if needed is None else {k: float(v) for k, v in needed.items()},
                chunks={tuple(k.rsplit(" ", 1)): int(c)
                        for k, c in (d.get("chunks") or {}).items()})
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"not a plan report's measurements: {err!r} missing or malformed") \
                from None

    def planner_measurements(self, buckets) -> planner.Measurements:
        """planner.Measurements for `buckets` ([(name, fp32 bytes)] in launch order), the links
        timed alone (as calibration.combine gave them to inputs.busy_links)."""
        try:
            order = [planner.Bucket(name, int(nbytes), self.ready_s[name])
                     for name, nbytes in buckets]
            needed = (None if self.needed_s is None
                      else tuple(self.needed_s[name] for name, _ in buckets))
        except KeyError as err:
            raise ValueError(f"not a plan report's measurements: {err!r} missing or malformed") \
                from None
        return planner.Measurements(
            self.n, tuple(order), self.backward_s,
            {c: Link(f.alpha, f.beta) for c, f in self.links.items()},
            dict(self.codecs), dict(self.errors), fixed_s=self.fixed_s,
            links_cpu=dict(self.links_cpu), cpu_share=self.cpu_share, needed_s=needed,
            chunks=dict(self.chunks))


@dataclass(frozen=True)
class TriedPlan:
    """A contender as the trial measured it: trial.Contender's fields, its median and its
    `low` timed step (NaN: no usable step)."""

    name: str
    labels: tuple
    predicted_s: float
    loss: float
    measured_s: float
    low_s: float

    def to_dict(self):
        return {"name": self.name, "labels": list(self.labels), "predicted_s": self.predicted_s,
                "loss": self.loss, "measured_s": self.measured_s, "low_s": self.low_s}

    @classmethod
    def from_dict(cls, d):
        return cls(d["name"], tuple(d["labels"]), _nan(d["predicted_s"]), _nan(d["loss"]),
                   _nan(d.get("measured_s")), _nan(d.get("low_s")))


@dataclass(frozen=True)
class TrialRecord:
    """What a trial ran and kept: the contenders, the one kept (its name), the steps and their
    order, the slowest rank's time of each step, what the trial cost, why it kept what it
    kept, the fixed time it re-measured (added to every prediction) and the kept plan's
    prediction before that shift."""

    contenders: tuple               # TriedPlan, the plan first
    chosen: str
    steps: int
    timed_steps_each: int
    schedule: tuple
    step_s: tuple
    wall_s: float
    cost_s: float
    reason: str
    fixed_shift_s: float
    predicted_untried_s: float

    def to_dict(self):
        return {"contenders": [c.to_dict() for c in self.contenders], "chosen": self.chosen,
                "steps": self.steps, "timed_steps_each": self.timed_steps_each,
                "schedule": list(self.schedule), "step_s": list(self.step_s),
                "wall_s": self.wall_s, "cost_s": self.cost_s, "reason": self.reason,
                "fixed_shift_s": self.fixed_shift_s,
                "predicted_untried_s": self.predicted_untried_s}

    @classmethod
    def from_dict(cls, d):
        return cls(tuple(TriedPlan.from_dict(c) for c in d.get("contenders", ())),
                   d.get("chosen"), int(d.get("steps", 0)), int(d.get("timed_steps_each", 0)),
                   tuple(d.get("schedule", ())), tuple(_nan(t) for t in d.get("step_s", ())),
                   _nan(d.get("wall_s")), _nan(d.get("cost_s")), d.get("reason", ""),
                   float(d.get("fixed_shift_s") or 0.0), _nan(d.get("predicted_untried_s")))


@dataclass(frozen=True)
class Decision:
    """Rank 0's decision, broadcast to every rank: a plan (a label per bucket, its predicted
    step, the fastest allowed plan's, whether the search proved it, the measurements and
    refusals it came from, every fixed plan's predicted step; the rivals to try, or why
    none), or, where `reason` is set, no plan and why (the ranks fall back). After a trial,
    `trial` is its record and the predictions carry its shift of the fixed time."""

    labels: tuple = ()
    predicted_s: float = math.nan
    fastest_s: float = math.nan
    exact: bool | None = None
    measurements: MeasurementsRecord | None = None
    refused: dict = field(default_factory=dict)         # {"bucket label": why}
    fixed_plans_s: dict = field(default_factory=dict)   # {label: predicted step}
    rivals: tuple = ()              # trial.Contender, the plan first: the trial to run
    no_trial: str | None = None     # why no trial runs ("trial_steps=0", ...)
    trial: TrialRecord | None = None
    note: str | None = None
    reason: str | None = None       # no plan: why

    @property
    def ok(self) -> bool:
        return self.reason is None

    @classmethod
    def fallback(cls, reason):
        return cls(reason=reason)

    def to_dict(self):
        if not self.ok:
            return {"ok": False, "reason": self.reason}
        out = {"ok": True, "labels": list(self.labels), "predicted_s": self.predicted_s,
               "fastest_s": self.fastest_s}
        if self.rivals:
            out["trials"] = [c.as_dict() for c in self.rivals]
        if self.no_trial is not None:
            out["no_trial"] = self.no_trial
        if self.exact is not None:
            out["exact"] = self.exact
        out.update(measurements={} if self.measurements is None else self.measurements.to_dict(),
                   refused=dict(self.refused), fixed_plans_s=dict(self.fixed_plans_s))
        if self.trial is not None:
            out["trial"] = self.trial.to_dict()
        if self.note is not None:
            out["note"] = self.note
        return out

    @classmethod
    def from_dict(cls, d):
        """From to_dict's dict, or a checkpoint's of an earlier version."""
        if not d.get("ok", True) or (d.get("reason") and "labels" not in d):
            return cls.fallback(d.get("reason", "no decision"))
        m = d.get("measurements") or None
        return cls(tuple(d["labels"]), _nan(d.get("predicted_s")), _nan(d.get("fastest_s")),
                   d.get("exact"), None if m is None else MeasurementsRecord.from_dict(m),
                   dict(d.get("refused") or {}), dict(d.get("fixed_plans_s") or {}),
                   tuple(Contender.from_dict(c) for c in d.get("trials") or ()),
                   d.get("no_trial"),
                   TrialRecord.from_dict(d["trial"]) if d.get("trial") else None,
                   d.get("note"))


@dataclass(frozen=True)
class BucketLabel:
    """A bucket in launch order, its float32 bytes and the label it travels by."""

    name: str
    bytes: int
    label: str


@dataclass(frozen=True)
class Event:
    """Something that happened to the plan, at a step count (a calibration's event carries
    what it cost; their sum is the report's calibration_s)."""

    step: int
    event: str
    calibration_s: float | None = None

    def to_dict(self):
        out = {"step": self.step, "event": self.event}
        if self.calibration_s is not None:
            out["calibration_s"] = self.calibration_s
        return out

    @classmethod
    def from_dict(cls, d):
        return cls(int(d["step"]), d["event"], d.get("calibration_s"))


@dataclass(frozen=True)
class ReplanCheck:
    """The last re-plan check (planner.should_replan): at which step, its answer, why, and
    the drift it measured."""

    step: int
    now: bool
    reason: str
    drift: float = math.nan

    def to_dict(self):
        return {"step": self.step, "now": self.now, "reason": self.reason, "drift": self.drift}

    @classmethod
    def from_dict(cls, d):
        return cls(int(d["step"]), bool(d["now"]), d["reason"], _nan(d.get("drift")))


@dataclass(frozen=True)
class PlanReport:
    """The plan and what it was chosen from (optimizer.plan_report(); the lab's manifest and
    bench_step's plans/<cell>.json keep its to_dict()). `plan`: the labels joined by spaces,
    "" while no plan is in force (during a trial, `buckets` carry the plan in force before
    it); `phase`: the communicator's (communicator.Phase's value); `settings`: the
    Compression.auto options; `trial`: the trial's record, `trial_skipped` why none ran
    (None in records older than both)."""

    plan: str
    phase: str
    buckets: tuple                  # BucketLabel, launch order
    predicted_s: float = math.nan
    fastest_s: float = math.nan
    measured_s: float = math.nan
    settings: dict = field(default_factory=dict)
    measurements: MeasurementsRecord | None = None
    refused: dict = field(default_factory=dict)
    fixed_plans_s: dict = field(default_factory=dict)
    trial: TrialRecord | None = None
    trial_skipped: str | None = None
    calibration_s: float = 0.0
    calibrations: int = 0
    last_replan_check: ReplanCheck | None = None
    step_clock_pauses: int = 0
    events: tuple = ()              # Event
    # objective="time_to_accuracy": the mode in force, the ratios, step times, each window's
    # decision and each switch (objective.TimeToAccuracy.report); None under "step_time"
    objective: dict | None = None

    @property
    def labels(self):
        """The label of each bucket, launch order."""
        return [b.label for b in self.buckets]

    @property
    def schedule(self):
        """The schedule the plan's step was priced on ("wait" or "overlap"; "" before any
        measurement)."""
        return self.measurements.schedule if self.measurements is not None else ""

    def to_dict(self):
        out = {"plan": self.plan, "phase": self.phase, "schedule": self.schedule,
               "buckets": [{"name": b.name, "bytes": b.bytes, "label": b.label}
                           for b in self.buckets],
               "predicted_s": self.predicted_s, "fastest_s": self.fastest_s,
               "measured_s": self.measured_s, "settings": dict(self.settings),
               "measurements": {} if self.measurements is None else self.measurements.to_dict(),
               "refused": dict(self.refused), "fixed_plans_s": dict(self.fixed_plans_s),
               "trial": (self.trial.to_dict() if self.trial is not None else
                         {"skipped": self.trial_skipped} if self.trial_skipped is not None
                         else None),
               "calibration_s": self.calibration_s, "calibrations": self.calibrations,
               "last_replan_check": (None if self.last_replan_check is None
                                     else self.last_replan_check.to_dict()),
               "step_clock_pauses": self.step_clock_pauses,
               "events": [e.to_dict() for e in self.events]}
        if self.objective is not None:
            out["objective"] = dict(self.objective)
        return out

    @classmethod
    def from_dict(cls, d):
        """The report from its dict (a plan_report's JSON, or the `plan_report` of a lab
        manifest); ValueError where it is not one."""
        if not isinstance(d, dict) or "buckets" not in d or "measurements" not in d:
            raise ValueError("no plan report in it (a plan_report() dict, or a manifest with "
                             "one: a run with --auto-allreduce)")
        try:
            buckets = tuple(BucketLabel(b["name"], int(b["bytes"]), b.get("label"))
                            if isinstance(b, dict) else BucketLabel(b[0], int(b[1]), None)
                            for b in d["buckets"])
            trial = d.get("trial")
            check = d.get("last_replan_check")
            settings = {k: (list(v) if isinstance(v, tuple) else v)
                        for k, v in (d.get("settings") or {}).items()}
            return cls(
                d.get("plan", ""), d.get("phase", ""), buckets, _nan(d.get("predicted_s")),
                _nan(d.get("fastest_s")), _nan(d.get("measured_s")), settings,
                MeasurementsRecord.from_dict(d["measurements"]) if d["measurements"] else None,
                dict(d.get("refused") or {}), dict(d.get("fixed_plans_s") or {}),
                TrialRecord.from_dict(trial) if trial and "skipped" not in trial else None,
                trial["skipped"] if trial and "skipped" in trial else None,
                float(d.get("calibration_s", 0.0)), int(d.get("calibrations", 0)),
                ReplanCheck.from_dict(check) if check else None,
                int(d.get("step_clock_pauses", 0)),
                tuple(Event.from_dict(e) for e in d.get("events", ())),
                dict(d["objective"]) if d.get("objective") else None)
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"not a plan report: {err!r} missing or malformed") from None
