"""E2M1 (OCP MX FP4) with a power-of-two block scale, from the format's specification alone,
value by value in plain Python: the reference docs/examples/e2m1_example.py is checked against
(tests/test_examples.py, and on 2 ranks tests/workers/contract_checks.py).

E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0. Exponent 0 is subnormal:
m * 0.5; otherwise 2**(e - 1) * (1 + m / 2). No Inf, no NaN. The example's conventions on top
(docs/examples/e2m1_example.py): round to nearest, ties to the even code; a block's scale is
the largest 2**k (k in [-126, 127]) with amax * 2**k <= 6, or <= 3 stored negative when the
block holds +-Inf (code 7 then means Inf); NaN is code 8; a zero is code 0.
"""
import math

import torch


def magnitude(code3):
    """The value of a 3-bit exponent-mantissa field, from the format's definition."""
    e, m = code3 >> 1, code3 & 1
    return m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)


def scale(values):
    """A block's signed scale: the largest 2**k with amax * 2**k <= 6 (3 with an Inf)."""
    finite = [abs(v) for v in values if math.isfinite(v)]
    has_inf = any(math.isinf(v) for v in values)
    amax, target = max(finite, default=0.0), 3.0 if has_inf else 6.0
    k = 0
    if amax > 0:
        k = 127
        while k > -126 and amax * 2.0 ** k > target:
            k -= 1
    return -(2.0 ** k) if has_inf else 2.0 ** k


def encode(v, s):
    """One value's 4-bit code under its block's scale s."""
    if math.isnan(v):
        return 8
    y = v * abs(s)
    sign = 8 if y < 0 else 0
    if math.isinf(y):
        return 7 | sign
    # nearest magnitude; on a tie, the code whose mantissa bit is 0
    code = min(range(8), key=lambda c: (abs(abs(y) - magnitude(c)), c % 2))
    return code | sign if code else 0


def decode(code, s):
    if code == 8:
        return math.nan
    mag = math.inf if (s < 0 and code & 7 == 7) else magnitude(code & 7)
    return (-mag if code & 8 else mag) / abs(s)


def encode_row(values, block):
    """(packed code bytes, scales) of a list of floats: two codes a byte, low nibble first."""
    scales = [scale(values[a:a + block]) for a in range(0, len(values), block)]
    codes = [encode(v, scales[i // block]) for i, v in enumerate(values)]
    codes += [0] * (len(codes) % 2)
    return bytes(lo | hi << 4 for lo, hi in zip(codes[::2], codes[1::2])), scales


def decode_sum(rows, numel, block, divisor=1):
    """Rows of (packed bytes, scales), rank order -> float32 tensor: row 0 + row 1 + ..., each
    addition in float32 as the ranks do it, then / divisor."""
    total = None
    for packed, scales in rows:
        codes = [b >> shift & 15 for b in packed for shift in (0, 4)][:numel]
        values = torch.tensor([decode(c, scales[i // block]) for i, c in enumerate(codes)],
                              dtype=torch.float32)
        total = values if total is None else total + values
    return total / divisor if divisor != 1 else total
