"""The measured check of a plan (Compression.auto; docs/planner.md, "The trial"): the planner's
choice is timed against its strongest rivals in interleaved trial steps of the job itself, and
the measured fastest is kept, the less lossy within a tie margin. The model ranks the plans;
the job's own steps settle those it cannot tell apart (a step of the order of the link's
alpha, a busy factor fitted on warm-up steps that ran slower than the later ones).

Pure (no torch, no Horovod): which plans to try (`contenders`), in which order (`schedule`),
which one the step times say to keep (`verdict`), and the fixed time the trial's steps show
(`fixed_shift`: what no plan moves, re-measured on steps later than the warm-up's). The
runtime (communicator.py) runs the schedule on every rank alike, gathers the step times, decides on
rank 0 and broadcasts.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ..registry import label, parse_label
from . import planner

__all__ = ["TRIAL_STEPS", "TRIAL_MARGIN", "TRIAL_RIVALS", "TRIAL_TIE", "Contender", "Verdict",
           "contenders", "schedule", "verdict", "low", "fixed_shift"]

# Timed steps per contender, after one untimed round (a plan's first step negotiates its
# collectives' names with Horovod and allocates its buffers, as the warm-up's first step). A
# contender is judged by the second fastest of its five (`low`): a neighbour's burst only adds
# to a step, so a low quantile is what the plan itself costs, and no one lucky step decides.
TRIAL_STEPS = 5
# Rivals: the fixed plans (one scheme on every bucket) predicted within this fraction of the
# plan's predicted step: as wide as the model's errors in *ranking* plans (a fixed plan
# predicted slower than the plan can run faster than it); a fixed plan predicted further off
# costs more trial time than it can be expected to win.
TRIAL_MARGIN = 0.30
# At most this many rivals beside the plan (the fastest predicted first): four plans x six
# rounds = 24 trial steps at most.
TRIAL_RIVALS = 3
# Measured steps within this fraction of the fastest count as tied: the least lossy is kept.
# 2%: below what a few steps resolve (a median of a few steps on a shared machine is known
# to a few percent at best).
TRIAL_TIE = 0.02


@dataclass(frozen=True)
class Contender:
    """A plan tried: its name ("plan", or "<label> everywhere"), a label per bucket, the model's
    predicted step and its loss (bytes x measured error, the search's tie-break)."""

    name: str
    labels: tuple
    predicted_s: float
    loss: float

    def as_dict(self):
        return {"name": self.name, "labels": list(self.labels), "predicted_s": self.predicted_s,
                "loss": self.loss}

    @classmethod
    def from_dict(cls, d):
        return cls(d["name"], tuple(d["labels"]), float(d["predicted_s"]), float(d["loss"]))


@dataclass(frozen=True)
class Verdict:
    """Which contender the trial keeps (its index), each contender's median and `low` timed
    step (NaN: no usable step; `low` decides), what the trial cost over running the kept plan
    throughout, and why; as rank 0 broadcasts it, also the slowest rank's time of each step and
    the fixed time's shift (`fixed_shift`)."""

    chosen: int
    medians: tuple
    lows: tuple
    cost_s: float
    reason: str
    step_s: tuple = ()
    shift_s: float = 0.0

    def to_dict(self):
        return {"chosen": self.chosen, "medians_s": list(self.medians), "lows_s": list(self.lows),
                "cost_s": self.cost_s, "reason": self.reason, "step_s": list(self.step_s),
                "shift_s": self.shift_s}

    @classmethod
    def from_dict(cls, d):
        return cls(int(d["chosen"]), tuple(d["medians_s"]), tuple(d["lows_s"]),
                   float(d["cost_s"]), d["reason"], tuple(d["step_s"]), float(d["shift_s"]))


def contenders(m: planner.Measurements, plan, candidates=planner.DEFAULT_CANDIDATES,
               bound=planner.ERROR_BOUND, margin=TRIAL_MARGIN, rivals=TRIAL_RIVALS):
    """The plan first, then its strongest rivals: each candidate on every bucket the accuracy
    guard lets it take (float32 on the others), predicted within `margin` of the plan's step,
    the fastest predicted first (ties: the candidates' order), at most `rivals` of them, none
    that repeats a plan already in. A list of one: nothing to try."""
    allowed, _ = planner.candidates_for(m, candidates, bound)
    plan = tuple(plan)
    base = planner.predict(m, plan)
    out = [Contender("plan", plan, base.step_s, base.loss)]
    fixed = []
    for index, text in enumerate(candidates):
        text = label(*parse_label(text))
        labels = tuple(text if text in ok else "none:allreduce" for ok in allowed)
        t = planner.predict(m, labels)
        name = f"{text} everywhere" if all(x == text for x in labels) else \
            f"{text} where the guard allows"
        fixed.append((t.step_s, index, Contender(name, labels, t.step_s, t.loss)))
    seen = {plan}
    for step, _, rival in sorted(fixed, key=lambda x: (x[0], x[1])):
        if len(out) > rivals:
            break
        if rival.labels in seen or not step <= base.step_s * (1 + margin):
            continue
        seen.add(rival.labels)
        out.append(rival)
    return out


def schedule(count, steps=TRIAL_STEPS):
    """The contender of each trial step: interleaved rounds, the first one untimed, then
    `steps` timed, each round's order turned by one (0 1 2, 1 2 0, 2 0 1, ...): a drift of the
    machine (a neighbour's burst) falls on every contender alike, and no contender always
    follows the same one or takes the same place in a round (a training loop's own period --
    a data loader's every 4th batch, a check every 4th step -- would otherwise fall on one)."""
    return [(j + r) % count for r in range(steps + 1) for j in range(count)]


def verdict(tried, times, steps=TRIAL_STEPS, tie=TRIAL_TIE) -> Verdict:
    """The contender to keep, from `times`: per step of `schedule(len(tried), steps)`, the
    slowest rank's step in seconds (the one that sets a synchronous step). Each contender's
    `low` over its timed steps; the fastest, or within `tie` of it the least lossy (then the
    faster, then the earlier). The plan (contender 0) is kept where its own steps gave no
    usable time. cost_s: what the trial steps of the other contenders took beyond the kept
    plan's median (the rest of the trial is training at the kept plan's pace). The reason
    has no "; " (pop_stats joins a step's events with it)."""
    order = schedule(len(tried), steps)
    if len(times) != len(order):
        raise ValueError(f"{len(times)} trial step times for a schedule of {len(order)} steps")
    per = [[] for _ in tried]
    for k, (j, t) in enumerate(zip(order, times)):
        if k >= len(tried) and isinstance(t, (int, float)) and math.isfinite(t) and t > 0:
            per[j].append(float(t))
    medians = tuple(statistics.median(x) if x else math.nan for x in per)
    lows = tuple(low(x) for x in per)
    usable = [j for j, t in enumerate(lows) if math.isfinite(t)]
    if 0 not in usable:
        return Verdict(0, medians, lows, 0.0, "the plan kept: its trial steps gave no usable time")
    fastest = min(lows[j] for j in usable)
    tied = [j for j in usable if lows[j] <= fastest * (1 + tie)]

    def lossy(j):
        return tried[j].loss if math.isfinite(tried[j].loss) else math.inf
    chosen = min(tied, key=lambda j: (lossy(j), lows[j], j))
    cost = sum(t - medians[chosen] for j, t in zip(order, times)
               if j != chosen and isinstance(t, (int, float)) and math.isfinite(t))
    best_rival = min((j for j in usable if j != chosen), key=lambda j: (lows[j], j),
                     default=None)

    def ms(j):
        return f"{1e3 * lows[j]:.4g} ms"
    if chosen == 0:
        reason = f"the plan kept ({ms(0)}" + (
            f", {tried[best_rival].name} {ms(best_rival)}" if best_rival is not None else "") + ")"
        if lows[0] > fastest:
            reason += f", within the {tie:.0%} tie and less lossy"
    else:
        reason = f"{tried[chosen].name} adopted ({ms(chosen)}, the plan {ms(0)})"
        if lows[chosen] > fastest:
            reason += f", within the {tie:.0%} tie of the fastest and less lossy"
    return Verdict(chosen, medians, lows, max(cost, 0.0), reason)


def low(values):
    """The step a contender is judged by: its lower quartile, taken as the value of that rank
    among the sorted steps (the second fastest of five; the fastest of up to four); NaN for
    none."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4] if ordered else math.nan


def fixed_shift(tried, medians, fixed_s):
    """How much the model's fixed time (forward, update, the loop: what no plan moves) is off,
    by the trial: the median over the contenders of measured minus predicted step, held so that
    the fixed time stays >= 0; 0 where fewer than two contenders were measured. The warm-up's
    first steps run slower than later ones (first touches, a training loop's own start-up), and
    the model took its fixed time from them; the trial's steps come later and, being several
    plans, show what is common to all of them. One number for every plan: it moves no plan's
    rank, and the kept plan's own error against its measurement is left in its prediction."""
    residuals = sorted(m - c.predicted_s for c, m in zip(tried, medians)
                       if math.isfinite(m) and math.isfinite(c.predicted_s))
    if len(residuals) < 2:
        return 0.0
    return max(statistics.median(residuals), -max(float(fixed_s), 0.0))
