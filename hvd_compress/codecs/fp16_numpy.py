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

from .formats import ABS_MASK, BLOCK, FP16, INF_BITS
from .fp8_numpy import gather
from .numpy_common import ENCODE_SCRATCH, check_input, effective_scale, prepare_out, run_blocks

__all__ = ["encode", "decode", "decode_bits"]

# every constant from the format (formats.FP16): 13 float32 mantissa bits dropped, the
# smallest normal 2**-14, MAGIC 0.5 (ulp(0.5) = 2**-24 = the smallest subnormal), Inf 0x7C00
_MAGIC = np.float32(FP16.magic)


def encode(x: np.ndarray, out=None, *, scale=None) -> np.ndarray:
    """Encode float32 `x` to float16 bit patterns (uint16), identical to `x.astype(np.float16)`.
    scale: encode x * scale instead, as fp8_numpy.encode does."""
    x = check_input(x, np.float32, "x")
    out = prepare_out(out, x.shape, np.uint16)
    run_blocks(x, out, BLOCK, _encode_block, ENCODE_SCRATCH, effective_scale(scale))
    return out


def _encode_block(x, codes, a, q, t, mask):
    u = x.view(np.int32)
    np.bitwise_and(u, ABS_MASK, out=a)                       # |x| as bits
    # normal results: re-bias, round to nearest even, drop 13 bits
    np.right_shift(a, FP16.shift, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(a, FP16.rebias_round, out=q)
    np.add(q, t, out=q)
    np.right_shift(q, FP16.shift, out=q)
    # subnormal results: |x| + 0.5 rounds |x| to a multiple of 2**-24
    np.add(a.view(np.float32), _MAGIC, out=t.view(np.float32))
    np.subtract(t, FP16.magic_bits, out=t)
    np.less(a, FP16.min_normal_bits, out=mask)
    np.copyto(q, t, where=mask)
    # overflow and Inf -> Inf; NaN -> 0x7C00 | top payload bits (at least 1)
    np.minimum(q, FP16.inf_code, out=q)
    np.right_shift(a, FP16.shift, out=t)
    np.bitwise_and(t, FP16.man_mask, out=t)
    np.maximum(t, 1, out=t)
    np.bitwise_or(t, FP16.inf_code, out=t)
    np.greater(a, INF_BITS, out=mask)
    np.copyto(q, t, where=mask)
    # sign: bit 31 -> bit 15
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, FP16.sign_bit, out=t)
    np.bitwise_or(q, t, out=q)
    np.copyto(codes, q, casting="unsafe")                    # values are 0..65535


def decode_bits(codes: np.ndarray) -> np.ndarray:
    """Bit-level decoder: normal, subnormal (M * 2**-24, exact), Inf/NaN (payload << 13)."""
    codes = check_input(codes, np.uint16, "codes")
    c = codes.astype(np.uint32)
    sign = (c & 0x8000) << 16
    e = (c >> FP16.man_bits) & 0x1F
    man = c & FP16.man_mask
    normal = sign | ((e + 127 - FP16.bias) << 23) | (man << FP16.shift)
    subnormal = sign | (man.astype(np.float32) * np.float32(FP16.min_subnormal)).view(np.uint32)
    special = sign | (0xFF << 23) | (man << FP16.shift)
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
    return gather(decode_table(), codes, out, BLOCK)
