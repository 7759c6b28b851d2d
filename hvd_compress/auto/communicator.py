"""AutoCommunicator: each bucket by the scheme and route its plan gives it, the plan chosen in
the job from what the job measures (Compression.auto; docs/planner.md, "In the job").

Buckets are fixed fused float32 buffers (DEFAULT_FUSION_BYTES, launch order = backward order),
as for the packet routes. Each is exchanged by the route communicator of its label, the very
objects make_communicator builds for a fixed scheme (none and fp16: Horovod's allreduce of the
bucket's buffer; bit16/bit8: the packet allgather or two-phase), so a bucket's exchange is
bit for bit what that fixed scheme's would be. Every collective's name carries its label, so
ranks that disagreed on a plan would never match each other's collectives silently.

The life of a plan, at step boundaries (end_step, which every rank reaches at the same count):
  measuring   `warmup_steps` steps on the current plan (float32 at first): their pace
  calibrate   this rank's codecs and errors (no collective), gathered; the collectives timed
              (all ranks, same order), gathered; rank 0 combines and searches; the plan and its
              rivals (trial.contenders) are broadcast. Any failure: every rank still joins each
              gather, and all keep the last good plan (float32 at first), warn once, record why
  trial       the plan and its rivals in interleaved steps, the same schedule on every rank,
              switched at step boundaries; the step times gathered (the slowest rank's each
              step), rank 0 judges (trial.verdict), broadcasts; the kept plan applies from the
              next step (none to try: the plan applies at once)
  planned     every `replan_every` steps the ranks' last steps are gathered (each step the
              ranks' mean) and planner.should_replan decides, identically everywhere; a drift
              -> measuring again. The first plan since the start (a restore, a membership
              change) is also judged once after planner.REPLAN_FIRST of its steps
"""
import math
import statistics
import time
import warnings

import torch
import horovod.torch as hvd

from .. import registry
from ..codecs import SCALE_BLOCK
from ..exchange.base import CommunicatorBase, launch_next_phases
from ..exchange.bucketing import DEFAULT_FUSION_BYTES
from ..exchange.routes import make_communicator
from ..registry import Route, parse_label
from . import calibration, planner, inputs as planner_inputs, trial

__all__ = ["AutoCommunicator", "FLOAT32"]

FLOAT32 = "none:allreduce"


