"""The planner (hvd_compress/auto/planner.py, the entry of timeline.py, search.py, candidates.py,
replan.py...): its timeline, its search against brute force, the accuracy guard, determinism,
the re-plan rule, the codec-cost fit (costmodel/affine.py). Pure: no torch, no Horovod."""
import math
import random

import pytest

from hvd_compress.auto import planner as pl
from hvd_compress.costmodel import methods
from hvd_compress.costmodel.fit import Fit
from hvd_compress.costmodel.model import Link
from hvd_compress.registry import parse_label

pytestmark = pytest.mark.unit

MiB = 1 << 20
FREE = pl.CodecCost()


def link(rate_bit_s, alpha=1e-3):
    return Link.from_bandwidth(alpha, rate_bit_s / 8)


def same_link(l):
    return {c: l for c in ("allreduce", "allreduce_fp16", "allgather", "alltoall")}


def codecs(enc_b=1e-9, dec_b=1e-9, a=1e-4):
    cost = pl.CodecCost(pl.Affine(a, enc_b), pl.Affine(a, dec_b))
    return {t: cost for t in pl.DEFAULT_CANDIDATES if t != "none:allreduce"}


def errors(buckets, err=0.03):
    return {(b.name, s): err for b in buckets for s in ("fp16", "bit16", "bit8")}


def measurements(buckets, backward_s, l, n=2, **kw):
    kw.setdefault("codecs", codecs())
    kw.setdefault("errors", errors(buckets))
    return pl.Measurements(n, buckets, backward_s, same_link(l), **kw)


# ---------------------------------------------------------------- the timeline

def test_one_bucket_on_free_codecs_is_backward_then_its_exchange():
    b = [pl.Bucket("b0", 4 * MiB, 0.010)]
    l = link(100e6, 0.0)
    m = measurements(b, 0.010, l, codecs={}, fixed_s=0.005)
    t = pl.predict(m, ["none"])
    wire = methods.COLLECTIVE_COSTS["allreduce"](2, 4 * MiB).seconds(l)
    assert t.step_s == pytest.approx(0.005 + 0.010 + wire)
    assert t.leaves_s == (0.010,) and t.done_s[0] == pytest.approx(0.010 + wire)


def test_an_exchange_hidden_behind_backward_costs_nothing():
    # the first bucket leaves at 1 ms and is done long before backward ends at 1 s
    b = [pl.Bucket("early", 64 * 1024, 0.001), pl.Bucket("last", 64 * 1024, 1.0)]
    m = measurements(b, 1.0, link(1e9), codecs={})
    t = pl.predict(m, ["none", "none"])
    assert t.done_s[0] < 1.0
    last_only = measurements(b[1:], 1.0, link(1e9), codecs={})
    assert t.step_s == pytest.approx(pl.predict(last_only, ["none"]).step_s)


def test_encode_delays_backward_and_every_later_bucket():
    b = [pl.Bucket("b0", 4 * MiB, 0.0), pl.Bucket("b1", 4 * MiB, 0.020)]
    enc = pl.CodecCost(encode=pl.Affine(0.003, 0.0))
    m = measurements(b, 0.030, link(10e9, 0.0), codecs={"bit8:allgather": enc})
    t = pl.predict(m, ["bit8:allgather", "bit8:allgather"])
    assert t.backward_end_s == pytest.approx(0.036)
    assert t.leaves_s[1] == pytest.approx(0.026)           # ready 20 ms + both encodes


def test_the_queue_runs_one_collective_at_a_time():
    # both ready at 0: the second waits for the first
    b = [pl.Bucket("a", 4 * MiB, 0.0), pl.Bucket("b", 4 * MiB, 0.0)]
    l = link(100e6, 0.0)
    m = measurements(b, 0.0, l, codecs={})
    t = pl.predict(m, ["none", "none"])
    wire = methods.COLLECTIVE_COSTS["allreduce"](2, 4 * MiB).seconds(l)
    assert t.leaves_s[1] == pytest.approx(wire) and t.step_s == pytest.approx(2 * wire)


def test_decode_waits_for_backward_and_for_its_bucket():
    b = [pl.Bucket("a", 1024, 0.0)]
    dec = pl.CodecCost(decode=pl.Affine(0.002, 0.0))
    m = measurements(b, 0.050, link(10e9, 0.0), codecs={"bit8:allgather": dec})
    assert pl.predict(m, ["bit8"]).step_s == pytest.approx(0.052)


def test_the_wire_bytes_are_the_cost_models():
    for scheme, route in (("bit8", "allgather"), ("bit16", "alltoall"), ("none", None)):
        units = pl.wire_units(scheme, route, 300_000, 4)
        assert units == methods.exchange_units(scheme, [(300_000,)], 4,
                                               route=route or "allreduce")[0]


def test_a_fit_object_serves_as_a_link():
    f = Fit("allreduce", alpha=1e-3, beta=1e-8, r2=1.0)
    b = [pl.Bucket("a", 4 * MiB, 0.0)]
    m1 = pl.Measurements(2, b, 0.0, {"allreduce": f})
    m2 = pl.Measurements(2, b, 0.0, {"allreduce": Link(1e-3, 1e-8)})
    assert pl.predict(m1, ["none"]) == pl.predict(m2, ["none"])


