"""float32 <-> 8-bit float codes with torch ops only (the compressors' hot path).

Two encoders, same results:

* `encode_bits`: THE REFERENCE.  The bit-manipulation algorithm of fp8_numpy (read its
  docstring), step for step with torch integer ops on the int32 view.  Runs on any device,
  never calls torch's float8 cast.  The tests and scripts/check_codecs_exhaustive.py check it
  against torch's and ml_dtypes' casts.
* `encode`: THE FAST PATH the compressors call.  It lets torch's own float8 cast do the
  rounding and patches the overflowing elements for the modes torch does not implement
  (see `_patch_block`).  It is used only where `cast_is_exact(fmt, saturate, device)` holds: a
  one-time probe (cached) that compares the fast path with `encode_bits` on 393,216 inputs
  covering every float32 exponent and every rounding boundary of both formats.  Anywhere the
  probe fails (another torch version, another device), `encode` is `encode_bits`.

`decode` gathers from a 256-entry float32 table (fp8_numpy's bit-level decoder, copied to the
device once); it is bit-identical to `codes.view(torch.float8_*).float()`, NaN bits included,
and several times faster than that cast on CPU.

Both work block by block (formats.TORCH_BLOCK elements) with preallocated scratch, so no 64 MB
temporaries are created; pass `out=` to avoid allocating the result as well.
"""
import functools
import math

import torch

from . import fp8_numpy
from .formats import TORCH_BLOCK as BLOCK, Float8Format, block_ranges
from .fp8_numpy import encode_constants, overflow_code

__all__ = ["encode", "encode_bits", "decode", "cast_is_exact", "torch_dtype", "effective_scale"]

_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF


# ---- argument checks shared by the torch codecs (fp16_torch uses them too) ------------------
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


def torch_dtype(fmt: Float8Format) -> torch.dtype:
    """torch.float8_e4m3fn or torch.float8_e5m2."""
    return getattr(torch, fmt.torch_dtype_name)


# ---- reference encoder: bit manipulation ---------------------------------------------------
def encode_bits(x: torch.Tensor, fmt: Float8Format, saturate: bool = True, out=None, *,
                scale=None) -> torch.Tensor:
    """Reference encoder (integer ops on the int32 view).  Arguments as in `encode`."""
    x = check_input(x, torch.float32, "x")
    out = prepare_out(out, x, torch.uint8)
    scale = effective_scale(scale)
    c = encode_constants(fmt)
    cap = overflow_code(fmt, saturate)
    flat_x, codes = x.view(-1), out.view(-1)
    size = max(1, min(flat_x.numel(), BLOCK))
    a, q, t = (torch.empty(size, dtype=torch.int32, device=x.device) for _ in range(3))
    mask = torch.empty(size, dtype=torch.bool, device=x.device)
    scaled = torch.empty(size if scale is not None else 0, dtype=torch.float32, device=x.device)
    for start, stop in block_ranges(flat_x.numel(), size):
        k = stop - start
        xb = flat_x[start:stop] if scale is None else torch.mul(flat_x[start:stop], scale, out=scaled[:k])
        _encode_bits_block(xb.view(torch.int32), codes[start:stop], a[:k], q[:k], t[:k], mask[:k],
                           c, fmt, saturate, cap)
    return out


def effective_scale(scale):
    """None when there is nothing to multiply by (None or 1.0), else the scale as a float."""
    if scale is None:
        return None
    scale = float(scale)
    return None if scale == 1.0 else scale


