"""What a plan is chosen from: the buckets in launch order, backward's pace, each collective's
link, each codec's cost, each scheme's error per bucket (docs/planner.md, "What it is given").

Frozen values, checked on construction, so that a bad measurement is refused where it is made,
not where the timeline (timeline.py) would divide by it. Pure: no torch, no Horovod.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..costmodel.affine import Affine

__all__ = ["Affine", "CodecCost", "Bucket", "Measurements"]


@dataclass(frozen=True)
class CodecCost:
    """One scheme-and-route's measured cost per bucket: `encode` in the gradient hook, `reduce`
    between a two-phase bucket's two collectives (decode, sum, re-encode its chunk), `decode`
    at step()."""

    encode: Affine = Affine()
    decode: Affine = Affine()
    reduce: Affine = Affine()


@dataclass(frozen=True)
class Bucket:
    """A bucket in launch order: its name, float32 bytes, and when backward has produced it
    (seconds from backward's start, hook work excluded; the slowest rank's)."""

    name: str
    nbytes: int
    ready_s: float

    def __post_init__(self):
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0 \
                or self.nbytes % 4:
            raise ValueError(f"bucket {self.name!r}: float32 bytes must be a whole multiple of "
                             f"4 >= 0, got {self.nbytes!r}")
        if not (math.isfinite(self.ready_s) and self.ready_s >= 0):
            raise ValueError(f"bucket {self.name!r}: ready time must be finite and >= 0 s, "
                             f"got {self.ready_s!r}")


@dataclass(frozen=True)
class Measurements:
    """Everything a plan is chosen from. `links`: {collective: Link or costmodel.fit.Fit} as
    timed while backward runs, `links_idle` as timed after it (optional); collectives:
    allreduce, allreduce_fp16 (Horovod's float16 sum; falls back to allreduce), allgather,
    alltoall. `codecs`: {'bit8:allgather': CodecCost, ...} ('none:allreduce' defaults to free).
    `errors`: {(bucket name, scheme name): measured relative error}. `links_cpu`:
    {collective: Affine} the CPU a collective's threads spend per call (bytes as for `links`),
    and `cpu_share`: the backward seconds one such CPU second costs where backward computes
    meanwhile (the cores' threads per core, 0 where a core is free; timeline.py, "The
    collectives' CPU"). `needed_s`: under schedule="overlap", per bucket, when the next
    forward first needs it (s after step() returns, waits excluded; timeline.py, "Across
    the step boundary"); None: the waiting schedule is priced. `chunks`: {(bucket name,
    label): count} the chunks a one-collective route cuts a bucket into under that schedule
    (priority on the wire; a bucket not named is not cut)."""

    n: int
    buckets: tuple
    backward_s: float
    links: dict
    codecs: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    links_idle: dict | None = None
    fixed_s: float = 0.0
    links_cpu: dict = field(default_factory=dict)
    cpu_share: float = 0.0
    needed_s: tuple | None = None
    chunks: dict = field(default_factory=dict)

    @property
    def schedule(self):
        """The schedule a plan's step is priced on: "overlap" where the forward's needs are
        given, else "wait"."""
        return "wait" if self.needed_s is None else "overlap"

    def __post_init__(self):
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"number of ranks must be an integer >= 1, got {self.n!r}")
        object.__setattr__(self, "buckets", tuple(self.buckets))
        if not self.buckets:
            raise ValueError("no buckets to plan")
        names = [b.name for b in self.buckets]
        if len(set(names)) != len(names):
            raise ValueError(f"bucket names must be unique, got {names}")
        last = max(b.ready_s for b in self.buckets)
        for what, v in (("backward_s", self.backward_s), ("fixed_s", self.fixed_s),
                        ("cpu_share", self.cpu_share)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{what} must be finite and >= 0, got {v!r}")
        if self.backward_s < last:
            raise ValueError(f"backward ends at {self.backward_s!r} s, before its last bucket "
                             f"is ready ({last!r} s)")
        if any(b.ready_s > a.ready_s for a, b in zip(self.buckets[1:], self.buckets)):
            raise ValueError("buckets must be given in launch order (ready times non-decreasing)")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1
               for c in self.chunks.values()):
            raise ValueError(f"chunks must be whole counts >= 1, got {self.chunks!r}")
        if self.needed_s is not None:
            object.__setattr__(self, "needed_s", tuple(self.needed_s))
            if len(self.needed_s) != len(self.buckets) or not all(
                    isinstance(t, (int, float)) and math.isfinite(t) and t >= 0
                    for t in self.needed_s):
                raise ValueError(f"needed_s must give every bucket a finite time >= 0 "
                                 f"({len(self.buckets)} buckets), got {self.needed_s!r}")