class AutoCommunicator(CommunicatorBase):
    """Per-bucket exchange by the current plan, and the plan's measuring and re-planning."""
    route = None                 # per bucket: plan_report() and pop_stats()['plan'] say which
    fuses = True
    takes_memory = True          # the packet labels compensate; an allreduce label carries the
                                 # residual once, exactly (_carry_residual)
    per_bucket = True

    def __init__(self, auto, op=hvd.Average, fusion_threshold_bytes=None,
                 scale_block=SCALE_BLOCK):
        super().__init__(auto, op)
        if scale_block is None:
            raise ValueError("Compression.auto needs block scales (scale_block values per "
                             "scale), not one scale per tensor")
        self.settings = auto
        self.scale_block = int(scale_block)
        self.fusion_threshold_bytes = (DEFAULT_FUSION_BYTES if fusion_threshold_bytes is None
                                       else int(fusion_threshold_bytes))
        self._subs = {}
        for text in auto.candidates:
            name, route = parse_label(text)
            comm = make_communicator(registry.scheme(name).load(), route, op,
                                     self.fusion_threshold_bytes, self.scale_block)
            comm.stats = self.stats          # one set of counters for the optimizer
            if comm.route == Route.ALLREDUCE:
                comm.tagged = True           # the label in the collective's name
            self._subs[text] = comm
        self._buckets, self._index, self._active = [], {}, {}
        self._inputs = {}                    # while measuring: each bucket's gradient as sent
        self._events, self._history = [], []
        self._warned = False
        self._calibration_s, self._calibrations = 0.0, 0
        self._measurements = {}
        self._refused = {}
        self._last_replan = None
        self._trial = None
        self._clock_pauses = 0               # pause_step_clock() calls, shown in plan_report()
        self._forget_plan("calibrating")

    # ---- the plan's state ---------------------------------------------------------------
    def _forget_plan(self, event):
        self._labels = [FLOAT32] * len(self._buckets)
        self._plan = None                    # the decision applied: labels, predicted_s, ...
        self._good = None                    # the last plan that was not a fallback
        self._measured, self._since_plan = [], 0
        self._first_plan = True              # the next plan is judged early (REPLAN_FIRST)
        self._early_check = None
        self._start_measuring()
        self._event(event)

    def _start_measuring(self):
        self._phase = "measuring"
        self._trial = None
        self._samples = []                   # the plan in force stays, and its steps
        self._inputs = {}
        self._last_end = None
        self._launches = [None] * len(self._buckets)

    def _event(self, text, calibration_s=None):
        """Note an event for pop_stats() and the history; a calibration's event carries what
        that calibration cost (the sum over all is plan_report()'s calibration_s)."""
        self._events.append(text)
        entry = {"step": self._steps_total(), "event": text}
        if calibration_s is not None:
            entry["calibration_s"] = calibration_s
        self._history.append(entry)

    def _steps_total(self):
        return getattr(self, "_total", 0)

    def describe(self):
        return "auto/per-bucket"

    def plan(self, names, tensors, prefix=""):
        planned = super().plan(names, tensors, prefix)
        self._buckets = [bucket for _, bucket in planned]
        self._index = {id(b): i for i, b in enumerate(self._buckets)}
        self._labels = [FLOAT32] * len(self._buckets)
        self._launches = [None] * len(self._buckets)
        return planned

    @property
    def labels(self):
        """The current plan: a label per bucket, in launch order."""
        return list(self._labels)

    # ---- the exchange -------------------------------------------------------------------
    def start(self, bucket, memory=None):
        i = self._index[id(bucket)]
        sub = self._subs[self._labels[i]]
        began = time.perf_counter()
        if self._phase == "measuring" and len(self._samples) + 1 >= self.settings.warmup_steps:
            # The calibration's errors and codec times are taken on the gradient as this rank
            # sends it: after the exchange the buffer holds the reduced result, which under a
            # lossy plan in force has been through its codec already (a bucket on fp16 then
            # measured an fp16 error of 0 at a re-plan). Only in a step that may end the
            # warm-up (the calibration follows it). Hook work: the pace subtracts it.
            kept = self._inputs.get(i)
            if kept is None or kept.shape != bucket.buffer.shape:
                self._inputs[i] = bucket.buffer.clone()
            else:
                kept.copy_(bucket.buffer)
        if sub.route == Route.ALLREDUCE:
            if memory is not None:
                _carry_residual(bucket, memory)
            bucket.tensor = bucket.buffer
            exchange = sub.start(bucket)
        else:
            exchange = sub.start(bucket, memory)
        self._active[id(bucket)] = sub
        self._launches[i] = (began, time.perf_counter() - began)
        return exchange

    def progress(self, exchange):
        self._active[id(exchange.bucket)].progress(exchange)

    def advance(self, exchanges):
        launch_next_phases(self, [ex for ex in exchanges
                                  if self._active[id(ex.bucket)].route == Route.ALLTOALL])

    def finish(self, exchange):
        bucket = exchange.bucket
        sub = self._active.pop(id(bucket))
        sub.finish(exchange)
        if sub.route == Route.ALLREDUCE:
            if bucket.tensor.data_ptr() != bucket.buffer.data_ptr():   # fp16: cast back
                bucket.buffer.copy_(bucket.tensor)
            bucket.tensor = None

    def codec_path(self):
        paths = {s.codec_path() for s in self._subs.values() if s.route != Route.ALLREDUCE}
        return "native" if paths == {"native"} else ("torch" if paths else "none")

    # ---- at a step boundary -------------------------------------------------------------
    def end_step(self, backward_start, backward_end):
        """After a step's exchange (the optimizer calls it on every rank, every step): note
        the step's pace; calibrate, or decide whether to re-plan, at the same step on every
        rank. Times from time.perf_counter(); backward_start None if no hook fired."""
        now = time.perf_counter()
        self._total = self._steps_total() + 1
        step_s = now - self._last_end if self._last_end is not None else math.nan
        if self._phase == "measuring":            # the pace is only needed while measuring
            sample = calibration.step_sample(step_s, backward_start, backward_end, now,
                                             self._launches)
            # Horovod's broadcast_optimizer_state steps once, with zero gradients and no
            # backward, before training: that is no warm-up step. Counted, it would take the
            # place of the slow first real step that pace_summary discards.
            if sample is not None or self._samples:
                self._samples.append(sample)
            if len(self._samples) >= self.settings.warmup_steps:
                self._calibrate()
        elif self._phase == "trial":
            self._trial_step(step_s)
        else:
            self._measured.append(step_s)
            del self._measured[:-1000]
            if math.isfinite(step_s):             # not after pause_step_clock (every rank alike)
                self._since_plan += 1
                predicted = self._plan["predicted_s"] if self._plan else math.nan
                due = (self._since_plan % self.settings.replan_every == 0
                       or self._since_plan == self._early_check)
                if due and math.isfinite(predicted):
                    self._check_drift(predicted)
        self._launches = [None] * len(self._buckets)
        self._last_end = time.perf_counter()

    def _check_drift(self, predicted):
        """Every rank: gather the ranks' last steps (each step the job's: the ranks' mean,
        calibration.job_step_s), decide."""
        window = planner.REPLAN_WINDOW
        recent = [t for t in self._measured if math.isfinite(t)][-window:]
        recent = [0.0] * (window - len(recent)) + recent
        gathered = hvd.allgather(torch.tensor([recent], dtype=torch.float64),
                                 name="hvdc.auto.replan")
        steps = [calibration.job_step_s(column) for column in gathered.t().tolist()]
        every = min(self.settings.replan_every, self._early_check or math.inf)
        decision = planner.should_replan(predicted, steps, self._since_plan, every=every)
        self._last_replan = {"step": self._total, "now": decision.now, "reason": decision.reason,
                             "drift": decision.drift}
        if decision:
            self._event(f"replanned: {decision.reason}")
            self._start_measuring()

    def pause_step_clock(self):
        """The job did other work since its last step (an evaluation, a checkpoint, another
        model's steps in a benchmark's round): the next step's time, measured from the last
        one's end, is not a training step's. It is left out of the pace, of the drift check and
        of the steps counted since the plan. Call it on every rank at the same step."""
        self._last_end = None
        self._clock_pauses += 1

    def _calibrate(self):
        """Measure, gather, decide on rank 0, broadcast, apply: the same collectives on every
        rank whatever fails where."""
        began = time.perf_counter()
        n, rank = hvd.size(), hvd.rank()
        local = self._measure_here(rank, n)
        ranks = hvd.allgather_object(local, name="hvdc.auto.measurements")
        problems = [r["error"] for r in ranks if "error" in r]
        links = [[] for _ in ranks]
        if not problems and n > 1:
            try:
                largest = max(4 * b.numel for b in self._buckets)
                rows = calibration.time_collectives(hvd, calibration.link_sizes(largest),
                                                    caps=calibration.link_grow_caps(largest))
            except Exception as err:
                rows = {"error": f"rank {rank}: timing the collectives: {_say(err)}"}
            links = hvd.allgather_object(rows, name="hvdc.auto.links")
            problems = [r["error"] for r in links if isinstance(r, dict)]
        decision = None
        if rank == 0:
            decision = _decide(self.settings, ranks, links, problems, n)
        decision = hvd.broadcast_object(decision, root_rank=0, name="hvdc.auto.plan")
        cost = time.perf_counter() - began
        self._calibration_s += cost
        self._calibrations += 1
        self._apply(decision, cost)

    def _measure_here(self, rank, n):
        """This rank's measurements, or {'error': why}: no collective in here."""
        try:
            buffers = [self._inputs.get(i, b.buffer) for i, b in enumerate(self._buckets)]
            self._inputs = {}
            return {"buckets": [[b.name, 4 * b.numel] for b in self._buckets],
                    "labels": list(self._labels),           # the plan the pace was taken on
                    "host": calibration.host(),
                    "pace": calibration.pace_summary(self._samples),
                    "codecs": calibration.time_codecs(buffers, self.settings.candidates, n,
                                                      self.scale_block),
                    "errors": calibration.measure_errors(buffers, [b.name for b in self._buckets],
                                                         self.settings.candidates,
                                                         self.scale_block)}
        except Exception as err:
            return {"error": f"rank {rank}: {_say(err)}"}

    def _apply(self, decision, cost):
        if decision.get("ok"):
            if len(decision.get("trials") or ()) > 1:
                self._start_trial(decision, cost)
            else:
                self._adopt(decision, "planned", calibration_s=cost)
            return
        reason = decision.get("reason", "no decision")
        keep = self._good
        self._run_on(keep, f"fallback: {reason}", calibration_s=cost)
        if not self._warned:
            self._warned = True
            warnings.warn(f"hvd_compress Compression.auto: {reason}; training goes on with "
                          f"{'the last good plan' if keep else 'float32 on every bucket'} "
                          "(optimizer.plan_report() keeps the reason)", RuntimeWarning,
                          stacklevel=2)

    # ---- the trial: the plan against its rivals, measured -------------------------------------
    def _start_trial(self, decision, cost=0.0):
        tried = [trial.Contender.from_dict(d) for d in decision["trials"]]
        order = trial.schedule(len(tried), self.settings.trial_steps)
        self._trial = {"decision": decision, "tried": tried, "order": order, "times": [],
                       "cost": cost}
        self._phase = "trial"
        self._labels = list(tried[order[0]].labels)
        self._event(f"trial: the plan and {len(tried) - 1} rival(s), "
                    f"{self.settings.trial_steps} timed steps each")

    def _trial_step(self, step_s):
        """A trial step ended (every rank, the same count): the next contender's labels, or,
        after the last, the verdict."""
        t = self._trial
        t["times"].append(step_s)
        done = len(t["times"])
        if done < len(t["order"]):
            self._labels = list(t["tried"][t["order"][done]].labels)
        else:
            self._finish_trial()

    def _finish_trial(self):
        """Every rank: gather the trial's step times, rank 0 judges, broadcast, apply."""
        began = time.perf_counter()
        t = self._trial
        times = [x if math.isfinite(x) else math.nan for x in t["times"]]
        every = hvd.allgather(torch.tensor([times], dtype=torch.float64), name="hvdc.auto.trial")
        verdict = None
        if hvd.rank() == 0:
            fixed = t["decision"].get("measurements", {}).get("fixed_s", 0.0)
            verdict = _judge(t["tried"], every, self.settings.trial_steps, fixed)
        verdict = hvd.broadcast_object(verdict, root_rank=0, name="hvdc.auto.trial_verdict")
        kept = t["tried"][verdict["chosen"]]
        record = {"contenders": [dict(c.as_dict(), measured_s=m, low_s=q) for c, m, q in
                                 zip(t["tried"], verdict["medians_s"], verdict["lows_s"])],
                  "chosen": kept.name, "steps": len(t["order"]),
                  "timed_steps_each": self.settings.trial_steps,
                  "schedule": list(t["order"]), "step_s": verdict["step_s"],
                  "wall_s": sum(x for x in verdict["step_s"] if math.isfinite(x)),
                  "cost_s": verdict["cost_s"], "reason": verdict["reason"],
                  "fixed_shift_s": verdict["shift_s"], "predicted_untried_s": kept.predicted_s}
        # the model's predictions, its fixed time re-measured by the trial (trial.fixed_shift)
        shift = verdict["shift_s"]
        decision = {k: v for k, v in t["decision"].items() if k != "trials"}
        decision.update(labels=list(kept.labels), predicted_s=kept.predicted_s + shift,
                        fastest_s=decision.get("fastest_s", math.nan) + shift,
                        fixed_plans_s={k: v + shift for k, v in
                                       decision.get("fixed_plans_s", {}).items()},
                        trial=record)
        trial_cost = verdict["cost_s"] + time.perf_counter() - began
        self._calibration_s += trial_cost
        self._trial = None
        self._event("trial: " + verdict["reason"].replace("; ", ", "))   # events join by "; "
        self._adopt(decision, "planned", calibration_s=t["cost"] + trial_cost)

    # ---- what it shows --------------------------------------------------------------------
    def measured_s(self):
        steps = [t for t in self._measured if math.isfinite(t)]
        return statistics.median(steps) if steps else math.nan

    def pop_stats(self):
        out = super().pop_stats()
        out.update(plan=" ".join(self._plan["labels"]) if self._plan else "",
                   plan_predicted_s=self._plan["predicted_s"] if self._plan else math.nan,
                   plan_measured_s=self.measured_s() if self._plan else math.nan,
                   plan_event="; ".join(self._events))
        self._events = []
        return out

    def plan_report(self):
        """The plan and what it was chosen from, JSON-able (the lab's manifest). During a trial,
        `plan` and the buckets' labels are the plan in force before it (phase "trial")."""
        labels = self._plan["labels"] if self._plan else self._labels
        return {
            "plan": " ".join(labels) if self._plan else "",
            "phase": self._phase,
            "buckets": [{"name": b.name, "bytes": 4 * b.numel, "label": t}
                        for b, t in zip(self._buckets, labels)],
            "predicted_s": self._plan["predicted_s"] if self._plan else math.nan,
            "fastest_s": self._plan.get("fastest_s", math.nan) if self._plan else math.nan,
            "measured_s": self.measured_s() if self._plan else math.nan,
            "settings": {k: (list(v) if isinstance(v, tuple) else v)
                         for k, v in self.settings.options().items()},
            "measurements": self._measurements,
            "refused": self._refused,
            "fixed_plans_s": self._plan.get("fixed_plans_s", {}) if self._plan else {},
            "trial": (self._plan.get("trial") or ({"skipped": self._plan["no_trial"]}
                                                   if "no_trial" in self._plan else None))
            if self._plan else None,
            "calibration_s": self._calibration_s,
            "calibrations": self._calibrations,
            "last_replan_check": self._last_replan,
            "step_clock_pauses": self._clock_pauses,
            "events": list(self._history),
        }

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self):
        """The plan in force (the same on every rank), so a resumed run takes it up without
        measuring again; None while there is none."""
        if not self._plan:
            return None
        return {"auto_plan": {"buckets": [[b.name, 4 * b.numel] for b in self._buckets],
                              "decision": self._plan}}

    def load_state_dict(self, state):
        """Take up a saved plan from the next step. Every rank must load the state of the same
        step (labs/kit/recorder.py does). A plan for other buckets is not taken: then the job
        measures and plans afresh."""
        saved = (state or {}).get("auto_plan")
        if not saved:
            return
        layout = [[b.name, 4 * b.numel] for b in self._buckets]
        if [list(x) for x in saved["buckets"]] != layout:
            self._forget_plan("calibrating (the saved plan is for other buckets)")
            return
        self._adopt(dict(saved["decision"]), "planned: restored from a checkpoint")

    def _adopt(self, decision, event, calibration_s=None):
        """Run on `decision`'s plan from the next step on (also the last good one to fall back to)."""
        self._good = decision
        self._measurements = decision.get("measurements", {})
        self._refused = decision.get("refused", {})
        self._run_on(decision, event, calibration_s)

    def _run_on(self, decision, event, calibration_s=None):
        """From the next step on, exchange by `decision`'s labels (None: float32 on every
        bucket), its steps measured afresh for the re-plan rule: what adopting a plan and
        falling back to the last good one (or to none) share."""
        self._plan = decision
        self._trial = None
        self._labels = (list(decision["labels"]) if decision
                        else [FLOAT32] * len(self._buckets))
        self._phase = "planned"
        self._measured, self._since_plan = [], 0
        self._early_check = planner.REPLAN_FIRST if self._first_plan and decision else None
        self._first_plan = False
        self._event(event, calibration_s)

    def reset_state(self):
        """Elastic training changed the ranks: the link, n and the pace are other; forget the
        plan, exchange float32, measure and plan again."""
        self._active = {}
        self._forget_plan("calibrating (membership changed)")


