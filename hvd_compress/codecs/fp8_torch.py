"""float32 <-> 8-bit float codes with torch ops only (the compressors' hot path).

Two encoders, same results:

* `encode_bits`: THE REFERENCE.  The bit-manipulation algorithm of fp8_numpy (read its
  docstring): reference.encode_bits_block, the very code fp8_numpy runs, with torch integer
  ops on the int32 view.  Runs on any device, never calls torch's float8 cast.  The tests and
  scripts/check_codecs_exhaustive.py check it against torch's and ml_dtypes' casts.
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
from .formats import TORCH_BLOCK as BLOCK, Float8Format
from .reference import encode_bits_block
from .torch_common import (ENCODE_SCRATCH, TORCH_OPS, check_input, effective_scale, prepare_out,
                           probe_inputs, run_blocks)

__all__ = ["encode", "encode_bits", "decode", "cast_is_exact", "torch_dtype", "effective_scale"]

def torch_dtype(fmt: Float8Format) -> torch.dtype:
    """torch.float8_e4m3fn or torch.float8_e5m2."""
    return getattr(torch, fmt.torch_dtype_name)


# ---- reference encoder: bit manipulation ---------------------------------------------------
def encode_bits(x: torch.Tensor, fmt: Float8Format, saturate: bool = True, out=None, *,
                scale=None) -> torch.Tensor:
    """Reference encoder (integer ops on the int32 view).  Arguments as in `encode`."""
    x = check_input(x, torch.float32, "x")
    out = prepare_out(out, x, torch.uint8)
    kernel = functools.partial(encode_bits_block, TORCH_OPS, fmt=fmt, saturate=saturate)
    run_blocks(x, out, BLOCK, kernel, ENCODE_SCRATCH, effective_scale(scale))
    return out


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
    native = saturate == (not fmt.has_inf)                      # torch's own mode: no patch
    if native and scale is None:
        out.view(-1).view(torch_dtype(fmt)).copy_(x.view(-1))   # torch's cast, whole tensor
        return out

    def kernel(xb, codes, f, mask):
        codes.view(torch_dtype(fmt)).copy_(xb)                  # torch's cast, one block
        if not native:
            _patch_block(xb, codes, f, mask, fmt)

    run_blocks(x, out, BLOCK, kernel, (torch.float32, torch.bool), scale)
    return out


@functools.lru_cache(maxsize=None)
def cast_is_exact(fmt: Float8Format, saturate: bool, device_type: str) -> bool:
    """Does the cast-based fast path equal `encode_bits` on this torch and device?"""
    x = probe_inputs(device_type)
    fast = _encode_cast(x, fmt, saturate, torch.empty(x.shape, dtype=torch.uint8, device=device_type))
    return bool(torch.equal(fast, encode_bits(x, fmt, saturate)))


def encode(x: torch.Tensor, fmt: Float8Format, saturate: bool = True, out=None, *,
           scale=None) -> torch.Tensor:
    """Encode float32 `x` to uint8 codes of `fmt` (round to nearest even).

    saturate=True : finite overflow -> +-max_finite (E4M3: Inf too, as torch's cast; E5M2: Inf
                    stays Inf).  saturate=False: overflow -> Inf (E5M2) or NaN (E4M3), as
                    ml_dtypes.  NaN -> S.1111111.  (fp8_numpy.encode's modes, same codes.)
    scale: encode x * scale (block by block, no full-size temporary); identical codes.
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
    return gather(table, codes, out, BLOCK)


def gather(table: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, block: int,
           mask=None) -> torch.Tensor:
    """out = table[codes] (or table[codes & mask], to read signed codes as unsigned), `block`
    codes at a time through one reused int32 index buffer (fp16_torch's table decoder too)."""
    def kernel(c, o, index):
        index.copy_(c)
        if mask is not None:
            index.bitwise_and_(mask)
        torch.index_select(table, 0, index, out=o)

    run_blocks(codes, out, block, kernel, (torch.int32,))
    return out
