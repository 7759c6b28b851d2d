"""Hypothesis properties of the codecs for any float32, against an oracle built from the spec.

The oracle knows nothing of our code or of any library: it lists every finite value of the
format from the bit-layout formula, picks the nearest one to x with exact rational arithmetic
(ties to the even code), and applies the mode's overflow rule to anything that rounds beyond
max_finite.  Properties: that nearest-value rule (both NumPy and torch paths), monotonicity,
sign symmetry, and the error bound of the scaled round trip the compressors use.
"""
import bisect
import functools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_compress.codecs import E4M3, E5M2, fp8_numpy, fp8_torch, fp16_numpy, fp16_torch, scaling

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=150, deadline=None)
MODES = [(E4M3, True), (E4M3, False), (E5M2, True), (E5M2, False)]


# ---- the oracle -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def grid(exp_bits: int, man_bits: int, bias: int, has_inf: bool):
    """Sorted positive finite values (with 0) and their magnitude codes, from the formula
    value = M * 2**(1-bias-m) for E = 0, (1 + M/2**m) * 2**(E-bias) otherwise."""
    values, codes = [], []
    for e in range(1 << exp_bits):
        for m in range(1 << man_bits):
            code = (e << man_bits) | m
            if has_inf and e == (1 << exp_bits) - 1:
                continue                                        # Inf / NaN
            if not has_inf and code == (1 << (exp_bits + man_bits)) - 1:
                continue                                        # the single NaN (E4M3)
            if e == 0:
                v = math.ldexp(m, 1 - bias - man_bits)
            else:
                v = math.ldexp((1 << man_bits) + m, e - bias - man_bits)
            values.append(v)
            codes.append(code)
    return values, codes


def oracle(x: np.float32, exp_bits, man_bits, bias, has_inf, overflow, inf_result, nan_result):
    """Expected magnitude code | sign for float32 x.  `overflow` is the code for finite values
    that round past max_finite, `inf_result` for +-Inf, `nan_result` for NaN."""
    sign_bit = 1 << (exp_bits + man_bits)
    sign = sign_bit if np.signbit(x) else 0
    if np.isnan(x):
        return sign | nan_result
    if np.isinf(x):
        return sign | inf_result
    values, codes = grid(exp_bits, man_bits, bias, has_inf)
    ax = abs(float(x))
    top = values[-1]
    beyond = top + math.ldexp(1.0, math.frexp(top)[1] - 1 - man_bits)   # next step after max
    if ax >= beyond:
        return sign | overflow
    i = bisect.bisect_left(values, ax)
    if i < len(values) and values[i] == ax:
        return sign | codes[i]
    lo_v, lo_c = values[i - 1], codes[i - 1]
    hi_v, hi_c = (values[i], codes[i]) if i < len(values) else (beyond, codes[-1] + 1)
    d_lo, d_hi = Fraction(ax) - Fraction(lo_v), Fraction(hi_v) - Fraction(ax)
    if d_lo < d_hi or (d_lo == d_hi and lo_c % 2 == 0):
        return sign | lo_c
    return sign | (overflow if hi_v == beyond else hi_c)


def fp8_oracle(x, fmt, saturate):
    overflow = fp8_numpy.overflow_code(fmt, saturate)
    inf_result = fmt.inf_code if fmt.has_inf else overflow   # E4M3: Inf like overflow
    return oracle(x, fmt.exp_bits, fmt.man_bits, fmt.bias, fmt.has_inf, overflow, inf_result, fmt.nan_code)


def fp16_nan_code(x: np.float32) -> int:
    return max((int(np.array(x).view(np.uint32)) >> 13) & 0x3FF, 1) | 0x7C00   # NumPy's payload rule


def fp16_oracle(x):
    return oracle(x, 5, 10, 15, True, 0x7C00, 0x7C00, fp16_nan_code(x) & 0x7FFF)


# ---- strategies ----------------------------------------------------------------------------
bit_patterns = st.integers(0, (1 << 32) - 1).map(lambda b: np.array(b, np.uint32).view(np.float32)[()])
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True).map(np.float32)
in_range = st.floats(-70000, 70000, width=32).map(np.float32)
any_float32 = st.one_of(bit_patterns, floats32, in_range)
# Each example is a small batch, so one codec call checks many values (the codecs' per-call
# overhead, not the oracle, dominates the run time); shrinking still finds a minimal batch.
batches = st.lists(any_float32, min_size=1, max_size=24)


def arr(xs):
    return np.array(xs, dtype=np.float32).reshape(-1)


def codes_all_paths(xs, fmt, saturate):
    """Codes of the NumPy encoder, torch fast path and torch reference, as lists of ints."""
    a = arr(xs)
    t = torch.from_numpy(a)
    return (fp8_numpy.encode(a, fmt, saturate).tolist(), fp8_torch.encode(t, fmt, saturate).tolist(),
            fp8_torch.encode_bits(t, fmt, saturate).tolist())


def flip_sign(xs):
    return (arr(xs).view(np.uint32) ^ np.uint32(0x80000000)).view(np.float32)


