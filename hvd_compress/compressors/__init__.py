"""Compressors: one file per scheme, on Horovod's two-method `Compressor` interface.

    blockcodec.py     the base of every codec of blocks of values: bucket messages, chunks and
                      the two-phase middle, written once
    scaled_float.py   the per-tensor packet bit8 and bit16 share (a power-of-two scale, codes)
    bit8.py bit16.py bf16.py int8.py onebit.py    one scheme each, a few lines over its codec

Horovod's patched source (the course route) imports this package while horovod.torch loads,
so it imports nothing above the compressors' own layer.
"""
from ..roles import FP16Compressor, NoneCompressor

from .bf16 import BF16Compressor
from .bit16 import Bit16Compressor
from .bit8 import Bit8Compressor
from .blockcodec import BlockCodec
from .int8 import Int8Compressor
from .onebit import OneBitCompressor
from .scaled_float import read_header

__all__ = ["Bit8Compressor", "Bit16Compressor", "BF16Compressor", "Int8Compressor",
           "OneBitCompressor", "BlockCodec", "compressor_name", "read_header"]


def compressor_name(compressor) -> str:
    """A stable name for any Horovod compressor (ours, Horovod's, a user's)."""
    known = {NoneCompressor: "none", FP16Compressor: "fp16"}
    return known.get(compressor, getattr(compressor, "name", getattr(compressor, "__name__", str(compressor))))