def _encode_bits_block(u, codes, a, q, t, mask, c, fmt, saturate, cap):
    shift = c["shift"]
    torch.bitwise_and(u, _ABS_MASK, out=a)                       # a = |x| as bits
    # normal results: re-bias, round to nearest even, drop the low bits
    torch.bitwise_right_shift(a, shift, out=t)
    t.bitwise_and_(1)                                            # lsb that decides ties
    torch.add(a, c["rebias_round"], out=q)
    q.add_(t)
    q.bitwise_right_shift_(shift)
    # subnormal results: the FPU rounds |x| + MAGIC to the subnormal grid
    torch.add(a.view(torch.float32), float(c["magic"]), out=t.view(torch.float32))
    t.sub_(c["magic_bits"])
    torch.lt(a, c["min_normal_bits"], out=mask)
    torch.where(mask, t, q, out=q)
    # overflow (finite and Inf), then the special inputs
    q.clamp_max_(cap)
    if saturate and fmt.has_inf:                                 # E5M2 saturate: Inf stays Inf
        q.masked_fill_(torch.eq(a, _INF_BITS, out=mask), fmt.inf_code)
    if cap != fmt.nan_code:
        q.masked_fill_(torch.gt(a, _INF_BITS, out=mask), fmt.nan_code)
    # sign: bit 31 -> bit 7
    torch.bitwise_right_shift(u, 24, out=t)
    t.bitwise_and_(0x80)
    q.bitwise_or_(t)
    codes.copy_(q)                                               # values are 0..255


# ---- fast encoder: torch's cast, patched, where it is proven exact -------------------------
def _overflow_threshold(fmt: Float8Format):
    """(value, inclusive): |x| above value (or equal, if inclusive) rounds past max_finite.

    The midpoint between max_finite and the next binade step is a tie; round-to-nearest-even
    sends it up only when max_code's mantissa is odd (E5M2: 61440 overflows, E4M3: 464 does not).
    """
    top_binade = math.frexp(fmt.max_finite)[1] - 1               # 448 = 1.75 * 2**8 -> 8
    ulp = math.ldexp(1.0, top_binade - fmt.man_bits)               # E4M3: 32, E5M2: 8192
    return fmt.max_finite + ulp / 2, bool(fmt.max_code & 1)


def _patch_block(x, codes, f, mask, fmt):
    """Move torch's cast to the modes torch does not implement, on one block.

    torch 2.13 casts E4M3 saturating (finite overflow and Inf -> 0x7E) and E5M2 to Inf (0x7C):
      E4M3 saturate=False: |x| > 464 (Inf too)  -> 0x7E + 1 = 0x7F (NaN)   [ml_dtypes' result]
      E5M2 saturate=True:  61440 <= |x| < Inf   -> 0x7C - 1 = 0x7B (57344)
    Adding a 0/1 mask to uint8 codes keeps the sign bit.  cast_is_exact() checks all of this.
    """
    limit, inclusive = _overflow_threshold(fmt)
    torch.abs(x, out=f)
    (torch.ge if inclusive else torch.gt)(f, limit, out=mask)  # NaN compares False
    if fmt.has_inf:                                             # E5M2 saturate: Inf stays Inf
        mask.logical_and_(f != float("inf"))
        codes.sub_(mask.view(torch.uint8))
    else:                                                       # E4M3 overflow -> NaN
        codes.add_(mask.view(torch.uint8))


def _encode_cast(x: torch.Tensor, fmt: Float8Format, saturate: bool, out: torch.Tensor, scale=None):
    flat_x, codes = x.view(-1), out.view(-1)
    native = saturate == (not fmt.has_inf)                      # torch's own mode: no patch
    if native and scale is None:
        codes.view(torch_dtype(fmt)).copy_(flat_x)              # torch's cast, whole tensor
        return out
    size = max(1, min(flat_x.numel(), BLOCK))
    f = torch.empty(size, dtype=torch.float32, device=x.device)
    mask = torch.empty(size, dtype=torch.bool, device=x.device)
    scaled = torch.empty(size if scale is not None else 0, dtype=torch.float32, device=x.device)
    for start, stop in block_ranges(flat_x.numel(), size):
        k = stop - start
        xb = flat_x[start:stop] if scale is None else torch.mul(flat_x[start:stop], scale, out=scaled[:k])
        codes[start:stop].view(torch_dtype(fmt)).copy_(xb)     # torch's cast, one block
        if not native:
            _patch_block(xb, codes[start:stop], f[:k], mask[:k], fmt)
    return out


