"""float32 <-> IEEE float16 codes with torch ops only, bit-identical to NumPy's casts.

Codes are **int16** tensors holding the float16 bit patterns (torch's uint16 lacks most ops);
`codes.view(torch.float16)` is the half tensor and `codes.numpy().view(np.uint16)` equals
fp16_numpy's codes.  NumPy is the reference (see fp16_numpy): torch's own casts agree with it
on every non-NaN value but quiet NaNs (float32 0x7F800001 -> 0x7E00, not NumPy's 0x7C01;
float16 0x7C01 -> 0x7FC02000, not 0x7F802000).

* `encode_bits` / `decode_lookup`: THE REFERENCE.  Bit manipulation on the int32 view (the
  code fp16_numpy runs, reference.encode_bits_block, with torch's ops) / a gather from the
  65536-entry table built by fp16_numpy.decode_bits.
* `encode` / `decode`: THE FAST PATH.  torch's cast (on the whole tensor, or block by block
  when `scale=` is given); if the data holds a NaN (one cheap sum tells), the blocks that hold
  one are redone by the reference path, so NaN payloads come out as NumPy's.  Used only where
  a one-time probe (`cast_is_exact`, cached) finds it equal to the reference path; otherwise
  they are the reference functions.
"""
import functools

import torch

from . import fp16_numpy
from .formats import FP16, TORCH_BLOCK as BLOCK
from .fp8_torch import gather
from .reference import encode_bits_block
from .torch_common import (ENCODE_SCRATCH, TORCH_OPS, check_input, effective_scale, may_hold_nan,
                           prepare_out, probe_inputs, run_blocks)

__all__ = ["encode", "encode_bits", "decode", "decode_lookup", "cast_is_exact"]

# the reference block encoder: fp16_numpy's, with torch's ops (constants from formats.FP16)
_encode_bits_block = functools.partial(encode_bits_block, TORCH_OPS, fmt=FP16, saturate=False,
                                       nan_payload=True)

# low halves for the probe: float16 drops 13 bits (more for subnormals), so its round bit can be
# bit 12, 13, 14 or 15 of the low half: a tie there with an even and an odd lsb, each +-1
_TIES = [1 << 12, 3 << 12, 1 << 13, 3 << 13, 1 << 14, 3 << 14, 1 << 15]
_FP16_LOW_HALVES = tuple(sorted({0, 1, 0xFFFF} | {(t + d) & 0xFFFF for t in _TIES for d in (-1, 0, 1)}))


# ---- reference: bit manipulation / table --------------------------------------------------
def encode_bits(x: torch.Tensor, out=None, *, scale=None) -> torch.Tensor:
    """Reference encoder: float32 -> float16 bits (int16), == NumPy `astype(np.float16)`."""
    x = check_input(x, torch.float32, "x")
    out = prepare_out(out, x, torch.int16)
    run_blocks(x, out, BLOCK, _encode_bits_block, ENCODE_SCRATCH, effective_scale(scale))
    return out


@functools.lru_cache(maxsize=None)
def decode_table(device: torch.device) -> torch.Tensor:
    """The 65536 float32 values of float16 codes on `device` (from fp16_numpy.decode_bits)."""
    return torch.from_numpy(fp16_numpy.decode_table().copy()).to(device)


def decode_lookup(codes: torch.Tensor, out=None) -> torch.Tensor:
    """Reference decoder: a gather from the 65536-entry table, == NumPy `.astype(np.float32)`."""
    codes = check_input(codes, torch.int16, "codes")
    out = prepare_out(out, codes, torch.float32)
    return gather(decode_table(codes.device), codes, out, BLOCK, 0xFFFF)   # int16 -> 0..65535


# ---- fast path: torch's casts, NaN blocks redone by the reference ---------------------------
def _encode_cast(x, out, scale=None):
    if scale is None:
        out.view(-1).view(torch.float16).copy_(x.view(-1))    # torch's cast, whole tensor
        if not may_hold_nan(x):
            return out

    def kernel(xb, codes, *scratch):
        if scale is not None:
            codes.view(torch.float16).copy_(xb)               # torch's cast, one block
        if may_hold_nan(xb):                                  # redo this block by the reference
            _encode_bits_block(xb, codes, *scratch)

    run_blocks(x, out, BLOCK, kernel, ENCODE_SCRATCH, scale)
    return out


def _decode_cast(codes, out):
    out.view(-1).copy_(codes.view(-1).view(torch.float16))    # torch's cast, whole tensor
    if not may_hold_nan(out):
        return out
    table = decode_table(codes.device)

    def kernel(c, o):
        if may_hold_nan(o):                                   # redo this block by the reference
            gather(table, c, o, o.numel(), 0xFFFF)

    run_blocks(codes, out, BLOCK, kernel)
    return out


@functools.lru_cache(maxsize=None)
def cast_is_exact(device_type: str) -> bool:
    """Do the cast-based encode and decode equal the reference on this torch and device?
    (encode: 65536 * 24 inputs around every float16 rounding position; decode: all codes)"""
    x = probe_inputs(device_type, _FP16_LOW_HALVES)
    fast = _encode_cast(x, torch.empty(x.shape, dtype=torch.int16, device=device_type))
    if not torch.equal(fast, encode_bits(x)):
        return False
    codes = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device=device_type).to(torch.int16)
    fast = _decode_cast(codes, torch.empty(codes.shape, dtype=torch.float32, device=device_type))
    return torch.equal(fast.view(torch.int32), decode_lookup(codes).view(torch.int32))


def encode(x: torch.Tensor, out=None, *, scale=None) -> torch.Tensor:
    """float32 -> float16 bit patterns (int16), == NumPy `astype(np.float16)` bit for bit:
    round to nearest even, subnormals, overflow -> Inf, NaN payloads as NumPy.
    scale: encode x * scale instead (block by block, no full-size temporary); identical to
    `encode(x * scale if scale != 1.0 else x)`."""
    x = check_input(x, torch.float32, "x")
    out = prepare_out(out, x, torch.int16)
    if cast_is_exact(x.device.type):
        return _encode_cast(x, out, effective_scale(scale))
    return encode_bits(x, out, scale=scale)


def decode(codes: torch.Tensor, out=None) -> torch.Tensor:
    """float16 bit patterns (int16) -> float32, == NumPy `.view(np.float16).astype(np.float32)`."""
    codes = check_input(codes, torch.int16, "codes")
    out = prepare_out(out, codes, torch.float32)
    if cast_is_exact(codes.device.type):
        return _decode_cast(codes, out)
    return decode_lookup(codes, out)
