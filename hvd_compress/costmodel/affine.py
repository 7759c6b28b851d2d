"""seconds = a + b * bytes: a cost per call and per byte, and its two fits (pure Python).

A codec's work on a bucket (encode, decode, the middle reduce) and a collective's CPU per call
are priced so; the planner's timeline (hvd_compress/auto/timeline.py) reads them. Two fits,
from the two kinds of timing there are:

    fit_affine             (bytes, seconds) points of single calls: what a job fits to its
                           timed encodes of a few sizes, or a collective's CPU per size
    fit_calls_and_bytes    two per-step totals of calls * a + bytes * b (two nets of different
                           bucket counts and sizes): what `hvd-compress-plan` solves from a step
                           benchmark's compress and decompress columns

Both hold a and b >= 0: a cost is never negative, so where the least-squares or exact solution
puts one below zero it is set to 0 and the other fitted alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Affine", "fit_affine", "fit_calls_and_bytes"]


@dataclass(frozen=True)
class Affine:
    """seconds = a + b * fp32 bytes: a codec's fitted cost on one bucket, or a collective's
    CPU per call."""

    a: float = 0.0
    b: float = 0.0

    def __post_init__(self):
        for name, v in (("a", self.a), ("b", self.b)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"codec cost {name} must be finite and >= 0, got {v!r}")

    def seconds(self, nbytes: float) -> float:
        return self.a + self.b * nbytes


def fit_affine(points) -> Affine:
    """seconds = a + b * bytes by least squares on (bytes, seconds) points, a and b held >= 0
    (a codec has no negative cost): what a job fits to its timed encodes of a few sizes."""
    pts = [(float(x), float(y)) for x, y in points]
    if not pts or any(not (math.isfinite(x) and math.isfinite(y) and x >= 0 and y >= 0)
                      for x, y in pts):
        raise ValueError("codec timings must be finite (bytes >= 0, seconds >= 0) points, "
                         f"got {points!r}")
    k = len(pts)
    mx, my = sum(x for x, _ in pts) / k, sum(y for _, y in pts) / k
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:                                   # one size: all of it is per-call cost
        return Affine(my, 0.0)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = my - b * mx
    if b < 0:
        return Affine(my, 0.0)
    if a < 0:
        return Affine(0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts))
    return Affine(a, b)


def fit_calls_and_bytes(first, second) -> Affine:
    """a per call, b per byte from two per-step totals, each (calls, bytes, seconds): the exact
    solution of calls * a + bytes * b = seconds for both; held >= 0 (a negative one is set to 0
    and the other fitted alone to both totals by least squares); Affine() where the totals
    determine neither (a NaN among them)."""
    (c1, x1, y1), (c2, x2, y2) = first, second
    det = c1 * x2 - c2 * x1
    a = (y1 * x2 - y2 * x1) / det
    b = (c1 * y2 - c2 * y1) / det
    if not (math.isfinite(a) and math.isfinite(b)):
        return Affine()
    if a < 0:
        return Affine(0.0, max((y1 * x1 + y2 * x2) / (x1 * x1 + x2 * x2), 0.0))
    if b < 0:
        return Affine(max((y1 * c1 + y2 * c2) / (c1 * c1 + c2 * c2), 0.0), 0.0)
    return Affine(a, b)
