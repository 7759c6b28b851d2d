"""Step 2: Bit8Compressor and Bit16Compressor, in NumPy, behind Horovod's Compressor interface.

Write every function marked TODO. `python check.py` holds them to this docstring (its examples,
round trips, the packet's layout) and says what is wrong; the course's grader checks them bit for
bit against its reference. Nothing else in the kit calls them until you do (step 3: your patch
makes `hvd.Compression.bit8` resolve to them).

The formats (codes are integers; bit 7 / bit 15 is the sign):

    E4M3 (OCP 8-bit float, torch.float8_e4m3fn): 4 exponent bits, bias 7, 3 mantissa bits.
        normal   (-1)^S * 2^(E-7) * (1 + M/8),   E in 1..15 (E=15, M=7 is NaN)
        subnormal (-1)^S * 2^-6 * (M/8),          E = 0   (smallest: 2^-9)
        largest finite 448 (code 0x7E); no Inf; NaN = S.1111.111 (0x7F / 0xFF)
    float16 (IEEE binary16): 5 exponent bits, bias 15, 10 mantissa bits; Inf 0x7C00.

encode_* must round to nearest, ties to even (never truncate). E4M3: a finite value beyond 448
saturates to +-448 (0x7E / 0xFE), and so does +-Inf; NaN becomes 0x7F with its sign (0xFF).
float16: exactly NumPy's `x.astype(np.float16)` (overflow -> Inf, NaN keeps the top 10 bits of
its payload, at least 1). Subnormal results are rounded to the subnormal grid. -0 keeps its sign.

The packet (what compress returns; any rank must be able to decode any rank's packet):

    bytes 0..3  float32 scale s, little-endian: the values were multiplied by s before encoding
    bytes 4..7  uint32 flags, little-endian: 1 = the largest code means +-Inf (Bit8 only)
    bytes 8..   the codes: Bit8 one byte per value; Bit16 two bytes per value, little-endian

Why a scale: gradients are 1e-3..1e-7 and E4M3's smallest subnormal is 2^-9, so unscaled they
flush to zero. s is the largest power of two with amax * s <= 448 (float16: 65504), amax the
largest finite |value| (s = 1 when there is none). A power of two changes only exponents, so
scaling and unscaling add no rounding. Inf: E4M3 has no Inf code, and a diverging run must stay
visible. When the tensor holds +-Inf, use 224 instead of 448 for the scale and set flag 1: the
code +-448 then means +-Inf. NaN stays NaN, +-Inf stays +-Inf, 0 stays 0.

Also the exchange (used in step 3): `allreduce(tensor, compression)` averages a tensor over
the Horovod ranks by allgather of the packets, since packets of codes cannot be summed.
"""
import numpy as np
import torch

HEADER_BYTES = 8


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 array -> uint8 E4M3 codes, same shape (rules above)."""
    raise NotImplementedError("TODO: step 2, encode_e4m3")


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """uint8 E4M3 codes -> float32 values, same shape (NaN codes -> NaN)."""
    raise NotImplementedError("TODO: step 2, decode_e4m3")


def encode_fp16(x: np.ndarray) -> np.ndarray:
    """float32 array -> uint16 float16 bit patterns, same shape (== x.astype(np.float16))."""
    raise NotImplementedError("TODO: step 2, encode_fp16")


def decode_fp16(codes: np.ndarray) -> np.ndarray:
    """uint16 float16 bit patterns -> float32 values, same shape."""
    raise NotImplementedError("TODO: step 2, decode_fp16")


class Bit8Compressor:
    """Horovod's Compressor interface (horovod/torch/compression.py): two static methods."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        """-> (packet: 1-D torch.uint8 tensor laid out as above, ctx to undo it).
        Any shape; float32, float64, float16 or bfloat16; empty tensors too."""
        raise NotImplementedError("TODO: step 2, Bit8Compressor.compress")

    @staticmethod
    def decompress(packet: torch.Tensor, ctx) -> torch.Tensor:
        """-> the tensor again: the original shape and dtype, scale undone, Inf restored."""
        raise NotImplementedError("TODO: step 2, Bit8Compressor.decompress")


class Bit16Compressor:
    """As Bit8Compressor, with float16 codes (2 bytes per value, little-endian); never flags."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        raise NotImplementedError("TODO: step 2, Bit16Compressor.compress")

    @staticmethod
    def decompress(packet: torch.Tensor, ctx) -> torch.Tensor:
        raise NotImplementedError("TODO: step 2, Bit16Compressor.decompress")


def allreduce(tensor: torch.Tensor, compression, name=None) -> torch.Tensor:
    """The average of `tensor` over all Horovod ranks, sent as `compression` packets: every
    rank allgathers every rank's packet, decodes each, sums the values in float32 in rank order
    and divides by the number of ranks. Every rank gets the same result, bit for bit."""
    raise NotImplementedError("TODO: step 3, allreduce by allgather of packets")
