"""BF16Compressor: gradients as bfloat16 codes, on the packet routes, reduced in float32.

bfloat16 keeps float32's 8 exponent bits and 7 of its 23 mantissa bits, so it needs no scale
(nothing underflows that float32 holds) and halves the bytes. PyTorch DDP ships it as a comm
hook (BF16_COMPRESS, summed in bfloat16); Horovod 0.28.1's allreduce refuses bfloat16 tensors
("Tensor type torch.BFloat16Tensor is not supported", horovod#4047). Here every rank decodes
every rank's codes and sums them in float32, in rank order, as bit16 does.

    codec    float32 -> bfloat16 by round-to-nearest-even (torch's cast; bit-exact against
             ml_dtypes.bfloat16, tests/test_bfloat16.py); NaN stays NaN (0x7fc0, its sign
             kept), +-Inf stays +-Inf;
             finite values past bfloat16's largest round to +-Inf, as the cast does
    message  [bfloat16 codes | padding to 4 bytes]: 2 bytes a value, no block scales
"""
import torch

from .blockcodec import BlockCodec

__all__ = ["BF16Compressor", "encode", "decode_accumulate"]


QUIET_NAN = 0x7FC0          # what a NaN becomes, its sign kept (ml_dtypes' choice)


def encode(flat, codes):
    """float32 values -> bfloat16 bit patterns (int16 `codes`), round-to-nearest-even; a NaN
    becomes the quiet NaN 0x7fc0 with its sign (torch's cast leaves 0xffff)."""
    codes.copy_(flat.to(torch.bfloat16).view(torch.int16))
    nan = torch.isnan(flat)
    if bool(nan.any()):
        negative = flat.view(torch.int32) < 0
        canonical = torch.where(negative, QUIET_NAN - 0x10000 + 0x8000, QUIET_NAN).to(torch.int16)
        codes.copy_(torch.where(nan, canonical, codes))
    return codes


def decode_accumulate(codes, out):
    """out = sum over rows r (rank order) of the bfloat16 values of codes[r], in float32."""
    values = codes.view(torch.bfloat16)
    out.copy_(values[0])
    for row in values[1:]:
        out.add_(row.to(torch.float32))
    return out


class BF16Compressor(BlockCodec):
    """float32 -> bfloat16 codes (2 bytes a value), summed in float32 by every rank."""
    name = "bf16"
    bits = 16
    block_scales = False

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        encode(flat, _int16(codes))

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        decode_accumulate(_int16(codes), out)


def _int16(raw):
    """uint8 code bytes (1-D, or 2-D rows) viewed as int16 bfloat16 patterns."""
    if raw.storage_offset() % 2 or (raw.dim() == 2 and raw.stride(0) % 2):
        raise ValueError("bfloat16 codes must start at an even byte offset")
    return raw.view(torch.int16)
