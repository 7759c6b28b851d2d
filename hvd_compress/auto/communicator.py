"""AutoCommunicator: each bucket by the scheme and route its plan gives it, the plan chosen in
the job from what the job measures (Compression.auto; docs/planner.md, "In the job").

Buckets are fixed fused float32 buffers (DEFAULT_FUSION_BYTES, launch order = backward order),
as for the packet routes. Each is exchanged by the route communicator of its label, the very
objects make_communicator builds for a fixed scheme (none and fp16: Horovod's allreduce of the
bucket's buffer; bit16/bit8: the packet allgather or two-phase), so a bucket's exchange is
bit for bit what that fixed scheme's would be. Every collective's name carries its label, so
ranks that disagreed on a plan would never match each other's collectives silently.

The life of a plan (Phase), at step boundaries (end_step, which every rank reaches at the same
count):
  measuring   `warmup_steps` steps on the current plan (float32 at first): their pace
  calibrate   this rank's codecs and errors (no collective), gathered; the collectives timed
              (all ranks, same order), gathered; rank 0 combines and searches; the plan and its
              rivals (trial.contenders) are broadcast. Any failure: every rank still joins each
              gather, and all keep the last good plan (float32 at first), warn once, record why:
              fallback
  trial       the plan and its rivals in interleaved steps, the same schedule on every rank,
              switched at step boundaries; the step times gathered (the slowest rank's each
              step), rank 0 judges (trial.verdict), broadcasts; the kept plan applies from the
              next step (none to try: the plan applies at once)
  planned     every `replan_every` steps the ranks' last steps are gathered (each step the
              ranks' mean) and planner.should_replan decides, identically everywhere; a drift
              -> measuring again. The first plan since the start (a restore, a membership
              change) is also judged once after planner.REPLAN_FIRST of its steps
  fallback    as planned, on the last good plan (or float32) after a calibration that failed

Its state is a few typed objects: the plan in force and the last good one (records.Decision),
the warm-up's samples (_Warmup), the step clock (_Clock), the planned steps judged for drift
(_Judging), a trial under way (_TrialRun), what it shows (_Log); `status` is a frozen snapshot
of them for a reader (tests, a debugger), plan_report() the record of the whole.
"""
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from enum import Enum

import torch
from .. import registry
from ..codecs import SCALE_BLOCK
from ..engine.base import AVERAGE
from ..exchange.base import Capabilities, CommunicatorBase, launch_next_phases
from ..exchange.bucketing import DEFAULT_FUSION_BYTES
from ..exchange.routes import make_communicator
from ..registry import Route, parse_label
from . import calibration, inputs, planner, trial
from .convergence import TIME_TO_ACCURACY, VALUE
from .objective import _DONE, TimeToAccuracy
from .records import (BucketLabel, Decision, Event, PlanReport, RankMeasurements, ReplanCheck,
                      TriedPlan, TrialRecord)

__all__ = ["AutoCommunicator", "FLOAT32", "Phase", "Status", "decide", "judge"]

FLOAT32 = "none:allreduce"


class Phase(str, Enum):
    """Where the communicator is in the life of a plan (module docstring). A str: the plan
    report's `phase` is its value."""
    MEASURING = "measuring"      # warm-up steps on the plan in force; a calibration ends them
    TRIAL = "trial"              # the plan and its rivals in turn, step by step
    PLANNED = "planned"          # exchanging by a plan, judged for drift
    FALLBACK = "fallback"        # a calibration failed: the last good plan (or float32)

    def __str__(self):
        return self.value


@dataclass
class _Warmup:
    """The steps measured since the last calibration (or the start): their pace samples
    (calibration.step_sample, None for an incomplete step) and, in the step that may end the
    warm-up, each bucket's gradient as this rank sent it."""
    samples: list = field(default_factory=list)
    inputs: dict = field(default_factory=dict)     # bucket index -> float32 copy


