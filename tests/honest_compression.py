"""An honest student's step 2 and 3a, written apart from the course's solution and the
project's codecs (tests/test_classroom_similarity.py: the similarity report must find it far
from both, and it is correct: the same codes and packets as the solution).

The approach differs on purpose: E4M3 codes by a nearest-value search on the format's sorted
grid (no bit arithmetic, no frexp rounding), the decoder a table written out by a loop, the
scale found by halving and doubling, the packet built with struct, the exchange by allgather
of the flat packets, split by their length.
"""
import math
import struct

import numpy as np
import torch

HEADER_BYTES = 8


def _grid():
    """The 127 finite non-negative E4M3 values, by code 0x00..0x7E (increasing)."""
    values = []
    for code in range(0x7F):
        exponent, mantissa = code >> 3, code & 7
        if exponent == 0:
            values.append(mantissa / 8 * 2.0 ** -6)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.array(values)


GRID = _grid()
TABLE = np.concatenate([GRID, [np.nan], -GRID, [np.nan]]).astype(np.float32)


def encode_e4m3(x):
    x = np.asarray(x, dtype=np.float32)
    magnitude = np.abs(x.astype(np.float64))
    bounded = np.minimum(np.nan_to_num(magnitude, nan=0.0, posinf=1e9), 1e9)
    upper = np.clip(np.searchsorted(GRID, bounded), 1, len(GRID) - 1)
    lower = upper - 1
    below, above = bounded - GRID[lower], GRID[upper] - bounded
    pick_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    index = np.where(pick_upper, upper, lower)
    index = np.where(bounded >= GRID[-1], len(GRID) - 1, index)
    index = np.where(np.isnan(x), 0x7F, index)
    sign = np.where(np.signbit(x), 0x80, 0)
    return (index + sign).astype(np.uint8)


def decode_e4m3(codes):
    return TABLE[np.asarray(codes).astype(np.intp)]


def encode_fp16(x):
    with np.errstate(all="ignore"):
        half = np.array(x, dtype=np.float32, copy=True).astype("<f2")
    return half.view("<u2").astype(np.uint16)


def decode_fp16(codes):
    bits = np.array(codes, dtype=np.uint16, copy=True)
    return bits.view(np.float16).astype(np.float32)


def _scale_for(largest_abs, limit):
    """The largest power of two s with largest_abs * s <= limit, found by doubling/halving."""
    if not largest_abs > 0:
        return 1.0
    s = 1.0
    while largest_abs * s * 2 <= limit and s < 2.0 ** 127:
        s *= 2
    while largest_abs * s > limit and s > 2.0 ** -126:
        s /= 2
    return s


def _pack(scale, flag, payload):
    head = struct.pack("<fI", scale, flag)
    return torch.tensor(list(head + payload), dtype=torch.uint8)


def _unpack(packet):
    data = bytes(packet.to(torch.uint8).tolist())
    scale, flag = struct.unpack("<fI", data[:HEADER_BYTES])
    return scale, flag, data[HEADER_BYTES:]


def _flat(tensor):
    return tensor.detach().to("cpu", torch.float32).flatten().numpy()


class Bit8Compressor:
    @staticmethod
    def compress(tensor):
        values = _flat(tensor)
        finite = values[np.isfinite(values)]
        peak = float(np.max(np.abs(finite))) if finite.size else 0.0
        infinite = bool(np.isinf(values).any())
        scale = _scale_for(peak, 224.0 if infinite else 448.0)
        codes = encode_e4m3(values * np.float32(scale))
        return _pack(scale, int(infinite), codes.tobytes()), (tensor.shape, tensor.dtype)

    @staticmethod
    def decompress(packet, ctx):
        shape, dtype = ctx
        scale, flag, payload = _unpack(packet)
        codes = np.frombuffer(payload, dtype=np.uint8)
        out = decode_e4m3(codes) / np.float32(scale)
        if flag == 1:
            top = (codes & 0x7F) == 0x7E
            out[top & (codes < 0x80)] = np.inf
            out[top & (codes >= 0x80)] = -np.inf
        return torch.from_numpy(out.astype(np.float32)).view(shape).to(dtype)


class Bit16Compressor:
    @staticmethod
    def compress(tensor):
        values = _flat(tensor)
        finite = values[np.isfinite(values)]
        peak = float(np.max(np.abs(finite))) if finite.size else 0.0
        scale = _scale_for(peak, 65504.0)
        codes = encode_fp16(values * np.float32(scale))
        return _pack(scale, 0, codes.astype("<u2").tobytes()), (tensor.shape, tensor.dtype)

    @staticmethod
    def decompress(packet, ctx):
        shape, dtype = ctx
        scale, _, payload = _unpack(packet)
        with np.errstate(over="ignore"):
            out = decode_fp16(np.frombuffer(payload, dtype="<u2")) / np.float32(scale)
        return torch.from_numpy(out.astype(np.float32)).view(shape).to(dtype)


def allreduce(tensor, compression, name=None):
    import horovod.torch as hvd
    packet, _ = compression.compress(tensor)
    gathered = hvd.allgather(packet, name=name)
    size = packet.numel()
    total = torch.zeros(tensor.numel())
    for rank in range(hvd.size()):
        piece = gathered[rank * size:(rank + 1) * size]
        total = total + compression.decompress(piece, (torch.Size([tensor.numel()]), torch.float32))
    return (total / hvd.size()).view(tensor.shape).to(tensor.dtype)
