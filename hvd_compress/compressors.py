"""Bit8Compressor and Bit16Compressor on Horovod's `Compressor` interface.

Horovod's interface is two static methods: `compress(tensor) -> (compressed, ctx)` and
`decompress(compressed, ctx) -> tensor`. Ours keep exactly that shape, so any code written
for `hvd.Compression.fp16` accepts them. What does not fit in two methods (which collective
carries the result, error feedback, bucketing) lives in communicators.py, memory.py and
fusion.py, as in GRACE (roles.py states the three roles).

The compressed form is a *packet*: one flat uint8 tensor, self-contained so that a
collective can carry it unchanged and any rank can decode it:

    bytes 0..3   float32  scale s (a power of two; values were multiplied by s before encoding)
    bytes 4..7   uint32   flags (bit 0: the format's largest code means +-Inf, see below)
    bytes 8..    codes    Bit8: one E4M3 byte per value; Bit16: one float16 (2 bytes) per value

Why a scale: gradients are small (1e-3..1e-7) and E4M3's smallest subnormal is 2**-9, so
without scaling most of them flush to zero. The amax-based power-of-two scale moves the
largest finite magnitude to the top of the format's range, exactly (multiplying by 2**k only
changes exponents), so each value keeps the format's 3 (E4M3) or 10 (float16) mantissa bits.

Why the Inf flag: E4M3 has no Inf code, and a diverging run must stay visible. When a tensor
holds +-Inf, its finite values are scaled one binade lower (to <= 224), so the largest code
(+-448) is free to mean +-Inf; NaN keeps E4M3's NaN code. float16 has Inf, so Bit16 never
needs the flag.

Both run on the codec's block kernels (codecs/blocks.py): a packet is one block as long as
the tensor, so the per-tensor interface and the optimizer's bucket path share one encoder and
one decoder. The bucket path is blockcodec.BlockCodec's (one scale per block of
`codecs.SCALE_BLOCK` values in front of the codes, on the native kernel where it is built); a
negative scale marks a block whose largest code means +-Inf, the same rule as the packet's flag.
"""
import math

import torch
from horovod.torch.compression import FP16Compressor, NoneCompressor

from .auto import Auto
from .bfloat16 import BF16Compressor
from .blockcodec import BlockCodec
from .codecs import E4M3, FP16, SCALE_BLOCK, blocks
from .quantizers import Int8Compressor, OneBitCompressor
from .registry import HEADER_BYTES
from .roles import flat_float32 as _flat_float32

__all__ = ["Bit8Compressor", "Bit16Compressor", "Int8Compressor", "OneBitCompressor",
           "BF16Compressor",
           "Compression", "HEADER_BYTES", "packet_bytes", "compressor_name", "read_header"]

FLAG_INF_AT_MAX = 1


def read_header(packet: torch.Tensor):
    """(scale, flags) of a packet, checked: a corrupt header raises instead of decoding garbage."""
    if packet.dtype != torch.uint8 or packet.dim() != 1 or packet.numel() < HEADER_BYTES:
        raise ValueError(f"not a packet: expected a 1-D uint8 tensor of >= {HEADER_BYTES} bytes, "
                         f"got {packet.dtype} of shape {tuple(packet.shape)}")
    head = packet[:HEADER_BYTES].cpu().clone()
    scale, flags = float(head[0:4].view(torch.float32)), int(head[4:8].view(torch.int32))
    mantissa, _ = math.frexp(scale) if math.isfinite(scale) else (0.0, 0)
    if not (scale > 0 and mantissa == 0.5) or flags & ~FLAG_INF_AT_MAX:
        raise ValueError(f"corrupt packet header: scale {scale!r} (must be a finite power of two), "
                         f"flags {flags:#x} (known: {FLAG_INF_AT_MAX:#x})")
    return scale, flags


