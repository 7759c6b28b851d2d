"""Compression: the choices a user names, as `hvd.Compression` with more."""
from .roles import FP16Compressor, NoneCompressor

from .auto.settings import Auto
from .compressors import (BF16Compressor, Bit8Compressor, Bit16Compressor, Int8Compressor,
                          OneBitCompressor)
from .methods.powersgd import PowerSGD
from .methods.topk import TopK

__all__ = ["Compression"]


class Compression:
    """Gradient compression choices, as `hvd.Compression` with more."""
    none = NoneCompressor       # Horovod's: no compression, float32 allreduce
    fp16 = FP16Compressor       # Horovod's: cast to float16, float16 allreduce
    bit16 = Bit16Compressor     # scaled float16 codes, reduced in float32
    bit8 = Bit8Compressor       # scaled E4M3 codes, reduced in float32
    int8 = Int8Compressor       # int8 codes, a scale per block, stochastic rounding
    onebit = OneBitCompressor   # sign bits and a mean magnitude per block, error feedback
    bf16 = BF16Compressor       # bfloat16 codes, reduced in float32 (Horovod's allreduce has none)
    # The optimizer chooses per bucket from what the job measures (docs/planner.md); bare or
    # called with options: Compression.auto(warmup_steps=10, margin=0.0).
    auto = Auto()

    # Methods that are not a codec of values but a communicator of their own.
    @staticmethod
    def topk(ratio=0.01, error_feedback=True):
        """The k = ceil(ratio numel) largest |g| of each gradient, by allgather (methods/topk.py)."""
        return TopK(ratio, error_feedback)

    @staticmethod
    def powersgd(rank=2, error_feedback=True, start_iter=0, min_compression_rate=0.0,
                 init="name"):
        """Rank-`rank` approximation of each matrix by two float32 allreduces (methods/powersgd.py);
        start_iter=2, min_compression_rate=2, init="ddp": torch's powerSGD_hook's variant."""
        return PowerSGD(rank, error_feedback, start_iter=start_iter,
                        min_compression_rate=min_compression_rate, init=init)
