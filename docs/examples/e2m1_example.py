"""E2M1Compressor: gradients as 4-bit floats (OCP MX FP4, E2M1: 1 sign, 2 exponent, 1 mantissa
bit, exponent bias 1), two codes a byte, with a power-of-two scale per block of values, decoded
and summed in float32 by every rank (docs/extending.md walks through it).

    code & 7    0    1    2    3    4    5    6    7          code 8 (-0): NaN
    magnitude   0    0.5  1    1.5  2    3    4    6          bit 3: the sign

A block's scale s is the largest power of two with (largest finite |x|) * s <= 6, so no finite
value saturates; x * s rounds to the nearest code, ties to the even code (the one whose
mantissa bit is 0). E2M1 has no Inf and no NaN, so: NaN is sent as code 8 (negative zero,
which no value needs: a zero is sent as code 0) and decodes to NaN; a block holding +-Inf is
scaled to 3 instead of 6, its +-Inf sent as code 7 / 15, and its scale stored negative, which
says "code 7 means Inf here" (bit8's rule for E4M3, which has no Inf either).

Codes pack two a byte, value 2i in the low nibble of byte i and value 2i+1 in the high one;
an odd count leaves the last high nibble 0. The registry entry's code_bytes says so.
"""
import torch

from hvd_compress.compressors.blockcodec import BlockCodec
from hvd_compress.registry import Route, Scheme, register

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NAN_CODE, MAX_CODE, SIGN = 8, 7, 8
# Between magnitude k and k+1: a tie goes to the even code, so the boundary after an even k
# is passed only by a larger value (>), after an odd k by an equal one too (>=).
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def block_scales(x, block):
    """The signed power-of-two scale of each block of `block` values (the last may be shorter):
    largest 2**k, k in [-126, 127], with amax * 2**k <= 6 (<= 3 and negative if the block
    holds +-Inf); 1 for a block of zeros or NaN alone."""
    pad = -x.numel() % block
    mag = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, block)
    has_inf = torch.isinf(mag).any(dim=1)
    amax = torch.where(torch.isfinite(mag), mag, 0.0).amax(dim=1)
    target = torch.where(has_inf, 3.0, 6.0)
    ma, ea = torch.frexp(amax)
    mt, et = torch.frexp(target)
    k = torch.where(amax > 0, et - ea - (ma > mt).to(ea.dtype), 0).clamp_(-126, 127)
    scale = torch.ldexp(torch.ones_like(amax), k)
    return torch.where(has_inf, -scale, scale)


def encode_values(x, scales, block):
    """One 4-bit code (in a uint8) per value of x, scaled by its block's |scale|."""
    y = x * scales.abs().repeat_interleave(block)[:x.numel()]
    mag = y.abs().nan_to_num(nan=0.0, posinf=6.0)        # +-Inf -> the largest code
    code = torch.zeros(x.numel(), dtype=torch.uint8, device=x.device)
    for k, edge in enumerate(MIDPOINTS):
        code += (mag > edge if k % 2 == 0 else mag >= edge).to(torch.uint8)
    code = torch.where((y < 0) & (code > 0), code | SIGN, code)    # a zero is code 0
    return torch.where(torch.isnan(y), NAN_CODE, code).to(torch.uint8)


def decode_values(code, scales, block):
    """float32 values of one row of 4-bit codes with its block scales."""
    table = torch.tensor(MAGNITUDES, dtype=torch.float32, device=code.device)
    per_value = scales.repeat_interleave(block)[:code.numel()]
    mag = table[(code & MAX_CODE).long()]
    mag = torch.where((per_value < 0) & ((code & MAX_CODE) == MAX_CODE), torch.inf, mag)
    values = torch.where(code & SIGN > 0, -mag, mag) * per_value.abs().reciprocal()
    return torch.where(code == NAN_CODE, torch.nan, values)


def pack(code, out):
    """Two codes a byte into `out` (ceil(numel / 2) bytes): even values low, odd values high."""
    if code.numel() % 2:
        code = torch.cat([code, code.new_zeros(1)])
    pairs = code.view(-1, 2)
    out.copy_(pairs[:, 0] | (pairs[:, 1] << 4))


def unpack(packed, numel):
    """The inverse of pack: `numel` codes from ceil(numel / 2) bytes."""
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:numel]


def check_scales(scales):
    """A corrupt message must not decode into garbage: every scale is +-2**k, k in [-126, 127]."""
    mantissa, _ = torch.frexp(scales.abs())
    if not bool((torch.isfinite(scales) & (mantissa == 0.5) & (scales.abs() >= 2.0 ** -126)).all()):
        raise ValueError("corrupt bucket message: e2m1 block scales must be powers of two")


class E2M1Compressor(BlockCodec):
    name = "e2m1"
    bits = 4

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        """flat: numel float32 values -> codes (ceil(numel/2) uint8, every byte written) and
        scales (ceil(numel/block) float32)."""
        scales.copy_(block_scales(flat, block))
        pack(encode_values(flat, scales, block), codes)

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        """Rows of codes and scales, one per rank, in rank order -> out = their sum in float32,
        row 0 + row 1 + ... (out's old contents are overwritten; the caller divides)."""
        check_scales(scales)
        numel = out.numel()
        out.copy_(decode_values(unpack(codes[0], numel), scales[0], block))
        for r in range(1, codes.shape[0]):
            out.add_(decode_values(unpack(codes[r], numel), scales[r], block))


register(Scheme(
    name="e2m1", bits=4, routes=(Route.ALLGATHER, Route.ALLTOALL),
    summary="OCP FP4 E2M1 codes, two a byte, power-of-two scale per block, reduced in float32",
    compressor=E2M1Compressor, flag="--e2m1-allreduce",
    code_bytes=lambda numel: -(-numel // 2),          # two codes a byte
    carries_values=True))                             # Compression.auto may choose it
