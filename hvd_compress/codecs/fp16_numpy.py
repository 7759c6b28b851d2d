"""float32 <-> IEEE float16 codes (uint16) in NumPy, by bit manipulation of the int32 view.

The same recipe as fp8_numpy (read that module's docstring first), with 10 mantissa bits and
bias 15.  The reference is NumPy itself: `x.astype(np.float16)` and `.astype(np.float32)`,
matched bit for bit on every input, NaN payloads included:

* encode: round to nearest even, subnormals, finite overflow -> +-Inf.  A NaN keeps its sign
  and the top 10 bits of its payload (0x7C00 | payload >> 13); a payload that would vanish
  becomes 0x7C01 so the result stays NaN (NumPy's rule; it does not set the quiet bit).
* decode: the exact widening, NaN payload shifted back up (0x7C01 -> 0x7F802000), again as
  NumPy does (no quieting).  Done through a 65536-entry float32 table built by `decode_bits`.
"""
import functools

import numpy as np

from .formats import BLOCK, block_ranges
from .fp8_numpy import check_input, effective_scale, prepare_out

__all__ = ["encode", "decode", "decode_bits"]

MAN_BITS = 10
BIAS = 15
_SHIFT = 23 - MAN_BITS                                      # 13 float32 mantissa bits dropped
_REBIAS_ROUND = ((BIAS - 127) << 23) + (1 << (_SHIFT - 1)) - 1
_MIN_NORMAL_BITS = (127 + 1 - BIAS) << 23                   # bits of 2**-14
_MAGIC = np.float32(0.5)                                    # 2**(23 - 24): ulp(0.5) = 2**-24
_MAGIC_BITS = 0x3F000000
_INF_BITS = 0x7F800000
_HALF_INF = 0x7C00


def encode(x: np.ndarray, out=None, *, scale=None) -> np.ndarray:
    """Encode float32 `x` to float16 bit patterns (uint16), identical to `x.astype(np.float16)`.
    scale: encode x * scale instead, as fp8_numpy.encode does."""
    x = check_input(x, np.float32, "x")
    out = prepare_out(out, x.shape, np.uint16)
    scale = effective_scale(scale)
    flat_x = x.reshape(-1)
    codes = out.reshape(-1)
    size = max(1, min(flat_x.size, BLOCK))
    a, q, t = (np.empty(size, np.int32) for _ in range(3))
    mask = np.empty(size, np.bool_)
    scaled = np.empty(size if scale is not None else 0, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for start, stop in block_ranges(flat_x.size, size):
            k = stop - start
            xb = flat_x[start:stop]
            if scale is not None:
                xb = np.multiply(xb, scale, out=scaled[:k])
            _encode_block(xb.view(np.int32), codes[start:stop], a[:k], q[:k], t[:k], mask[:k])
    return out


def _encode_block(u, codes, a, q, t, mask):
    np.bitwise_and(u, 0x7FFFFFFF, out=a)                     # |x| as bits
    # normal results: re-bias, round to nearest even, drop 13 bits
    np.right_shift(a, _SHIFT, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(a, _REBIAS_ROUND, out=q)
    np.add(q, t, out=q)
    np.right_shift(q, _SHIFT, out=q)
    # subnormal results: |x| + 0.5 rounds |x| to a multiple of 2**-24
    np.add(a.view(np.float32), _MAGIC, out=t.view(np.float32))
    np.subtract(t, _MAGIC_BITS, out=t)
    np.less(a, _MIN_NORMAL_BITS, out=mask)
    np.copyto(q, t, where=mask)
    # overflow and Inf -> Inf; NaN -> 0x7C00 | top payload bits (at least 1)
    np.minimum(q, _HALF_INF, out=q)
    np.right_shift(a, _SHIFT, out=t)
    np.bitwise_and(t, 0x3FF, out=t)
    np.maximum(t, 1, out=t)
    np.bitwise_or(t, _HALF_INF, out=t)
    np.greater(a, _INF_BITS, out=mask)
    np.copyto(q, t, where=mask)
    # sign: bit 31 -> bit 15
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 0x8000, out=t)
    np.bitwise_or(q, t, out=q)
    np.copyto(codes, q, casting="unsafe")                    # values are 0..65535


def decode_bits(codes: np.ndarray) -> np.ndarray:
    """Bit-level decoder: normal, subnormal (M * 2**-24, exact), Inf/NaN (payload << 13)."""
    codes = check_input(codes, np.uint16, "codes")
    c = codes.astype(np.uint32)
    sign = (c & 0x8000) << 16
    e = (c >> MAN_BITS) & 0x1F
    man = c & 0x3FF
    normal = sign | ((e + 127 - BIAS) << 23) | (man << _SHIFT)
    subnormal = sign | (man.astype(np.float32) * np.float32(2.0 ** -24)).view(np.uint32)
    special = sign | (0xFF << 23) | (man << _SHIFT)
    bits = np.where(e == 0x1F, special, np.where(e == 0, subnormal, normal))
    return bits.astype(np.uint32).view(np.float32)


@functools.lru_cache(maxsize=None)
def decode_table() -> np.ndarray:
    """float32 value of each of the 65536 codes (read-only, 256 KiB)."""
    table = decode_bits(np.arange(1 << 16, dtype=np.uint16))
    table.setflags(write=False)
    return table


def decode(codes: np.ndarray, out=None) -> np.ndarray:
    """Decode uint16 float16 bit patterns to float32, identical to `.view(np.float16).astype(np.float32)`."""
    codes = check_input(codes, np.uint16, "codes")
    out = prepare_out(out, codes.shape, np.float32)
    table = decode_table()
    flat_codes = codes.reshape(-1)
    flat_out = out.reshape(-1)
    for start, stop in block_ranges(flat_codes.size, BLOCK):
        # every code is a valid index, so 'clip' (no bounds check, no error path) is exact
        np.take(table, flat_codes[start:stop], out=flat_out[start:stop], mode="clip")
    return out