def test_idle_link_after_backward():
    b = [pl.Bucket("a", 4 * MiB, 0.0)]
    busy, idle = link(100e6, 0.0), link(1e9, 0.0)
    m = pl.Measurements(2, b, 0.0, same_link(busy), links_idle=same_link(idle))
    wire_idle = methods.COLLECTIVE_COSTS["allreduce"](2, 4 * MiB).seconds(idle)
    assert pl.predict(m, ["none"]).step_s == pytest.approx(wire_idle)


def phase_seconds(scheme, route, nbytes, n, l):
    return [methods.COLLECTIVE_COSTS[c](n, b).seconds(l)
            for c, b in pl.wire_units(scheme, route, nbytes // 4, n)]


def test_a_later_phase_waits_for_the_next_hook_and_queues_after_that_hooks_bucket():
    # "a": two-phase, its alltoall ends long before "b" is ready: the plugin launches the
    # allgather from b's hook (ready 50 ms + both encodes), after b's own first collective
    b = [pl.Bucket("a", 4 * MiB, 0.0), pl.Bucket("b", 4 * MiB, 0.050)]
    l = link(1e9, 0.0)
    cost = pl.CodecCost(encode=pl.Affine(0.001, 0.0), reduce=pl.Affine(0.002, 0.0))
    m = measurements(b, 0.100, l, n=4, codecs={"bit8:alltoall": cost,
                                               "bit8:allgather": pl.CodecCost()})
    a2a, ag = phase_seconds("bit8", "alltoall", 4 * MiB, 4, l)
    (b_ag,) = phase_seconds("bit8", "allgather", 4 * MiB, 4, l)
    assert 0.001 + a2a < 0.050                      # a's first phase ends before b's hook
    t = pl.predict(m, ["bit8:alltoall", "bit8:allgather"])
    hook = 0.050 + 0.001                            # b's ready time plus a's encode
    assert t.leaves_s == (pytest.approx(0.001), pytest.approx(hook))
    assert t.done_s[1] == pytest.approx(hook + b_ag)
    # a's middle reduce runs in that hook, on backward's thread: backward ends 2 ms later
    assert t.backward_end_s == pytest.approx(0.100 + 0.001 + 0.002)
    assert t.done_s[0] == pytest.approx(max(hook + b_ag, hook + 0.002) + ag)


def test_after_backward_a_later_phase_follows_at_once():
    # one two-phase bucket ready as backward ends: no hook is left, step() launches the
    # allgather as soon as the alltoall ends (plus the middle reduce)
    b = [pl.Bucket("a", 4 * MiB, 0.020)]
    l = link(100e6, 0.0)
    mid = pl.CodecCost(reduce=pl.Affine(0.003, 0.0))
    m = measurements(b, 0.020, l, n=4, codecs={"bit8:alltoall": mid})
    a2a, ag = phase_seconds("bit8", "alltoall", 4 * MiB, 4, l)
    t = pl.predict(m, ["bit8:alltoall"])
    assert t.done_s[0] == pytest.approx(0.020 + a2a + 0.003 + ag)
    assert t.step_s == pytest.approx(t.done_s[0])


def test_a_later_phase_without_a_later_hook_waits_for_backwards_end():
    # the only bucket's alltoall ends mid-backward: no hook comes, its allgather waits for
    # step() at backward's end, where the idle link runs it
    b = [pl.Bucket("a", 64 * 1024, 0.0)]
    l = link(1e9, 0.0)
    m = measurements(b, 0.200, l, n=4, codecs={"bit8:alltoall": FREE})
    a2a, ag = phase_seconds("bit8", "alltoall", 64 * 1024, 4, l)
    assert a2a < 0.200
    assert pl.predict(m, ["bit8:alltoall"]).done_s[0] == pytest.approx(0.200 + ag)


# ---------------------------------------------------------------- the search

def test_a_collectives_cpu_during_backward_delays_backward_in_its_overlap_only():
    # an early bucket's exchange hidden behind backward still takes its CPU from backward
    b = [pl.Bucket("early", 4 * MiB, 0.010), pl.Bucket("last", 1024, 0.100)]
    l = link(1e9, 0.0)
    cpu = {"allreduce": pl.Affine(0.001, 2e-9)}
    plain = measurements(b, 0.100, l, codecs={})
    t0 = pl.predict(plain, ["none", "none"])
    took = 2 * (0.001 + 2e-9 * 4 * MiB)                     # share 2: 4 threads on 2 cores
    t = pl.predict(measurements(b, 0.100, l, codecs={}, links_cpu=cpu, cpu_share=2.0),
                   ["none", "none"])
    assert t.backward_end_s == pytest.approx(0.100 + took)
    assert t.stolen_s == pytest.approx((0.0, took, took))
    assert t.leaves_s[1] == pytest.approx(0.100 + took)
    assert t.step_s == pytest.approx(t0.step_s + took)
    # no share (a core is free), or the collective after backward: nothing taken
    free = measurements(b, 0.100, l, codecs={}, links_cpu=cpu, cpu_share=0.0)
    assert pl.predict(free, ["none", "none"]) == t0
    late = [pl.Bucket("last", 4 * MiB, 0.100)]
    after = measurements(late, 0.100, l, codecs={}, links_cpu=cpu, cpu_share=2.0)
    assert pl.predict(after, ["none"]).step_s == pytest.approx(
        pl.predict(measurements(late, 0.100, l, codecs={}), ["none"]).step_s)
    # half of its run inside backward: half of its CPU
    wire = methods.COLLECTIVE_COSTS["allreduce"](2, 4 * MiB).seconds(l)
    half = [pl.Bucket("half", 4 * MiB, 0.100 - wire / 2), pl.Bucket("last", 1024, 0.100)]
    t = pl.predict(measurements(half, 0.100, l, codecs={}, links_cpu=cpu, cpu_share=2.0),
                   ["none", "none"])
    assert t.stolen_s[-1] == pytest.approx(took / 2, rel=1e-6)


def test_a_scheme_whose_sum_costs_the_cores_loses_the_hidden_bucket_to_a_cheaper_one():
    # fp16's exchange hides behind backward, but Horovod's float16 sum takes the cores
    # (results/collective-cpu: 17 ms a rank at 4 ranks); bit8 by allgather sums in the decode
    b = [pl.Bucket("fc1", 4 * MiB, 0.010), pl.Bucket("tail", 64 * 1024, 0.100)]
    l = link(1e9, 0.0)
    fast = codecs(enc_b=1e-10, dec_b=1e-10, a=1e-5)
    cheap_wire = measurements(b, 0.100, l, n=4, codecs=fast)
    assert pl.search(cheap_wire).schemes[0] == "none:allreduce"
    cpu = {"allreduce": pl.Affine(0.0, 1e-9), "allreduce_fp16": pl.Affine(0.0, 7e-9),
           "allgather": pl.Affine(0.0, 0.5e-9), "alltoall": pl.Affine(0.0, 0.5e-9)}
    costly = measurements(b, 0.100, l, n=4, codecs=fast, links_cpu=cpu, cpu_share=2.0)
    plan = pl.search(costly)
    assert plan.schemes[0].startswith(("bit8", "bit16")), plan.schemes
    fp16 = pl.predict(costly, ["fp16", plan.schemes[1]]).step_s
    assert plan.predicted_s < fp16


def test_slow_wire_compresses_the_exposed_tail_and_leaves_the_hidden_bucket_alone():
    # bucket 0 is ready at once and done long before backward's end; the last is ready at the end
    b = [pl.Bucket("early", 256 * 1024, 0.0), pl.Bucket("tail", 4 * MiB, 0.200)]
    m = measurements(b, 0.200, link(100e6))
    plan = pl.search(m)
    assert plan.schemes[0] == "none:allreduce"
    assert plan.schemes[1].startswith("bit8")
    assert plan.predicted_s < pl.predict(m, pl.fixed_plan(m, "none")).step_s


def test_fast_wire_and_costly_codec_keeps_float32():
    b = [pl.Bucket("a", 1 * MiB, 0.01), pl.Bucket("b", 1 * MiB, 0.02)]
    m = measurements(b, 0.02, link(100e9, 1e-5), codecs=codecs(enc_b=2e-9, dec_b=2e-9, a=3e-4))
    assert pl.search(m).schemes == ("none:allreduce", "none:allreduce")


def test_the_plan_is_never_predicted_slower_than_any_fixed_scheme():
    rng = random.Random(7)
    for _ in range(30):
        m = random_instance(rng, k=rng.randint(1, 6))
        plan = pl.search(m, margin=0.0)
        allowed, _ = pl.candidates_for(m)
        for text in pl.DEFAULT_CANDIDATES:
            if not all(text in ok for ok in allowed):      # the guard refuses it somewhere
                continue
            assert plan.predicted_s <= pl.predict(m, pl.fixed_plan(m, text)).step_s * (1 + 1e-12)


def random_instance(rng, k):
    t, buckets = 0.0, []
    for i in range(k):
        t += rng.choice([0.0, rng.uniform(0, 0.05)])
        buckets.append(pl.Bucket(f"b{i}", 4 * rng.randint(1, 1_500_000), t))
    backward = t + rng.uniform(0, 0.02)
    rate = rng.choice([10e6, 100e6, 1e9, 20e9])
    costs = {}
    for text in pl.DEFAULT_CANDIDATES[1:]:
        costs[text] = pl.CodecCost(pl.Affine(rng.uniform(0, 3e-4), rng.uniform(0, 3e-9)),
                                   pl.Affine(rng.uniform(0, 3e-4), rng.uniform(0, 3e-9)),
                                   pl.Affine(rng.uniform(0, 1e-4), rng.uniform(0, 1e-9)))
    errs = {(b.name, s): rng.choice([0.001, 0.02, 0.05, 0.2])
            for b in buckets for s in ("fp16", "bit16", "bit8")}
    links = {c: Link(rng.uniform(0, 2e-3), 8 / (rate * rng.uniform(0.5, 1.0)))
             for c in ("allreduce", "allreduce_fp16", "allgather", "alltoall")}
    idle = None
    if rng.random() < 0.5:
        idle = {c: Link(l.alpha * rng.uniform(0.2, 1.5), l.beta * rng.uniform(0.3, 1.5))
                for c, l in links.items()}
    return pl.Measurements(rng.choice([2, 3, 4, 8]), buckets, backward, links, costs, errs,
                           links_idle=idle, fixed_s=rng.uniform(0, 0.01))


ONE_PHASE = ("none:allreduce", "fp16:allreduce", "bit16:allgather", "bit8:allgather")


def test_a_few_buckets_are_searched_by_predicting_every_plan():
    m = random_instance(random.Random(5), k=3)
    plan, brute = pl.search(m), pl.exhaustive(m)
    assert plan == brute and plan.exact
    allowed, _ = pl.candidates_for(m)
    assert plan.front == math.prod(len(a) for a in allowed) <= pl.EXHAUSTIVE_PLANS


@pytest.mark.parametrize("seed", range(25))
def test_the_dp_finds_the_exhaustive_optimum_where_no_phase_waits(seed):
    # one-phase candidates: the fold is the timeline, so the DP is exact (forced here;
    # search() itself predicts every plan up to EXHAUSTIVE_PLANS)
    rng = random.Random(seed)
    m = random_instance(rng, k=rng.randint(3, 5))
    margin = rng.choice([0.0, pl.TIE_MARGIN, 0.1])
    dp = pl.search(m, ONE_PHASE, margin=margin, exhaustive_plans=0)
    brute = pl.exhaustive(m, ONE_PHASE, margin=margin)
    assert dp.fastest_s == pytest.approx(brute.fastest_s, rel=1e-12)
    assert (dp.predicted_s, dp.loss) == pytest.approx((brute.predicted_s, brute.loss), rel=1e-12)
    assert pl.predict(m, dp.schemes).step_s == pytest.approx(dp.predicted_s, rel=1e-12)
    assert dp.exact and dp.front <= brute.front    # it kept fewer prefixes than there are plans
    # a unique optimum: the very same plan. Another plan only at exactly the optimum's time,
    # a tie (brute's own plan predicts exactly that time, so the optimum was not unique):
    # asked without predicting every plan a second time (that doubled the test's time)
    assert pl.predict(m, brute.schemes).step_s == brute.predicted_s
    if dp.schemes != brute.schemes:
        assert pl.predict(m, dp.schemes).step_s == brute.predicted_s, (dp.schemes, brute.schemes)


@pytest.mark.parametrize("seed", range(25))
def test_the_dp_with_later_phases_finds_the_exhaustive_optimum_on_these_instances(seed):
    # two-phase candidates: the fold launches a later phase at once, the timeline at the next
    # hook, so the DP's plans are a shortlist the timeline re-ranks and improves bucket by
    # bucket: not proven (exact is False), but it found the optimum on 300 of 300 such
    # instances (docs/planner.md, "The search"); these 25 hold it to that
    rng = random.Random(seed)
    m = random_instance(rng, k=rng.randint(3, 5))
    margin = rng.choice([0.0, pl.TIE_MARGIN, 0.1])
    dp = pl.search(m, margin=margin, exhaustive_plans=0)
    brute = pl.exhaustive(m, margin=margin)
    assert pl.predict(m, dp.schemes).step_s == pytest.approx(dp.predicted_s, rel=1e-12)
    assert dp.fastest_s == pytest.approx(brute.fastest_s, rel=1e-12)
    assert (dp.predicted_s, dp.loss) == pytest.approx((brute.predicted_s, brute.loss), rel=1e-12)
    allowed, _ = pl.candidates_for(m)
    assert dp.exact is not any(
        len(pl.wire_units(*parse_label(t), 1, m.n)) > 1 for a in allowed for t in a)


def test_tens_of_buckets_like_a_real_backward_are_searched_exactly():
    # 30 buckets of 1 MB ready evenly through a 200 ms backward: the front stays small
    bs = [pl.Bucket(f"b{i}", 1_000_000, 0.2 * (i + 1) / 30) for i in range(30)]
    for rate, expect in ((10e6, "bit8:allgather"), (10e9, "none:allreduce")):
        m = measurements(bs, 0.2, link(rate), codecs=codecs(5e-10, 5e-10, 1e-4))
        plan = pl.search(m, ONE_PHASE)
        assert plan.exact and expect in plan.schemes
        if rate == 10e9:
            assert set(plan.schemes) == {"none:allreduce"}
        # with the two-phase routes too the timeline decides among the DP's plans: not proven
        plan = pl.search(m)
        assert not plan.exact and expect in plan.schemes


def test_a_wide_front_falls_back_to_a_beam_never_worse_than_a_fixed_plan():
    m = random_instance(random.Random(0), k=10)          # adversarial: every trade-off differs
    plan = pl.search(m, margin=0.0)
    assert not plan.exact and plan.front > pl.MAX_FRONT
    assert plan.predicted_s == pytest.approx(pl.predict(m, plan.schemes).step_s)
    allowed, _ = pl.candidates_for(m)
    for text in pl.DEFAULT_CANDIDATES:
        if all(text in ok for ok in allowed):
            assert plan.predicted_s <= pl.predict(m, pl.fixed_plan(m, text)).step_s


def test_margin_prefers_the_less_lossy_plan_within_it_only():
    # one bucket, the wire makes bit8 ~1% faster than bit16: inside 2% bit16 wins, at 0% bit8
    b = [pl.Bucket("a", 4 * MiB, 0.100)]                      # ready as backward ends
    m = measurements(b, 0.100, link(10e9, 0.0), codecs=codecs(enc_b=0, dec_b=0, a=0.0))
    t8 = pl.predict(m, ["bit8:allgather"]).step_s
    t16 = pl.predict(m, ["bit16:allgather"]).step_s
    assert t8 < t16 <= t8 * 1.02
    errs = {("a", "fp16"): 0.5, ("a", "bit16"): 1e-3, ("a", "bit8"): 0.03}
    m = measurements(b, 0.100, link(10e9, 0.0), codecs=codecs(enc_b=0, dec_b=0, a=0.0),
                     errors=errs)
    assert pl.search(m, margin=0.0).schemes == ("bit8:allgather",)
    assert pl.search(m, margin=0.02).schemes[0].startswith("bit16")


# ---------------------------------------------------------------- the accuracy guard

def test_a_scheme_over_the_error_bound_is_refused_and_said_why():
    b = [pl.Bucket("tail", 4 * MiB, 0.0)]
    errs = {("tail", "bit8"): 0.09, ("tail", "bit16"): 0.001, ("tail", "fp16"): 0.001}
    m = measurements(b, 0.0, link(10e6), errors=errs)
    plan = pl.search(m)
    assert not plan.schemes[0].startswith("bit8")
    assert "bound" in plan.refused[("tail", "bit8:allgather")]


def test_unmeasured_error_or_codec_means_float32():
    b = [pl.Bucket("tail", 4 * MiB, 0.0)]
    assert pl.search(measurements(b, 0.0, link(10e6), errors={})).schemes == ("none:allreduce",)
    assert pl.search(measurements(b, 0.0, link(10e6), codecs={})).schemes == ("none:allreduce",)
    nan = {("tail", s): math.nan for s in ("fp16", "bit16", "bit8")}
    assert pl.search(measurements(b, 0.0, link(10e6), errors=nan)).schemes == ("none:allreduce",)


# ---------------------------------------------------------------- determinism, bad input

def test_same_measurements_same_plan_whatever_the_dict_order():
    rng = random.Random(11)
    m = random_instance(rng, k=6)
    shuffled = pl.Measurements(m.n, m.buckets, m.backward_s,
                               dict(reversed(list(m.links.items()))),
                               dict(reversed(list(m.codecs.items()))),
                               dict(reversed(list(m.errors.items()))),
                               links_idle=m.links_idle, fixed_s=m.fixed_s)
    assert pl.search(m) == pl.search(shuffled) == pl.search(m)


def test_exact_ties_go_to_the_first_candidate():
    b = [pl.Bucket("a", 4, 0.0)]
    free = {t: FREE for t in pl.DEFAULT_CANDIDATES}
    zero = {("a", s): 0.0 for s in ("fp16", "bit16", "bit8")}
    # a link so fast every option takes the same (zero-alpha, tiny-beta) time: none first
    m = pl.Measurements(1, b, 0.0, same_link(Link(0.0, 1e-30)), free, zero)
    assert pl.search(m).schemes == ("none:allreduce",)


@pytest.mark.parametrize("bad", [
    dict(n=0), dict(buckets=()), dict(backward_s=math.nan), dict(backward_s=0.001),
    dict(buckets=(pl.Bucket("a", 4, 0.0), pl.Bucket("a", 4, 0.0))),
    dict(buckets=(pl.Bucket("a", 4, 0.01), pl.Bucket("b", 4, 0.0))),
    dict(cpu_share=-1.0), dict(cpu_share=math.inf),
])
def test_bad_measurements_are_refused_with_a_clear_error(bad):
    kw = dict(n=2, buckets=(pl.Bucket("a", 4, 0.002),), backward_s=0.002,
              links=same_link(link(1e9)))
    kw.update(bad)
    with pytest.raises(ValueError):
        pl.Measurements(**kw)


@pytest.mark.parametrize("bad", [dict(nbytes=3), dict(nbytes=-4), dict(ready_s=-1.0),
                                 dict(ready_s=math.inf)])
def test_bad_buckets_are_refused(bad):
    with pytest.raises(ValueError):
        pl.Bucket(**{"name": "a", "nbytes": 4, "ready_s": 0.0, **bad})


def test_a_missing_link_is_named():
    m = pl.Measurements(2, [pl.Bucket("a", 4, 0.0)], 0.0, {"allreduce": link(1e9)},
                        codecs(), {("a", "bit8"): 0.01})
    with pytest.raises(ValueError, match="allgather"):
        pl.predict(m, ["bit8:allgather"])


def test_codec_costs_cannot_be_negative_or_nan():
    for a, b in ((-1.0, 0.0), (0.0, math.nan)):
        with pytest.raises(ValueError):
            pl.Affine(a, b)


# ---------------------------------------------------------------- re-planning

def test_replan_on_drift_beyond_the_margin_only():
    steps = [0.130] * pl.REPLAN_WINDOW
    r = pl.should_replan(0.100, steps, steps_since_plan=500)
    assert r and r.drift == pytest.approx(0.30)
    assert not pl.should_replan(0.100, [0.110] * pl.REPLAN_WINDOW, 500)
    assert pl.should_replan(0.100, [0.080] * pl.REPLAN_WINDOW, 500)     # faster counts too


def test_replan_at_most_every_n_steps_and_not_on_a_few_slow_steps():
    steps = [0.100] * (pl.REPLAN_WINDOW - 3) + [5.0] * 3                   # a checkpoint
    assert not pl.should_replan(0.100, steps, 500)
    assert not pl.should_replan(0.100, [0.3] * pl.REPLAN_WINDOW, pl.REPLAN_EVERY - 1)
    assert pl.should_replan(0.100, [0.3] * pl.REPLAN_WINDOW, pl.REPLAN_EVERY)


def test_replan_needs_enough_usable_steps_and_a_prediction():
    nan_steps = [0.3] * (pl.REPLAN_WINDOW - 1) + [math.nan]
    assert not pl.should_replan(0.100, nan_steps, 500)
    assert not pl.should_replan(math.nan, [0.3] * pl.REPLAN_WINDOW, 500)
    assert not pl.should_replan(0.0, [0.3] * pl.REPLAN_WINDOW, 500)


# ---------------------------------------------------------------- codec cost fit

def test_fit_affine_recovers_a_line_and_holds_at_zero():
    pts = [(x, 1e-4 + 2e-9 * x) for x in (1e4, 1e5, 1e6, 4e6)]
    f = pl.fit_affine(pts)
    assert (f.a, f.b) == pytest.approx((1e-4, 2e-9))
    assert pl.fit_affine([(1e6, 0.003)]) == pl.Affine(0.003, 0.0)
    neg = pl.fit_affine([(1e3, 0.0), (1e6, 0.002), (2e6, 0.0045)])  # intercept would be < 0
    assert neg.a == 0.0 and neg.b > 0
    with pytest.raises(ValueError):
        pl.fit_affine([(1e6, math.nan)])


# ---------------------------------------------------------------- the CLI (ask before training)

def run_cli(capsys, *args):
    from hvd_compress.auto import cli
    assert cli.main(list(args) + ["--format", "json"]) == 0
    import json
    return json.loads(capsys.readouterr().out)


def test_cli_buckets_are_the_optimizers_and_ready_in_launch_order(capsys):
    from hvd_compress.auto import cli
    for model in ("horovod", "basic"):
        counts = [methods.numel(s) for s in methods.MODEL_SHAPES[model]]
        assert [c for _, c, _ in cli.model_buckets(model)] == methods.buckets(counts)
    out = run_cli(capsys, "--model", "basic", "--nodes", "2", "--bandwidth", "100Mbit/s",
                  "--latency", "1ms")
    ready = [b["ready_s"] for b in out["buckets"]]
    assert [b["name"] for b in out["buckets"]] == ["fc2.bias", "fc1.weight", "conv2.bias"]
    assert ready == sorted(ready) and ready[0] < 0.1 * ready[-1]   # the convs' work comes last


@pytest.mark.parametrize("rate, wire_bound", [("10Mbit/s", True), ("100Gbit/s", False)])
def test_cli_plan_is_no_slower_than_any_fixed_scheme_and_compresses_only_a_slow_wire(
        capsys, rate, wire_bound):
    out = run_cli(capsys, "--model", "basic", "--nodes", "2", "--bandwidth", rate,
                  "--latency", "100us", "--margin", "0")
    plan = out["plan"]
    assert plan["predicted_s"] <= min(out["fixed"].values()) * (1 + 1e-12)
    big = plan["schemes"][1]                                         # fc1.weight, 4.7 MB
    assert big.startswith("bit8") if wire_bound else big == "none:allreduce"


def test_cli_says_what_to_pass_without_a_step_benchmark_or_with_a_bad_rate(capsys, tmp_path):
    """A step benchmark that is not there: the error names the flag, not an errno. A rate without
    '/s' is refused with the parser's own words, not argparse's "invalid parse_rate value"."""
    from hvd_compress.auto import cli
    with pytest.raises(SystemExit, match="no step benchmark at .*pass --step-results"):
        cli.main(["--model", "basic", "--nodes", "2", "--bandwidth", "100Mbit/s", "--latency",
                  "1ms", "--step-results", str(tmp_path / "summary.csv")])
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--model", "basic", "--nodes", "2", "--bandwidth", "100mbit", "--latency", "1ms"])
    assert exit_.value.code == 2
    assert "'100mbit' is not a rate: it needs a '/s' unit" in capsys.readouterr().err


def test_cli_without_measured_errors_refuses_every_lossy_scheme(capsys, tmp_path):
    out = run_cli(capsys, "--model", "lab", "--nodes", "2", "--bandwidth", "10Mbit/s",
                  "--latency", "1ms", "--errors", str(tmp_path / "missing.csv"))
    assert out["plan"]["schemes"] == ["none:allreduce"]


def test_cli_reads_a_fitted_link(capsys):
    from conftest import ROOT
    fit = str(ROOT / "results" / "netem" / "1gbit" / "bench_fit.json")
    out = run_cli(capsys, "--model", "lab", "--nodes", "4", "--link-fit", fit)
    assert out["plan"]["predicted_s"] > 0 and "fitted" in out["notes"][0]


def test_cli_counts_a_collectives_cpu_against_backward_where_cores_are_shared(capsys,
                                                                             tmp_path):
    from hvd_compress.auto import cli
    args = ("--model", "basic", "--nodes", "4", "--bandwidth", "1Gbit/s", "--latency", "500us")
    free = run_cli(capsys, *args)["fixed"]
    shared = run_cli(capsys, *args, "--cpu-share", "2")
    # Horovod's fp16 sum costs 2.6-3.7x float32's CPU (results/collective-cpu): with the
    # cores shared it loses more against float32 than the wire alone says
    gap = lambda fixed: fixed["fp16:allreduce"] - fixed["none:allreduce"]
    assert gap(shared["fixed"]) > gap(free) + 0.005
    assert "cpu-np4.csv" in " ".join(shared["notes"])
    cpu, _ = cli.collective_cpu(None, 4)
    assert set(cpu) == {"allreduce", "allreduce_fp16", "allgather", "alltoall"}
    assert cpu["allreduce_fp16"].seconds(2359296) > 2 * cpu["allreduce"].seconds(2359296)
    bad = tmp_path / "cpu.csv"
    bad.write_text("ranks,rank,collective,input_bytes,wall_ms,cpu_ms\n")
    with pytest.raises(SystemExit, match="no collective's CPU"):
        cli.main(list(args) + ["--cpu-share", "1", "--collective-cpu", str(bad)])
    with pytest.raises(SystemExit):
        cli.main(list(args) + ["--cpu-share", "nan"])
    capsys.readouterr()


def test_the_commands_default_inputs_are_the_committed_measurements():
    """The package's defaults/ (what an install plans from) is each committed file byte for byte:
    a new run of a benchmark is copied there (hvd_compress/auto/defaults/README.md)."""
    from conftest import ROOT
    from hvd_compress.auto import cli
    copies = {cli.STEP_RESULTS: ROOT / "results" / "step" / "summary.csv",
              cli.ERRORS: ROOT / "results" / "planner" / "bucket_errors.csv"}
    for source in sorted((ROOT / "results" / "collective-cpu").glob("cpu-np*.csv")):
        copies[cli.COLLECTIVE_CPU / source.name] = source
    assert len(copies) >= 4 and all(p.is_relative_to(cli.DEFAULTS) for p in copies)
    for copy, source in copies.items():
        assert copy.read_bytes() == source.read_bytes(), f"{copy} differs from {source}"
    shipped = {p for p in cli.DEFAULTS.rglob("*.csv")}
    assert shipped == set(copies), sorted(shipped ^ set(copies))


@pytest.mark.interpreter
def test_the_planner_and_its_command_import_neither_torch_nor_horovod():
    import subprocess
    import sys
    code = ("import sys, hvd_compress.auto.planner, hvd_compress.auto.cli; "
            "bad = [m for m in ('torch', 'horovod') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout


# ---------------------------------------------------------------- across the step boundary

def test_overlap_with_every_need_at_once_is_the_waiting_step():
    # a forward that needs every bucket the moment step() returns waits as step() would (one
    # collective a bucket: a later phase is launched where the optimizer looks, below)
    rng = random.Random(11)
    for _ in range(20):
        m = random_instance(rng, k=rng.randint(1, 5))
        now = pl.Measurements(**{**m.__dict__, "needed_s": (0.0,) * len(m.buckets)})
        assert now.schedule == "overlap" and m.schedule == "wait"
        for text in ONE_PHASE:
            plan = pl.fixed_plan(m, text)
            assert pl.predict(now, plan).step_s == pytest.approx(pl.predict(m, plan).step_s,
                                                                 rel=1e-12)


def fc_and_conv(buckets, needed_s):
    """A 4 MiB fc bucket and a 64 KiB conv bucket (in `buckets`' order, name: ready at)
    over 100 Mbit/s, bit8 allgather with a 1 ms decode, 40 ms of compute outside backward:
    (the waiting schedule's measurements, the overlapped one's with `needed_s`, the plan)."""
    size = {"fc": 4 * MiB, "conv": 64 * 1024}
    b = [pl.Bucket(name, size[name], ready) for name, ready in buckets]
    dec = pl.CodecCost(decode=pl.Affine(0.001, 0.0))
    waiting = measurements(b, 0.020, link(100e6, 0.0), codecs={"bit8:allgather": dec},
                           fixed_s=0.040)
    late = pl.Measurements(**{**waiting.__dict__, "needed_s": needed_s})
    return waiting, late, ["bit8:allgather", "bit8:allgather"]


def test_overlap_waits_first_for_the_bucket_the_next_forward_needs_first():
    # fc's 4 MiB leaves first, the convs' small bucket last, queued behind it; the next
    # forward needs the convs at once and fc 30 ms later: it waits for the convs (so for fc's
    # whole exchange), then decodes fc's when it needs it: nothing is hidden, fc's decode is
    # no longer done while the convs' bucket is on the wire
    waiting, late, plan = fc_and_conv([("fc", 0.005), ("conv", 0.020)], (0.030, 0.0))
    w, o = pl.predict(waiting, plan), pl.predict(late, plan)
    fc_done, conv_done = w.done_s
    assert o.done_s == w.done_s                       # the wire does not change
    assert w.step_s == pytest.approx(0.040 + conv_done + 0.001)
    # the forward waits for the convs (needed at 20 ms), then runs 30 ms to fc's need
    conv_applied = max(0.020, conv_done) + 0.001
    fc_applied = max(conv_applied + 0.030, fc_done) + 0.001
    assert o.applied_s == pytest.approx((fc_applied, conv_applied))
    assert o.step_s == pytest.approx(0.040 + fc_applied - 0.030)
    assert o.step_s == pytest.approx(w.step_s + 0.001)
    # a forward that needs nothing until fc, 200 ms in, waits for nothing but the decodes
    never = pl.Measurements(**{**waiting.__dict__, "needed_s": (0.2, 0.2)})
    assert pl.predict(never, plan).step_s == pytest.approx(0.040 + 0.020 + 0.002)


def test_overlap_hides_the_exchange_of_a_bucket_the_next_forward_needs_late():
    # the convs' small bucket leaves first, fc's 4 MiB last; the forward needs the convs at
    # once (done long before) and fc 30 ms later: fc's exchange runs on behind those 30 ms
    waiting, late, plan = fc_and_conv([("conv", 0.005), ("fc", 0.020)], (0.0, 0.030))
    w, o = pl.predict(waiting, plan), pl.predict(late, plan)
    fc_done = w.done_s[1]
    assert w.step_s == pytest.approx(0.040 + fc_done + 0.001)
    assert o.applied_s[0] == pytest.approx(0.020 + 0.001)
    assert o.step_s == pytest.approx(w.step_s - 0.030)


def test_overlap_is_searched_on_its_own_timeline_and_said_not_proven_by_the_dp():
    rng = random.Random(3)
    for _ in range(10):
        m = random_instance(rng, k=rng.randint(2, 4))
        needs = tuple(rng.uniform(0, 0.05) for _ in m.buckets)
        o = pl.Measurements(**{**m.__dict__, "needed_s": needs})
        brute = pl.exhaustive(o)
        assert brute.predicted_s == pl.predict(o, brute.schemes).step_s
        for text in pl.DEFAULT_CANDIDATES:
            allowed, _ = pl.candidates_for(o)
            if all(text in ok for ok in allowed):
                assert brute.predicted_s <= pl.predict(o, pl.fixed_plan(o, text)).step_s * (1 + 1e-12)
        dp = pl.search(o, exhaustive_plans=0)
        assert not dp.exact
        assert dp.predicted_s == pl.predict(o, dp.schemes).step_s
        assert dp.fastest_s >= brute.fastest_s * (1 - 1e-12)


@pytest.mark.parametrize("needs", [(0.1,), (0.1, -0.01, 0.0), (0.1, math.nan, 0.0)])
def test_forward_needs_must_give_every_bucket_a_finite_time(needs):
    b = [pl.Bucket(f"b{i}", 4096, 0.01) for i in range(3)]
    with pytest.raises(ValueError, match="needed_s"):
        measurements(b, 0.01, link(1e9), needed_s=needs)


def test_overlap_prices_the_chunks_a_front_bucket_jumps_ahead_of():
    # fc's 4 MiB in 8 chunks from 5 ms on; the convs' bucket, ready at 20 ms, goes in after the
    # chunk on the wire and the one handed next, and fc's rest waits for it
    b = [pl.Bucket("fc", 4 * MiB, 0.005), pl.Bucket("conv", 64 * 1024, 0.020)]
    l = link(100e6, 0.0)
    costs = {"bit8:allgather": pl.CodecCost()}
    plan = ["bit8:allgather", "bit8:allgather"]
    plain = measurements(b, 0.020, l, codecs=costs, fixed_s=0.040, needed_s=(0.030, 0.0))
    cut = pl.Measurements(**{**plain.__dict__, "chunks": {("fc", "bit8:allgather"): 8}})
    p, c = pl.predict(plain, plan), pl.predict(cut, plan)
    whole = p.done_s[0] - 0.005                       # fc's exchange alone
    conv = p.done_s[1] - p.leaves_s[1]                # the convs'
    piece = whole / 8
    starts = 0.005 + piece * (math.ceil((0.020 - 0.005) / piece) + 1)
    assert c.leaves_s == pytest.approx((0.005, starts))
    assert c.done_s == pytest.approx((0.005 + whole + conv, starts + conv))
    # the forward has its convs long before fc's last chunk: the step is fc's, 30 ms hidden
    assert c.step_s < p.step_s
    assert c.step_s == pytest.approx(0.040 + 0.005 + whole + conv - 0.030)
    # the waiting schedule cuts nothing: chunks are not priced there
    waiting = pl.Measurements(**{**cut.__dict__, "needed_s": None})
    assert pl.predict(waiting, plan) == pl.predict(
        pl.Measurements(**{**plain.__dict__, "needed_s": None}), plan)
    with pytest.raises(ValueError, match="chunks"):
        pl.Measurements(**{**plain.__dict__, "chunks": {("fc", "bit8:allgather"): 0}})


def test_overlap_launches_a_later_phase_only_where_the_optimizer_looks():
    # two-phase fc, its alltoall done after step() returned: waiting, step() launches its
    # allgather as soon as the alltoall ends; overlapped, nothing looks until the forward
    # needs a bucket (200 ms after step()): the allgather starts there, and ends later
    b = [pl.Bucket("fc", 4 * MiB, 0.005)]
    l = link(100e6, 0.0)
    costs = {"bit8:alltoall": pl.CodecCost()}
    waiting = measurements(b, 0.010, l, codecs=costs, fixed_s=0.040)
    w = pl.predict(waiting, ["bit8:alltoall"])
    first, second = (methods.COLLECTIVE_COSTS[c](2, nbytes).seconds(l)
                     for c, nbytes in pl.wire_units("bit8", "alltoall", MiB, 2))
    assert w.done_s[0] == pytest.approx(0.005 + first + second)
    late = pl.Measurements(**{**waiting.__dict__, "needed_s": (0.200,)})
    o = pl.predict(late, ["bit8:alltoall"])
    assert 0.005 + first < 0.210                    # the alltoall ended before the need
    assert o.done_s[0] == pytest.approx(0.210 + second) and o.done_s[0] > w.done_s[0]
    assert o.step_s == pytest.approx(0.040 + 0.010 + second)
