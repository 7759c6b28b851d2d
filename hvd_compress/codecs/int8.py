"""Uniform int8 block codec with stochastic rounding (QSGD-style, unbiased).

One float32 scale per block of ``block`` values: ``scale = amax / 127`` of the block (not a
power of two: a power of two wastes up to half of the 255 levels, about one bit, and int8
has no exponent to make up for it). A value ``x`` becomes ``floor(x / scale + u)`` with
``u ~ U[0, 1)`` from the caller's ``torch.Generator``, so ``E[decode(encode(x))] = x``;
deterministic per seed, and ranks must use different seeds (e.g. ``seed + rank``).
An all-zero block gets scale 0 and codes 0. int8 has no NaN/Inf code: a non-finite value
raises ValueError (bit8 carries them; here they would poison the block's scale silently).
"""
import torch

__all__ = ["LEVELS", "num_blocks", "encode", "decode_accumulate"]

LEVELS = 127


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _padded(x: torch.Tensor, block: int) -> torch.Tensor:
    nb = num_blocks(x.numel(), block)
    pad = nb * block - x.numel()
    flat = x.reshape(-1)
    return torch.nn.functional.pad(flat, (0, pad)).view(nb, block) if pad else flat.view(nb, block)


def encode(x, codes, scales, block, generator):
    """Write int8 ``codes`` (numel) and float32 ``scales`` (one per block) of float32 ``x``."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError("int8 codec: non-finite gradient values (NaN/Inf) cannot be encoded")
    v = _padded(x.float(), block)
    s = v.abs().amax(dim=1) / LEVELS
    scales.copy_(s)
    safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(1)
    u = torch.rand(v.shape, generator=generator, dtype=torch.float32)
    q = torch.floor(v / safe + u).clamp_(-LEVELS, LEVELS)
    codes.copy_(q.reshape(-1)[: x.numel()].to(torch.int8))


def decode_accumulate(codes2d, scales2d, out, block):
    """``out += sum over rows r of codes2d[r] * scales2d[r]`` in rank order, float32."""
    n = out.numel()
    for c, s in zip(codes2d, scales2d):
        v = _padded(c.to(torch.float32), block) * s.unsqueeze(1)
        out.add_(v.reshape(-1)[:n].view_as(out))
    return out