@dataclass
class _Clock:
    """The step clock: steps ended, when the last one ended (None: not a step's end to time
    from, after pause_step_clock or a change of plan), this step's launches per bucket
    ((began, took) or None), under schedule="overlap" its buckets' applies in the next forward
    ((bucket, needed at, took), in the order applied; empty: the waiting schedule), and how
    often it was paused."""
    steps: int = 0
    last_end: float | None = None
    launches: list = field(default_factory=list)
    applies: list = field(default_factory=list)
    pauses: int = 0


@dataclass
class _Judging:
    """The steps of the plan in force, for the re-plan rule: their times (NaN after a pause),
    how many were real steps, the early check's step (planner.REPLAN_FIRST, a first plan's)."""
    measured: list = field(default_factory=list)
    since_plan: int = 0
    early_check: int | None = None


@dataclass
class _TrialRun:
    """A trial under way: rank 0's decision, its contenders, the schedule, the step times so
    far, and what the calibration before it cost."""
    decision: Decision
    tried: list
    order: list
    times: list = field(default_factory=list)
    cost: float = 0.0


@dataclass
class _Log:
    """What the communicator shows: events not yet popped (pop_stats), the history
    (plan_report), the calibrations' cost, the last re-plan check, whether it warned."""
    pending: list = field(default_factory=list)
    history: list = field(default_factory=list)
    calibration_s: float = 0.0
    calibrations: int = 0
    last_replan: ReplanCheck | None = None
    warned: bool = False


@dataclass(frozen=True)
class Status:
    """A snapshot of the communicator's state, read-only: the phase, the labels in force, the
    plan in force and the last good one (None: float32), the warm-up's samples, the planned
    steps measured (NaN: after a pause) and how many counted, the trial's step times so far
    (None: no trial under way), the steps ended."""
    phase: Phase
    labels: tuple
    plan: Decision | None
    last_good: Decision | None
    samples: tuple
    measured: tuple
    since_plan: int
    trial_times: tuple | None
    steps: int


