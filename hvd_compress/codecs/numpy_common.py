"""What the NumPy codecs (fp8_numpy, fp16_numpy) share: argument checks, the block loop and
the table of array operations the bit-level encoder (reference.py) runs on."""
import functools
from types import SimpleNamespace

import numpy as np

from .formats import for_blocks
from .reference import ELEMENTWISE_OPS

__all__ = ["check_input", "prepare_out", "effective_scale", "run_blocks", "ENCODE_SCRATCH",
           "NUMPY_OPS"]

# the work buffers of the bit-level encoders: a = |x| bits, q = codes, t = temporary, a mask
ENCODE_SCRATCH = (np.int32, np.int32, np.int32, np.bool_)

# reference.encode_bits_block's operations: the table uses NumPy's names, so mostly np itself
NUMPY_OPS = SimpleNamespace(
    **{name: getattr(np, name) for name in ELEMENTWISE_OPS},
    copyto=functools.partial(np.copyto, casting="unsafe"),   # int32 -> uint8/uint16 codes
    int32=np.int32, float32=np.float32)


def check_input(x, dtype, what: str) -> np.ndarray:
    """Return `x` as a C-contiguous ndarray, or raise TypeError if it is not an ndarray of dtype.
    A NumPy scalar of the right dtype (what arithmetic on 0-d arrays returns) becomes a 0-d array."""
    if isinstance(x, np.generic) and x.dtype == dtype:
        x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray of {np.dtype(dtype).name}, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{what} must have dtype {np.dtype(dtype).name}, got {x.dtype}")
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)   # (keeps 0-d arrays 0-d)


def prepare_out(out, shape, dtype) -> np.ndarray:
    """A fresh output array, or check that the caller's `out` has the right shape and dtype."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray) or out.dtype != dtype:
        raise TypeError(f"out must be a numpy.ndarray of {np.dtype(dtype).name}")
    if out.shape != tuple(shape):
        raise ValueError(f"out has shape {out.shape}, expected {tuple(shape)}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writeable")
    return out


def effective_scale(scale):
    """None when there is nothing to multiply by (None or 1.0), else the scale as np.float32."""
    if scale is None or float(scale) == 1.0:
        return None
    return np.float32(scale)


def run_blocks(src: np.ndarray, dst: np.ndarray, block: int, kernel, scratch=(), scale=None):
    """formats.for_blocks on the flat views of NumPy arrays (the float ops see Inf/NaN too:
    their warnings are silenced)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return for_blocks(src.reshape(-1), dst.reshape(-1), block, kernel, scratch,
                          np.empty, np.multiply, scale)
