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
one decoder. The bucket path (`encode_message` / `decode_messages`) puts one scale per block
of `codecs.SCALE_BLOCK` values in front of the codes; a negative scale marks a block whose
largest code means +-Inf, the same rule as the packet's flag.
"""
import math

import torch
from horovod.torch.compression import FP16Compressor, NoneCompressor

from .codecs import E4M3, FP16, SCALE_BLOCK, blocks
from .quantizers import Int8Compressor, OneBitCompressor
from .registry import HEADER_BYTES
from .roles import PacketCompressor, flat_float32 as _flat_float32, pad4 as _pad4

__all__ = ["Bit8Compressor", "Bit16Compressor", "Int8Compressor", "OneBitCompressor",
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


class _BlockScaledCompressor(PacketCompressor):
    """Shared shape of Bit8/Bit16: a power-of-two scale per block, then the format's codes."""
    code_bytes = 1               # bytes per value
    name = "scaled"

    # ---- per tensor: Horovod's interface, one self-describing packet -----------------------
    @classmethod
    def compress(cls, tensor):
        """Encode a floating-point tensor into a packet; ctx = (shape, dtype) to restore it."""
        x = _flat_float32(tensor)
        packet = torch.empty(HEADER_BYTES + cls.code_bytes * x.numel(), dtype=torch.uint8,
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
        if raw.numel() % cls.code_bytes:
            raise ValueError(f"{cls.__name__} packet has {raw.numel()} code bytes, "
                             f"not a multiple of {cls.code_bytes}")
        numel = raw.numel() // cls.code_bytes
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=packet.device)
        signed = torch.tensor([-scale if flags & FLAG_INF_AT_MAX else scale], device=packet.device)
        return blocks.decode(cls._codes(raw), signed, cls.fmt, out, block=max(numel, 1))

    @classmethod
    def packet_bytes(cls, numel: int) -> int:
        return HEADER_BYTES + cls.code_bytes * numel

    # ---- per bucket: the optimizer's path, [scales | codes | pad to 4 bytes] --------------
    @classmethod
    def message_bytes(cls, numel: int, block=SCALE_BLOCK) -> int:
        """Bytes of a bucket message: float32 scales, codes, padded to a multiple of 4 so
        that rows of a gathered buffer can be viewed as float32 without copying."""
        return 4 * blocks.num_blocks(numel, block or max(numel, 1)) + _pad4(cls.code_bytes * numel)

    @classmethod
    def encode_message(cls, flat, message, block=SCALE_BLOCK):
        """Encode contiguous float32 `flat` into `message` (message_bytes long), one pass."""
        numel = flat.numel()
        if numel == 0:
            return message
        block = block or numel
        if blocks.native_message_ok(message, cls.fmt):      # one call, no views made
            blocks.native.module().encode_message(flat, message, cls.fmt.name, int(block))
            return message
        codes, scales = cls._split(message, numel, block)
        blocks.encode(flat, cls.fmt, codes, scales, block=block)
        return message

    @classmethod
    def decode_message(cls, message, numel, out, block=SCALE_BLOCK):
        """Decode one message into float32 `out` (numel values)."""
        return cls.decode_messages(message.view(1, -1), numel, out, block)

    @classmethod
    def decode_messages(cls, messages, numel, out, block=SCALE_BLOCK, divisor=1):
        """Decode n messages (rows of a 2-D uint8 tensor, rank order), sum them into `out` in
        float32, rank by rank, and divide by `divisor` (n to average), in one pass:
        bit-identical on every rank, and to summing first and dividing after."""
        if numel == 0:
            return out
        block = block or numel
        if blocks.native_message_ok(messages, cls.fmt):
            blocks.native.module().decode_messages(messages, int(numel), out, cls.fmt.name,
                                                   int(block), float(divisor))
            return out
        codes, scales = cls._split(messages, numel, block)
        blocks.decode_accumulate(codes, scales, cls.fmt, out, block=block)
        return out.div_(divisor) if divisor != 1 else out

    # ---- runs of messages: the chunks of a bucket, one message each, one after another -----
    @classmethod
    def chunks_bytes(cls, bounds, block=SCALE_BLOCK):
        """Bytes of the messages of chunks [bounds[k], bounds[k+1]) (block None: one per chunk)."""
        return sum(cls.message_bytes(b - a, block or max(b - a, 1)) for a, b in zip(bounds, bounds[1:]))

    @classmethod
    def encode_chunks(cls, flat, message, bounds, block=SCALE_BLOCK):
        """Encode chunk k = flat[bounds[k]:bounds[k+1]] into the k-th message of `message`;
        block None: one scale per chunk. One call for the whole bucket."""
        if blocks.native_message_ok(message, cls.fmt):
            blocks.native.module().encode_chunks(flat, message, list(bounds), cls.fmt.name, int(block or 0))
            return message
        offset = 0
        for a, b in zip(bounds, bounds[1:]):
            size = cls.message_bytes(b - a, block or max(b - a, 1))
            cls.encode_message(flat[a:b], message[offset:offset + size], block or max(b - a, 1))
            offset += size
        return message

    @classmethod
    def decode_chunks(cls, message, bounds, out, block=SCALE_BLOCK):
        """The inverse of encode_chunks: chunk k's values into out[bounds[k]:bounds[k+1]]."""
        if blocks.native_message_ok(message, cls.fmt):
            blocks.native.module().decode_chunks(message, list(bounds), out, cls.fmt.name, int(block or 0))
            return out
        offset = 0
        for a, b in zip(bounds, bounds[1:]):
            size = cls.message_bytes(b - a, block or max(b - a, 1))
            cls.decode_message(message[offset:offset + size], b - a, out[a:b], block or max(b - a, 1))
            offset += size
        return out

    @classmethod
    def reduce_encode(cls, messages, numel, message, block=SCALE_BLOCK, divisor=1):
        """n ranks' messages of one chunk (rows) decoded, summed in rank order, divided by
        `divisor` and encoded again into `message`: the two-phase route's middle, one call."""
        block = block or max(numel, 1)
        if blocks.native_message_ok(messages, cls.fmt) and blocks.native_message_ok(message, cls.fmt):
            blocks.native.module().reduce_encode(messages, int(numel), message, cls.fmt.name,
                                                 int(block), float(divisor))
            return message
        total = torch.empty(numel, dtype=torch.float32, device=messages.device)
        cls.decode_messages(messages, numel, total, block, divisor)
        return cls.encode_message(total, message, block)

    @classmethod
    def message_views(cls, message, numel, block=SCALE_BLOCK):
        """(codes, scales) of a message (or of each row of a 2-D batch of messages), as views:
        the layout, for callers that keep them from step to step."""
        return cls._split(message, numel, block)

    @classmethod
    def _split(cls, message, numel, block):
        nb = blocks.num_blocks(numel, block or max(numel, 1))
        scales = message[..., :4 * nb].view(torch.float32)
        return cls._codes(message[..., 4 * nb:4 * nb + cls.code_bytes * numel]), scales

    @classmethod
    def _codes(cls, raw):
        """uint8 bytes viewed as the format's codes (int16 for float16; copied if misaligned)."""
        if cls.code_bytes == 1:
            return raw
        if raw.storage_offset() % cls.code_bytes:
            raw = raw.clone()
        return raw.view(blocks.code_dtype(cls.fmt))


class Bit8Compressor(_BlockScaledCompressor):
    """float32 -> scaled OCP E4M3 (torch.float8_e4m3fn bits), 1 byte per value + 8-byte header.

    Relative error <= 2**-4 for values that land in E4M3's normal range after scaling;
    NaN stays NaN and +-Inf stays +-Inf (see the module docstring).
    """
    code_bytes = 1
    bits = 8
    name = "bit8"
    fmt = E4M3


class Bit16Compressor(_BlockScaledCompressor):
    """float32 -> scaled IEEE float16 bits, 2 bytes per value + 8-byte header.

    Unlike Horovod's `Compression.fp16` (a plain cast, summed in float16 by allreduce), the
    values are scaled first, so gradients below float16's normal range (6.1e-5) keep their
    11 significant bits, and ranks reduce in float32. Relative error <= 2**-11 for normal values.
    """
    code_bytes = 2
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
