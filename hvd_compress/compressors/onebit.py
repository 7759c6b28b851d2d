"""OneBitCompressor: one sign bit per value and the mean |x| of each block (1-bit SGD).

1 bit + 32/block per value, about 28x fewer bytes than float32 at block 256; it travels by
allgather only. Biased: error feedback is its default (`error_feedback = True`). The codec is
codecs/onebit.py.
"""
from ..codecs import onebit as onebit_codec
from .blockcodec import BlockCodec, check_scales

__all__ = ["OneBitCompressor"]


class OneBitCompressor(BlockCodec):
    """float32 -> one sign bit per value and the mean |x| of each block (1-bit SGD); biased, so
    `hc.DistributedOptimizer` turns error feedback on for it unless told otherwise."""
    name = "onebit"
    bits = 1
    error_feedback = True

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        onebit_codec.encode(flat, codes, scales, block)

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        out.zero_()
        check_scales(cls.name, scales)
        onebit_codec.decode_accumulate(codes, scales, out, block)
