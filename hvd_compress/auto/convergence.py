"""What a job measures of its own convergence, for Compression.auto's choice by time to
accuracy (docs/planner.md, "Time to accuracy").

The planner prices a step; a method that compresses harder (PowerSGD at a low rank, top-k at a
small ratio, 1-bit signs) sends a step sooner and may need more of them, and at a bad moment
more than it saves. The optimizer sees no loss, only gradients, so this module reads the
gradients. Pure: numbers in, decisions out (no torch, no collectives); the communicator feeds
it the norm of each step's averaged gradient, the same on every rank, so every rank decides
alike without a collective of its own.

    Regime      Accordion's critical-regime detector (Agarwal et al., "Accordion: Adaptive
                Gradient Communication via Critical Learning Regime Identification", MLSys
                2021): the norm of the gradient accumulated over an interval of steps,
                against the interval before; a relative change of eta or more marks the next
                interval critical, when a compressed gradient's error does lasting harm, and
                auto then sends what costs no steps (the value codecs under their error bound).
                The first interval is critical: nothing to compare it with, and the start of
                training is where the gradient norm moves most.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["ETA", "INTERVAL", "Regime", "changed"]

# Accordion's threshold of relative change (its paper's 0.5, used in all its experiments).
ETA = 0.5
# Steps per interval. Accordion compares epochs (or tens of steps for its batch-size
# schedule); the lab trains two or three epochs, a few hundred steps each, so an interval is a
# fraction of an epoch: a switch can follow the regime within a tenth of a run.
INTERVAL = 50


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


def changed(before, now, eta=ETA) -> bool:
    """Accordion's rule: |now - before| / before >= eta (no interval before, or a norm that is
    not a number: critical, the safe side)."""
    if before is None or not math.isfinite(now) or not math.isfinite(before):
        return True
    if before == 0:
        return now != 0
    return abs(now - before) / before >= eta