class AutoCommunicator(CommunicatorBase):
    """Per-bucket exchange by the current plan, and the plan's measuring and re-planning."""
    route = None                 # per bucket: plan_report() and pop_stats()['plan'] say which
    # the packet labels compensate with the front's memory; an allreduce label carries the
    # residual once, exactly (_carry_residual)
    capabilities = Capabilities(fuses=True, takes_memory=True, plans_buckets=True)

    def __init__(self, auto, op=AVERAGE, fusion_threshold_bytes=None,
                 scale_block=SCALE_BLOCK, engine=None):
        super().__init__(auto, op, engine)
        if scale_block is None:
            raise ValueError("Compression.auto needs block scales (scale_block values per "
                             "scale), not one scale per tensor")
        self.settings = auto(candidates=auto.candidates)   # the candidates, fixed now
        self.scale_block = int(scale_block)
        self.fusion_threshold_bytes = (DEFAULT_FUSION_BYTES if fusion_threshold_bytes is None
                                       else int(fusion_threshold_bytes))
        self._subs = {}
        self._pinned = auto.plan             # ((bucket, bytes, label), ...) or None
        pinned = [t for _, _, t in self._pinned or () if t not in auto.candidates]
        for text in tuple(auto.candidates) + tuple(dict.fromkeys(pinned)):
            name, route = parse_label(text)
            comm = make_communicator(registry.scheme(name).load(), route, op,
                                     self.fusion_threshold_bytes, self.scale_block,
                                     engine=self.engine)
            comm.stats = self.stats          # one set of counters for the optimizer
            if comm.route == Route.ALLREDUCE:
                comm.tagged = True           # the label in the collective's name
            self._subs[text] = comm
        self._buckets, self._index, self._active = [], {}, {}
        self._clock, self._log = _Clock(), _Log()
        self._adopted = None                 # the last decision adopted: its measurements
        self._chunks = {}                    # overlap: {label: {bucket: chunks}} (prioritise)
        # objective="time_to_accuracy": the mode (the value plan, or one method everywhere)
        self._tta = None
        if self.settings.objective == TIME_TO_ACCURACY:
            self._tta = TimeToAccuracy(self.settings, op, self.fusion_threshold_bytes,
                                       self.scale_block, self.engine)
            self._tta.on_switch = self._event
        self._forget_plan("calibrating")

    # ---- the plan's state ---------------------------------------------------------------
    def _forget_plan(self, event):
        if self._pinned is not None and self._take_pinned(event):
            return
        self._labels = [FLOAT32] * len(self._buckets)
        self._plan = None                    # the decision in force (None: float32)
        self._good = None                    # the last plan that was not a fallback
        self._judging = _Judging()
        self._first_plan = True              # the next plan is judged early (REPLAN_FIRST)
        self._start_measuring()
        self._event(event)

    def _take_pinned(self, why, strict=False):
        """Run on the pinned plan (Compression.auto(plan=...)) if it names these buckets: True.
        strict: else raise, naming the difference (the buckets are final)."""
        layout = [(b.name, 4 * b.numel) for b in self._buckets if b is not None]
        wanted = [(n, b) for n, b, _ in self._pinned]
        if layout != wanted:
            if strict:
                raise ValueError(f"Compression.auto(plan=...): the plan is for buckets {wanted}, "
                                 f"this job's are {layout} (a plan fits the front, model, "
                                 "fusion threshold and bucket cap it was measured with)")
            return False
        self._first_plan = False
        self._good = self._adopted = Decision(tuple(t for _, _, t in self._pinned),
                                              note="pinned")
        self._run_on(self._adopted, f"planned: pinned ({why})")
        return True

    def _start_measuring(self):
        self._phase = Phase.MEASURING
        self._trial = None
        self._warmup = _Warmup()             # the plan in force stays, and its steps
        self._clock.last_end = None
        self._clock.launches = [None] * len(self._buckets)
        self._clock.applies = []

    def _event(self, text, calibration_s=None):
        """Note an event for pop_stats() and the history; a calibration's event carries what
        that calibration cost (the sum over all is plan_report()'s calibration_s)."""
        self._log.pending.append(text)
        self._log.history.append(Event(self._clock.steps, text, calibration_s))

    def describe(self):
        return "auto/per-bucket"

    def plan(self, names, tensors, prefix=""):
        planned = super().plan(names, tensors, prefix)
        self._buckets = [bucket for _, bucket in planned]
        self._index = {id(b): i for i, b in enumerate(self._buckets)}
        self._labels = [FLOAT32] * len(self._buckets)
        self._clock.launches = [None] * len(self._buckets)
        if self._pinned is not None:
            self._take_pinned("plan=", strict=True)
        return planned

    def use_bucket(self, index, bucket):
        """A front that cuts its own buckets (hvd_compress.ddp: DDP's) puts bucket `index` in
        place before its first start(); it travels in float32 until use_buckets() ends the step
        in which the buckets changed, or by its pinned label where the pinned plan names it
        (this name and size, at this place), so that a pinned job's first step, a resumed
        one's too, is already the plan's."""
        while len(self._buckets) <= index:
            self._buckets.append(None)
            self._labels.append(FLOAT32)
            self._clock.launches.append(None)
        self._buckets[index] = bucket
        pinned = (self._pinned or ())[index:index + 1]
        self._labels[index] = pinned[0][2] if pinned and pinned[0][:2] == (
            bucket.name, 4 * bucket.numel) else FLOAT32
        self._index[id(bucket)] = index

    def use_buckets(self, buckets):
        """The front's buckets, in launch order, after a step in which they changed (DDP
        rebuilds its buckets after its first step): the plan is made again for them, as at a
        membership change."""
        self._buckets = list(buckets)
        self._index = {id(b): i for i, b in enumerate(self._buckets)}
        if self._tta is not None:
            self._tta.reset()
        self._forget_plan("calibrating (the buckets changed)")

    @property
    def labels(self):
        """The current plan: a label per bucket, in launch order."""
        return list(self._labels)

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def status(self) -> Status:
        """The state now, as a frozen snapshot (Status)."""
        return Status(self._phase, tuple(self._labels), self._plan, self._good,
                      tuple(self._warmup.samples), tuple(self._judging.measured),
                      self._judging.since_plan,
                      None if self._trial is None else tuple(self._trial.times),
                      self._clock.steps)

    # ---- the exchange -------------------------------------------------------------------
    def start(self, bucket, memory=None):
        i = self._index[id(bucket)]
        sub = self._subs[self._labels[i]]
        began = time.perf_counter()
        if self._tta is not None:
            self._tta.before(i, bucket)
            if self._tta.mode != VALUE:          # a method on every bucket (objective.py)
                sub, exchange = self._tta.start(bucket, memory)
                self._active[id(bucket)] = sub
                self.record_launch(i, began, time.perf_counter() - began)
                return exchange
        if self._phase == Phase.MEASURING and \
                len(self._warmup.samples) + 1 >= self.settings.warmup_steps:
            # The calibration's errors and codec times are taken on the gradient as this rank
            # sends it: after the exchange the buffer holds the reduced result, which under a
            # lossy plan in force has been through its codec already (a re-plan would find that
            # codec's error on it to be 0). Only in a step that may end the
            # warm-up (the calibration follows it). Hook work: the pace subtracts it.
            kept = self._warmup.inputs.get(i)
            if kept is None or kept.shape != bucket.buffer.shape:
                self._warmup.inputs[i] = bucket.buffer.clone()
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
        self.record_launch(i, began, time.perf_counter() - began)
        return exchange

    def record_launch(self, index, began, took):
        """Bucket `index` was launched this step at `began` (time.perf_counter()), its hook
        work taking `took` s: what the warm-up's pace is taken from (start() calls it)."""
        self._clock.launches[index] = (began, took)

    def record_apply(self, index, needed_at, took):
        """Under schedule="overlap": bucket `index` of the step was applied when the next
        forward (or a flush) needed it at `needed_at` (time.perf_counter()), its wait, decode
        and copy taking `took` s: the next forward's pace is taken from it (the optimizer calls
        it, in the order it applies them)."""
        self._clock.applies.append((index, needed_at, took))

    def prioritise(self, buckets):
        """schedule="overlap": every allgather route cuts a large bucket into chunks sent
        behind the front layers' buckets, as it does for a fixed scheme (exchange/sender.py);
        whichever label a bucket takes, its route's cut is the one the fixed scheme makes."""
        self._chunks = {}
        for text, sub in self._subs.items():
            sub.prioritise(buckets)
            # the cut it made, for the planner to price ({bucket name: chunks})
            cut = sub.chunk_counts()
            if cut:
                self._chunks[text] = cut

    def close(self):
        for sub in self._subs.values():
            sub.close()

    def drop(self, exchange):
        """Wait for an abandoned exchange (its result and its own error dropped) by the route
        that started it."""
        sub = self._active.pop(id(exchange.bucket), None)
        return (sub or super()).drop(exchange)

    def progress(self, exchange, wait=False):
        sub = self._active[id(exchange.bucket)]
        if sub.route == Route.ALLTOALL:
            sub.progress(exchange, wait)

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
        if self._tta is not None:
            self._tta.after(self._index[id(bucket)], bucket)

    def codec_path(self):
        paths = {s.codec_path() for s in self._subs.values() if s.route != Route.ALLREDUCE}
        return "native" if paths == {"native"} else ("torch" if paths else "none")

    # ---- at a step boundary -------------------------------------------------------------
    def end_step(self, backward_start, backward_end):
        """After a step's exchange (the optimizer calls it on every rank, every step): note
        the step's pace; calibrate, or decide whether to re-plan, at the same step on every
        rank. Times from time.perf_counter(); backward_start None if no hook fired."""
        now = time.perf_counter()
        clock = self._clock
        clock.steps += 1
        step_s = now - clock.last_end if clock.last_end is not None else math.nan
        lossy_step = self._tta is not None and self._tta.mode != VALUE
        if lossy_step:
            # a method ran this step: the value plan's measuring, trial and drift wait for
            # the value mode's steps
            self._tta.end_step(self._buckets, step_s)
        elif self._phase == Phase.MEASURING and self._pinned is not None:
            # the pinned plan waits for its buckets (a DDP front meets them in its first two
            # steps: DDP rebuilds them after the first); nothing is measured meanwhile
            if clock.steps >= 2:
                self._take_pinned("plan=", strict=True)
        elif self._phase == Phase.MEASURING:      # the pace is only needed while measuring
            sample = calibration.step_sample(step_s, backward_start, backward_end, now,
                                             clock.launches, clock.applies or None)
            # Horovod's broadcast_optimizer_state steps once, with zero gradients and no
            # backward, before training: that is no warm-up step. Counted, it would take the
            # place of the slow first real step that pace_summary discards.
            samples = self._warmup.samples
            if sample is not None or samples:
                samples.append(sample)
            if len(samples) >= self.settings.warmup_steps:
                self._calibrate()
        elif self._phase == Phase.TRIAL:
            self._trial_step(step_s)
        else:                                     # planned, or on a fallback
            judging = self._judging
            judging.measured.append(step_s)
            del judging.measured[:-1000]
            if math.isfinite(step_s):             # not after pause_step_clock (every rank alike)
                judging.since_plan += 1
                predicted = self._plan.predicted_s if self._plan else math.nan
                due = (judging.since_plan % self.settings.replan_every == 0
                       or judging.since_plan == judging.early_check)
                if due and math.isfinite(predicted):
                    self._check_drift(predicted)
        if self._tta is not None and not lossy_step:
            self._tta.end_step(self._buckets, step_s)
        clock.launches = [None] * len(self._buckets)
        clock.applies = []
        clock.last_end = time.perf_counter()

    def _check_drift(self, predicted):
        """Every rank: gather the ranks' last steps (each step the job's: the ranks' mean,
        calibration.job_step_s), decide."""
        window = planner.REPLAN_WINDOW
        judging = self._judging
        recent = [t for t in judging.measured if math.isfinite(t)][-window:]
        recent = [0.0] * (window - len(recent)) + recent
        gathered = self.engine.allgather(torch.tensor([recent], dtype=torch.float64),
                                         "hvdc.auto.replan")
        steps = [calibration.job_step_s(column) for column in gathered.t().tolist()]
        every = min(self.settings.replan_every, judging.early_check or math.inf)
        decision = planner.should_replan(predicted, steps, judging.since_plan, every=every)
        self._log.last_replan = ReplanCheck(self._clock.steps, decision.now, decision.reason,
                                            decision.drift)
        if decision:
            self._event(f"replanned: {decision.reason}")
            self._start_measuring()

    def pause_step_clock(self):
        """The job did other work since its last step (an evaluation, a checkpoint, another
        model's steps in a benchmark's round): the next step's time, measured from the last
        one's end, is not a training step's. It is left out of the pace, of the drift check and
        of the steps counted since the plan. Call it on every rank at the same step."""
        self._clock.last_end = None
        self._clock.pauses += 1

    def _calibrate(self):
        """Measure, gather, decide on rank 0, broadcast, apply: the same collectives on every
        rank whatever fails where."""
        began = time.perf_counter()
        n, rank = self.engine.size(), self.engine.rank()
        local = self._measure_here(rank, n)
        ranks = self.engine.allgather_object(local.to_dict() if isinstance(local, RankMeasurements)
                                             else {"error": local}, "hvdc.auto.measurements")
        problems = [r["error"] for r in ranks if "error" in r]
        links = [[] for _ in ranks]
        if not problems and n > 1:
            try:
                largest = max(4 * b.numel for b in self._buckets)
                rows = calibration.time_collectives(self.engine, calibration.link_sizes(largest),
                                                    caps=calibration.link_grow_caps(largest))
            except Exception as err:
                rows = {"error": f"rank {rank}: timing the collectives: {_say(err)}"}
            links = self.engine.allgather_object(rows, "hvdc.auto.links")
            problems = [r["error"] for r in links if isinstance(r, dict)]
        decision = None
        if rank == 0:
            decision = decide(self.settings, ranks, links, problems, n).to_dict()
        decision = Decision.from_dict(self.engine.broadcast_object(decision, root_rank=0,
                                                                   name="hvdc.auto.plan"))
        cost = time.perf_counter() - began
        self._log.calibration_s += cost
        self._log.calibrations += 1
        self.apply_decision(decision, cost)

    def _measure_here(self, rank, n):
        """This rank's records.RankMeasurements, or why there are none (a str): no collective
        in here."""
        try:
            buffers = [self._warmup.inputs.get(i, b.buffer) for i, b in enumerate(self._buckets)]
            self._warmup.inputs = {}
            return RankMeasurements(
                tuple((b.name, 4 * b.numel) for b in self._buckets),
                tuple(self._labels),                        # the plan the pace was taken on
                calibration.host(),
                calibration.pace_summary(self._warmup.samples),
                calibration.time_codecs(buffers, self.settings.candidates, n, self.scale_block),
                calibration.measure_errors(buffers, [b.name for b in self._buckets],
                                           self.settings.candidates, self.scale_block),
                self._chunks)
        except Exception as err:
            return f"rank {rank}: {_say(err)}"

    def apply_decision(self, decision: Decision, calibration_s=0.0):
        """What every rank does with rank 0's decision (after a calibration that cost
        `calibration_s`): a plan with rivals starts the trial, a plan without is adopted, no
        plan falls back to the last good one (or float32), warning once. From the next step on."""
        if decision.ok:
            if len(decision.rivals) > 1:
                self._start_trial(decision, calibration_s)
            else:
                self._adopt(decision, "planned", calibration_s=calibration_s)
            return
        keep = self._good
        self._run_on(keep, f"fallback: {decision.reason}", calibration_s, Phase.FALLBACK)
        if not self._log.warned:
            self._log.warned = True
            warnings.warn(f"hvd_compress Compression.auto: {decision.reason}; training goes on "
                          f"with {'the last good plan' if keep else 'float32 on every bucket'} "
                          "(optimizer.plan_report() keeps the reason)", RuntimeWarning,
                          stacklevel=2)

    # ---- the trial: the plan against its rivals, measured -------------------------------------
    def _start_trial(self, decision, cost=0.0):
        tried = list(decision.rivals)
        order = trial.schedule(len(tried), self.settings.trial_steps)
        self._trial = _TrialRun(decision, tried, order, cost=cost)
        self._phase = Phase.TRIAL
        self._labels = list(tried[order[0]].labels)
        self._event(f"trial: the plan and {len(tried) - 1} rival(s), "
                    f"{self.settings.trial_steps} timed steps each")

    def _trial_step(self, step_s):
        """A trial step ended (every rank, the same count): the next contender's labels, or,
        after the last, the verdict."""
        t = self._trial
        t.times.append(step_s)
        done = len(t.times)
        if done < len(t.order):
            self._labels = list(t.tried[t.order[done]].labels)
        else:
            self._finish_trial()

    def _finish_trial(self):
        """Every rank: gather the trial's step times, rank 0 judges, broadcast, apply."""
        began = time.perf_counter()
        t = self._trial
        times = [x if math.isfinite(x) else math.nan for x in t.times]
        every = self.engine.allgather(torch.tensor([times], dtype=torch.float64), "hvdc.auto.trial")
        verdict = None
        if self.engine.rank() == 0:
            fixed = t.decision.measurements.fixed_s if t.decision.measurements else 0.0
            verdict = judge(t.tried, every, self.settings.trial_steps, fixed).to_dict()
        verdict = trial.Verdict.from_dict(self.engine.broadcast_object(
            verdict, root_rank=0, name="hvdc.auto.trial_verdict"))
        kept = t.tried[verdict.chosen]
        record = TrialRecord(
            tuple(TriedPlan(c.name, tuple(c.labels), c.predicted_s, c.loss, m, q)
                  for c, m, q in zip(t.tried, verdict.medians, verdict.lows)),
            kept.name, len(t.order), self.settings.trial_steps, tuple(t.order),
            tuple(verdict.step_s), sum(x for x in verdict.step_s if math.isfinite(x)),
            verdict.cost_s, verdict.reason, verdict.shift_s, kept.predicted_s)
        # the model's predictions, its fixed time re-measured by the trial (trial.fixed_shift)
        shift = verdict.shift_s
        d = t.decision
        decision = Decision(tuple(kept.labels), kept.predicted_s + shift, d.fastest_s + shift,
                            d.exact, d.measurements, d.refused,
                            {k: v + shift for k, v in d.fixed_plans_s.items()},
                            no_trial=d.no_trial, trial=record, note=d.note)
        trial_cost = verdict.cost_s + time.perf_counter() - began
        self._log.calibration_s += trial_cost
        self._trial = None
        self._event("trial: " + verdict.reason.replace("; ", ", "))   # events join by "; "
        self._adopt(decision, "planned", calibration_s=t.cost + trial_cost)

    # ---- what it shows --------------------------------------------------------------------
    def measured_s(self):
        steps = [t for t in self._judging.measured if math.isfinite(t)]
        return statistics.median(steps) if steps else math.nan

    def pop_stats(self):
        out = super().pop_stats()
        out.update(plan=" ".join(self._plan.labels) if self._plan else "",
                   plan_predicted_s=self._plan.predicted_s if self._plan else math.nan,
                   plan_measured_s=self.measured_s() if self._plan else math.nan,
                   plan_event="; ".join(self._log.pending))
        self._log.pending = []
        return out

    def plan_report(self) -> PlanReport:
        """The plan and what it was chosen from (records.PlanReport; its to_dict() is the lab's
        manifest's). During a trial, `plan` is "" and the buckets' labels are the plan in
        force before it (phase "trial")."""
        plan, adopted = self._plan, self._adopted
        labels = plan.labels if plan else self._labels
        return PlanReport(
            plan=" ".join(labels) if plan else "",
            phase=self._phase.value,
            buckets=tuple(BucketLabel(b.name, 4 * b.numel, t)
                          for b, t in zip(self._buckets, labels)),
            predicted_s=plan.predicted_s if plan else math.nan,
            fastest_s=plan.fastest_s if plan else math.nan,
            measured_s=self.measured_s() if plan else math.nan,
            settings={k: (list(v) if isinstance(v, tuple) else v)
                      for k, v in self.settings.options().items()},
            measurements=adopted.measurements if adopted else None,
            refused=dict(adopted.refused) if adopted else {},
            fixed_plans_s=dict(plan.fixed_plans_s) if plan else {},
            trial=plan.trial if plan else None,
            trial_skipped=plan.no_trial if plan and plan.trial is None else None,
            calibration_s=self._log.calibration_s,
            calibrations=self._log.calibrations,
            last_replan_check=self._log.last_replan,
            step_clock_pauses=self._clock.pauses,
            events=tuple(self._log.history),
            objective=None if self._tta is None else self._tta.report())

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self):
        """The plan in force (the same on every rank), so a resumed run takes it up without
        measuring again, and under objective="time_to_accuracy" the mode and what decides it
        (this rank's shadows among it); None while there is neither."""
        state = {}
        if self._plan:
            state["auto_plan"] = {"buckets": [[b.name, 4 * b.numel] for b in self._buckets],
                                  "decision": self._plan.to_dict()}
        if self._tta is not None and self._buckets:
            state["auto_tta"] = {"buckets": [[b.name, 4 * b.numel] for b in self._buckets],
                                 "state": self._tta.state_dict()}
        return state or None

    def load_state_dict(self, state):
        """Take up a saved plan from the next step. Every rank must load the state of the same
        step (labs/kit/recorder.py does). A plan for other buckets is not taken: then the job
        measures and plans afresh."""
        tta = (state or {}).get("auto_tta")
        if tta and self._tta is not None:
            if [list(x) for x in tta["buckets"]] == [[b.name, 4 * b.numel]
                                                     for b in self._buckets]:
                self._tta.load_state_dict(tta["state"])
                self._event(f"mode: {self._tta.mode}, restored from a checkpoint")
        saved = (state or {}).get("auto_plan")
        if not saved or self._pinned is not None:      # a pinned plan stays
            return
        layout = [[b.name, 4 * b.numel] for b in self._buckets]
        if [list(x) for x in saved["buckets"]] != layout:
            self._forget_plan("calibrating (the saved plan is for other buckets)")
            return
        self._adopt(Decision.from_dict(saved["decision"]), "planned: restored from a checkpoint")

    def _adopt(self, decision, event, calibration_s=None):
        """Run on `decision`'s plan from the next step on (also the last good one to fall back to)."""
        self._good = self._adopted = decision
        self._run_on(decision, event, calibration_s)

    def _run_on(self, decision, event, calibration_s=None, phase=Phase.PLANNED):
        """From the next step on, exchange by `decision`'s labels (None: float32 on every
        bucket), its steps measured afresh for the re-plan rule: what adopting a plan and
        falling back to the last good one (or to none) share."""
        self._plan = decision
        self._trial = None
        self._labels = (list(decision.labels) if decision
                        else [FLOAT32] * len(self._buckets))
        self._phase = phase
        self._judging = _Judging(early_check=planner.REPLAN_FIRST
                                 if self._first_plan and decision else None)
        self._first_plan = False
        self._event(event, calibration_s)

    def reset_state(self):
        """Elastic training changed the ranks: the link, n and the pace are other; forget the
        plan, exchange float32, measure and plan again."""
        self._active = {}
        if self._tta is not None:
            self._tta.reset()
        self._forget_plan("calibrating (membership changed)")


