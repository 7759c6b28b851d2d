"""What the torch codecs (fp8_torch, fp16_torch) share: argument checks, the block loop, the
table of array operations the bit-level encoder (reference.py) runs on, and the inputs of
their one-time fast-path probes."""
from types import SimpleNamespace

import torch

from .formats import for_blocks

__all__ = ["check_input", "prepare_out", "effective_scale", "run_blocks", "ENCODE_SCRATCH",
           "TORCH_OPS", "probe_inputs", "may_hold_nan"]

# the work buffers of the bit-level encoders: a = |x| bits, q = codes, t = temporary, a mask
ENCODE_SCRATCH = (torch.int32, torch.int32, torch.int32, torch.bool)


def _copyto(dst, src, where=None):
    """np.copyto for tensors: dst[where] = src (a tensor or a number), or without `where`
    dst[:] = src (int32 -> uint8/int16 keeps the low bits)."""
    if where is None:
        return dst.copy_(src)
    if isinstance(src, torch.Tensor):
        return torch.where(where, src, dst, out=dst)
    return dst.masked_fill_(where, src)


# reference.encode_bits_block's operations under NumPy's names (`b` is a number where
# torch needs one: clamp_max / clamp_min are the minimum / maximum with a number)
TORCH_OPS = SimpleNamespace(
    bitwise_and=torch.bitwise_and, bitwise_or=torch.bitwise_or, right_shift=torch.bitwise_right_shift,
    add=torch.add, subtract=torch.sub, minimum=torch.clamp_max, maximum=torch.clamp_min,
    less=torch.lt, equal=torch.eq, greater=torch.gt, copyto=_copyto,
    int32=torch.int32, float32=torch.float32)


def check_input(x, dtype, what: str) -> torch.Tensor:
    """Return `x` detached and contiguous, or raise TypeError if it is not a tensor of dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor of {dtype}, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{what} must have dtype {dtype}, got {x.dtype}")
    return x.detach().contiguous()


def prepare_out(out, like: torch.Tensor, dtype) -> torch.Tensor:
    """A fresh output tensor shaped like `like`, or check the caller's `out`."""
    if out is None:
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    if not isinstance(out, torch.Tensor) or out.dtype != dtype:
        raise TypeError(f"out must be a torch.Tensor of {dtype}")
    if out.shape != like.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(like.shape)}")
    if out.device != like.device:
        raise ValueError(f"out is on {out.device}, input on {like.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out


def effective_scale(scale):
    """None when there is nothing to multiply by (None or 1.0), else the scale as a float."""
    if scale is None:
        return None
    scale = float(scale)
    return None if scale == 1.0 else scale


def run_blocks(src: torch.Tensor, dst: torch.Tensor, block: int, kernel, scratch=(), scale=None):
    """formats.for_blocks on the flat views of two tensors, scratch on src's device."""
    device = src.device

    def empty(size, dtype):
        return torch.empty(size, dtype=dtype, device=device)

    return for_blocks(src.view(-1), dst.view(-1), block, kernel, scratch, empty, torch.mul, scale)


def may_hold_nan(t: torch.Tensor) -> bool:
    """False only if `t` holds no NaN: a NaN makes the sum NaN (Inf - Inf may too: harmless,
    the caller then just looks block by block).  One reduction, no temporary tensor."""
    return t.numel() > 0 and bool(torch.isnan(t.sum()))


FP8_LOW_HALVES = (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)


def probe_inputs(device, low_halves=FP8_LOW_HALVES) -> torch.Tensor:
    """float32 inputs for the one-time fast-path probes: every value of the top 16 bits (sign,
    exponent, 7 mantissa bits: every binade, every rounding and tie position of the 8-bit
    formats, Inf and NaN) times a few low halves (default: exact, just above, just below,
    at and around the tie of bit 15) -> 65536 * 6 = 393,216 values."""
    hi = torch.arange(1 << 16, dtype=torch.int64, device=device) << 16
    lo = torch.tensor(low_halves, dtype=torch.int64, device=device)
    bits = (hi[:, None] | lo[None, :]).reshape(-1)
    return bits.to(torch.int32).view(torch.float32)   # int64 -> int32 keeps the low 32 bits
