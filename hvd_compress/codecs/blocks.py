"""Block-scaled codes: one power-of-two scale per block of values, for whole gradient buckets.

    nb = num_blocks(x.numel())                       # ceil(numel / SCALE_BLOCK)
    encode(x, E4M3, codes, scales)                   # codes: numel uint8, scales: nb float32
    decode_accumulate(codes_2d, scales_2d, E4M3, out)  # out = rank 0's values + rank 1's + ...

For each block of `block` values (the last may be shorter): amax = its largest FINITE
magnitude; s = scaling.pow2_scale(amax, target) with target = the format's max_finite, or
half of it when the format has no Inf (E4M3) and the block holds +-Inf; codes = the format's
saturating round-to-nearest-even encode of x * s (E4M3: torch's float8_e4m3fn cast, +-Inf ->
the max code, NaN -> NaN; float16: NumPy's astype, Inf stays Inf). The block's scale is stored
as s, or as -s when the block's max code means +-Inf (the packet header's FLAG_INF_AT_MAX, per
block). Decoding divides by |s| (exact: a power of two) and puts +-Inf back.

Error bound: every value whose scaled magnitude is a normal number of the format comes back
within a relative 2**-(man_bits+1) (E4M3 2**-4, float16 2**-11); smaller ones within half the
format's smallest subnormal step divided by s. A block's scale follows its own largest
value, so a large gradient only costs precision to the <= SCALE_BLOCK - 1 values beside it,
not to the whole tensor or bucket.

`decode_accumulate` sums rank by rank in float32, ((d0 + d1) + d2) + ..., on every rank the
same, so all ranks hold the same bits. Two implementations, bit-identical (tests): this pure
torch one (any device; the reference), and the native C++ kernel (codecs/native) used on CPU
when it is built.
"""
import os
import warnings

import torch

from . import fp8_torch, fp16_torch, native
from .formats import FP16, SCALE_BLOCK, FloatFormat
from .scaling import FLOAT32_MAX_EXP, FLOAT32_MIN_EXP

__all__ = ["SCALE_BLOCK", "num_blocks", "code_dtype", "encode", "decode", "decode_accumulate",
           "encode_reference", "decode_accumulate_reference", "native_available", "block_scales",
           "native_message_ok", "codec_path", "note_missing_kernel"]


