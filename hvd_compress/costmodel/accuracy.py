"""Time to accuracy past the machine that measured it: n ranks, from the steps measured at two.

A method's time to a target at n ranks is its steps to the target at n ranks times its step
at n ranks. Neither is measured beyond 4 ranks here, so each comes from a model, with its
assumptions said (docs/costmodel.md, "Time to accuracy at n ranks"):

Steps. Each rank trains on its own batch of b images, the learning rate scaled by n (the
lab's rule): the global batch is B = n b. The steps to a target then follow McCandlish et al.,
"An Empirical Model of Large-Batch Training" (2018): (S / S_min - 1)(E / E_min - 1) = 1 for S
steps of E images in all, S_min the fewest steps any batch needs and E_min the fewest images;
so S(B) = S_min + E_min / B = S_min (1 + B_crit / B), B_crit = E_min / S_min the critical
batch, beyond which a larger one buys few steps (close to the gradient noise scale, they
find). Two measurements (the same target, two rank counts) fix both:

    S_min = (B2 S2 - B1 S1) / (B2 - B1),   E_min = B1 B2 (S1 - S2) / (B2 - B1)

held to what the model allows, through the larger batch's measurement (the nearer to the
rank counts it is asked about): a pair whose larger batch did not cut the steps (S2 >= S1)
gives E_min = 0 (more ranks, the same steps S2); one that cut them by the batch's ratio or more
(B2 S2 <= B1 S1) gives S_min = 0 (perfect scaling: the images B2 S2 at every batch). Each
method's own pair, so a compression that slows convergence more at a larger batch keeps doing so.

Step. step(n) = (compute - backward) + exchange(n), the exchange on the alpha-beta link from
the first launch (early in backward) to the last result, the last unit leaving only once
backward ends (methods.exchange_seconds), so the part hidden behind backward is taken out:
compute is the method's step on one rank's own core with nothing to send (forward, backward,
its codec and the update), backward the share of it that overlaps the exchange. A rank per
machine: compute does not grow with n; the decoding of n ranks' packets does, and is left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .methods import exchange_seconds, exchange_units, two_phase
from .model import Link

__all__ = ["StepsCurve", "step_seconds", "time_to_accuracy", "BACKWARD_SHARE"]

# The share of forward+backward+update that backward is, and so may hide the exchange behind
# it (the planner's command takes the same: docs/planner.md, "What it is given").
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class StepsCurve:
    """Steps to one target against the global batch B: S(B) = s_min + e_min / B."""
    s_min: float
    e_min: float

    @classmethod
    def fit(cls, batch1: float, steps1: float, batch2: float, steps2: float) -> "StepsCurve":
        """The curve through two measurements (batch1 < batch2), held to what the model allows
        (the module's docstring)."""
        if not (0 < batch1 < batch2 and math.isfinite(batch2)):
            raise ValueError(f"need two batches, the first smaller: got {batch1}, {batch2}")
        if not all(x > 0 and math.isfinite(x) for x in (steps1, steps2)):
            raise ValueError(f"steps must be positive and finite, got {steps1}, {steps2}")
        if steps2 >= steps1:                        # the larger batch bought no steps
            return cls(s_min=float(steps2), e_min=0.0)
        if batch2 * steps2 <= batch1 * steps1:      # no more images: perfect scaling
            return cls(s_min=0.0, e_min=float(batch2 * steps2))
        return cls(s_min=(batch2 * steps2 - batch1 * steps1) / (batch2 - batch1),
                   e_min=batch1 * batch2 * (steps1 - steps2) / (batch2 - batch1))

    @property
    def b_crit(self):
        """The critical batch, B_crit = E_min / S_min (inf: perfect scaling)."""
        return math.inf if self.s_min == 0 else self.e_min / self.s_min

    def steps(self, batch: float) -> float:
        return self.s_min + self.e_min / batch


def step_seconds(method, shapes, n, link: Link, compute_s, parameter=None, route=None,
                 backward_share=BACKWARD_SHARE) -> float:
    """One step at n ranks: the compute that no exchange hides, then the exchange on `link`
    (every collective on the same link), its last unit after backward's end."""
    backward = backward_share * compute_s
    links = {c: link for c in ("allreduce", "allreduce_fp16", "allgather", "alltoall")}
    units = exchange_units(method, shapes, n, parameter, route)
    exchange = exchange_seconds(units, n, links, launch_span=backward,
                                second_phase_after_backward=two_phase(method, route))
    return compute_s - backward + max(backward, exchange)


def time_to_accuracy(curve: StepsCurve, batch_per_rank, n, step_s, overhead_s=0.0) -> float:
    """Seconds to the target at n ranks: the curve's steps at the global batch n x
    batch_per_rank times the step, plus what the run spends besides its steps."""
    return overhead_s + curve.steps(n * batch_per_rank) * step_s
