"""Compression.auto(objective="time_to_accuracy") runs its shadows at a sample of each window's
steps (convergence.sampled_positions, shadow.Shadows.observe): which steps, that the others do
no shadow work, and that a window's estimate is the one computed by hand from the sampled
steps alone, a stateful shadow (top-k's residual, PowerSGD's Q) advancing at those steps only.
Every rank samples alike: the positions are a function of the settings alone (the decisions'
equality on real ranks is tests/test_auto_tta.py's)."""
import math

import pytest
import torch

import hvd_compress as hc
from hvd_compress.auto import convergence
from hvd_compress.auto.convergence import sampled_positions
from hvd_compress.auto.shadow import Shadows
from hvd_compress.exchange.fusion import Bucket
from hvd_compress.methods.powersgd import initial_q, orthonormal
from hvd_compress.methods.topk import select


def _bucket():
    tensors = [torch.zeros(32, 40), torch.zeros(32), torch.zeros(8, 32)]
    (_, bucket), = Bucket.plan(["a", "b", "c"], tensors, 1 << 20)
    return bucket


def _stream(steps, numel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(numel, generator=gen)
    return [mean + 0.5 * torch.randn(numel, generator=gen) for _ in range(steps)]


@pytest.mark.unit
def test_the_sampled_steps_are_evenly_spaced_from_the_windows_first():
    assert sampled_positions(50, 2) == {0, 25}
    assert sampled_positions(10, 2) == {0, 5}
    assert sampled_positions(50, 3) == {0, 16, 32}
    assert sampled_positions(7, 7) == set(range(7))          # every step
    assert sampled_positions() == sampled_positions(convergence.INTERVAL,
                                                    convergence.SHADOW_SAMPLES)
    assert len(sampled_positions()) == convergence.SHADOW_SAMPLES < convergence.INTERVAL


@pytest.mark.unit
def test_every_rank_samples_the_same_steps_for_equal_settings():
    """The positions depend on the settings alone (no clock, no rank): equal settings, as the
    ranks' agreement check requires them, give equal positions."""
    a = hc.Compression.auto(objective="time_to_accuracy", interval=20, shadow_samples=4)
    b = hc.Compression.auto(objective="time_to_accuracy")(interval=20, shadow_samples=4)
    assert a == b and hash(a) == hash(b)
    assert sampled_positions(a.interval, a.shadow_samples) == \
        sampled_positions(b.interval, b.shadow_samples) == {0, 5, 10, 15}
    assert hc.Compression.auto(objective="time_to_accuracy").shadow_samples == \
        convergence.SHADOW_SAMPLES
    assert a != a(shadow_samples=2)


@pytest.mark.unit
@pytest.mark.parametrize("options", [{"shadow_samples": 0}, {"shadow_samples": 51},
                                     {"interval": 10, "shadow_samples": 11},
                                     {"shadow_samples": 2.5}, {"shadow_samples": True}])
def test_a_sample_count_outside_the_window_is_refused_by_name(options):
    with pytest.raises(ValueError, match="shadow_samples must be a whole number of steps"):
        hc.Compression.auto(objective="time_to_accuracy", **options)


@pytest.mark.unit
def test_a_step_neither_sampled_nor_after_one_does_no_shadow_work(monkeypatch):
    bucket = _bucket()
    shadows = Shadows(("topk0.1", "powersgd2", "int8"))
    calls = []
    real = Shadows._one
    monkeypatch.setattr(Shadows, "_one", lambda self, *a: calls.append(a[0]) or real(self, *a))
    g = _stream(4, bucket.numel)
    assert shadows.observe(True, [g[0]], [g[0]], [bucket]) is None     # the first step
    assert len(calls) == 3
    kept = {m: dict(d) for m, d in shadows.residual.items()}
    products = shadows.observe(False, [g[1]], [g[1]], [bucket])        # reads step 0's
    assert products is not None and set(products[1]) == {"topk0.1", "powersgd2", "int8"}
    assert len(calls) == 3 and not shadows.pending()
    assert shadows.observe(False, [g[2]], [g[2]], [bucket]) is None    # nothing at all
    assert len(calls) == 3 and shadows.sent is None and shadows.reference is None
    assert all(shadows.residual[m][i] is t for m, d in kept.items() for i, t in d.items())


@pytest.mark.unit
def test_the_windows_estimate_is_the_one_computed_by_hand_from_its_sampled_steps():
    """Over two windows of 10 steps, shadows at steps 0 and 5 of each: top-k's u from its own
    residual carried from sampled step to sampled step only, PowerSGD's Q and residual
    likewise, their
    products with the step after's gradient: the ratio is sum <u, g_t+1> / sum <g_t, g_t+1>
    over the sampled t alone."""
    bucket = _bucket()
    interval, at = 10, sampled_positions(10, 2)
    grads = _stream(2 * interval, bucket.numel, seed=4)
    shadows = Shadows(("topk0.1", "powersgd2"))
    progress = convergence.Progress()
    for step, g in enumerate(grads):
        products = shadows.observe(step % interval in at, [g], [g], [bucket])
        if products is not None:
            progress.add(*products)
    assert progress.steps == 4

    sampled = [t for t in range(len(grads)) if t % interval in at]
    assert sampled == [0, 5, 10, 15]
    residual, residual_psgd = torch.zeros(bucket.numel), torch.zeros(bucket.numel)
    q = {}
    made_topk = made_psgd = exact = 0.0
    for t in sampled:
        g, h = grads[t], grads[t + 1]
        exact += float(torch.dot(g, h))
        x = g + residual
        u = torch.zeros_like(x)
        for off, k in zip(bucket.offsets, bucket.numels):
            idx = select(x[off:off + k], max(1, math.ceil(0.1 * k)))
            u[off:off + k][idx] = x[off:off + k][idx]
        residual = x - u
        made_topk += float(torch.dot(u, h))
        y = g + residual_psgd
        v = torch.empty_like(y)
        for j, (off, k, shape) in enumerate(zip(bucket.offsets, bucket.numels, bucket.shapes)):
            part = y[off:off + k]
            if len(shape) < 2:
                v[off:off + k] = part
                continue
            m = part.reshape(shape[0], -1)
            r = min(2, *m.shape)
            qj = q.get(j, initial_q(str((0, j)), m.shape[1], r, 0, m.device))
            p = orthonormal(m @ qj)
            q[j] = m.t() @ p
            v[off:off + k] = (p @ q[j].t()).reshape(-1)
        residual_psgd = y - v
        made_psgd += float(torch.dot(v, h))
    assert exact > 0
    ratios = progress.ratios()
    assert ratios["topk0.1"] == pytest.approx(made_topk / exact, rel=1e-5)
    assert ratios["powersgd2"] == pytest.approx(made_psgd / exact, rel=1e-5)
    # the sample is not every step: the shadows at every step read another estimate
    every = Shadows(("topk0.1",))
    full = convergence.Progress()
    for g in grads:
        products = every.observe(True, [g], [g], [bucket])
        if products is not None:
            full.add(*products)
    assert full.steps == len(grads) - 1 and full.ratios()["topk0.1"] != ratios["topk0.1"]
