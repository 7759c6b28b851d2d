"""float32 <-> IEEE float16 codes with torch ops only, bit-identical to NumPy's casts.

Codes are **int16** tensors holding the float16 bit patterns (torch's uint16 lacks most ops);
`codes.view(torch.float16)` is the half tensor and `codes.numpy().view(np.uint16)` equals
fp16_numpy's codes.  NumPy is the reference (see fp16_numpy): torch's own casts agree with it
on every non-NaN value but quiet NaNs (float32 0x7F800001 -> 0x7E00, not NumPy's 0x7C01;
float16 0x7C01 -> 0x7FC02000, not 0x7F802000).

* `encode_bits` / `decode_lookup`: THE REFERENCE.  Bit manipulation on the int32 view (the
  algorithm of fp16_numpy, step for step) / a gather from the 65536-entry table built by
  fp16_numpy.decode_bits.
* `encode` / `decode`: THE FAST PATH.  torch's cast (on the whole tensor, or block by block
  when `scale=` is given); if the data holds a NaN (one cheap sum tells), the blocks that hold
  one are redone by the reference path, so NaN payloads come out as NumPy's.  Used only where
  a one-time probe (`cast_is_exact`, cached) finds it equal to the reference path; otherwise
  they are the reference functions.
"""
import functools

import torch

from . import fp16_numpy
from .formats import TORCH_BLOCK as BLOCK, block_ranges
from .fp8_torch import check_input, effective_scale, prepare_out, probe_inputs

__all__ = ["encode", "encode_bits", "decode", "decode_lookup", "cast_is_exact"]

_SHIFT = 13
_REBIAS_ROUND = ((15 - 127) << 23) + (1 << (_SHIFT - 1)) - 1
_MIN_NORMAL_BITS = (127 + 1 - 15) << 23                       # bits of 2**-14
_MAGIC = 0.5                                                  # ulp(0.5) = 2**-24 = min subnormal
_MAGIC_BITS = 0x3F000000
_INF_BITS = 0x7F800000
_HALF_INF = 0x7C00
# low halves for the probe: float16 drops 13 bits (more for subnormals), so its round bit can be
# bit 12, 13, 14 or 15 of the low half: a tie there with an even and an odd lsb, each +-1
_TIES = [1 << 12, 3 << 12, 1 << 13, 3 << 13, 1 << 14, 3 << 14, 1 << 15]
_FP16_LOW_HALVES = tuple(sorted({0, 1, 0xFFFF} | {(t + d) & 0xFFFF for t in _TIES for d in (-1, 0, 1)}))


# ---- reference: bit manipulation / table --------------------------------------------------
def encode_bits(x: torch.Tensor, out=None, *, scale=None) -> torch.Tensor:
    """Reference encoder: float32 -> float16 bits (int16), == NumPy `astype(np.float16)`."""
    x = check_input(x, torch.float32, "x")
    out = prepare_out(out, x, torch.int16)
    scale = effective_scale(scale)
    flat_x, codes = x.view(-1), out.view(-1)
    size = max(1, min(flat_x.numel(), BLOCK))
    a, q, t = (torch.empty(size, dtype=torch.int32, device=x.device) for _ in range(3))
    mask = torch.empty(size, dtype=torch.bool, device=x.device)
    scaled = torch.empty(size if scale is not None else 0, dtype=torch.float32, device=x.device)
    for start, stop in block_ranges(flat_x.numel(), size):
        k = stop - start
        xb = flat_x[start:stop] if scale is None else torch.mul(flat_x[start:stop], scale, out=scaled[:k])
        _encode_bits_block(xb.view(torch.int32), codes[start:stop], a[:k], q[:k], t[:k], mask[:k])
    return out


