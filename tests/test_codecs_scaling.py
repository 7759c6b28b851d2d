"""pow2_scale: the largest power of two that keeps amax within the target."""
import math

import numpy as np
import pytest
import torch

from hvd_compress.codecs import E4M3, E5M2, fp8_numpy, fp8_torch, fp16_numpy, scaling

pytestmark = pytest.mark.unit


def brute_force_scale(amax: float, target: float) -> float:
    """Largest 2**k (k in float32's normal range) with amax * 2**k <= target, by trying all k.
    amax * 2**k is exact in double for every k here, so the comparison is exact."""
    best = None
    for k in range(scaling.FLOAT32_MIN_EXP, scaling.FLOAT32_MAX_EXP + 1):
        if math.ldexp(amax, k) <= target:
            best = k
    return math.ldexp(1.0, best if best is not None else scaling.FLOAT32_MIN_EXP)


@pytest.mark.parametrize("amax, target, expected", [
    (448.0, 448.0, 1.0), (449.0, 448.0, 0.5), (224.0, 448.0, 2.0), (224.1, 448.0, 1.0),
    (1e-3, 448.0, 2.0 ** 18), (1.0, 57344.0, 2.0 ** 15), (65504.0, 65504.0, 1.0),
    (3.4028234663852886e38, 448.0, 2.0 ** -120),
])
def test_known_values(amax, target, expected):
    assert scaling.pow2_scale(amax, target) == expected


def test_against_brute_force():
    rng = np.random.default_rng(0)
    amaxes = np.concatenate([10.0 ** rng.uniform(-40, 38, 300),
                             [2.0 ** k for k in range(-120, 120, 7)],
                             [np.nextafter(np.float32(448 / 2 ** k), np.float32(np.inf)) for k in range(-20, 20)]])
    for target in (E4M3.max_finite, E5M2.max_finite, 65504.0, 1.0, 3.0):
        for amax in amaxes.astype(np.float32):
            assert scaling.pow2_scale(amax, target) == brute_force_scale(float(amax), target), (amax, target)


def test_result_is_power_of_two_and_fits():
    for amax in (1e-30, 5e-8, 0.37, 1.0, 1234.5, 1e30):
        s = scaling.pow2_scale(amax, 448.0)
        assert math.frexp(s)[0] == 0.5                       # a power of two
        assert amax * s <= 448.0 < amax * s * 2
        assert float(np.float32(s)) == s                     # survives a float32 header


@pytest.mark.parametrize("amax", [0.0, -0.0, float("inf"), float("nan"), np.float32("inf")])
def test_zero_and_non_finite_give_one(amax):
    assert scaling.pow2_scale(amax, 448.0) == 1.0


def test_tiny_amax_is_clamped_to_float32_range():
    assert scaling.pow2_scale(1e-45, 448.0) == 2.0 ** 127
    assert scaling.pow2_scale(2.0 ** -149, 1.0) == 2.0 ** 127


def test_accepts_numpy_and_torch_scalars():
    assert scaling.pow2_scale(np.float32(1e-3), 448.0) == 2.0 ** 18
    assert scaling.pow2_scale(torch.tensor(1e-3), 448.0) == 2.0 ** 18


@pytest.mark.parametrize("amax, target", [(-1.0, 448.0), (1.0, 0.0), (1.0, -4.0), (1.0, float("inf")),
                                          (1.0, float("nan"))])
def test_bad_arguments_raise(amax, target):
    with pytest.raises(ValueError):
        scaling.pow2_scale(amax, target)


@pytest.mark.parametrize("fmt, rel", [(E4M3, 2.0 ** -4), (E5M2, 2.0 ** -3)])
def test_scaled_roundtrip_error_bound_on_gradients(fmt, rel):
    """The Bit8 pipeline: scale by s, encode, decode, unscale.  Where the scaled value lies in
    the format's normal range the error is at most half an ulp: 2**-(man_bits+1) relative.
    (Just below min_normal the subnormal grid is coarser: a value rounding *up* to min_normal
    can be off by more, so the bound is stated for normal-range inputs, not outputs.)"""
    rng = np.random.default_rng(1)
    g = (rng.standard_normal(1 << 16) * 10.0 ** rng.uniform(-7, -3, 1 << 16)).astype(np.float32)
    s = np.float32(scaling.pow2_scale(float(np.abs(g).max()), fmt.max_finite))
    for dec in (fp8_numpy.decode(fp8_numpy.encode(g * s, fmt), fmt),
                fp8_torch.decode(fp8_torch.encode(torch.from_numpy(g * s), fmt), fmt).numpy()):
        normal = np.abs(g * s) >= fmt.min_normal
        assert normal.mean() > 0.5                              # the bound is about most values
        back = dec / s
        assert np.all(np.abs(back[normal] - g[normal]) <= rel * np.abs(g[normal]))
        assert np.all(np.abs(dec) <= fmt.max_finite)            # scaling avoided any overflow


def test_scaled_roundtrip_fp16():
    rng = np.random.default_rng(2)
    g = (rng.standard_normal(1 << 16) * 10.0 ** rng.uniform(-9, 2, 1 << 16)).astype(np.float32)
    s = np.float32(scaling.pow2_scale(float(np.abs(g).max()), 65504.0))
    dec = fp16_numpy.decode(fp16_numpy.encode(g * s))
    normal = np.abs(g * s) >= 2.0 ** -14
    assert np.all(np.abs(dec[normal] / s - g[normal]) <= 2.0 ** -11 * np.abs(g[normal]))