def _say(err):
    return f"{type(err).__name__}: {err}"


def _carry_residual(bucket, memory):
    """A bucket that moves to an exact route (none, fp16) carries its error-feedback residual
    once, in this exchange, and keeps none: nothing that was not sent is lost."""
    memory.compensate(bucket.name, bucket.buffer, inplace=True)
    memory.remember(bucket.name, bucket.buffer, bucket.buffer)


def decide(settings, ranks, links, problems, n) -> Decision:
    """Rank 0: the plan from every rank's measurements (records.RankMeasurements, or their
    dicts as gathered), or why there is none. Never raises (the other ranks wait for its
    broadcast)."""
    if problems:
        return Decision.fallback("calibration failed: " + "; ".join(problems))
    try:
        ranks = [r if isinstance(r, RankMeasurements) else RankMeasurements.from_dict(r)
                 for r in ranks]
        layout = ranks[0].buckets
        if n == 1:
            return Decision((FLOAT32,) * len(layout), ranks[0].pace.step_s,
                            note="one rank: nothing travels")
        timed = calibration.combine(ranks, links, n)
        step = calibration.job_step_s(r.pace.step_s for r in ranks)
        in_force = ranks[0].labels or (FLOAT32,) * len(layout)
        m, busy = inputs.busy_links(timed, in_force, step)
        plan = planner.search(m, settings.candidates, settings.error_bound, settings.margin)
        tried, why = _rivals(settings, m, plan.schemes)
        return Decision(
            tuple(plan.schemes), plan.predicted_s, plan.fastest_s, plan.exact,
            inputs.summary(timed, busy, step, in_force),
            {f"{b} {t}": r for (b, t), r in sorted(plan.refused.items())},
            {t: _predicted(m, t) for t in settings.candidates},
            rivals=tuple(tried) if len(tried) > 1 else (),
            no_trial=None if len(tried) > 1 else why)
    except Exception as err:
        return Decision.fallback(f"no plan from the measurements: {_say(err)}")


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


def judge(tried, every, steps, fixed_s=0.0) -> trial.Verdict:
    """Rank 0: the trial's verdict from every rank's step times (a row per rank), the slowest
    rank's each step, and the model's fixed time re-measured (trial.fixed_shift). Never raises
    (the other ranks wait for its broadcast): no verdict keeps the plan, unshifted."""
    slowest = [math.nan] * len(trial.schedule(len(tried), steps))
    try:
        slowest = every.max(dim=0).values.tolist()
        v = trial.verdict(tried, slowest, steps)
        return trial.Verdict(v.chosen, v.medians, v.lows, v.cost_s, v.reason, tuple(slowest),
                             trial.fixed_shift(tried, v.medians, fixed_s))
    except Exception as err:
        return trial.Verdict(0, (math.nan,) * len(tried), (math.nan,) * len(tried), 0.0,
                             f"the plan kept: no verdict ({_say(err)})", tuple(slowest), 0.0)


def _predicted(m, text):
    """A fixed scheme's predicted step on these measurements (nan where it cannot be)."""
    try:
        return planner.predict(m, planner.fixed_plan(m, text)).step_s
    except ValueError:
        return math.nan
