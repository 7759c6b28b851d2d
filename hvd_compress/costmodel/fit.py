"""Fit a link's alpha and beta to measured collective times (least squares, NumPy only).

For a collective at n ranks the model says  t = c_a(n) * alpha + c_b(n, bytes) * beta,
with the coefficients of model.py (e.g. allreduce: c_a = 2(n-1), c_b = 2(n-1)/n * bytes).
Fitting against those coefficients, rather than a bare intercept and slope, recovers the
*link's* alpha and beta, so one fit at n = 2 and 4 predicts n = 64.

Measurement CSV (written by labs.netem.bench, the benchmark; extra columns are ignored):

    collective  one of: allreduce, allgather, alltoall, reducescatter, broadcast
    n           number of ranks (integer >= 1; n = 1 moves no data and is left out of the fit)
    bytes       bytes of each rank's *input* tensor:
                  allreduce      the vector every rank reduces          (g)
                  allgather      what each rank contributes             (G / n)
                  alltoall       each rank's whole send buffer          (m)
                  reducescatter  the whole vector each rank inputs      (G)
                  broadcast      the root's tensor
    seconds     wall time of one repetition  -- one row per repetition, or instead
    median_s    the median over repetitions  -- one row per (collective, n, bytes)

Pooled or per rank count: by default one (alpha, beta) per collective covers every n, which
is what extrapolating to other n needs. ``per_n=True`` fits each (collective, n) on its own,
as MPI libraries tune per communicator size: measured implementations are not always the
textbook algorithm at every n (Horovod over Gloo at n = 2 moves allgather and alltoall data
half-duplex, MPI full-duplex; Horovod's per-call negotiation adds latency that does not grow
like c_a(n)). Then alpha and beta describe that n only.

Rows sharing (collective, n, bytes) are reduced to their median before fitting, so one
slow repetition does not drag the fit. The default weighting is *relative* (minimise the
sum of ((measured - predicted) / measured)^2): sizes span many decades, and absolute least
squares would let the largest messages decide alone, leaving alpha to chance.

A job's own timings (the auto package's calibration, rows rather than a CSV) are fitted by
``fit_links``: one pooled fit per collective, each beta at least BETA_FLOOR, since a link whose
bytes cost nothing measurable at the sizes timed is still not free. A codec's and a
collective's CPU cost, a + b * bytes, are fitted in affine.py.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field

import numpy as np

from . import model

__all__ = ["COLLECTIVES", "BETA_FLOOR", "Measurement", "Point", "Fit", "FitError",
           "read_measurements", "measurements_from_rows", "fit", "fit_all", "fit_links"]

COLLECTIVES = {
    "allreduce": model.ring_allreduce,
    "allreduce_fp16": model.ring_allreduce,      # a float16 tensor (Horovod's fp16 cast)
    "allgather": model.allgather,
    "alltoall": model.alltoall,
    "reducescatter": model.reduce_scatter,
    "broadcast": model.broadcast_tree,
}
_ALIASES = {"reduce_scatter": "reducescatter", "reduce-scatter": "reducescatter"}
WEIGHTINGS = ("relative", "absolute")


class FitError(ValueError):
    """The measurements cannot be read or cannot determine alpha and beta."""


@dataclass(frozen=True)
class Measurement:
    collective: str
    n: int
    bytes: float
    seconds: float


@dataclass(frozen=True)
class Point:
    """One (collective, n, bytes) after taking the median of its repetitions."""

    collective: str
    n: int
    bytes: float
    reps: int
    measured_s: float
    predicted_s: float

    @property
    def rel_residual(self) -> float:
        """(measured - predicted) / measured."""
        return (self.measured_s - self.predicted_s) / self.measured_s


@dataclass
class Fit:
    collective: str              # a collective's name, or "all" for one link fitted to all
    alpha: float                 # seconds per message
    beta: float                  # seconds per byte
    r2: float                    # on the per-point medians, in seconds
    points: list = field(default_factory=list)
    rows: int = 0                # measurement rows used (before taking medians)
    excluded_n1: int = 0         # rows at n = 1, which carry no communication
    clamped: str = ""            # "alpha" or "beta" if that one was held at 0 (it fitted < 0);
                                 # "bandwidth" if it was held at max_bandwidth (fitted above)
    weighting: str = "relative"
    n: int | None = None         # the rank count this fit is for; None: pooled over all n

    @property
    def label(self) -> str:
        return self.collective if self.n is None else f"{self.collective}@n={self.n}"

    @property
    def bandwidth(self) -> float:
        """Bytes per second (inf if beta was clamped to 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    @property
    def max_abs_rel_residual(self) -> float:
        return max(abs(p.rel_residual) for p in self.points)

    def link(self) -> model.Link:
        return model.Link(self.alpha, self.beta)


# ---------------------------------------------------------------- reading

def _canonical(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in COLLECTIVES:
        raise FitError(f"unknown collective {name!r}; known: {', '.join(COLLECTIVES)}")
    return key


def _number(text, what: str, where: str) -> float:
    try:
        x = float(str(text).strip())
    except ValueError:
        raise FitError(f"{where}: {what} {text!r} is not a number") from None
    if not math.isfinite(x):
        raise FitError(f"{where}: {what} {text!r} is not finite")
    return x


def measurements_from_rows(rows, source: str = "<rows>") -> list[Measurement]:
    """Validate dict rows (CSV or pandas records) into Measurements; any bad row is an error."""
    out = []
    time_col = None
    for i, row in enumerate(rows, start=2):  # line 1 of a CSV is its header
        where = f"{source}:{i}"
        if time_col is None:
            missing = [c for c in ("collective", "n", "bytes") if c not in row]
            time_col = "seconds" if "seconds" in row else "median_s" if "median_s" in row else None
            if missing or time_col is None:
                need = missing + ([] if time_col else ["seconds (or median_s)"])
                raise FitError(f"{source}: missing column(s) {', '.join(need)}; "
                               f"have {', '.join(map(str, row))}")
        n = _number(row["n"], "n", where)
        if n != int(n) or n < 1:
            raise FitError(f"{where}: n must be an integer >= 1, got {row['n']!r}")
        nbytes = _number(row["bytes"], "bytes", where)
        if nbytes < 0:
            raise FitError(f"{where}: bytes must be >= 0, got {row['bytes']!r}")
        t = _number(row[time_col], time_col, where)
        if t <= 0:
            raise FitError(f"{where}: {time_col} must be > 0, got {row[time_col]!r}")
        try:
            name = _canonical(str(row["collective"]))
        except FitError as e:
            raise FitError(f"{where}: {e}") from None
        out.append(Measurement(name, int(n), nbytes, t))
    if not out:
        raise FitError(f"{source}: no measurement rows")
    return out


def read_measurements(path) -> list[Measurement]:
    """Read a measurement CSV (columns: see module docstring)."""
    with open(path, newline="") as f:
        return measurements_from_rows(csv.DictReader(f), source=str(path))


# ---------------------------------------------------------------- fitting

def _medians(measurements) -> list[tuple]:
    """[(collective, n, bytes, reps, median seconds)] sorted, one per distinct point."""
    groups: dict = {}
    for m in measurements:
        groups.setdefault((m.collective, m.n, m.bytes), []).append(m.seconds)
    return [(c, n, b, len(ts), float(np.median(ts))) for (c, n, b), ts in sorted(groups.items())]


def _solve_nonnegative(A: np.ndarray, y: np.ndarray):
    """Least squares for x = (alpha, beta) >= 0; returns (x, clamped-name).

    With two unknowns the constrained optimum is either the free one or lies on an
    axis, so we try those and keep the best; no scipy needed.
    """
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    As = A / scale  # columns of similar size: c_a ~ 10, c_b ~ 1e8 would upset the rank test
    z, _, rank, _ = np.linalg.lstsq(As, y, rcond=None)
    if rank < 2:
        raise FitError(
            "alpha and beta cannot be told apart from these points: measure at least two "
            "message sizes (or, for allreduce/alltoall/reducescatter, two node counts)")
    x = z / scale
    if np.all(x >= 0):
        return x, ""
    candidates = []
    for keep, name in ((1, "alpha"), (0, "beta")):  # hold the *other* one at 0
        col = A[:, keep]
        v = max(float(col @ y) / float(col @ col), 0.0)
        xc = np.zeros(2)
        xc[keep] = v
        candidates.append((float(np.sum((A @ xc - y) ** 2)), name, xc))
    _, name, xc = min(candidates, key=lambda c: c[0])
    return xc, name


def _hold_bandwidth(A: np.ndarray, y: np.ndarray, beta: float) -> np.ndarray:
    """(alpha >= 0, beta) with beta given: least squares of the rest on the messages column."""
    col, rest = A[:, 0], y - A[:, 1] * beta
    return np.array([max(float(col @ rest) / float(col @ col), 0.0) if col @ col else 0.0, beta])


def fit(measurements, collective: str | None = None, weighting: str = "relative",
        n: int | None = None, max_bandwidth: float | None = None) -> Fit:
    """Fit one link (alpha, beta) to `collective`'s rows, or to all rows if collective is None;
    only to the rows at `n` ranks if n is given.

    max_bandwidth (bytes/s): the link's rate, where it is known (an emulated link). A fit
    above it is impossible (a payload cannot cross faster than the wire, and framing adds
    bytes): it means a few slow repetitions of a small message raised alpha and the slope
    fell to make up. Then beta is held at 1 / max_bandwidth and alpha refitted alone."""
    if weighting not in WEIGHTINGS:
        raise FitError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if max_bandwidth is not None and not max_bandwidth > 0:
        raise FitError(f"max_bandwidth must be > 0 bytes/s, got {max_bandwidth!r}")
    if collective is not None:
        collective = _canonical(collective)
        measurements = [m for m in measurements if m.collective == collective]
        if not measurements:
            raise FitError(f"no rows for collective {collective!r}")
    if n is not None:
        measurements = [m for m in measurements if m.n == n]
        if not measurements:
            raise FitError(f"no rows at n = {n}")
    name = collective or "all"
    label = name + ("" if n is None else f"@n={n}")
    excluded = sum(1 for m in measurements if m.n == 1)
    used = [m for m in measurements if m.n >= 2]
    points = _medians(used)
    if len(points) < 2:
        raise FitError(f"{label}: need at least two distinct (n, bytes) points with n >= 2, "
                       f"got {len(points)}")

    coeffs = [COLLECTIVES[c](n, b) for c, n, b, _, _ in points]
    A = np.array([[k.messages, k.bytes] for k in coeffs], dtype=float)
    y = np.array([t for *_, t in points], dtype=float)
    w = 1.0 / y if weighting == "relative" else np.ones_like(y)
    try:
        x, clamped = _solve_nonnegative(A * w[:, None], y * w)
    except FitError as e:
        raise FitError(f"{label}: {e}") from None
    if max_bandwidth is not None and x[1] < 1.0 / max_bandwidth:
        x, clamped = _hold_bandwidth(A * w[:, None], y * w, 1.0 / max_bandwidth), "bandwidth"
    alpha, beta = float(x[0]), float(x[1])

    predicted = A @ x
    ss_res = float(np.sum((y - predicted) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan
    return Fit(
        collective=name, alpha=alpha, beta=beta, r2=r2,
        points=[Point(c, n, b, reps, t, float(p))
                for (c, n, b, reps, t), p in zip(points, predicted)],
        rows=len(used), excluded_n1=excluded, clamped=clamped, weighting=weighting, n=n,
    )


def fit_all(measurements, weighting: str = "relative", per_n: bool = False,
            max_bandwidth: float | None = None) -> list[Fit]:
    """One fit per collective present, plus a joint "all" fit when there are several;
    with per_n, those for each rank count n >= 2 on its own; none above max_bandwidth."""
    names = sorted({m.collective for m in measurements})
    groups = [None] if not per_n else sorted({m.n for m in measurements if m.n >= 2})
    fits = []
    for n in groups:
        fits += [fit(measurements, c, weighting, n, max_bandwidth) for c in names]
        if len(names) > 1:
            fits.append(fit(measurements, None, weighting, n, max_bandwidth))
    return fits


# s/byte: 100 GB/s, a memory copy's pace; the least a link fitted by fit_links takes as beta.
BETA_FLOOR = 1e-11


def fit_links(rows) -> dict:
    """{collective: Fit} from timed collectives, rows of (collective, n, bytes, seconds), bytes
    as this module defines them: what a job fits to the collectives it timed (the auto
    package's calibration, through its planner). Each beta at least BETA_FLOOR. Raises FitError
    (a ValueError) where the rows cannot determine a link."""
    measurements = measurements_from_rows(
        [{"collective": c, "n": n, "bytes": b, "seconds": s} for c, n, b, s in rows],
        source="timed collectives")
    fits = {c: fit(measurements, c) for c in sorted({m.collective for m in measurements})}
    for f in fits.values():
        if f.beta <= 0:
            # The sizes timed could not resolve a cost per byte (the larger message no slower
            # than the smaller, within noise): bytes that cost nothing measurable there are
            # taken at memory-copy pace, never free (a link needs beta > 0).
            f.beta, f.clamped = BETA_FLOOR, "beta"
    return fits