def num_blocks(numel: int, block: int = SCALE_BLOCK) -> int:
    """ceil(numel / block): how many scales a bucket of `numel` values carries."""
    if block < 1:
        raise ValueError(f"block must be >= 1 values, got {block}")
    return -(-int(numel) // int(block))


def code_dtype(fmt: FloatFormat) -> torch.dtype:
    """uint8 for the 8-bit formats, int16 (float16 bit patterns) for float16."""
    return torch.int16 if fmt.code_bytes == 2 else torch.uint8


def native_available() -> bool:
    """Is the C++ kernel loaded (built on first use, or by scripts/setup.sh) and not switched
    off (HVD_COMPRESS_NATIVE=0)?"""
    return native.module() is not None


def native_message_ok(message: torch.Tensor, fmt: FloatFormat) -> bool:
    """Can the native kernel take this bucket message (or 2-D batch of them) whole: built, on
    the CPU, rows contiguous and 4-byte aligned (compressors/scaled_float.py pads messages to 4)?"""
    return (_use_native(message, fmt)
            and message.stride(-1) == 1 and message.data_ptr() % 4 == 0
            and (message.dim() == 1 or message.size(0) == 1 or message.stride(0) % 4 == 0))


def codec_path(fmt: FloatFormat, device="cpu") -> str:
    """'native' if the C++ kernel codes `fmt` on `device`, else 'torch': what a run records."""
    native_here = torch.device(device).type == "cpu" and fmt.name in native.FORMATS
    return "native" if native_here and native.module() is not None else "torch"


_missing_warned = []


def note_missing_kernel(fmt: FloatFormat):
    """Warn, once per process, when `fmt` has a native kernel but it is not loaded (no compiler
    here, or its build failed) and its codes take the torch path: the same bits (the path the
    kernel is tested against), an order of magnitude slower or more, by bucket size and CPU.
    Switched off on purpose (HVD_COMPRESS_NATIVE=0) is not warned about; codec_path() records
    both."""
    if (_missing_warned or fmt.name not in native.FORMATS or native.module() is not None
            or os.environ.get("HVD_COMPRESS_NATIVE", "1") == "0"):
        return
    _missing_warned.append(fmt.name)
    warnings.warn(f"hvd_compress: no native {fmt.name} kernel ({native.why_missing()}), so "
                  "codes take the torch path (the same bits, an order of magnitude slower or "
                  "more); build it with `hvd-compress-build-kernel` "
                  "(python -m hvd_compress.codecs.native)",
                  RuntimeWarning, stacklevel=3)


def _use_native(t: torch.Tensor, fmt: FloatFormat) -> bool:
    return t.device.type == "cpu" and fmt.name in native.FORMATS and native.module() is not None


def _check(x, fmt, codes, scales, block):
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise TypeError(f"x must be a contiguous 1-D float32 tensor, got {x.dtype} {tuple(x.shape)}")
    if codes.dtype != code_dtype(fmt) or codes.numel() != x.numel() or not codes.is_contiguous():
        raise ValueError(f"codes must be {x.numel()} contiguous {code_dtype(fmt)} values")
    if scales.dtype != torch.float32 or scales.numel() != num_blocks(x.numel(), block):
        raise ValueError(f"scales must be {num_blocks(x.numel(), block)} float32 values")


def _blockwise(x: torch.Tensor, block: int, reduce):
    """reduce(view, dim=1) over full blocks, then over the tail: one value per block."""
    full = x.numel() // block * block
    parts = [reduce(x[:full].view(-1, block), dim=1)] if full else []
    if full < x.numel():
        parts.append(reduce(x[full:].view(1, -1), dim=1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def block_scales(x: torch.Tensor, fmt: FloatFormat, block: int = SCALE_BLOCK) -> torch.Tensor:
    """The signed scale of every block (see the module docstring), as float32."""
    mag = x.abs()
    finite = torch.isfinite(mag)
    has_inf = _blockwise(torch.isinf(mag), block, torch.any)
    amax = _blockwise(torch.where(finite, mag, 0.0), block, torch.amax)
    target = torch.full_like(amax, fmt.max_finite)
    if not fmt.has_inf:
        target = torch.where(has_inf, fmt.max_finite / 2, target)
    # largest k with amax * 2**k <= target, exactly as scaling.pow2_scale (frexp, not log2)
    ma, ea = torch.frexp(amax)
    mt, et = torch.frexp(target)
    k = et - ea - (ma > mt).to(ea.dtype)
    k = torch.where(amax > 0, k, 0).clamp_(FLOAT32_MIN_EXP, FLOAT32_MAX_EXP)
    s = torch.ldexp(torch.ones_like(amax), k)
    return torch.where(has_inf & (not fmt.has_inf), -s, s)


def _per_value(scales: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    return scales.repeat_interleave(block)[:numel]


def encode(x, fmt, codes, scales, block=SCALE_BLOCK):
    """Encode contiguous 1-D float32 `x` into `codes` (numel codes of code_dtype(fmt)) and
    `scales` (num_blocks float32), a scale per `block` values. One pass in the native kernel."""
    _check(x, fmt, codes, scales, block)
    if x.numel() == 0:
        return
    if _use_native(x, fmt):
        return native.module().encode(x, codes, scales, fmt.name, int(block))
    encode_reference(x, fmt, codes, scales, block)


def encode_reference(x, fmt, codes, scales, block=SCALE_BLOCK):
    """`encode` by torch ops alone, on any device: the reference for the native kernel."""
    _check(x, fmt, codes, scales, block)
    if x.numel() == 0:
        return
    signed = block_scales(x, fmt, block)
    scaled = x * _per_value(signed.abs(), x.numel(), block)
    if fmt is FP16:
        fp16_torch.encode(scaled, out=codes)
    else:
        fp8_torch.encode(scaled, fmt, saturate=True, out=codes)
    scales.copy_(signed)


def _decode_into(codes, scales, fmt, out, block):
    """out = values of codes / |scale|, +-Inf restored where the scale is negative."""
    if fmt is FP16:
        fp16_torch.decode(codes, out=out)
    else:
        fp8_torch.decode(codes, fmt, out=out)
    per_value = _per_value(scales, codes.numel(), block)
    out.mul_(per_value.abs().reciprocal_())               # exact: a power of two
    if not fmt.has_inf and bool((scales < 0).any()):
        at_max = (codes & (fmt.sign_bit - 1)) == fmt.max_code
        inf = at_max & (per_value < 0)
        out.masked_fill_(inf & (codes < fmt.sign_bit), float("inf"))
        out.masked_fill_(inf & (codes >= fmt.sign_bit), float("-inf"))
    return out


def decode(codes, scales, fmt, out, block=SCALE_BLOCK):
    """Decode one row of codes (1-D) with its scales into float32 `out`."""
    if codes.numel() == 0:
        return out
    if _use_native(codes, fmt):
        native.module().decode_accumulate(codes.view(1, -1), scales.view(1, -1), out,
                                          fmt.name, int(block))
        return out
    return _decode_into(codes.contiguous(), scales.contiguous(), fmt, out, block)


def decode_accumulate(codes, scales, fmt, out, block=SCALE_BLOCK):
    """out = ((d_0 + d_1) + d_2) + ... in float32, d_r = decode(codes[r], scales[r]): the rank
    order of rows, so every rank that sums the same rows holds the same bits. codes: 2-D
    [n, numel] (rows may be views into one gathered buffer); scales: 2-D [n, num_blocks]."""
    if codes.dim() != 2 or scales.dim() != 2 or codes.shape[0] != scales.shape[0]:
        raise ValueError("codes and scales must be 2-D with one row per rank")
    if codes.shape[1] == 0:
        return out
    if _use_native(codes, fmt):
        native.module().decode_accumulate(codes, scales, out, fmt.name, int(block))
        return out
    return decode_accumulate_reference(codes, scales, fmt, out, block)


def check_scales(scales, fmt):
    """Raise if any scale is not 2**k, k in [-126, 127], or its negative for a format without
    Inf (what every encoder writes): a corrupt message must not decode into garbage
    gradients. The native kernel checks the same."""
    a = scales.abs() if not fmt.has_inf else scales
    mantissa, _ = torch.frexp(a)
    ok = torch.isfinite(a) & (mantissa == 0.5) & (a >= 2.0 ** FLOAT32_MIN_EXP)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise RuntimeError(f"corrupt bucket message: scale {float(scales[tuple(bad)])!r} at "
                           f"(rank, block) {tuple(bad)}; scales must be finite powers of two")


def decode_accumulate_reference(codes, scales, fmt, out, block=SCALE_BLOCK):
    """`decode_accumulate` by torch ops alone: the reference for the native kernel."""
    if codes.shape[1] == 0:
        return out
    check_scales(scales, fmt)
    _decode_into(codes[0].contiguous(), scales[0].contiguous(), fmt, out, block)
    if codes.shape[0] > 1:
        scratch = torch.empty_like(out)
        for r in range(1, codes.shape[0]):
            out.add_(_decode_into(codes[r].contiguous(), scales[r].contiguous(), fmt, scratch, block))
    return out