class ScaledFloatCompressor(BlockCodec):
    """Shared shape of Bit8/Bit16: a power-of-two scale per block, then the format's codes
    (codecs/blocks.py), on the native kernel where it is built."""
    fmt = None                   # the codec's number format (codecs.E4M3, codecs.FP16)

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        blocks.encode(flat, cls.fmt, codes, scales, block=block)

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        blocks.decode_accumulate(codes, scales, cls.fmt, out, block=block)

    @classmethod
    def kernel(cls, *messages):
        """The native kernel if it takes every one of these messages whole (built, CPU, rows
        4-byte aligned); a missing kernel warns once (codecs/blocks.py)."""
        if all(blocks.native_message_ok(m, cls.fmt) for m in messages):
            return blocks.native.module()
        if messages and messages[0].device.type == "cpu":
            blocks.note_missing_kernel(cls.fmt)
        return None

    @classmethod
    def codec_path(cls, device="cpu"):
        return blocks.codec_path(cls.fmt, device)

    @classmethod
    def message_views(cls, message, numel, block=SCALE_BLOCK):
        """(codes, scales) of a message (or of each row of a 2-D batch of messages), as views;
        float16 codes as int16."""
        codes, scales = super().message_views(message, numel, block)
        return cls._codes(codes), scales

    # ---- per tensor: Horovod's interface, one self-describing packet -----------------------
    @classmethod
    def compress(cls, tensor):
        """Encode a floating-point tensor into a packet; ctx = (shape, dtype) to restore it."""
        x = _flat_float32(tensor)
        packet = torch.empty(HEADER_BYTES + cls.fmt.code_bytes * x.numel(), dtype=torch.uint8,
                             device=x.device)
        scale = packet[0:4].view(torch.float32)          # the header's scale, written in place
        scale.fill_(1.0)
        if x.numel():
            blocks.encode(x, cls.fmt, cls._codes(packet[HEADER_BYTES:]), scale, block=x.numel())
        inf_at_max = float(scale) < 0
        scale.abs_()
        packet[4:8].view(torch.int32).fill_(FLAG_INF_AT_MAX if inf_at_max else 0)
        return packet, (tensor.shape, tensor.dtype)

    @classmethod
    def decode_packet(cls, packet, out=None):
        """The packet's values as flat float32 (scale undone, Inf restored)."""
        scale, flags = read_header(packet)
        if flags and cls.fmt.has_inf:
            raise ValueError(f"corrupt packet header: {cls.__name__} never sets flags")
        raw = packet[HEADER_BYTES:]
        width = cls.fmt.code_bytes
        if raw.numel() % width:
            raise ValueError(f"{cls.__name__} packet has {raw.numel()} code bytes, "
                             f"not a multiple of {width}")
        numel = raw.numel() // width
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=packet.device)
        signed = torch.tensor([-scale if flags & FLAG_INF_AT_MAX else scale], device=packet.device)
        return blocks.decode(cls._codes(raw), signed, cls.fmt, out, block=max(numel, 1))

    @classmethod
    def packet_bytes(cls, numel: int) -> int:
        return HEADER_BYTES + cls.fmt.code_bytes * numel

    @classmethod
    def _codes(cls, raw):
        """uint8 bytes viewed as the format's codes (int16 for float16; copied if misaligned)."""
        if cls.fmt.code_bytes == 1:
            return raw
        if raw.storage_offset() % cls.fmt.code_bytes:
            raw = raw.clone()
        return raw.view(blocks.code_dtype(cls.fmt))


class Bit8Compressor(ScaledFloatCompressor):
    """float32 -> scaled OCP E4M3 (torch.float8_e4m3fn bits), 1 byte per value + 8-byte header.

    Relative error <= 2**-4 for values that land in E4M3's normal range after scaling;
    NaN stays NaN and +-Inf stays +-Inf (see the module docstring).
    """
    bits = 8
    name = "bit8"
    fmt = E4M3


class Bit16Compressor(ScaledFloatCompressor):
    """float32 -> scaled IEEE float16 bits, 2 bytes per value + 8-byte header.

    Unlike Horovod's `Compression.fp16` (a plain cast, summed in float16 by allreduce), the
    values are scaled first, so gradients below float16's normal range (6.1e-5) keep their
    11 significant bits, and ranks reduce in float32. Relative error <= 2**-11 for normal values.
    """
    bits = 16
    name = "bit16"
    fmt = FP16


def packet_bytes(compressor, numel: int) -> int:
    """Size of the packet `compressor` makes for `numel` values."""
    return compressor.packet_bytes(numel)


def compressor_name(compressor) -> str:
    """A stable name for any Horovod compressor (ours, Horovod's, a user's)."""
    known = {NoneCompressor: "none", FP16Compressor: "fp16"}
    return known.get(compressor, getattr(compressor, "name", getattr(compressor, "__name__", str(compressor))))



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

    # Methods that are not a codec of values but a communicator of their own (imported when
    # called: Horovod's patched source imports this module while horovod.torch loads).
    @staticmethod
    def topk(ratio=0.01, error_feedback=True):
        """The k = ceil(ratio numel) largest |g| of each gradient, by allgather (topk.py)."""
        from .topk import TopK
        return TopK(ratio, error_feedback)

    @staticmethod
    def powersgd(rank=2, error_feedback=True):
        """Rank-`rank` approximation of each matrix by two float32 allreduces (powersgd.py)."""
        from .powersgd import PowerSGD
        return PowerSGD(rank, error_feedback)
