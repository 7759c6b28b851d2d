"""Bit16Compressor: float32 gradients as scaled IEEE float16 codes (scaled_float.py: the packet)."""
from ..codecs import FP16
from .scaled_float import ScaledFloatCompressor

__all__ = ["Bit16Compressor"]


class Bit16Compressor(ScaledFloatCompressor):
    """float32 -> scaled IEEE float16 bits, 2 bytes per value + 8-byte header.

    Unlike Horovod's `Compression.fp16` (a plain cast, summed in float16 by allreduce), the
    values are scaled first, so gradients below float16's normal range (6.1e-5) keep their
    11 significant bits, and ranks reduce in float32. Relative error <= 2**-11 for normal values.
    """
    bits = 16
    name = "bit16"
    fmt = FP16
