"""A plan's step on the exchange's timeline: when each bucket leaves, when its exchange is done,
when step() (or the next forward) has it applied. Pure: no torch, no Horovod.

Per step, times from the start of backward (a plan changes nothing before it):

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

That is the fold (`advance`, `finish`, `fold`): the search's DP runs on it (search.py), exact
where no option has a later phase.

A later phase (a two-phase bucket's allgather) is where that fold and the plugin differ
(under schedule="overlap" it is launched where the optimizer looks at its pending buckets:
at step() and where the next forward needs one): the plugin launches it from the first
gradient hook after the phase before it ended (after that hook's own bucket has been launched;
its middle reduce runs in the hook, on backward's thread) or, from backward's end on, as soon
as that phase ends. `predict` times every plan so, event by event (`simulate`).

The collectives' CPU: Horovod's thread sums what it receives (a float16 sum on a CPU is a
software conversion each way, so Horovod's fp16 allreduce costs more CPU than float32's for
half the bytes). Where the compute threads fill the cores, that CPU is taken from backward: a
collective's `cpu` (its measured CPU seconds x Measurements.cpu_share) is added to backward's
end and to every later hook, in the share of its run that overlaps backward. The fold leaves
it out; the timeline, which chooses, has it.

Across the step boundary (schedule="overlap"; `Measurements.needed_s`): step() returns at
backward's end B' and the next forward runs on; bucket i is first needed `needed_i` after
that (its pace measured as backward's is: the forward's pre-hooks, waits taken out), so in
order of need

    at_i = max(B' + needed_i + lag, Q_i) + dec_i,   lag = at_i - B' - needed_i   (lag_0: 0)
    step = fixed_s + B' + lag                        the forward is in fixed_s; only its waits add

With every need 0 and one collective a bucket this is the waiting fold (a later phase waits
for the optimizer to look: at step() and at each need). A bucket the next forward needs late
hides its exchange behind the forward's first layers, which the waiting schedule cannot.

Priority on the wire (overlap only; `Measurements.chunks`): a bucket its route cuts into c
chunks runs as c equal pieces, handed to Horovod two at a time; a bucket launched later, while
they run, goes in after the piece on the wire and the next one, and pushes the rest back by
its own time.

A collective that runs while backward still computes takes the busy link's pace; after
backward's end (as far as it is known at its launch, `backward_s` plus the encodes so far) the
idle link's, where one was measured; a collective across that moment does the rest at idle pace
(as costmodel.methods.exchange_seconds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..registry import label, parse_label
from .measurements import Measurements
from .options import plan_options

__all__ = ["Timeline", "predict", "fixed_plan", "simulate", "advance", "finish", "fold"]


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


def advance(state, bucket, opt, backward_s):
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


def finish(state, backward_s):
    """The fold's t, fixed_s not included: the last decode, or backward's end plus every
    decode where the decodes start only then."""
    E, _, P, D = state
    return max(backward_s + E + D, P)


def fold(m, opts):
    """The plan's step on the fold alone (no later phase waits, no CPU taken, no next forward)."""
    state = (0.0, 0.0, 0.0, 0.0)
    for bucket, opt in zip(m.buckets, opts):
        state, _ = advance(state, bucket, opt, m.backward_s)
    return m.fixed_s + finish(state, m.backward_s)


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


def predict(m: Measurements, plan) -> Timeline:
    """The predicted step of `plan` (a label per bucket, 'bit8:allgather' or 'bit8'), whether
    or not the accuracy guard would allow it (fixed schemes are predicted as they are)."""
    plan = tuple(plan)
    if len(plan) != len(m.buckets):
        raise ValueError(f"a plan needs one scheme per bucket: {len(m.buckets)}, got {len(plan)}")
    return simulate(m, plan_options(m, plan))


def simulate(m, opts):
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

