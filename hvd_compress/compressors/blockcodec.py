"""BlockCodec: the message, chunk and two-phase logic of every codec of blocks of values,
written once (bit8, bit16, int8, onebit and bfloat16 are small subclasses).

A bucket message is

    [float32 scale per block of `block` values | codes | zero padding to a multiple of 4]

(no scales when `block_scales` is False), and its size is the registry's formula
(registry.Scheme.message_bytes), so the cost model counts exactly what travels. A subclass says
how a block of values becomes codes and back, with three classmethods:

    encode_blocks(flat, codes, scales, block)        float32 -> codes (uint8) and scales
    decode_blocks(codes, scales, out, block)         rows of codes (rank order) -> out, their
                                                     sum in float32 (overwritten)
    and its registry entry's code_bytes(numel)       how many code bytes numel values take

Per tensor (Horovod's interface) the default packet is [int32 numel | int32 block | message],
so a packet decodes on its own; bit8 and bit16 keep their own 8-byte header (compressors/scaled_float.py).
"""
import torch

from .. import registry
from ..codecs import SCALE_BLOCK
from ..registry import HEADER_BYTES
from ..roles import PacketCompressor, flat_float32

__all__ = ["BlockCodec"]


class BlockCodec(PacketCompressor):
    """A packet compressor of blocks of values; subclasses give the codec (module docstring)."""
    name = None
    bits = None
    block_scales = True      # one float32 scale per block in front of the codes
    error_feedback = False   # the method's default (DistributedOptimizer error_feedback=None)

    # ---- what a subclass provides -------------------------------------------------------------
    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        raise NotImplementedError

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        raise NotImplementedError

    @classmethod
    def kernel(cls, *messages):
        """A native kernel that takes these messages whole (compressors/scaled_float.py), else None."""
        return None

    @classmethod
    def codec_path(cls, device="cpu"):
        """Which implementation runs on `device`: 'torch' (or 'native', where a kernel is)."""
        return "torch"

    # ---- sizes and layout ---------------------------------------------------------------------
    @classmethod
    def scheme(cls):
        """The registry entry whose layout this codec's messages follow: its own name's, or the
        nearest base class's (a subclass of Bit8Compressor under another name sends bit8's)."""
        for klass in cls.__mro__:
            name = getattr(klass, "name", None)
            if name is not None and (name in registry.SCHEMES or klass is cls):
                if name in registry.SCHEMES or name in registry.load_plugins():
                    return registry.SCHEMES[name]
        raise ValueError(f"{cls.__name__} ({cls.name!r}) is not a registered scheme: register "
                         "it with hvd_compress.registry.register(Scheme(...)) "
                         "(docs/extending.md)")

    @classmethod
    def code_bytes(cls, numel):
        """Bytes of the codes of `numel` values (the registry entry's formula)."""
        return cls.scheme().code_bytes(numel)

    @classmethod
    def message_bytes(cls, numel, block=SCALE_BLOCK):
        """Bytes of a bucket message: scales, codes, padded to a multiple of 4 so that rows of a
        gathered buffer can be viewed as float32 without copying."""
        return cls.scheme().message_bytes(numel, block or max(numel, 1))

    @classmethod
    def message_views(cls, message, numel, block=SCALE_BLOCK):
        """(codes, scales) of a message, or of each row of a 2-D batch of them, as views."""
        nb = -(-numel // (block or max(numel, 1))) if cls.block_scales else 0
        return message[..., 4 * nb:4 * nb + cls.code_bytes(numel)], message[..., :4 * nb].view(torch.float32)

    @classmethod
    def _check_length(cls, messages, numel, block):
        need = cls.message_bytes(numel, block)
        if messages.dim() not in (1, 2) or messages.dtype != torch.uint8 or messages.size(-1) < need:
            raise ValueError(f"corrupt bucket message: {cls.name} needs {need} bytes for {numel} "
                             f"values, got {messages.dtype} of shape {tuple(messages.shape)}")

    # ---- per bucket ---------------------------------------------------------------------------
    @classmethod
    def encode_message(cls, flat, message, block=SCALE_BLOCK):
        """Encode contiguous float32 `flat` into `message` (message_bytes long), one pass."""
        numel = flat.numel()
        if numel == 0:
            return message
        block = block or numel
        kernel = cls.kernel(message)
        if kernel is not None:                       # one call, no views made
            kernel.encode_message(flat, message, cls.fmt.name, int(block))
            return message
        codes, scales = cls.message_views(message, numel, block)
        cls.encode_blocks(flat, codes, scales, block)
        return message

    @classmethod
    def decode_messages(cls, messages, numel, out, block=SCALE_BLOCK, divisor=1):
        """Decode n messages (rows of a 2-D uint8 tensor, rank order), sum them into `out` in
        float32, rank by rank, and divide by `divisor` (n to average), in one pass:
        bit-identical on every rank, and to summing first and dividing after. A message
        shorter than its values need raises ValueError."""
        if numel == 0:
            return out.zero_()
        block = block or numel
        cls._check_length(messages, numel, block)
        kernel = cls.kernel(messages)
        if kernel is not None:
            kernel.decode_messages(messages, int(numel), out, cls.fmt.name, int(block),
                                   float(divisor))
            return out
        codes, scales = cls.message_views(messages, numel, block)
        cls.decode_blocks(codes, scales, out, block)
        return out.div_(divisor) if divisor != 1 else out

    # ---- runs of messages: the chunks of a bucket, one message each, back to back -------------
    @classmethod
    def encode_chunks(cls, flat, message, bounds, block=SCALE_BLOCK):
        kernel = cls.kernel(message)
        if kernel is not None:
            kernel.encode_chunks(flat, message, list(bounds), cls.fmt.name, int(block or 0))
            return message
        return super().encode_chunks(flat, message, bounds, block)

    @classmethod
    def decode_chunks(cls, message, bounds, out, block=SCALE_BLOCK):
        kernel = cls.kernel(message)
        if kernel is not None:
            kernel.decode_chunks(message, list(bounds), out, cls.fmt.name, int(block or 0))
            return out
        return super().decode_chunks(message, bounds, out, block)

    @classmethod
    def reduce_encode(cls, messages, numel, message, block=SCALE_BLOCK, divisor=1):
        kernel = cls.kernel(messages, message)
        if kernel is not None:
            kernel.reduce_encode(messages, int(numel), message, cls.fmt.name,
                                 int(block or max(numel, 1)), float(divisor))
            return message
        return super().reduce_encode(messages, numel, message, block, divisor)

    @classmethod
    def chunks_bytes(cls, bounds, block=SCALE_BLOCK):
        return super().chunks_bytes(bounds, block)

    @classmethod
    def decode_message(cls, message, numel, out, block=SCALE_BLOCK):
        return super().decode_message(message, numel, out, block)

    # ---- per tensor: Horovod's interface, [int32 numel | int32 block | message] ---------------
    @classmethod
    def compress(cls, tensor):
        """Encode a floating-point tensor into a packet; ctx = (shape, dtype) to restore it."""
        x = flat_float32(tensor)
        numel, block = x.numel(), SCALE_BLOCK
        packet = torch.zeros(cls.packet_bytes(numel), dtype=torch.uint8, device=x.device)
        packet[:HEADER_BYTES].view(torch.int32).copy_(torch.tensor([numel, block], dtype=torch.int32))
        cls.encode_message(x, packet[HEADER_BYTES:], block)
        return packet, (tensor.shape, tensor.dtype)

    @classmethod
    def decode_packet(cls, packet, out=None):
        """The packet's values as flat float32; a header that disagrees with the size raises."""
        if packet.dtype != torch.uint8 or packet.dim() != 1 or packet.numel() < HEADER_BYTES:
            raise ValueError(f"not a {cls.name} packet: expected a 1-D uint8 tensor of >= "
                             f"{HEADER_BYTES} bytes, got {packet.dtype} of shape {tuple(packet.shape)}")
        numel, block = (int(v) for v in packet[:HEADER_BYTES].clone().view(torch.int32))
        if numel < 0 or block < 1 or packet.numel() != HEADER_BYTES + cls.message_bytes(numel, block):
            raise ValueError(f"corrupt {cls.name} packet: header says {numel} values in blocks "
                             f"of {block}, but the packet has {packet.numel()} bytes")
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=packet.device)
        return cls.decode_message(packet[HEADER_BYTES:], numel, out, block)

    @classmethod
    def packet_bytes(cls, numel):
        return HEADER_BYTES + cls.message_bytes(numel, SCALE_BLOCK)


def check_scales(name, scales):
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError(f"corrupt bucket message: {name} block scales must be finite and >= 0")
