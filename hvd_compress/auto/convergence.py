"""What a job measures of its own convergence, for Compression.auto's choice by time to
accuracy (docs/planner.md, "Time to accuracy").

The planner prices a step; a method that compresses harder (PowerSGD at a low rank, top-k at a
small ratio, 1-bit signs) sends a step sooner and may need more of them, and at a bad moment
more than it saves. The optimizer sees no loss, only gradients, so this module reads the
gradients. Pure: numbers in, decisions out (no torch, no collectives); the communicator feeds
it the norm of each step's averaged gradient, the same on every rank, so every rank decides
alike without a collective of its own.

    Progress    each candidate's first-order progress along the trajectory in force, from the
                same gradients: a step's update u moves the loss by about -lr <u, G>, G the
                expected gradient, which the next step's averaged gradient estimates without
                this step's noise; so a candidate that would have sent u_c where the value
                plan sent g (both error-compensated, u_c by its own shadow residual: what its
                error feedback would carry) makes r_c = sum <u_c,t, g_t+1> / sum <g_t, g_t+1>
                of float32's progress per step, and needs about 1 / r_c of its steps. The
                caller computes the inner products (each rank on its own share: a separable
                method's u_c is the mean of the ranks' compressed gradients) and adds them up
                over a window; the ratios are the same on every rank once summed over ranks.
    choose      the mode with the fewest seconds per unit of float32's progress,
                step_c / r_c, among those whose r_c clears the accuracy guard (R_MIN): a
                method predicted to need more than 1 / R_MIN of float32's steps is refused,
                for it is the kind that may never reach a target float32 reaches.
    Regime      Accordion's critical-regime detector (Agarwal et al., "Accordion: Adaptive
                Gradient Communication via Critical Learning Regime Identification", MLSys
                2021): the norm of the gradient accumulated over an interval of steps,
                against the interval before; a relative change of eta or more marks the next
                interval critical, when a compressed gradient's error does lasting harm, and
                auto then sends what costs no steps (the value codecs under their error bound).
                The first interval is critical: nothing to compare it with, and the start of
                training is where the gradient norm moves most.
    sampled_positions
                which steps of a window the shadows run at (SHADOW_SAMPLES of them, evenly
                spaced from its first step): a pure function of the settings, so every rank
                samples the same steps; the window's Progress sums those steps' products only.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

__all__ = ["ETA", "INTERVAL", "R_MIN", "MARGIN", "VALUE", "OBJECTIVES", "DEFAULT_METHODS",
           "SHADOW_SAMPLES", "Progress", "choose", "Regime", "changed", "sampled_positions",
           "parse_method", "check_method"]

# Compression.auto's objectives: the step's time (the value plan alone) or the time to
# accuracy (the value plan and the methods below, by their measured progress).
STEP_TIME, TIME_TO_ACCURACY = "step_time", "time_to_accuracy"
OBJECTIVES = (STEP_TIME, TIME_TO_ACCURACY)

# Accordion's threshold of relative change (its paper's 0.5, used in all its experiments).
ETA = 0.5
# Steps per interval. Accordion compares epochs (or tens of steps for its batch-size
# schedule); the lab trains two or three epochs, a few hundred steps each, so an interval is a
# fraction of an epoch: a switch can follow the regime within a tenth of a run.
INTERVAL = 50
# Steps of a window the shadows run at. A shadowed step runs every candidate's compression
# once (top-k's selection, PowerSGD's products, the codecs' rounds: together a large share of
# a short step's compute), so the window's mean shadow cost is SHADOW_SAMPLES / INTERVAL of
# it; two, not one, so that a window's ratio rests on more than one pair of gradients, and the
# calm windows' pooled sums (objective.py) carry the rest of the precision.
SHADOW_SAMPLES = 2


# The accuracy guard: a candidate must make at least this share of float32's progress per
# step (at most 1 / R_MIN of its steps predicted). What it keeps out, measured on the lab's
# nets (results/tta/README.md, "Shadow progress"): top-k at 1% and 0.1%, PowerSGD at rank 1 and
# 1-bit signs, whose runs needed twice float32's steps or never reached its accuracy.
R_MIN = 0.5
# A switch away from the mode in force must promise this much less time per unit of
# progress: the ratios and step times are measured, and a tie is no reason to change.
MARGIN = 0.05
VALUE = "value"            # the mode of the per-bucket value plan (the planner's): r = 1

# The methods that change convergence, as auto names them (the grid's names).
DEFAULT_METHODS = ("powersgd1", "powersgd2", "powersgd4", "topk0.1", "topk0.01", "topk0.001",
                   "onebit", "int8")
_PATTERN = re.compile(r"^(?:(topk)(\d*\.?\d+(?:e-?\d+)?)|(powersgd)(\d+)|(onebit)|(int8))$")


def parse_method(text):
    """('topk', ratio) | ('powersgd', rank) | ('onebit', None) | ('int8', None), or a
    ValueError naming what is accepted."""
    m = _PATTERN.match(str(text).strip())
    if not m:
        raise ValueError(f"not a method auto can switch to: {text!r} (topk<ratio>, "
                         f"powersgd<rank>, onebit, int8)")
    if m.group(1):
        ratio = float(m.group(2))
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {text!r}")
        return "topk", ratio
    if m.group(3):
        rank = int(m.group(4))
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {text!r}")
        return "powersgd", rank
    return (m.group(5) or m.group(6)), None


def check_method(text):
    """The label, normalised (topk0.10 -> topk0.1), or a ValueError."""
    kind, p = parse_method(text)
    return f"{kind}{p:g}" if kind == "topk" else (f"{kind}{p}" if kind == "powersgd" else kind)


@dataclass
class Progress:
    """First-order progress of candidate modes along the trajectory in force, summed over a
    window. add() takes one step's inner products with the next step's averaged gradient:
    the exact update's (`exact`, <g_t, g_t+1>) and each candidate's (<u_c,t, g_t+1>)."""
    made: dict = field(default_factory=dict)
    exact: float = 0.0
    steps: int = 0

    def add(self, exact: float, candidates: dict) -> None:
        if not math.isfinite(exact) or not all(math.isfinite(v) for v in candidates.values()):
            raise ValueError("an inner product is not a number: the step's gradient is")
        self.exact += float(exact)
        for name, value in candidates.items():
            self.made[name] = self.made.get(name, 0.0) + float(value)
        self.steps += 1

    def ratios(self) -> dict:
        """{candidate: r_c}; empty until the exact progress is positive (a window that made no
        first-order progress measures nothing)."""
        if not self.exact > 0:
            return {}
        return {name: made / self.exact for name, made in self.made.items()}


def choose(step_s: dict, ratios: dict, current=VALUE, r_min=R_MIN, margin=MARGIN):
    """The mode to run next: the fewest seconds per unit of float32's progress, step_s[c] /
    r_c (the value plan's r is 1), among the modes whose r_c >= r_min; the mode in force is
    kept unless another promises `margin` less. step_s must hold the value plan's."""
    if VALUE not in step_s:
        raise ValueError("choose needs the value plan's step")
    cost = {VALUE: step_s[VALUE]}
    for name, seconds in step_s.items():
        r = ratios.get(name)
        if name != VALUE and r is not None and r >= r_min and seconds > 0:
            cost[name] = seconds / r
    best = min(cost, key=cost.get)
    if current in cost and cost[best] > (1 - margin) * cost[current]:
        return current
    return best


@dataclass
class Regime:
    """The critical-regime detector. The caller sums each step's averaged gradient over an
    interval (in its own buffers: this module holds no tensor) and gives the sum's norm at the
    interval's end; the next interval is critical when that norm moved by eta or more against
    the interval before's. `critical` is the regime in force."""
    eta: float = ETA
    interval: int = INTERVAL
    critical: bool = True                   # the first interval: nothing to compare with
    history: list = field(default_factory=list)    # (norm, critical) at each interval's end
    _previous: float | None = None

    def __post_init__(self):
        if not (isinstance(self.eta, (int, float)) and self.eta > 0 and math.isfinite(self.eta)):
            raise ValueError(f"eta must be a positive number, got {self.eta!r}")
        if isinstance(self.interval, bool) or int(self.interval) != self.interval or self.interval < 1:
            raise ValueError(f"interval must be a whole number of steps >= 1, got {self.interval!r}")

    def end_interval(self, norm: float) -> bool:
        """The norm of the gradient summed over the interval that ended: decides the next
        interval's regime, and returns it (True: critical)."""
        self.critical = changed(self._previous, float(norm), self.eta)
        self._previous = float(norm)
        self.history.append((float(norm), self.critical))
        return self.critical


def sampled_positions(interval=INTERVAL, samples=SHADOW_SAMPLES) -> frozenset:
    """The steps of a window (0 .. interval - 1, counted from its first) whose shadows run:
    `samples` of them, every (interval // samples)-th from the first; samples == interval is
    every step."""
    if isinstance(interval, bool) or int(interval) != interval or interval < 1:
        raise ValueError(f"interval must be a whole number of steps >= 1, got {interval!r}")
    if isinstance(samples, bool) or int(samples) != samples or not 1 <= samples <= interval:
        raise ValueError(f"shadow_samples must be a whole number of steps in 1..interval "
                         f"({interval}), got {samples!r}")
    stride = int(interval) // int(samples)
    return frozenset(range(0, stride * int(samples), stride))


def changed(before, now, eta=ETA) -> bool:
    """Accordion's rule: |now - before| / before >= eta (no interval before, or a norm that is
    not a number: critical, the safe side)."""
    if before is None or not math.isfinite(now) or not math.isfinite(before):
        return True
    if before == 0:
        return now != 0
    return abs(now - before) / before >= eta
