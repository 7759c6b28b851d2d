"""The number formats of the codecs, described by their numbers only: the two OCP 8-bit
floats and IEEE float16.

A `FloatFormat` says how its 8 or 16 bits are split (1 sign, `exp_bits`, `man_bits`), the exponent
bias, and whether the all-ones exponent means Inf/NaN (IEEE style, E5M2) or is an ordinary
binade with a single NaN pattern S.1111.111 (the "fn" = finite-only style, E4M3).  The codecs
derive every constant they need (shifts, thresholds, special codes) from these fields, so the
arithmetic in fp8_numpy / fp8_torch reads the same for both formats.

    E4M3 (float8_e4m3fn): S EEEE MMM, bias 7,  no Inf, NaN = S.1111.111,  max 448,   min sub 2**-9
    E5M2 (float8_e5m2):   S EEEEE MM, bias 15, Inf = S.11111.00, NaN = S.11111.{01,10,11},
                                                                       max 57344, min sub 2**-16

This module also holds the few array-plumbing helpers every NumPy/torch codec module shares
(block iteration): they are library-free, so importing it never imports torch.
"""
from dataclasses import dataclass

__all__ = ["FloatFormat", "Float8Format", "E4M3", "E5M2", "FP16", "BLOCK", "TORCH_BLOCK",
           "SCALE_BLOCK", "block_ranges"]


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

    def is_nan_code(self, code: int) -> bool:
        """True when the 8-bit `code` (any sign) decodes to NaN."""
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
# (scripts/bench_codec.py --block-sizes measures).
BLOCK = 1 << 16          # NumPy codecs: 256 KiB per int32 scratch buffer
TORCH_BLOCK = 1 << 20    # torch codecs: 4 MiB per int32 scratch buffer


def block_ranges(n: int, block: int = BLOCK):
    """Yield (start, stop) pairs that cover range(n) in steps of `block`."""
    for start in range(0, n, block):
        yield start, min(start + block, n)
