"""Int8Compressor and OneBitCompressor: the course's other quantisers, on the packet routes.

Both are codes that allreduce cannot sum, so they travel as bit8 does (communicators.py):
every rank's bucket message by allgather, decoded and summed in float32 in rank order; int8
also by the two-phase route. Their messages and packets are blockcodec.BlockCodec's,

    [float32 scale per block | codes | zero padding to a multiple of 4 bytes]

    int8     codes: one int8 per value, scale = block amax / 127, stochastic rounding
             (codecs/int8.py): unbiased, E[decoded] = x. 8 bits + 32/block per value.
    onebit   codes: one sign bit per value, scale = block mean |x| (codecs/onebit.py):
             1 bit + 32/block per value, about 28x fewer bytes than float32 at block 256.
             Biased; error feedback is its default (OneBitCompressor.error_feedback).

The codecs are torch code, not native kernels: these methods are here to compare accuracy and
bytes; bit8 is the fast 8-bit path.
"""
import torch

from .blockcodec import BlockCodec
from .codecs import int8 as int8_codec
from .codecs import onebit as onebit_codec

__all__ = ["Int8Compressor", "OneBitCompressor"]


def _check_scales(name, scales):
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError(f"corrupt bucket message: {name} block scales must be finite and >= 0")


class Int8Compressor(BlockCodec):
    """float32 -> int8 with a scale per block (amax / 127) and stochastic rounding (QSGD-style).

    Each rank rounds with its own generator, seeded `seed * 1000003 + rank` on first use, so the
    ranks' rounding errors are independent and a run is repeatable. (The generator's state is
    not in a checkpoint: a resumed run rounds with other random numbers.)
    """
    name = "int8"
    bits = 8
    seed = 0
    _generators = {}

    @classmethod
    def generator(cls, device):
        key = str(device)
        if key not in cls._generators:
            rank = 0
            try:
                import horovod.torch as hvd
                rank = hvd.rank() if hvd.is_initialized() else 0
            except (ImportError, ValueError):
                pass
            cls._generators[key] = torch.Generator(device).manual_seed(cls.seed * 1_000_003 + rank)
        return cls._generators[key]

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
        _check_scales(cls.name, scales)
        int8_codec.decode_accumulate(codes.view(torch.int8), scales, out, block)


class OneBitCompressor(BlockCodec):
    """float32 -> one sign bit per value and the mean |x| of each block (1-bit SGD); biased, so
    `hc.DistributedOptimizer` turns error feedback on for it unless told otherwise."""
    name = "onebit"
    bits = 1
    error_feedback = True

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        onebit_codec.encode(flat, codes, scales, block)

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        out.zero_()
        _check_scales(cls.name, scales)
        onebit_codec.decode_accumulate(codes, scales, out, block)