_FP8_LOW_HALVES = (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)


def probe_inputs(device, low_halves=_FP8_LOW_HALVES) -> torch.Tensor:
    """float32 inputs for the one-time fast-path probes: every value of the top 16 bits (sign,
    exponent, 7 mantissa bits: every binade, every rounding and tie position of the 8-bit
    formats, Inf and NaN) times a few low halves (default: exact, just above, just below,
    at and around the tie of bit 15) -> 65536 * 6 = 393,216 values."""
    hi = torch.arange(1 << 16, dtype=torch.int64, device=device) << 16
    lo = torch.tensor(low_halves, dtype=torch.int64, device=device)
    bits = (hi[:, None] | lo[None, :]).reshape(-1)
    return bits.to(torch.int32).view(torch.float32)   # int64 -> int32 keeps the low 32 bits


@functools.lru_cache(maxsize=None)
def cast_is_exact(fmt: Float8Format, saturate: bool, device_type: str) -> bool:
    """Does the cast-based fast path equal `encode_bits` on this torch and device?"""
    x = probe_inputs(device_type)
    fast = _encode_cast(x, fmt, saturate, torch.empty(x.shape, dtype=torch.uint8, device=device_type))
    return bool(torch.equal(fast, encode_bits(x, fmt, saturate)))


def encode(x: torch.Tensor, fmt: Float8Format, saturate: bool = True, out=None, *,
           scale=None) -> torch.Tensor:
    """Encode float32 `x` to uint8 codes of `fmt` (round to nearest even).

    saturate=True : finite overflow -> +-max_finite.  E4M3: Inf -> +-448 too (== torch 2.13's
                    `x.to(torch.float8_e4m3fn)`).  E5M2: Inf stays Inf.
    saturate=False: finite overflow and Inf -> Inf for E5M2 (== torch / ml_dtypes cast),
                    NaN for E4M3 (== ml_dtypes `astype(float8_e4m3fn)`).
    NaN -> S.1111111 (sign kept), as torch does.
    scale: encode x * scale instead (a float32 multiply done block by block, so no full-size
           temporary); the codes are identical to `encode(x * scale if scale != 1.0 else x)`.
    Uses torch's cast where `cast_is_exact` (see the module docstring), else `encode_bits`.
    """
    x = check_input(x, torch.float32, "x")
    out = prepare_out(out, x, torch.uint8)
    if cast_is_exact(fmt, bool(saturate), x.device.type):
        return _encode_cast(x, fmt, bool(saturate), out, effective_scale(scale))
    return encode_bits(x, fmt, saturate, out, scale=scale)


# ---- decode ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def decode_table(fmt: Float8Format, device: torch.device) -> torch.Tensor:
    """The 256 float32 values of `fmt` on `device` (built by fp8_numpy.decode_bits)."""
    return torch.from_numpy(fp8_numpy.decode_table(fmt).copy()).to(device)


def decode(codes: torch.Tensor, fmt: Float8Format, out=None, *, table=None) -> torch.Tensor:
    """Decode uint8 codes of `fmt` to float32: one table gather per block.

    table: 256 float32 values to gather from instead of `decode_table(fmt)`; the compressors
    pass that table times 1/scale, so unscaling costs no extra pass over the data.
    """
    codes = check_input(codes, torch.uint8, "codes")
    out = prepare_out(out, codes, torch.float32)
    if table is None:
        table = decode_table(fmt, codes.device)
    elif table.shape != (256,) or table.dtype != torch.float32:
        raise ValueError("table must be 256 float32 values")
    flat_codes = codes.view(-1)
    flat_out = out.view(-1)
    size = max(1, min(flat_codes.numel(), BLOCK))
    index = torch.empty(size, dtype=torch.int32, device=codes.device)
    for start, stop in block_ranges(flat_codes.numel(), size):
        k = stop - start
        index[:k].copy_(flat_codes[start:stop])
        torch.index_select(table, 0, index[:k], out=flat_out[start:stop])
    return out
