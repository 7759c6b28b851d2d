"""The bit-level reference encoder, written once: float32 -> E4M3 / E5M2 / float16 codes.

Every step is an integer operation on the float32 bit pattern (fp8_numpy's docstring derives
the constants; formats.FloatFormat computes them).  NumPy and torch spell these operations
differently (np.right_shift / torch.bitwise_right_shift, np.minimum / torch.clamp_max, ...),
so `encode_bits_block` calls them through `ops`, a small table of array operations that uses
NumPy's names and argument order, `op(a, b, out=c)`:

    bitwise_and, bitwise_or, right_shift    a & b, a | b, a >> b   (int32: >> keeps the sign)
    add, subtract, minimum, maximum         a + b, a - b, min(a, b), max(a, b)
    less, equal, greater                    a < b, a == b, a > b   (into a bool mask)
    copyto(dst, src, where=mask)            dst[mask] = src (an array or a number); without
                                            where: dst[:] = src, int32 narrowed to the codes
    int32, float32                          the library's dtypes, to view the same bits as both

numpy_common.NUMPY_OPS and torch_common.TORCH_OPS fill the table, so fp8_numpy, fp8_torch,
fp16_numpy and fp16_torch all run the code below, and cannot drift apart.  This module imports
neither library.
"""
from .formats import ABS_MASK, INF_BITS, FloatFormat

__all__ = ["encode_bits_block", "overflow_code", "ELEMENTWISE_OPS"]

# the table's entries that NumPy provides under the same name (numpy_common uses np's own)
ELEMENTWISE_OPS = ("bitwise_and", "bitwise_or", "right_shift", "add", "subtract",
                   "minimum", "maximum", "less", "equal", "greater")


def overflow_code(fmt: FloatFormat, saturate: bool) -> int:
    """Magnitude code for finite values too large for the format.

    saturate=True  -> the largest finite code (E4M3 0x7E = 448, E5M2 0x7B = 57344)
    saturate=False -> Inf where the format has one (E5M2 0x7C, float16 0x7C00), else NaN (E4M3 0x7F)
    """
    if saturate:
        return fmt.max_code
    return fmt.inf_code if fmt.has_inf else fmt.nan_code


def encode_bits_block(ops, x, codes, a, q, t, mask, *, fmt: FloatFormat, saturate: bool,
                      nan_payload: bool = False):
    """Encode one block of float32 `x` into `codes` of `fmt`, rounding to nearest even.

    a, q, t: int32 scratch (|x|'s bits, the codes, a temporary); mask: bool scratch; all as
    long as x.  saturate: where finite overflow goes, see `overflow_code` (saturating E5M2
    keeps Inf as Inf).  NaN keeps its sign and becomes S.1..1 (torch's 8-bit casts), or with
    nan_payload Inf | the top payload bits, at least 1 (NumPy's float16 cast).
    """
    u = x.view(ops.int32)                                   # the float32 bits as integers
    ops.bitwise_and(u, ABS_MASK, out=a)                     # a = bits of |x|
    # 1. normal results: one add re-biases the exponent and rounds half up, plus the lsb
    #    of the kept bits (ties to even); then drop the `shift` low mantissa bits
    ops.right_shift(a, fmt.shift, out=t)
    ops.bitwise_and(t, 1, out=t)                            # t = the lsb that breaks ties
    ops.add(a, fmt.rebias_round, out=q)
    ops.add(q, t, out=q)
    ops.right_shift(q, fmt.shift, out=q)
    # 2. subnormal results (|x| < min normal): the FPU rounds |x| + MAGIC to the subnormal
    #    grid (MAGIC is a power of two, added in float32), and the low bits are the code
    ops.add(a.view(ops.float32), fmt.magic, out=t.view(ops.float32))
    ops.subtract(t, fmt.magic_bits, out=t)
    ops.less(a, fmt.min_normal_bits, out=mask)
    ops.copyto(q, t, where=mask)
    # 3. overflow: q grows with a, so one minimum sends every too-large value and Inf to cap
    cap = overflow_code(fmt, saturate)
    ops.minimum(q, cap, out=q)
    if saturate and fmt.has_inf:                            # saturating E5M2: Inf stays Inf
        ops.equal(a, INF_BITS, out=mask)
        ops.copyto(q, fmt.inf_code, where=mask)
    # 4. NaN inputs (a above Inf's bits); when cap is the NaN code, step 3 already did it
    if cap != fmt.nan_code:
        nan = fmt.nan_code                                  # S.1..1
        if nan_payload:                                     # Inf | top payload bits (>= 1)
            ops.right_shift(a, fmt.shift, out=t)
            ops.bitwise_and(t, fmt.man_mask, out=t)
            ops.maximum(t, 1, out=t)
            ops.bitwise_or(t, fmt.inf_code, out=t)
            nan = t
        ops.greater(a, INF_BITS, out=mask)
        ops.copyto(q, nan, where=mask)
    # 5. sign: bit 31 -> the code's top bit (bit 7 or 15)
    ops.right_shift(u, 32 - fmt.bits, out=t)
    ops.bitwise_and(t, fmt.sign_bit, out=t)
    ops.bitwise_or(q, t, out=q)
    ops.copyto(codes, q)                                    # values fit the 8 or 16 code bits