def _say(err):
    return f"{type(err).__name__}: {err}"


def _carry_residual(bucket, memory):
    """A bucket that moves to an exact route (none, fp16) carries its error-feedback residual
    once, in this exchange, and keeps none: nothing that was not sent is lost."""
    memory.compensate(bucket.name, bucket.buffer, inplace=True)
    memory.remember(bucket.name, bucket.buffer, bucket.buffer)


def _decide(settings, ranks, links, problems, n):
    """Rank 0: the plan from every rank's measurements, or why there is none. Never raises
    (the other ranks wait for its broadcast)."""
    if problems:
        return {"ok": False, "reason": "calibration failed: " + "; ".join(problems)}
    try:
        layout = ranks[0]["buckets"]
        if n == 1:
            return {"ok": True, "labels": [FLOAT32] * len(layout),
                    "predicted_s": ranks[0]["pace"]["step_s"], "fastest_s": math.nan,
                    "measurements": {}, "refused": {}, "note": "one rank: nothing travels"}
        timed = calibration.combine(ranks, links, n)
        step = calibration.job_step_s(r["pace"]["step_s"] for r in ranks)
        in_force = ranks[0].get("labels", [FLOAT32] * len(layout))
        m, busy = planner_inputs.busy_links(timed, in_force, step)
        plan = planner.search(m, settings.candidates, settings.error_bound, settings.margin)
        tried, why = _rivals(settings, m, plan.schemes)
        return {"ok": True, "labels": list(plan.schemes), "predicted_s": plan.predicted_s,
                **({"trials": [c.as_dict() for c in tried]} if len(tried) > 1 else
                   {"no_trial": why}),
                "fastest_s": plan.fastest_s, "exact": plan.exact,
                "measurements": dict(planner_inputs.summary(timed), busy_factor=busy,
                                     measured_step_s=step, measured_on=list(in_force)),
                "refused": {f"{b} {t}": r for (b, t), r in sorted(plan.refused.items())},
                "fixed_plans_s": {t: _predicted(m, t) for t in settings.candidates}}
    except Exception as err:
        return {"ok": False, "reason": f"no plan from the measurements: {_say(err)}"}