def _encode_bits_block(u, codes, a, q, t, mask):
    torch.bitwise_and(u, 0x7FFFFFFF, out=a)                   # |x| as bits
    # normal results: re-bias, round to nearest even, drop 13 bits
    torch.bitwise_right_shift(a, _SHIFT, out=t)
    t.bitwise_and_(1)
    torch.add(a, _REBIAS_ROUND, out=q)
    q.add_(t)
    q.bitwise_right_shift_(_SHIFT)
    # subnormal results: |x| + 0.5 rounds |x| to a multiple of 2**-24
    torch.add(a.view(torch.float32), _MAGIC, out=t.view(torch.float32))
    t.sub_(_MAGIC_BITS)
    torch.lt(a, _MIN_NORMAL_BITS, out=mask)
    torch.where(mask, t, q, out=q)
    # overflow and Inf -> Inf; NaN -> 0x7C00 | top payload bits (at least 1)
    q.clamp_max_(_HALF_INF)
    torch.bitwise_right_shift(a, _SHIFT, out=t)
    t.bitwise_and_(0x3FF).clamp_min_(1).bitwise_or_(_HALF_INF)
    torch.gt(a, _INF_BITS, out=mask)
    torch.where(mask, t, q, out=q)
    # sign: bit 31 -> bit 15
    torch.bitwise_right_shift(u, 16, out=t)
    t.bitwise_and_(0x8000)
    q.bitwise_or_(t)
    codes.copy_(q)                                            # int32 -> int16 keeps the 16 bits


@functools.lru_cache(maxsize=None)
def decode_table(device: torch.device) -> torch.Tensor:
    """The 65536 float32 values of float16 codes on `device` (from fp16_numpy.decode_bits)."""
    return torch.from_numpy(fp16_numpy.decode_table().copy()).to(device)


def decode_lookup(codes: torch.Tensor, out=None) -> torch.Tensor:
    """Reference decoder: a gather from the 65536-entry table, == NumPy `.astype(np.float32)`."""
    codes = check_input(codes, torch.int16, "codes")
    out = prepare_out(out, codes, torch.float32)
    flat_codes, flat_out = codes.view(-1), out.view(-1)
    size = max(1, min(flat_codes.numel(), BLOCK))
    index = torch.empty(size, dtype=torch.int32, device=codes.device)
    table = decode_table(codes.device)
    for start, stop in block_ranges(flat_codes.numel(), size):
        k = stop - start
        _lookup_block(flat_codes[start:stop], flat_out[start:stop], index[:k], table)
    return out


def _lookup_block(codes, out, index, table):
    index.copy_(codes)
    index.bitwise_and_(0xFFFF)                                # int16 -> 0..65535
    torch.index_select(table, 0, index, out=out)


# ---- fast path: torch's casts, NaN blocks redone by the reference ---------------------------
def _may_hold_nan(t: torch.Tensor) -> bool:
    """False only if `t` holds no NaN: a NaN makes the sum NaN (Inf - Inf may too: harmless,
    the caller then just looks block by block).  One reduction, no temporary tensor."""
    return t.numel() > 0 and bool(torch.isnan(t.sum()))


def _encode_cast(x, out, scale=None):
    flat_x, codes = x.view(-1), out.view(-1)
    if scale is None:
        codes.view(torch.float16).copy_(flat_x)               # torch's cast, whole tensor
        if not _may_hold_nan(flat_x):
            return out
    size = max(1, min(flat_x.numel(), BLOCK))
    a, q, t = (torch.empty(size, dtype=torch.int32, device=x.device) for _ in range(3))
    mask = torch.empty(size, dtype=torch.bool, device=x.device)
    scaled = torch.empty(size if scale is not None else 0, dtype=torch.float32, device=x.device)
    for start, stop in block_ranges(flat_x.numel(), size):
        k = stop - start
        if scale is None:
            xb = flat_x[start:stop]
        else:
            xb = torch.mul(flat_x[start:stop], scale, out=scaled[:k])
            codes[start:stop].view(torch.float16).copy_(xb)  # torch's cast, one block
        if _may_hold_nan(xb):                                 # redo this block by the reference
            _encode_bits_block(xb.view(torch.int32), codes[start:stop], a[:k], q[:k], t[:k], mask[:k])
    return out


def _decode_cast(codes, out):
    flat_codes, flat_out = codes.view(-1), out.view(-1)
    flat_out.copy_(flat_codes.view(torch.float16))            # torch's cast, whole tensor
    if not _may_hold_nan(flat_out):
        return out
    size = max(1, min(flat_codes.numel(), BLOCK))
    index = torch.empty(size, dtype=torch.int32, device=codes.device)
    table = decode_table(codes.device)
    for start, stop in block_ranges(flat_codes.numel(), size):
        k = stop - start
        if _may_hold_nan(flat_out[start:stop]):               # redo this block by the reference
            _lookup_block(flat_codes[start:stop], flat_out[start:stop], index[:k], table)
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
