"""float32 <-> 8-bit float codes in NumPy, by bit manipulation of the int32 view.

This is the course's reference codec: every step is an integer operation on the float32 bit
pattern, written out so a student can follow it.  The steps are written once, in reference.py
(`encode_bits_block`), over a small table of array operations: this module runs them with
NumPy's, fp8_torch.py with torch's, and the float16 codecs with float16's constants; the tests
check them against torch's and ml_dtypes' casts.

Encoding one float32 |x| with bit pattern `a` (sign removed), for a format with `m` mantissa
bits and exponent bias `b`:

* normal result (|x| >= 2**(1-b)): re-bias the exponent and drop the 23-m low mantissa bits
  with round-to-nearest-even, all in one integer addition:
      q = (a - ((127-b) << 23) + (2**(22-m) - 1) + lsb) >> (23-m)    where lsb = (a >> (23-m)) & 1
  A mantissa that rounds up past all ones carries into the exponent, which is exactly right.
* subnormal result (|x| < 2**(1-b)): the code is |x| / min_subnormal rounded to nearest even.
  We let the FPU do that shift-and-round: adding MAGIC = 2**(23 + log2(min_subnormal)) places
  the binary point so that the float32 sum keeps exactly the bits a subnormal can hold, rounded
  to nearest even; the code is then bits(|x| + MAGIC) - bits(MAGIC).  (Float32 subnormal inputs
  give 0 either way, so this is also right when the CPU flushes denormals.)
* overflow: q grows monotonically with a, so one `minimum` clamps every too-large finite value
  and Inf to the mode's overflow code (see `overflow_code`); NaN inputs are set to S.1111111.
* sign: copied from bit 31 to bit 7.

Decoding goes through a 256-entry float32 table built once per format by `decode_bits`
(the bit-level decoder), so `decode` is one gather.
"""
import functools

import numpy as np

from .formats import BLOCK, Float8Format
from .numpy_common import (ENCODE_SCRATCH, NUMPY_OPS, check_input, effective_scale, prepare_out,
                           run_blocks)
from .reference import encode_bits_block, overflow_code

__all__ = ["encode", "decode", "decode_bits", "overflow_code", "effective_scale"]


# ---- encode ---------------------------------------------------------------------------------
def encode(x: np.ndarray, fmt: Float8Format, saturate: bool = True, out=None, *,
           scale=None) -> np.ndarray:
    """Encode float32 `x` to uint8 codes of `fmt` (round to nearest even).

    saturate=True : finite overflow -> +-max_finite.  E4M3: Inf -> +-448 too (== torch 2.13's
                    `x.to(torch.float8_e4m3fn)`).  E5M2: Inf stays Inf.
    saturate=False: finite overflow and Inf -> Inf for E5M2 (== torch / ml_dtypes cast),
                    NaN for E4M3 (== ml_dtypes `astype(float8_e4m3fn)`).
    NaN -> S.1111111 (sign kept), as torch does.
    scale: encode x * scale instead (float32 multiply, block by block: no full-size temporary);
           identical to `encode(x * np.float32(scale))`.  None or 1.0: no multiply.
    """
    x = check_input(x, np.float32, "x")
    out = prepare_out(out, x.shape, np.uint8)
    kernel = functools.partial(encode_bits_block, NUMPY_OPS, fmt=fmt, saturate=saturate)
    run_blocks(x, out, BLOCK, kernel, ENCODE_SCRATCH, effective_scale(scale))
    return out


# ---- decode ---------------------------------------------------------------------------------
def decode_bits(codes: np.ndarray, fmt: Float8Format) -> np.ndarray:
    """Bit-level decoder (builds the table `decode` uses; also readable as the definition).

    normal:    bits = S<<31 | (E + 127 - bias)<<23 | M<<(23-m)
    subnormal: value = M * min_subnormal (exact in float32)
    NaN:       the code's bits widened as above with exponent 0xFF and the quiet bit set,
               which is what torch returns (E4M3 NaN -> 0x7FF00000, E5M2 0x7D -> 0x7FE00000)
    Inf (E5M2): exponent 0xFF, mantissa 0.
    """
    codes = check_input(codes, np.uint8, "codes")
    c = codes.astype(np.uint32)
    m = fmt.man_bits
    sign = (c & 0x80) << 24
    e = (c >> m) & ((1 << fmt.exp_bits) - 1)
    man = c & ((1 << m) - 1)
    normal = sign | ((e + 127 - fmt.bias) << 23) | (man << (23 - m))
    subnormal = sign | (man.astype(np.float32) * np.float32(fmt.min_subnormal)).view(np.uint32)
    special = sign | (0xFF << 23) | (man << (23 - m))
    special = np.where(man != 0, special | 0x00400000, special)         # quiet the NaNs
    mag = c & (fmt.sign_bit - 1)
    if fmt.has_inf:
        is_special = mag >= fmt.inf_code
    else:
        is_special = mag == fmt.nan_code
    bits = np.where(is_special, special, np.where(e == 0, subnormal, normal))
    return bits.astype(np.uint32).view(np.float32)


@functools.lru_cache(maxsize=None)
def decode_table(fmt: Float8Format) -> np.ndarray:
    """float32 value of each of the 256 codes (read-only)."""
    table = decode_bits(np.arange(256, dtype=np.uint8), fmt)
    table.setflags(write=False)
    return table


def decode(codes: np.ndarray, fmt: Float8Format, out=None) -> np.ndarray:
    """Decode uint8 codes of `fmt` to float32 through the 256-entry table (bit-exact with torch)."""
    codes = check_input(codes, np.uint8, "codes")
    out = prepare_out(out, codes.shape, np.float32)
    return gather(decode_table(fmt), codes, out, BLOCK)


def gather(table: np.ndarray, codes: np.ndarray, out: np.ndarray, block: int) -> np.ndarray:
    """out = table[codes], `block` codes at a time (fp16_numpy's decoder too)."""
    # every code is a valid index, so 'clip' (no bounds check, no error path) is exact
    run_blocks(codes, out, block, lambda c, o: np.take(table, c, out=o, mode="clip"))
    return out