def _rivals(settings, m, plan):
    """(the trial's contenders, the plan first; why there is no trial, or ""). No trial where
    none is asked (trial_steps=0), no fixed plan is predicted near the plan, or none could be
    named (the plan is then taken untried, not lost)."""
    if settings.trial_steps <= 0:
        return [], "trial_steps=0"
    try:
        tried = trial.contenders(m, plan, settings.candidates, settings.error_bound)
    except Exception as err:
        return [], f"no rivals named: {_say(err)}"
    return tried, "" if len(tried) > 1 else \
        f"no fixed plan predicted within {trial.TRIAL_MARGIN:.0%} of the plan"


def _judge(tried, every, steps, fixed_s=0.0):
    """Rank 0: the trial's verdict from every rank's step times (a row per rank), the slowest
    rank's each step, and the model's fixed time re-measured (trial.fixed_shift). Never raises
    (the other ranks wait for its broadcast): no verdict keeps the plan, unshifted."""
    slowest = [math.nan] * len(trial.schedule(len(tried), steps))
    try:
        slowest = every.max(dim=0).values.tolist()
        v = trial.verdict(tried, slowest, steps)
        return {"chosen": v.chosen, "medians_s": list(v.medians), "lows_s": list(v.lows),
                "cost_s": v.cost_s,
                "reason": v.reason, "step_s": slowest,
                "shift_s": trial.fixed_shift(tried, v.medians, fixed_s)}
    except Exception as err:
        return {"chosen": 0, "medians_s": [math.nan] * len(tried),
                "lows_s": [math.nan] * len(tried), "cost_s": 0.0,
                "reason": f"the plan kept: no verdict ({_say(err)})", "step_s": slowest,
                "shift_s": 0.0}


def _predicted(m, text):
    """A fixed scheme's predicted step on these measurements (nan where it cannot be)."""
    try:
        return planner.predict(m, planner.fixed_plan(m, text)).step_s
    except ValueError:
        return math.nan
