"""When a job re-plans: the rule that compares the plan's predicted step with the steps the job
then measures (docs/planner.md, "Re-planning"). Pure: no torch, no Horovod; the auto
communicator feeds it the same step times on every rank (each step the ranks' mean), so
every rank decides alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["REPLAN_MARGIN", "REPLAN_WINDOW", "REPLAN_EVERY", "REPLAN_FIRST", "Replan",
           "should_replan"]

# Re-plan when the median of the last REPLAN_WINDOW steps is off the prediction by more than
# REPLAN_MARGIN (the accuracy the prediction is held to: a drift inside it is no evidence),
# at most once every REPLAN_EVERY steps.
REPLAN_MARGIN = 0.15
REPLAN_WINDOW = 20
REPLAN_EVERY = 100
# A first plan is also judged once a window of its own steps exists: it was predicted from the
# run's least settled steps (the first after start-up, when caches and Horovod's negotiation
# are still settling).
REPLAN_FIRST = REPLAN_WINDOW


@dataclass(frozen=True)
class Replan:
    """Whether to re-plan now, and why (or why not)."""

    now: bool
    reason: str
    drift: float = math.nan

    def __bool__(self):
        return self.now


def should_replan(predicted_s, measured_s, steps_since_plan, margin=REPLAN_MARGIN,
                  window=REPLAN_WINDOW, every=REPLAN_EVERY) -> Replan:
    """Re-plan when the median of the last `window` measured steps (finite ones) is off the
    plan's prediction by more than `margin` of it, and at least `every` steps have passed since
    the plan was applied. The median: one slow step (a checkpoint, a GC pause) is no drift."""
    if not (isinstance(predicted_s, (int, float)) and math.isfinite(predicted_s)
            and predicted_s > 0):
        return Replan(False, f"no usable prediction ({predicted_s!r})")
    if steps_since_plan < every:
        return Replan(False, f"{steps_since_plan} steps since the plan, "
                             f"re-plan at most every {every}")
    recent = sorted(t for t in list(measured_s)[-window:] if math.isfinite(t) and t > 0)
    if len(recent) < window:
        return Replan(False, f"{len(recent)} usable steps of the last {window}: too few to judge")
    mid = len(recent) // 2
    median = recent[mid] if len(recent) % 2 else (recent[mid - 1] + recent[mid]) / 2
    drift = (median - predicted_s) / predicted_s
    if abs(drift) > margin:
        return Replan(True, f"measured median {median:.4g} s is {drift:+.1%} off the predicted "
                            f"{predicted_s:.4g} s (margin {margin:.0%})", drift)
    return Replan(False, f"drift {drift:+.1%} within {margin:.0%}", drift)

