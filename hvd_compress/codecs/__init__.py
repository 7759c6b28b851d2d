"""The codecs: pure functions on bits, float32 <-> E4M3, E5M2, float16, bfloat16, int8 and signs.

The float codecs in NumPy and torch:

    from hvd_compress.codecs import E4M3, E5M2, fp8_torch, scaling
    s = scaling.pow2_scale(float(g.abs().max()), E4M3.max_finite)
    codes = fp8_torch.encode(g, E4M3, scale=s)       # uint8, same shape; == encode(g * s)
    g_hat = fp8_torch.decode(codes, E4M3) / s        # float32

Every codec is bit-exact against a named reference (torch / ml_dtypes / NumPy casts); see
docs/codecs.md and scripts/check_codecs_exhaustive.py, which checks all 2**32 inputs.
The torch modules are imported lazily so the NumPy codecs work without importing torch.
"""
import importlib

from . import fp8_numpy, fp16_numpy, scaling
from .formats import E4M3, E5M2, FP16, SCALE_BLOCK, Float8Format, FloatFormat

__all__ = ["E4M3", "E5M2", "FP16", "SCALE_BLOCK", "FloatFormat", "Float8Format", "blocks",
           "fp8_numpy", "fp8_torch", "fp16_numpy", "fp16_torch", "scaling"]


def __getattr__(name):
    if name in ("fp8_torch", "fp16_torch", "blocks"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
