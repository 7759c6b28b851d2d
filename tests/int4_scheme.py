"""A throwaway sub-byte scheme for the tests (not shipped): int4, a code of 4 bits per value, two
codes a byte, a float32 scale per block (amax / 7), round to nearest. Written as
docs/extending.md asks of a new compressor: a BlockCodec subclass and its registry entry, here
registered by the test that needs it (register(), then unregister()) so that no other test
sees it."""
import torch

from hvd_compress import registry
from hvd_compress.compressors.blockcodec import BlockCodec

NAME = "int4test"


class Int4Compressor(BlockCodec):
    """float32 -> int4 codes in [-7, 7] (stored + 8, two a byte, low nibble first) with a scale
    per block (amax / 7)."""
    name = NAME
    bits = 4

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        numel = flat.numel()
        count = scales.numel()
        padded = torch.zeros(count * block, dtype=torch.float32)
        padded[:numel] = flat
        blocks = padded.view(count, block)
        scale = blocks.abs().amax(dim=1) / 7
        scales.copy_(scale)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (torch.round(blocks / safe[:, None]).clamp(-7, 7) + 8).to(torch.uint8).flatten()
        q = q[:numel]
        if numel % 2:
            q = torch.cat([q, torch.full((1,), 8, dtype=torch.uint8)])
        pairs = q.view(-1, 2)
        codes.copy_(pairs[:, 0] | (pairs[:, 1] << 4))

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        numel = out.numel()
        out.zero_()
        for row_codes, row_scales in zip(codes.reshape(-1, codes.shape[-1]),
                                         scales.reshape(-1, scales.shape[-1])):
            q = torch.stack([row_codes & 15, row_codes >> 4], dim=1).flatten()[:numel]
            values = (q.to(torch.float32) - 8) * row_scales.repeat_interleave(block)[:numel]
            out.add_(values)


SCHEME = registry.Scheme(
    NAME, 4, (registry.Route.ALLGATHER, registry.Route.ALLTOALL),
    "int4 (tests only): amax/7 scale per block, two codes a byte",
    Int4Compressor, code_bytes=lambda numel: -(-numel // 2), carries_values=True)


def register():
    registry.register(SCHEME)


def unregister():
    registry.SCHEMES.pop(NAME, None)
