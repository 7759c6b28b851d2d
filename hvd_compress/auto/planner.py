"""Which scheme and route each bucket takes: the plan with the smallest predicted step.

Pure (no torch, no Horovod; NumPy, as the cost model's fit): from a job's measurements --
when backward makes each bucket ready, each collective's fitted link, each codec's cost, each
scheme's error on each bucket's gradients -- predict the step of any plan on the exchange's
timeline, and search for the best one. The same measurements give the same plan on every
rank (docs/planner.md, "The search").

The timeline, per step, times from the start of backward (a plan changes nothing before it):

    produced_i = ready_i + enc_1 + ... + enc_i      the hook encodes the bucket in backward's
                                                     thread, so each encode delays the rest
    B'         = backward_s + enc_1 + ... + enc_k    backward's end, encodes included
    Q_i        = max(Q_(i-1), produced_i) + w_i      Horovod's background thread runs the
                                                     collectives one after another, in launch
                                                     order; w_i: the bucket's collectives (a
                                                     two-phase bucket's two, back to back, with
                                                     the middle reduce between them)
    decode     t = B'; t = max(t, Q_i) + dec_i       at step(), bucket by bucket
    step       = fixed_s + t                         fixed_s: forward, update (no plan moves them)

A later phase (a two-phase bucket's allgather) is where that fold and the plugin differ
(under schedule="overlap" it is launched where the optimizer looks at its pending buckets:
at step() and where the next forward needs one): the
plugin launches it from the first gradient hook after the phase before it ended (after that
hook's own bucket has been launched; its middle reduce runs in the hook, on backward's thread)
or, from backward's end on, as soon as that phase ends. `predict` times every plan so, event by
event (`_timeline`); the fold is what the search's DP runs on, exact where no option has a later
phase.

Unrolled, the fold's t = max(B' + D, P_k) with P_i = max(P_(i-1), Q_i) + dec_i, D = dec_1 + ...
+ dec_k: a left-to-right fold whose state (E, Q, P, D) -- encodes so far, queue free, decodes
done if they started at 0, decode total -- grows monotonically with every input and sets the
step monotonically. So a plan prefix whose state is no smaller in every component than another's
(and no less lossy) can be dropped: the DP keeps only the Pareto front of these states over the
buckets, exactly the plans an exhaustive search could still need (tests check it), up to
MAX_FRONT prefixes; beyond, the most promising of them (a beam, said in the plan). A waiting
later phase breaks that monotonicity (a later bucket may go first), so `search` predicts every
plan where there are at most EXHAUSTIVE_PLANS, and beyond lets the timeline re-rank and improve
the DP's plans (`_improve`).

The collectives' CPU: Horovod's thread sums what it receives (a float16 sum on a CPU is a
software conversion each way, so Horovod's fp16 allreduce costs more CPU than float32's for
half the bytes). Where the compute threads fill the cores, that CPU
is taken from backward: a collective's `cpu` (its measured CPU seconds x Measurements.cpu_share)
is added to backward's end and to every later hook, in the share of its run that overlaps
backward. The fold leaves it out; the timeline, which chooses, has it.

Across the step boundary (schedule="overlap"; `Measurements.needed_s`): step() returns at
backward's end B' and the next forward runs on; bucket i is first needed `needed_i` after
that (its pace measured as backward's is: the forward's pre-hooks, waits taken out), so in
order of need

    at_i = max(B' + needed_i + lag, Q_i) + dec_i,   lag = at_i - B' - needed_i   (lag_0: 0)
    step = fixed_s + B' + lag                        the forward is in fixed_s; only its waits add

With every need 0 and one collective a bucket this is the waiting fold (a later phase waits
for the optimizer to look: at step() and at each need). A bucket the next forward needs late hides its
exchange behind the forward's first layers, which the waiting schedule cannot.

Priority on the wire (overlap only; `Measurements.chunks`): a bucket its route cuts into c
chunks runs as c equal pieces, handed to Horovod two at a time; a bucket launched later, while
they run, goes in after the piece on the wire and the next one, and pushes the rest back by
its own time.

A collective that runs while backward still computes takes the busy link's pace; after
backward's end (as far as it is known at its launch, `backward_s` plus the encodes so far) the
idle link's, where one was measured; a collective across that moment does the rest at idle pace
(as costmodel.methods.exchange_seconds). The idle link is never taken slower than the busy one
(noise would otherwise break the monotonicity the search relies on).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..costmodel import fit as link_fit
from ..costmodel import methods
from ..registry import label, parse_label, resolve_route

__all__ = ["Affine", "CodecCost", "Bucket", "Measurements", "Timeline", "Plan",
           "DEFAULT_CANDIDATES", "ERROR_BOUND", "TIE_MARGIN", "REPLAN_MARGIN",
           "REPLAN_EVERY", "REPLAN_WINDOW", "REPLAN_FIRST", "MAX_FRONT", "EXHAUSTIVE_PLANS", "candidates_for",
           "wire_units", "predict", "fixed_plan", "search", "exhaustive", "should_replan",
           "Replan", "Ranked", "fit_affine", "fit_links"]

# The candidates, in the fixed order that breaks every tie: least lossy first.
# int8 is left out: it sends exactly bit8's bytes (so it never moves less), its stochastic
# rounding costs more codec time, and its error is relative to each block's largest value,
# not to each value (a value 100x below its block's max keeps ~1 significant bit where E4M3
# keeps 4). It can be passed in `candidates` where a measurement says otherwise.
DEFAULT_CANDIDATES = ("none:allreduce", "fp16:allreduce", "bit16:alltoall", "bit16:allgather",
                      "bit8:allgather", "bit8:alltoall")
# Accuracy guard: a bucket takes a lossy scheme only where that scheme's measured relative
# error on the bucket's gradients (||decode(encode(g)) - g|| / ||g||, as the codec tests define
# it) is at most this: E4M3's worst rounding of a value in its normal range, 2**-4
# (docs/codecs.md). Above it some of the bucket's values fell below the format's normal range
# after scaling (flushed or coarsely rounded): the scale does not fit the bucket.
ERROR_BOUND = 2.0 ** -4
# Plans predicted within this fraction of the fastest are tied, the least lossy taken: small,
# since the model's gaps between plans are smaller than the measured ones (a wide margin hands
# the step to a slower, less lossy plan the model cannot tell apart).
TIE_MARGIN = 0.005
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
# The most plan prefixes the DP keeps per bucket: exact below it (tests/test_planner.py holds it
# to brute force), a beam above, which the plan then says.
MAX_FRONT = 128
# Up to this many allowed plans every one is predicted on the timeline (6 candidates on 5
# buckets: 7,776, a fraction of a second in pure Python); beyond, the DP shortlists.
EXHAUSTIVE_PLANS = 8192
# Then the timeline improves the IMPROVE_STARTS fastest shortlisted plans one bucket at a time,
# at most IMPROVE_PLANS predicted: enough to find the exhaustive optimum on 300 random instances
# where one start missed 5 (tests/test_planner.py holds 25 of them).
IMPROVE_STARTS = 16
IMPROVE_PLANS = 2000


# ---------------------------------------------------------------- the measurements

@dataclass(frozen=True)
class Affine:
    """seconds = a + b * fp32 bytes: a codec's fitted cost on one bucket."""

    a: float = 0.0
    b: float = 0.0

    def __post_init__(self):
        for name, v in (("a", self.a), ("b", self.b)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"codec cost {name} must be finite and >= 0, got {v!r}")

    def seconds(self, nbytes: float) -> float:
        return self.a + self.b * nbytes


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
    meanwhile (the cores' threads per core, 0 where a core is free; module docstring, "The
    collectives' CPU"). `needed_s`: under schedule="overlap", per bucket, when the next
    forward first needs it (s after step() returns, waits excluded; module docstring, "Across
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


# ---------------------------------------------------------------- one bucket, one option

def wire_units(scheme: str, route, count: int, n: int):
    """The collectives of one bucket of `count` values, as (collective, bytes) with bytes as
    fit.py defines them: costmodel.methods' own reckoning, the one its tests hold to the
    communicators' byte counts."""
    route = resolve_route(scheme, route).value
    return methods.exchange_units(scheme, [(count,)], n, route=route)[0]


def _measured_as(table, collective):
    """The key `collective` was measured under: Horovod's fp16 sum falls back to allreduce's."""
    return "allreduce" if collective == "allreduce_fp16" and collective not in table else collective


def _link(links, collective):
    collective = _measured_as(links, collective)
    if collective not in links:
        raise ValueError(f"no link measured for collective {collective!r}; have "
                         f"{', '.join(sorted(links))}")
    x = links[collective]
    return x.link() if callable(getattr(x, "link", None)) else x


def _unit_seconds(unit, n, links):
    return sum(methods.COLLECTIVE_COSTS[c](n, b).seconds(_link(links, c)) for c, b in unit)


def _unit_cpu(m, collective, nbytes):
    """Backward seconds the collective's CPU costs where it runs during backward."""
    cost = m.links_cpu.get(_measured_as(m.links_cpu, collective))
    return 0.0 if cost is None or not m.cpu_share else m.cpu_share * cost.seconds(nbytes)


@dataclass(frozen=True)
class _Option:
    """One candidate for one bucket, with its costs worked out."""
    label: str
    index: int           # position in the candidate order: breaks ties
    enc: float
    mid: float
    dec: float
    phases: tuple        # ((busy s, idle s), ...): the bucket's collectives
    cpu: tuple           # per phase: backward seconds its CPU costs, run during backward
    loss: float          # bytes * measured error: what the tie-break minimises
    chunks: int = 1      # overlap: the chunks its route cuts it into (Measurements.chunks)


def _option(m: Measurements, bucket: Bucket, text: str, index: int) -> _Option:
    scheme, route = parse_label(text)
    if text == "none:allreduce" and text not in m.codecs:
        cost = CodecCost()
    elif text in m.codecs:
        cost = m.codecs[text]
    else:
        raise ValueError(f"no codec cost measured for {text}")
    count = bucket.nbytes // 4
    idle = m.links_idle or m.links
    phases, cpu = [], []
    for c, b in wire_units(scheme, route, count, m.n):
        busy = _unit_seconds([(c, b)], m.n, m.links)
        phases.append((busy, min(busy, _unit_seconds([(c, b)], m.n, idle))))
        cpu.append(_unit_cpu(m, c, b))
    err = 0.0 if scheme == "none" else m.errors.get((bucket.name, scheme), math.nan)
    chunks = m.chunks.get((bucket.name, text), 1) if m.needed_s is not None else 1
    return _Option(text, index, cost.encode.seconds(bucket.nbytes),
                   cost.reduce.seconds(bucket.nbytes), cost.decode.seconds(bucket.nbytes),
                   tuple(phases), tuple(cpu), bucket.nbytes * err,
                   chunks if len(phases) == 1 else 1)


def candidates_for(m: Measurements, candidates=DEFAULT_CANDIDATES, bound=ERROR_BOUND):
    """Per bucket, the candidates it may take, in the given order, and why the others may not:
    ([[label, ...] per bucket], {(bucket, label): reason}). none is always allowed."""
    allowed, refused = [], {}
    for bucket in m.buckets:
        ok = []
        for text in candidates:
            scheme, route = parse_label(text)
            text = label(scheme, route)
            err = m.errors.get((bucket.name, scheme))
            if scheme != "none" and text not in m.codecs:
                refused[(bucket.name, text)] = "codec cost not measured"
            elif scheme != "none" and err is None:
                refused[(bucket.name, text)] = "error not measured"
            elif scheme != "none" and not (math.isfinite(err) and err <= bound):
                refused[(bucket.name, text)] = f"error {err:.3g} > bound {bound:.3g}"
            else:
                ok.append(text)
        if "none:allreduce" not in ok:
            ok.insert(0, "none:allreduce")
        allowed.append(ok)
    return allowed, refused


# ---------------------------------------------------------------- the timeline

def _run(start, phase, busy_until):
    """End of a collective that starts at `start`: busy pace until `busy_until`, idle after."""
    busy, idle = phase
    if start + busy <= busy_until:
        return start + busy
    if start >= busy_until:
        return start + idle
    return busy_until + (1 - (busy_until - start) / busy) * idle


def _stolen(start, end, cpu, busy_until):
    """What a collective running from `start` to `end` takes from backward (which runs until
    `busy_until`): its CPU cost, in the share of its run that overlaps backward."""
    if cpu <= 0 or start >= busy_until:
        return 0.0
    if end <= busy_until or end <= start:
        return cpu
    return cpu * (busy_until - start) / (end - start)


def _advance(state, bucket, opt, backward_s):
    """One bucket through the fold: (E, Q, P, D) -> the next (see the module docstring)."""
    E, Q, P, D = state
    E += opt.enc
    clock = max(Q, bucket.ready_s + E)
    busy_until = backward_s + E
    for k, phase in enumerate(opt.phases):
        if k:
            clock += opt.mid
        clock = _run(clock, phase, busy_until)
    return (E, clock, max(P, clock) + opt.dec, D + opt.dec), clock


def _finish(state, backward_s):
    E, _, P, D = state
    return max(backward_s + E + D, P)


@dataclass(frozen=True)
class Timeline:
    """A plan's predicted step and, per bucket, when it leaves and when its exchange is done
    (seconds from backward's start); its loss, as the search counts it (bytes x measured
    error, summed over buckets; NaN where an error was not measured)."""

    step_s: float
    backward_end_s: float
    leaves_s: tuple
    done_s: tuple
    loss: float = 0.0
    stolen_s: tuple = ()     # backward's time the collectives' CPU took before each bucket's
                             # hook, then in all
    applied_s: tuple = ()    # when each bucket is decoded and applied (the waiting schedule:
                             # in step(); overlap: when the next forward needs it)


def _options(m, plan, candidates=None):
    order = {t: i for i, t in enumerate(candidates or DEFAULT_CANDIDATES)}
    return [_option(m, b, label(*parse_label(t)), order.get(label(*parse_label(t)), len(order)))
            for b, t in zip(m.buckets, plan)]


def predict(m: Measurements, plan) -> Timeline:
    """The predicted step of `plan` (a label per bucket, 'bit8:allgather' or 'bit8'), whether
    or not the accuracy guard would allow it (fixed schemes are predicted as they are)."""
    plan = tuple(plan)
    if len(plan) != len(m.buckets):
        raise ValueError(f"a plan needs one scheme per bucket: {len(m.buckets)}, got {len(plan)}")
    return _timeline(m, _options(m, plan))


def _timeline(m, opts):
    """The plan's step, event by event, as the plugin runs it (module docstring, "A later
    phase"): a bucket's first collective is queued at its hook; a later phase is queued by the
    first hook after the phase before it ended (after that hook's own bucket), its middle
    reduce in that hook, on backward's thread; from backward's end on, as soon as the phase
    before it ends; Horovod's thread runs the queue in order; step() decodes bucket by bucket."""
    E = Q = stolen = 0.0
    leaves, done, pending = [], [0.0] * len(opts), []      # pending: (bucket, phase, ended)
    before = []
    chunked = None       # overlap: a bucket whose chunks are on the wire [index, grid, piece, end]
    ahead = 0.0          # when the buckets that went ahead of its chunks are done
    for j, (bucket, opt) in enumerate(zip(m.buckets, opts)):
        before.append(stolen)
        E += opt.enc
        hook = bucket.ready_s + E
        jumps = chunked is not None and chunked[3] > hook and opt.chunks <= 1
        if jumps:        # in after the chunk on the wire and the one handed next (sender.DEPTH)
            i, grid, piece, end = chunked
            boundary = grid + piece * max(1, math.ceil((hook - grid) / piece - 1e-9))
            leaves.append(max(hook, ahead, min(end, boundary + piece)))
            jumps = leaves[-1] < end
            if not jumps:
                leaves.pop()
        if jumps:
            mine_end = ahead = _run(leaves[-1], opt.phases[0], m.backward_s + E)
            shift = mine_end - leaves[-1]
            chunked = [i, grid + shift, piece, end + shift]
            Q = done[i] = end + shift
        else:
            leaves.append(max(Q, hook))
            Q = mine_end = _run(leaves[-1], opt.phases[0], m.backward_s + E)
            if opt.chunks > 1:
                chunked = [j, leaves[-1], (Q - leaves[-1]) / opt.chunks, Q]
                ahead = leaves[-1]
        took = _stolen(leaves[-1], mine_end, opt.cpu[0], m.backward_s + E)
        E, stolen = E + took, stolen + took
        mine, still = (j, 1, mine_end), []
        for i, k, ended in pending:
            if ended > hook:
                still.append((i, k, ended))
                continue
            E += opts[i].mid
            began = max(Q, bucket.ready_s + E)
            Q = _run(began, opts[i].phases[k], m.backward_s + E)
            took = _stolen(began, Q, opts[i].cpu[k], m.backward_s + E)
            E, stolen = E + took, stolen + took
            still.append((i, k + 1, Q))
        pending = [p for p in still + [mine] if p[1] < len(opts[p[0]].phases)]
        for i, k, ended in still + [mine]:
            if k == len(opts[i].phases):
                done[i] = ended
    backward_end = clock = m.backward_s + E
    applied = [0.0] * len(opts)
    if m.needed_s is not None:        # step() returns; the next forward waits per bucket
        t = _across_boundary(m.needed_s, opts, done, pending, Q, backward_end, applied)
        return Timeline(m.fixed_s + t, backward_end, tuple(leaves), tuple(done),
                        sum(o.loss for o in opts), tuple(before) + (stolen,), tuple(applied))
    while pending:                    # step(): each later phase as soon as the one before ends
        pending.sort(key=lambda p: p[2])
        i, k, ended = pending.pop(0)
        clock = max(clock, ended) + opts[i].mid
        Q = _run(max(Q, clock), opts[i].phases[k], backward_end)
        if k + 1 < len(opts[i].phases):
            pending.append((i, k + 1, Q))
        else:
            done[i] = Q
    t = clock                         # step() decodes bucket by bucket, then returns
    for i, (opt, d) in enumerate(zip(opts, done)):
        t = applied[i] = max(t, d) + opt.dec
    return Timeline(m.fixed_s + t, backward_end, tuple(leaves), tuple(done),
                    sum(o.loss for o in opts), tuple(before) + (stolen,), tuple(applied))


def _across_boundary(needed, opts, done, pending, Q, backward_end, applied):
    """schedule="overlap": step() returns at backward's end; the next forward reaches bucket
    i's first need `needed[i]` later, plus every wait before it, then waits for its exchange
    and decodes it. A later phase (two-phase) is launched where the optimizer looks at the
    pending exchanges: at step() and at each need (its middle reduce on the main thread), and
    a bucket's own, waited for, where it is needed. Returns the step's time as the waiting
    fold counts it (from backward's start, `fixed_s` not included): the forward's own time is
    in fixed_s, so what the exchange adds is the lag it leaves. Fills `done` and `applied`."""
    pending = list(pending)

    def launch(i, k, now, Q):
        now += opts[i].mid
        Q = _run(max(Q, now), opts[i].phases[k], backward_end)
        if k + 1 < len(opts[i].phases):
            pending.append((i, k + 1, Q))
        else:
            done[i] = Q
        return now, Q

    def progress(now, Q):
        while True:
            ready = sorted((p for p in pending if p[2] <= now), key=lambda p: (p[2], p[0]))
            if not ready:
                return now, Q
            pending.remove(ready[0])
            now, Q = launch(*ready[0][:2], now, Q)

    now, Q = progress(backward_end, Q)
    lag = now - backward_end
    for i in sorted(range(len(opts)), key=lambda i: (needed[i], i)):
        now, Q = progress(backward_end + needed[i] + lag, Q)
        while any(p[0] == i for p in pending):          # its own later phases, waited for
            p = next(p for p in pending if p[0] == i)
            pending.remove(p)
            now, Q = launch(i, p[1], max(now, p[2]), Q)
        now = applied[i] = max(now, done[i]) + opts[i].dec
        lag = now - backward_end - needed[i]
    return backward_end + lag


def fixed_plan(m: Measurements, text: str):
    """Every bucket on one scheme and route: the plan of a fixed choice."""
    return (label(*parse_label(text)),) * len(m.buckets)


# ---------------------------------------------------------------- the search

@dataclass(frozen=True)
class Plan:
    """The chosen plan: a label per bucket, its predicted step, the fastest predicted step of
    any allowed plan, how many plans or plan prefixes the search kept at most (its front: every
    plan, where it predicted them all), the reasons candidates were refused, and whether the
    plan is proven the best on the model (every plan predicted, or the DP's front within
    MAX_FRONT and no later phase allowed)."""

    buckets: tuple
    schemes: tuple
    predicted_s: float
    fastest_s: float
    loss: float
    front: int
    refused: dict
    exact: bool = True

    def as_dict(self):
        return {"buckets": list(self.buckets), "schemes": list(self.schemes),
                "predicted_s": self.predicted_s, "fastest_s": self.fastest_s,
                "front": self.front, "exact": self.exact,
                "refused": {f"{b} {t}": r for (b, t), r in sorted(self.refused.items())}}


class Ranked(NamedTuple):
    """A whole plan as the search ranks it: its predicted step, its loss (bytes x measured
    error, summed), each bucket's index in the candidate order, and its labels. Two orders,
    both ending in the indices so that every rank breaks a tie alike (the candidates run
    from the least lossy, so the earlier is also the safer):

    by_speed()  step, loss, indices: the fastest first; how the search improves a plan and
                which plans it starts from (_improve)
    by_loss()   loss, step, indices: among the plans within the tie margin of the fastest,
                the least lossy, then the faster (_choose): the margin admits plans the model
                cannot tell apart, and the less lossy of them costs no measured time
    """
    step_s: float
    loss: float
    indices: tuple
    labels: tuple

    def by_speed(self):
        return (self.step_s, self.loss, self.indices)

    def by_loss(self):
        return (self.loss, self.step_s, self.indices)


def _choose(finals, margin):
    """The least lossy of the plans within `margin` of the fastest; then the faster; then the
    earlier in the candidate order, bucket by bucket (Ranked.by_loss). finals: [Ranked]."""
    fastest = min(f.step_s for f in finals)
    tied = [f for f in finals if f.step_s <= fastest * (1 + margin)]
    return min(tied, key=Ranked.by_loss), fastest


def search(m: Measurements, candidates=DEFAULT_CANDIDATES, bound=ERROR_BOUND,
           margin=TIE_MARGIN, exhaustive_plans=None) -> Plan:
    """The plan with the smallest predicted step, or, among those within `margin` of it, the
    least lossy (sum over buckets of bytes x measured error). Up to EXHAUSTIVE_PLANS allowed
    plans (`exhaustive_plans`): every one predicted, exact. Beyond, a Pareto-front DP over the
    buckets in launch order on the fold (module docstring; exact where no allowed option has a
    later phase, which the fold alone times as the timeline does), in two passes: the fastest
    step T* (state E, Q, P, D), then the least lossy plan within (1 + margin) T* (the loss a
    fifth component), each dropping a prefix whose step can only end above its limit; its
    final plans, every fixed plan and each of them with its later-phase buckets on the same
    scheme's allgather are then predicted on the timeline, which chooses."""
    if not 0 <= margin < 1:
        raise ValueError(f"tie margin must be in [0, 1), got {margin!r}")
    allowed, refused = candidates_for(m, candidates, bound)
    limit = EXHAUSTIVE_PLANS if exhaustive_plans is None else exhaustive_plans
    if math.prod(len(a) for a in allowed) <= limit:
        return exhaustive(m, candidates, bound, margin)
    order = {label(*parse_label(t)): i for i, t in enumerate(candidates)}
    opts = [[_option(m, b, t, order.get(t, len(order))) for t in texts]
            for b, texts in zip(m.buckets, allowed)]
    indices = sorted({o.index for per in opts for o in per})
    fixed = [[next((o for o in per if o.index == i), per[0]) for per in opts] for i in indices]
    upper = min(_fold(m, f) for f in fixed)      # the best plan taking one scheme everywhere
    finals, w1, exact1 = _front(m, opts, upper * (1 + 1e-12), with_loss=False)
    fastest = min([f.step_s for f in finals] + [upper])
    finals2, w2, exact2 = _front(m, opts, fastest * (1 + margin) * (1 + 1e-12), with_loss=True)
    # the fold times neither a waiting later phase nor the collectives' CPU, nor the next
    # forward's needs (schedule="overlap")
    phased = m.needed_s is not None or any(len(o.phases) > 1 or any(o.cpu)
                                           for per in opts for o in per)
    by_label = [{o.label: o for o in per} for per in opts]
    shortlist = {tuple(f.indices) for f in finals + finals2} | {tuple(o.index for o in f)
                                                                for f in fixed}
    rows = {}
    for idx in sorted(shortlist):
        chosen = [next(o for o in per if o.index == i) for per, i in zip(opts, idx)]
        for plan in (chosen, [_one_phase(o, labels) for o, labels in zip(chosen, by_label)]):
            key = tuple(o.label for o in plan)
            if key not in rows:
                t = _timeline(m, plan)
                rows[key] = Ranked(t.step_s, t.loss, tuple(o.index for o in plan), key)
    if phased:
        _improve(m, opts, rows)
    best, fastest = _choose(list(rows.values()), margin)
    return Plan(tuple(b.name for b in m.buckets), best.labels, best.step_s, fastest, best.loss,
                max(w1, w2), refused, exact1 and exact2 and not phased)


def _improve(m, opts, rows):
    """Where the fold and the timeline differ (a later phase waits for a hook), the fold's best
    need not be the timeline's: from each of the IMPROVE_STARTS fastest plans found, move one
    bucket at a time to another option while that makes the predicted step shorter, for at
    most IMPROVE_PLANS plans predicted (every plan tried is added to `rows`: {labels: Ranked})."""
    by_index = [{o.index: o for o in per} for per in opts]
    budget = IMPROVE_PLANS
    for start in sorted(rows.values(), key=Ranked.by_speed)[:IMPROVE_STARTS]:
        current, better = start, True
        while better and budget > 0:
            better = False
            for i, per in enumerate(opts):
                for o in per:
                    key = current.labels[:i] + (o.label,) + current.labels[i + 1:]
                    if key not in rows:
                        if budget <= 0:
                            return
                        budget -= 1
                        idx = current.indices[:i] + (o.index,) + current.indices[i + 1:]
                        t = _timeline(m, [by_index[j][x] for j, x in enumerate(idx)])
                        rows[key] = Ranked(t.step_s, t.loss, idx, key)
                    if rows[key].by_speed() < current.by_speed():
                        current, better = rows[key], True


def _one_phase(opt, options):
    """The same scheme by allgather, where `opt` has a later phase and that is allowed."""
    if len(opt.phases) < 2:
        return opt
    return options.get(label(parse_label(opt.label)[0], "allgather"), opt)


def _fold(m, opts):
    state = (0.0, 0.0, 0.0, 0.0)
    for bucket, opt in zip(m.buckets, opts):
        state, _ = _advance(state, bucket, opt, m.backward_s)
    return m.fixed_s + _finish(state, m.backward_s)


def _front(m, opts, limit, with_loss):
    """The DP: [Ranked] of the plans left on the final front, and the
    widest front. A prefix whose step must end above `limit` is dropped: what is left can only
    add, at least the cheapest remaining encodes and decodes (backward's end, the decode
    fold); with_loss=False keeps loss out of the dominance test (the first pass)."""
    rest_enc = [0.0] * (len(opts) + 1)
    rest_dec = [0.0] * (len(opts) + 1)
    for i in range(len(opts) - 1, -1, -1):
        rest_enc[i] = rest_enc[i + 1] + min(o.enc for o in opts[i])
        rest_dec[i] = rest_dec[i + 1] + min(o.dec for o in opts[i])
    front = {(0.0, 0.0, 0.0, 0.0, 0.0): ((), (), 0.0)}
    widest, exact = 1, True
    for i, (bucket, per) in enumerate(zip(m.buckets, opts)):
        grown = {}
        for key in sorted(front):                       # a fixed order: deterministic ties
            idx, labels, loss = front[key]
            for opt in per:
                state, _ = _advance(key[:4], bucket, opt, m.backward_s)
                E, _, P, D = state
                least = max(m.backward_s + E + D + rest_enc[i + 1] + rest_dec[i + 1],
                            P + rest_dec[i + 1])
                if m.fixed_s + least > limit:
                    continue
                new = state + ((loss + opt.loss) if with_loss else 0.0,)
                plan = (idx + (opt.index,), labels + (opt.label,), loss + opt.loss)
                if new not in grown or plan[0] < grown[new][0]:
                    grown[new] = plan
        front = _pareto(grown)
        widest = max(widest, len(front))
        if len(front) > MAX_FRONT:
            exact = False
            lower = {k: (max(m.backward_s + k[0] + k[3] + rest_enc[i + 1] + rest_dec[i + 1],
                             k[2] + rest_dec[i + 1]), k[4], front[k][0]) for k in front}
            front = {k: front[k] for k in sorted(front, key=lower.get)[:MAX_FRONT]}
    return [Ranked(m.fixed_s + _finish(k[:4], m.backward_s), loss, idx, labels)
            for k, (idx, labels, loss) in sorted(front.items())], widest, exact


def _pareto(states):
    """Drop every state that another is no better than in any component (plans kept with it).
    Sorted first, so a state can only be dominated by one before it; NumPy compares a state
    with all kept ones at once."""
    keys = sorted(states)
    if not keys:
        return {}
    kept = np.empty((len(keys), len(keys[0])))
    count = 0
    out = {}
    for k in keys:
        row = np.asarray(k)
        if count and np.any(np.all(kept[:count] <= row, axis=1)):
            continue
        kept[count] = row
        count += 1
        out[k] = states[k]
    return out


def exhaustive(m: Measurements, candidates=DEFAULT_CANDIDATES, bound=ERROR_BOUND,
               margin=TIE_MARGIN) -> Plan:
    """Every allowed plan, predicted one by one: what `search` does up to EXHAUSTIVE_PLANS
    plans, and the reference its DP is tested against."""
    import itertools
    allowed, refused = candidates_for(m, candidates, bound)
    order = {label(*parse_label(t)): i for i, t in enumerate(candidates)}
    finals = []
    options = [{t: _option(m, b, t, order.get(t, len(order))) for t in texts}
               for b, texts in zip(m.buckets, allowed)]
    for labels in itertools.product(*allowed):
        t = _timeline(m, [per[x] for per, x in zip(options, labels)])
        finals.append(Ranked(t.step_s, t.loss, tuple(order.get(x, len(order)) for x in labels),
                             labels))
    best, fastest = _choose(finals, margin)
    return Plan(tuple(b.name for b in m.buckets), best.labels, best.step_s, fastest, best.loss,
                len(finals), refused)


# ---------------------------------------------------------------- re-planning

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


# ---------------------------------------------------------------- fitting codec costs

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



# ---------------------------------------------------------------- fitting the links

# s/byte: 100 GB/s, a memory copy's pace; the least a fitted link's beta is taken at.
BETA_FLOOR = 1e-11


def fit_links(rows):
    """{collective: costmodel.fit.Fit} from timed collectives, rows of (collective, n, bytes,
    seconds), bytes as fit.py defines them: what a job fits to the collectives it timed. The
    runtime reaches the cost model through here only (tests/test_import_graph.py). Raises
    costmodel.fit.FitError (a ValueError) where the rows cannot determine a link."""
    measurements = link_fit.measurements_from_rows(
        [{"collective": c, "n": n, "bytes": b, "seconds": s} for c, n, b, s in rows],
        source="timed collectives")
    fits = {c: link_fit.fit(measurements, c) for c in sorted({m.collective for m in measurements})}
    for f in fits.values():
        if f.beta <= 0:
            # The sizes timed could not resolve a cost per byte (the larger message no slower
            # than the smaller, within noise): bytes that cost nothing measurable there are
            # taken at memory-copy pace, never free (a link needs beta > 0).
            f.beta, f.clamped = BETA_FLOOR, "beta"
    return fits
