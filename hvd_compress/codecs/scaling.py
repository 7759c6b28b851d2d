"""Power-of-two scale factors that bring a tensor's range to a narrow format's range.

Why a power of two: multiplying a float32 by 2**k only changes its exponent, so scaling and
unscaling are exact (no extra rounding on top of the codec's), and the scale itself is
exactly representable in the packet's float32 header.
"""
import math

__all__ = ["pow2_scale", "FLOAT32_MIN_EXP", "FLOAT32_MAX_EXP"]

# k in 2**k is kept in float32's normal range so the scale survives a float32 header exactly
# and x * s is an exact exponent change for every normal x.
FLOAT32_MIN_EXP = -126
FLOAT32_MAX_EXP = 127


def pow2_scale(amax: float, target_max: float) -> float:
    """Largest power of two s with amax * s <= target_max.

    Returns 1.0 when amax is 0 or not finite (nothing sensible to scale by; the codec's
    overflow mode then decides what Inf/NaN become).  The exponent is clamped to float32's
    normal range [2**-126, 2**127], so for a subnormal-sized amax s can be smaller than the
    mathematical answer (amax * s <= target_max still holds).  Computed exactly with frexp,
    not with a rounded log2.

    >>> pow2_scale(1e-3, 448.0)      # 1e-3 * 2**18 = 262.1 <= 448 < 524.3
    262144.0
    """
    amax = float(amax)
    target_max = float(target_max)
    if not (math.isfinite(target_max) and target_max > 0):
        raise ValueError(f"target_max must be finite and > 0, got {target_max}")
    if math.isnan(amax) or amax < 0:
        if amax < 0:
            raise ValueError(f"amax must be >= 0 (a maximum of absolute values), got {amax}")
        return 1.0
    if amax == 0 or math.isinf(amax):
        return 1.0
    # amax = ma * 2**ea and target = mt * 2**et with ma, mt in [0.5, 1):
    # amax * 2**k <= target  <=>  ma * 2**(ea + k) <= mt * 2**et
    ma, ea = math.frexp(amax)
    mt, et = math.frexp(target_max)
    k = et - ea if ma <= mt else et - ea - 1
    k = max(FLOAT32_MIN_EXP, min(FLOAT32_MAX_EXP, k))
    return math.ldexp(1.0, k)
