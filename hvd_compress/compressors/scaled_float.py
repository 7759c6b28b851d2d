"""ScaledFloatCompressor: the shape bit8 and bit16 share, on Horovod's `Compressor` interface.

Horovod's interface is two static methods: `compress(tensor) -> (compressed, ctx)` and
`decompress(compressed, ctx) -> tensor`. Ours keep exactly that shape, so any code written
for `hvd.Compression.fp16` accepts them. What does not fit in two methods (which collective
carries the result, error feedback, bucketing) lives in exchange/routes.py, exchange/memory.py and
exchange/fusion.py, as in GRACE (roles.py states the three roles).

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

from ..codecs import SCALE_BLOCK, blocks
from ..registry import HEADER_BYTES
from ..roles import flat_float32
from .blockcodec import BlockCodec

__all__ = ["ScaledFloatCompressor", "FLAG_INF_AT_MAX", "read_header"]

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
        x = flat_float32(tensor)
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
