"""float32 <-> IEEE float16 codes (uint16) in NumPy, by bit manipulation of the int32 view.

The same recipe as fp8_numpy (read that module's docstring first), with 10 mantissa bits and
bias 15: the same code (reference.encode_bits_block) with formats.FP16's constants.  The
reference is NumPy itself: `x.astype(np.float16)` and `.astype(np.float32)`, matched bit for
bit on every input, NaN payloads included:

* encode: round to nearest even, subnormals, finite overflow -> +-Inf.  A NaN keeps its sign
  and the top 10 bits of its payload (0x7C00 | payload >> 13); a payload that would vanish
  becomes 0x7C01 so the result stays NaN (NumPy's rule; it does not set the quiet bit).
* decode: the exact widening, NaN payload shifted back up (0x7C01 -> 0x7F802000), again as
  NumPy does (no quieting).  Done through a 65536-entry float32 table built by `decode_bits`.
"""
import functools

import numpy as np

from .formats import BLOCK, FP16
from .fp8_numpy import gather
from .numpy_common import (ENCODE_SCRATCH, NUMPY_OPS, check_input, effective_scale, prepare_out,
                           run_blocks)
from .reference import encode_bits_block

__all__ = ["encode", "decode", "decode_bits"]

# every constant from the format (formats.FP16): 13 float32 mantissa bits dropped, the
# smallest normal 2**-14, MAGIC 0.5 (ulp(0.5) = 2**-24 = the smallest subnormal), Inf 0x7C00;
# overflow -> Inf (saturate=False), NaN -> Inf | payload (nan_payload=True)
_encode_block = functools.partial(encode_bits_block, NUMPY_OPS, fmt=FP16, saturate=False,
                                  nan_payload=True)


def encode(x: np.ndarray, out=None, *, scale=None) -> np.ndarray:
    """Encode float32 `x` to float16 bit patterns (uint16), identical to `x.astype(np.float16)`.
    scale: encode x * scale instead, as fp8_numpy.encode does."""
    x = check_input(x, np.float32, "x")
    out = prepare_out(out, x.shape, np.uint16)
    run_blocks(x, out, BLOCK, _encode_block, ENCODE_SCRATCH, effective_scale(scale))
    return out


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
