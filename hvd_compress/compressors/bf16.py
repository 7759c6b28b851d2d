"""BF16Compressor: gradients as bfloat16 codes, on the packet routes, reduced in float32.

bfloat16 keeps float32's 8 exponent bits and 7 of its 23 mantissa bits, so it needs no scale
(nothing underflows that float32 holds) and halves the bytes. PyTorch DDP ships it as a comm
hook (BF16_COMPRESS, summed in bfloat16); Horovod 0.28.1's allreduce refuses bfloat16 tensors
("Tensor type torch.BFloat16Tensor is not supported", horovod#4047). Here every rank decodes
every rank's codes and sums them in float32, in rank order, as bit16 does.

    codec    codecs/bfloat16.py: round-to-nearest-even, NaN and +-Inf kept
    message  [bfloat16 codes | padding to 4 bytes]: 2 bytes a value, no block scales
"""
import torch

from ..codecs import bfloat16
from .blockcodec import BlockCodec

__all__ = ["BF16Compressor"]


class BF16Compressor(BlockCodec):
    """float32 -> bfloat16 codes (2 bytes a value), summed in float32 by every rank."""
    name = "bf16"
    bits = 16
    block_scales = False

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        bfloat16.encode(flat, _int16(codes))

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        bfloat16.decode_accumulate(_int16(codes), out)


def _int16(raw):
    """uint8 code bytes (1-D, or 2-D rows) viewed as int16 bfloat16 patterns."""
    if raw.storage_offset() % 2 or (raw.dim() == 2 and raw.stride(0) % 2):
        raise ValueError("bfloat16 codes must start at an even byte offset")
    return raw.view(torch.int16)
