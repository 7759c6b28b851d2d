"""The plan with the smallest predicted step: three searches on the timeline (timeline.py), the
same plan on every rank from the same measurements (docs/planner.md, "The search"). Pure: no
torch, no Horovod.

    exhaustive   every allowed plan predicted, up to EXHAUSTIVE_PLANS of them: exact
    _front       beyond, a DP over the buckets on the fold, keeping a Pareto front
    _improve     then, where the fold and the timeline differ, the timeline improves the DP's
                 plans one bucket at a time

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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..registry import label, parse_label
from .candidates import DEFAULT_CANDIDATES, ERROR_BOUND, candidates_for
from .measurements import Measurements
from .options import option
from .timeline import advance, finish, fold, simulate

__all__ = ["TIE_MARGIN", "MAX_FRONT", "EXHAUSTIVE_PLANS", "Plan", "Ranked", "search",
           "exhaustive"]

# Plans predicted within this fraction of the fastest are tied, the least lossy taken: small,
# since the model's gaps between plans are smaller than the measured ones (a wide margin hands
# the step to a slower, less lossy plan the model cannot tell apart).
TIE_MARGIN = 0.005
# The most plan prefixes the DP keeps per bucket: exact below it (tests/test_planner.py holds it
# to brute force), a beam above, which the plan then says.
MAX_FRONT = 128
# Up to this many allowed plans every one is predicted on the timeline (6 candidates on 5
# buckets: 7,776, a fraction of a second in pure Python); beyond, the DP shortlists.
EXHAUSTIVE_PLANS = 8192
# Then the timeline improves the IMPROVE_STARTS fastest shortlisted plans one bucket at a time,
# at most IMPROVE_PLANS predicted: several starts, since one bucket moved at a time from a
# single start can stop at a plan no single move improves though another plan is faster
# (tests/test_planner.py holds the result to the exhaustive optimum on random instances).
IMPROVE_STARTS = 16
IMPROVE_PLANS = 2000


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
    buckets in launch order on the fold (the module docstring; exact where no allowed option
    has a later phase, which the fold alone times as the timeline does), in two passes: the fastest
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
    opts = [[option(m, b, t, order.get(t, len(order))) for t in texts]
            for b, texts in zip(m.buckets, allowed)]
    indices = sorted({o.index for per in opts for o in per})
    fixed = [[next((o for o in per if o.index == i), per[0]) for per in opts] for i in indices]
    upper = min(fold(m, f) for f in fixed)      # the best plan taking one scheme everywhere
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
                t = simulate(m, plan)
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
                        t = simulate(m, [by_index[j][x] for j, x in enumerate(idx)])
                        rows[key] = Ranked(t.step_s, t.loss, idx, key)
                    if rows[key].by_speed() < current.by_speed():
                        current, better = rows[key], True


def _one_phase(opt, options):
    """The same scheme by allgather, where `opt` has a later phase and that is allowed."""
    if len(opt.phases) < 2:
        return opt
    return options.get(label(parse_label(opt.label)[0], "allgather"), opt)


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
                state, _ = advance(key[:4], bucket, opt, m.backward_s)
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
    return [Ranked(m.fixed_s + finish(k[:4], m.backward_s), loss, idx, labels)
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
    options = [{t: option(m, b, t, order.get(t, len(order))) for t in texts}
               for b, texts in zip(m.buckets, allowed)]
    for labels in itertools.product(*allowed):
        t = simulate(m, [per[x] for per, x in zip(options, labels)])
        finals.append(Ranked(t.step_s, t.loss, tuple(order.get(x, len(order)) for x in labels),
                             labels))
    best, fastest = _choose(finals, margin)
    return Plan(tuple(b.name for b in m.buckets), best.labels, best.step_s, fastest, best.loss,
                len(finals), refused)

