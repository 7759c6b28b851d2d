"""The number formats of the codecs, described by their numbers only: the two OCP 8-bit
floats and IEEE float16.

A `FloatFormat` says how its 8 or 16 bits are split (1 sign, `exp_bits`, `man_bits`), the exponent
bias, and whether the all-ones exponent means Inf/NaN (IEEE style, E5M2) or is an ordinary
binade with a single NaN pattern S.1111.111 (the "fn" = finite-only style, E4M3).  The codecs
derive every constant they need (shifts, thresholds, special codes) from these fields, so one
bit-level encoder (reference.py) serves all three formats, in NumPy and in torch.

    E4M3 (float8_e4m3fn): S EEEE MMM, bias 7,  no Inf, NaN = S.1111.111,  max 448,   min sub 2**-9
    E5M2 (float8_e5m2):   S EEEEE MM, bias 15, Inf = S.11111.00, NaN = S.11111.{01,10,11},
                                                                       max 57344, min sub 2**-16

    FP16 (IEEE float16):  S EEEEE MMMMMMMMMM, bias 15, Inf = S.11111.0, NaN = S.11111.(!= 0),
                                                                       max 65504, min sub 2**-24

This module also holds the array plumbing every NumPy/torch codec module shares (the block
loop, `for_blocks`): it is library-free, so importing it never imports torch.
"""
import math
import struct
from dataclasses import dataclass

__all__ = ["FloatFormat", "Float8Format", "E4M3", "E5M2", "FP16", "BLOCK", "TORCH_BLOCK",
           "SCALE_BLOCK", "block_ranges", "for_blocks", "INF_BITS", "ABS_MASK"]

INF_BITS = 0x7F800000       # float32 +Inf; any larger magnitude pattern is NaN
ABS_MASK = 0x7FFFFFFF


@dataclass(frozen=True)
class FloatFormat:
    """One float format.  Frozen, so it can be a dict key or an lru_cache argument."""

    name: str               # "e4m3fn", "e5m2" or "float16"
    exp_bits: int
    man_bits: int
    bias: int
    has_inf: bool           # True: exponent all-ones is Inf/NaN (IEEE); False: only S.1..1.1..1 is NaN
    max_finite: float
    min_subnormal: float
    torch_dtype_name: str   # also the ml_dtypes name

    # ---- derived codes (magnitudes, i.e. without the sign bit) -----------------------------
    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def code_bytes(self) -> int:
        return self.bits // 8

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def nan_code(self) -> int:
        """The NaN magnitude with all exponent and mantissa bits set (torch's 8-bit NaN)."""
        return self.sign_bit - 1

    @property
    def inf_code(self):
        """Magnitude code of Inf (exponent all ones, mantissa 0), or None when there is no Inf."""
        return ((1 << self.exp_bits) - 1) << self.man_bits if self.has_inf else None

    @property
    def max_code(self) -> int:
        """Magnitude code of the largest finite value (0x7E for E4M3, 0x7B for E5M2)."""
        return self.inf_code - 1 if self.has_inf else self.nan_code - 1

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def man_mask(self) -> int:
        return (1 << self.man_bits) - 1

    # ---- the encoder's integer constants (fp8_numpy's docstring derives them) ---------------
    @property
    def shift(self) -> int:
        """float32 mantissa bits dropped (20 for E4M3, 13 for float16)."""
        return 23 - self.man_bits

    @property
    def rebias_round(self) -> int:
        """Added to |x|'s bits: re-bias the exponent, plus the round-half-up part of RNE."""
        return ((self.bias - 127) << 23) + (1 << (self.shift - 1)) - 1

    @property
    def min_normal_bits(self) -> int:
        """float32 bits of the smallest normal value, 2**(1-bias)."""
        return (127 + 1 - self.bias) << 23

    @property
    def magic(self) -> float:
        """2**(23 + log2(min_subnormal)): |x| + magic rounds |x| to the subnormal grid."""
        return math.ldexp(1.0, 23 + math.frexp(self.min_subnormal)[1] - 1)

    @property
    def magic_bits(self) -> int:
        return struct.unpack("<i", struct.pack("<f", self.magic))[0]

    def is_nan_code(self, code: int) -> bool:
        """True when `code` (any sign) decodes to NaN."""
        mag = code & (self.sign_bit - 1)
        if self.has_inf:
            return mag > self.inf_code
        return mag == self.nan_code


Float8Format = FloatFormat     # the name the 8-bit codecs and their tests use

E4M3 = Float8Format(
    name="e4m3fn", exp_bits=4, man_bits=3, bias=7, has_inf=False,
    max_finite=448.0, min_subnormal=2.0 ** -9, torch_dtype_name="float8_e4m3fn",
)
E5M2 = Float8Format(
    name="e5m2", exp_bits=5, man_bits=2, bias=15, has_inf=True,
    max_finite=57344.0, min_subnormal=2.0 ** -16, torch_dtype_name="float8_e5m2",
)
FP16 = FloatFormat(
    name="float16", exp_bits=5, man_bits=10, bias=15, has_inf=True,
    max_finite=65504.0, min_subnormal=2.0 ** -24, torch_dtype_name="float16",
)

# Values per power-of-two scale in a bucket (codecs/blocks.py). The OCP MX formats share one
# scale per 32 values; 256 keeps the scales at 4/256 = 1.6% of an 8-bit bucket, and a block is
# still small enough that one large gradient does not push its neighbours' values out of range
# (docs/codecs.md gives the error bound).
SCALE_BLOCK = 256

# ---- shared plumbing ---------------------------------------------------------------------
# Codecs work block by block so their temporaries (a few blocks' worth) stay in cache and are
# reused, instead of allocating and page-faulting several 64 MB arrays per call.
# NumPy runs one thread and likes L2-sized blocks.  torch splits every op over its threads, and
# each op is then a parallel region whose start/end costs grow sharply when the cores are
# shared (other jobs, several ranks per machine), so torch gets fewer, larger blocks (L3-sized):
# on the 2-core dev machine 2**20 beat 2**18 both idle and under load
# (labs/bench/codec.py --block-sizes measures).
BLOCK = 1 << 16          # NumPy codecs: 256 KiB per int32 scratch buffer
TORCH_BLOCK = 1 << 20    # torch codecs: 4 MiB per int32 scratch buffer


def block_ranges(n: int, block: int = BLOCK):
    """Yield (start, stop) pairs that cover range(n) in steps of `block`."""
    for start in range(0, n, block):
        yield start, min(start + block, n)


def for_blocks(src, dst, block, kernel, scratch, empty, multiply, scale=None):
    """The codecs' block loop, written once: kernel(src_b, dst_b, *scratch_b) for each block of
    `block` elements of the flat arrays `src` and `dst` (NumPy or torch; the caller passes its
    library's `empty(size, dtype)` and `multiply(a, b, out=)`).

    scratch: dtypes of the work buffers the kernel gets, allocated once at the size of one
    block and sliced to each block's length.  scale: when not None, src_b is src's block times
    `scale`, multiplied into one more reused buffer (so x * scale never exists in full).
    """
    n = len(src)
    size = max(1, min(n, block))
    buffers = [empty(size, dtype) for dtype in scratch]
    scaled = empty(size, src.dtype) if scale is not None else None
    for start, stop in block_ranges(n, size):
        k = stop - start
        src_b = src[start:stop] if scale is None else multiply(src[start:stop], scale, out=scaled[:k])
        kernel(src_b, dst[start:stop], *(b[:k] for b in buffers))
    return dst
