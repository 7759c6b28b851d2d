"""bfloat16 codes of float32 values: float32's 8 exponent bits and 7 of its 23 mantissa bits.

    encode   float32 -> bfloat16 by round-to-nearest-even (torch's cast; bit-exact against
             ml_dtypes.bfloat16, tests/test_bfloat16.py); NaN stays NaN (0x7fc0, its sign
             kept), +-Inf stays +-Inf; finite values past bfloat16's largest round to +-Inf,
             as the cast does
    decode   every rank's codes summed in float32, in rank order
"""
import torch

__all__ = ["QUIET_NAN", "encode", "decode_accumulate"]

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
