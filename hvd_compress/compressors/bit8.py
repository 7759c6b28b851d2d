"""Bit8Compressor: float32 gradients as scaled OCP E4M3 codes (scaled_float.py: the packet)."""
from ..codecs import E4M3
from .scaled_float import ScaledFloatCompressor

__all__ = ["Bit8Compressor"]


class Bit8Compressor(ScaledFloatCompressor):
    """float32 -> scaled OCP E4M3 (torch.float8_e4m3fn bits), 1 byte per value + 8-byte header.

    Relative error <= 2**-4 for values that land in E4M3's normal range after scaling;
    NaN stays NaN and +-Inf stays +-Inf (scaled_float.py says how).
    """
    bits = 8
    name = "bit8"
    fmt = E4M3