# ---- fp8 properties ------------------------------------------------------------------------
@SETTINGS
@given(xs=batches)
def test_fp8_encode_is_nearest_value_ties_to_even(xs):
    for fmt, sat in MODES:
        expected = [fp8_oracle(x, fmt, sat) for x in arr(xs)]
        for path, got in zip(("numpy", "torch", "torch-bits"), codes_all_paths(xs, fmt, sat)):
            assert got == expected, (fmt.name, sat, path, arr(xs), [hex(c) for c in expected])


@SETTINGS
@given(xs=batches)
def test_fp8_decode_of_encode_is_the_nearest_value(xs):
    for fmt, sat in MODES:
        q = fp8_torch.decode(fp8_torch.encode(torch.from_numpy(arr(xs)), fmt, sat), fmt).numpy()
        values, _ = grid(fmt.exp_bits, fmt.man_bits, fmt.bias, fmt.has_inf)
        for x, qi in zip(arr(xs), q):
            code = fp8_oracle(x, fmt, sat)
            if fmt.is_nan_code(code):
                assert np.isnan(qi)
                continue
            mag = values[code & 0x7F] if code & 0x7F < len(values) else math.inf
            expected = np.float32(-mag if code & 0x80 else mag)
            assert qi == expected and np.signbit(qi) == np.signbit(expected), (x, qi, expected)


@SETTINGS
@given(xs=batches, ys=batches)
def test_fp8_monotone(xs, ys):
    pairs = [(x, y) if x <= y else (y, x) for x, y in zip(arr(xs), arr(ys))
             if not (np.isnan(x) or np.isnan(y))]
    if not pairs:
        return
    lo, hi = arr([p[0] for p in pairs]), arr([p[1] for p in pairs])
    for fmt, sat in MODES:
        q_lo = fp8_numpy.decode(fp8_numpy.encode(lo, fmt, sat), fmt)
        q_hi = fp8_numpy.decode(fp8_numpy.encode(hi, fmt, sat), fmt)
        ordered = ~(np.isnan(q_lo) | np.isnan(q_hi))            # E4M3 overflow -> NaN is unordered
        assert np.all(q_lo[ordered] <= q_hi[ordered]), (fmt.name, sat, lo, hi)


@SETTINGS
@given(xs=batches)
def test_fp8_sign_symmetric(xs):
    for fmt, sat in MODES:
        for c_pos, c_neg in zip(codes_all_paths(xs, fmt, sat), codes_all_paths(flip_sign(xs), fmt, sat)):
            assert c_neg == [c ^ 0x80 for c in c_pos]


@SETTINGS
@given(g=st.lists(st.floats(-1e4, 1e4, width=32, allow_subnormal=True), min_size=1, max_size=64))
def test_fp8_scaled_roundtrip_relative_error(g):
    g = np.array(g, np.float32)
    for fmt, bound in ((E4M3, 2.0 ** -4), (E5M2, 2.0 ** -3)):
        s = np.float32(scaling.pow2_scale(float(np.abs(g).max()), fmt.max_finite))
        y = g * s
        back = fp8_torch.decode(fp8_torch.encode(torch.from_numpy(y), fmt), fmt).numpy() / s
        normal = np.abs(y) >= fmt.min_normal                    # scaled value in the normal range
        assert np.all(np.abs(back[normal] - g[normal]) <= bound * np.abs(g[normal]))
        assert not np.isnan(back).any()


# ---- fp16 properties -----------------------------------------------------------------------
@SETTINGS
@given(xs=batches)
def test_fp16_encode_is_nearest_value_ties_to_even(xs):
    a = arr(xs)
    expected = [fp16_oracle(x) for x in a]
    got = (fp16_numpy.encode(a).tolist(),
           (fp16_torch.encode(torch.from_numpy(a)).numpy().view(np.uint16)).tolist(),
           (fp16_torch.encode_bits(torch.from_numpy(a)).numpy().view(np.uint16)).tolist())
    for path, g in zip(("numpy", "torch", "torch-bits"), got):
        assert g == expected, (path, a, [hex(c) for c in expected])


@SETTINGS
@given(xs=batches, ys=batches)
def test_fp16_monotone_and_sign_symmetric(xs, ys):
    pairs = [(x, y) if x <= y else (y, x) for x, y in zip(arr(xs), arr(ys))
             if not (np.isnan(x) or np.isnan(y))]
    if pairs:
        q_lo = fp16_numpy.decode(fp16_numpy.encode(arr([p[0] for p in pairs])))
        q_hi = fp16_numpy.decode(fp16_numpy.encode(arr([p[1] for p in pairs])))
        assert np.all(q_lo <= q_hi)
    assert fp16_numpy.encode(flip_sign(xs)).tolist() == [c ^ 0x8000 for c in fp16_numpy.encode(arr(xs)).tolist()]


@SETTINGS
@given(g=st.lists(st.floats(-1e6, 1e6, width=32, allow_subnormal=True), min_size=1, max_size=64))
def test_fp16_scaled_roundtrip_relative_error(g):
    g = np.array(g, np.float32)
    s = np.float32(scaling.pow2_scale(float(np.abs(g).max()), 65504.0))
    y = g * s
    back = fp16_torch.decode(fp16_torch.encode(torch.from_numpy(y))).numpy() / s
    normal = np.abs(y) >= 2.0 ** -14
    assert np.all(np.abs(back[normal] - g[normal]) <= 2.0 ** -11 * np.abs(g[normal]))
