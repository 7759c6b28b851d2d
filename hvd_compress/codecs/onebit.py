"""1-bit sign codec: the sign of every value, 8 to a byte, and one magnitude per block.

1-bit SGD (Seide et al., Interspeech 2014) sends signs only; scaling each block's signs by the
block's mean |x| (as EF-signSGD does per tensor: Karimireddy et al., ICML 2019,
https://arxiv.org/abs/1901.09847) keeps the decoded gradient's L1 norm per block, so the step
size does not depend on the gradient's scale. Alone it is biased; error feedback (exchange/memory.py)
carries what it drops to the next step, which is why `Compression.onebit` turns it on.

    signs   bit j of byte i is value 8i + j (least significant bit first, as
            numpy.packbits(bitorder="little")); 1 where x < 0 (so -0.0 and +0.0 both give 0)
    means   float32, one per block of `block` values: mean |x| over the block's own values
            (the last block may be shorter)
    decode  x~ = means[block of i] * (+1 if bit i is 0 else -1)

A block of zeros decodes to zeros (mean 0). There is no code for NaN/Inf: a non-finite value
raises ValueError instead of turning a whole block's magnitude into NaN unseen.
"""
import torch

__all__ = ["num_blocks", "sign_bytes", "pack_signs", "unpack_signs", "encode", "decode",
           "decode_accumulate"]

_BIT = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)
_SHIFT = torch.arange(8, dtype=torch.uint8)


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def sign_bytes(numel: int) -> int:
    """Bytes of packed signs for `numel` values: ceil(numel / 8)."""
    return -(-numel // 8)


def pack_signs(negative: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (True: negative) into `out`, uint8, ceil(numel / 8) bytes, LSB first;
    the unused high bits of the last byte are 0."""
    n = negative.numel()
    bits = negative.reshape(-1).to(torch.uint8)
    if n % 8:
        bits = torch.nn.functional.pad(bits, (0, 8 - n % 8))
    torch.sum(bits.view(-1, 8) * _BIT.to(bits.device), dim=1, dtype=torch.uint8, out=out)
    return out


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first `numel` bits of `packed` as a bool tensor (True: negative)."""
    if packed.numel() != sign_bytes(numel):
        raise ValueError(f"{packed.numel()} sign bytes cannot hold {numel} values "
                         f"(need {sign_bytes(numel)})")
    bits = (packed.unsqueeze(1) >> _SHIFT.to(packed.device)) & 1
    return bits.view(-1)[:numel].bool()


def encode(x, signs, means, block):
    """Write the packed signs (ceil(numel/8) bytes) and per-block mean |x| (float32) of `x`."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError("onebit codec: non-finite gradient values (NaN/Inf) cannot be encoded")
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    if n == 0:
        return
    nb = num_blocks(n, block)
    pad = nb * block - n
    mag = flat.abs()
    sums = (torch.nn.functional.pad(mag, (0, pad)) if pad else mag).view(nb, block).sum(dim=1)
    counts = torch.full((nb,), float(block), device=flat.device)
    counts[-1] = n - (nb - 1) * block
    torch.div(sums, counts, out=means)
    pack_signs(flat < 0, signs)


def decode(signs, means, numel, block, out=None):
    """The decoded values: each block's mean with each value's sign (float32, numel values)."""
    if means.numel() != num_blocks(numel, block):
        raise ValueError(f"{means.numel()} block magnitudes for {numel} values in blocks of "
                         f"{block} (need {num_blocks(numel, block)})")
    negative = unpack_signs(signs, numel)
    mag = means.repeat_interleave(block)[:numel] if numel else means[:0]
    values = torch.where(negative, -mag, mag)
    if out is None:
        return values
    return out.copy_(values.view_as(out))


def decode_accumulate(signs2d, means2d, out, block):
    """``out += decode(row)`` for each row (a rank's message) in order, float32."""
    n = out.numel()
    for s, m in zip(signs2d, means2d):
        out.add_(decode(s, m, n, block).view_as(out))
    return out
