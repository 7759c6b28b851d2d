"""Int8Compressor: int8 codes, a scale per block (amax / 127), stochastic rounding (QSGD-style).

Codes that allreduce cannot sum, so they travel as bit8's do: every rank's bucket message by
allgather (or the two-phase route), decoded and summed in float32 in rank order. The codec is
codecs/int8.py (torch code, not a native kernel: int8 is here to compare accuracy and bytes).
Unbiased: E[decoded] = x. 8 bits + 32/block per value.
"""
import zlib

import torch

from ..codecs import int8 as int8_codec
from ..roles import current_stream
from .blockcodec import BlockCodec, check_scales

__all__ = ["Int8Compressor"]


class Int8Compressor(BlockCodec):
    """float32 -> int8 with a scale per block (amax / 127) and stochastic rounding (QSGD-style).

    Each rank rounds with its own generators, one per stream a communicator names (a bucket
    and its phase: roles.rounding_stream), seeded from `seed * 1000003 + rank` and the stream's
    name on first use, so the ranks' rounding errors are independent and a run is repeatable
    whatever order the buckets are encoded in. (The generators' state is not in a checkpoint:
    a resumed run rounds with other random numbers.)
    """
    name = "int8"
    bits = 8
    seed = 0
    _generators = {}

    @classmethod
    def generator(cls, device):
        stream = current_stream()
        key = (str(device), stream)
        if key not in cls._generators:
            cls._generators[key] = torch.Generator(device).manual_seed(cls.stream_seed(_rank(), stream))
        return cls._generators[key]

    @classmethod
    def stream_seed(cls, rank, stream=None):
        """The seed of `rank`'s generator for `stream` (None: outside any named stream)."""
        seed = cls.seed * 1_000_003 + rank
        if stream is not None:              # 32 bits of the name below the rank's seed
            seed = (seed << 32) | zlib.crc32(str(stream).encode())
        return seed

    @classmethod
    def reseed(cls, seed=0):
        """Start every rank's rounding stream again from `seed` (tests, repeatable runs)."""
        cls.seed = int(seed)
        cls._generators.clear()

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        int8_codec.encode(flat, codes.view(torch.int8), scales, block, cls.generator(flat.device))

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        out.zero_()
        check_scales(cls.name, scales)
        int8_codec.decode_accumulate(codes.view(torch.int8), scales, out, block)


def _rank():
    """This process's rank in the job, Horovod's or torch.distributed's (0 in neither), so that
    int8 rounds with the same stream on either engine (hvd_compress.ddp)."""
    try:
        import horovod.torch as hvd
        if hvd.is_initialized():
            return hvd.rank()
    except (ImportError, ValueError):
        pass
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0
