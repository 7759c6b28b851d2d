"""Int8Compressor and OneBitCompressor: the course's other quantisers, on the packet routes.

Both are codes that allreduce cannot sum, so they travel as bit8 does (communicators.py):
every rank's bucket message by allgather, decoded and summed in float32 in rank order; int8
also by the two-phase route. A message is the same shape as bit8's,

    [float32 scale per block | codes | zero padding to a multiple of 4 bytes]

    int8     codes: one int8 per value, scale = block amax / 127, stochastic rounding
             (codecs/int8.py): unbiased, E[decoded] = x. 8 bits + 32/block per value.
    onebit   codes: one sign bit per value, scale = block mean |x| (codecs/onebit.py):
             1 bit + 32/block per value, about 28x fewer bytes than float32 at block 256.
             Biased; error feedback is its default (OneBitCompressor.error_feedback).

Per tensor (Horovod's interface) the packet is [uint32 numel | uint32 block | message], so a
packet decodes on its own. The codecs are torch code, not native kernels: these methods are
here to compare accuracy and bytes; bit8 is the fast 8-bit path.
"""
import torch

from .codecs import SCALE_BLOCK
from .codecs import int8 as int8_codec
from .codecs import onebit as onebit_codec
from .registry import HEADER_BYTES
from .roles import PacketCompressor, flat_float32 as _flat_float32, pad4 as _pad4

__all__ = ["Int8Compressor", "OneBitCompressor"]


class _MessageCompressor(PacketCompressor):
    """The packet and message layout shared by int8 and onebit; subclasses give the codec."""
    name = "message"
    error_feedback = False           # the method's default (DistributedOptimizer error_feedback=None)

    @classmethod
    def code_bytes(cls, numel):
        raise NotImplementedError

    @classmethod
    def _encode(cls, flat, codes, scales, block):
        raise NotImplementedError

    @classmethod
    def _decode_accumulate(cls, codes2d, scales2d, out, block):
        raise NotImplementedError

    # ---- per tensor: Horovod's interface ------------------------------------------------------
    @classmethod
    def compress(cls, tensor):
        x = _flat_float32(tensor)
        numel, block = x.numel(), SCALE_BLOCK
        packet = torch.zeros(cls.packet_bytes(numel), dtype=torch.uint8, device=x.device)
        packet[:HEADER_BYTES].view(torch.int32).copy_(torch.tensor([numel, block], dtype=torch.int32))
        cls.encode_message(x, packet[HEADER_BYTES:], block)
        return packet, (tensor.shape, tensor.dtype)

    @classmethod
    def decode_packet(cls, packet, out=None):
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

    # ---- per bucket: the optimizer's path -----------------------------------------------------
    @classmethod
    def message_bytes(cls, numel, block=SCALE_BLOCK):
        block = block or max(numel, 1)
        return 4 * -(-numel // block) + _pad4(cls.code_bytes(numel))

    @classmethod
    def message_views(cls, message, numel, block=SCALE_BLOCK):
        """(codes, scales) of a message, or of each row of a 2-D batch of them, as views."""
        block = block or max(numel, 1)
        nb = -(-numel // block)
        return message[..., 4 * nb:4 * nb + cls.code_bytes(numel)], message[..., :4 * nb].view(torch.float32)

    @classmethod
    def encode_message(cls, flat, message, block=SCALE_BLOCK):
        if flat.numel():
            codes, scales = cls.message_views(message, flat.numel(), block)
            cls._encode(flat, codes, scales, block or flat.numel())
        return message

    @classmethod
    def decode_message(cls, message, numel, out, block=SCALE_BLOCK):
        return cls.decode_messages(message.view(1, -1), numel, out, block)

    @classmethod
    def decode_messages(cls, messages, numel, out, block=SCALE_BLOCK, divisor=1):
        """Sum the n messages (rows, rank order) into `out` (overwritten), / divisor."""
        out.zero_()
        if numel == 0:
            return out
        codes, scales = cls.message_views(messages, numel, block)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise ValueError(f"corrupt bucket message: {cls.name} block scales must be finite "
                             "and >= 0")
        cls._decode_accumulate(codes, scales, out, block or numel)
        return out.div_(divisor) if divisor != 1 else out

    @classmethod
    def chunks_bytes(cls, bounds, block=SCALE_BLOCK):
        return sum(cls.message_bytes(b - a, block) for a, b in zip(bounds, bounds[1:]))

    @classmethod
    def _chunk_messages(cls, message, bounds, block):
        offset = 0
        for a, b in zip(bounds, bounds[1:]):
            size = cls.message_bytes(b - a, block)
            yield a, b, message[offset:offset + size]
            offset += size

    @classmethod
    def encode_chunks(cls, flat, message, bounds, block=SCALE_BLOCK):
        for a, b, part in cls._chunk_messages(message, bounds, block):
            cls.encode_message(flat[a:b], part, block)
        return message

    @classmethod
    def decode_chunks(cls, message, bounds, out, block=SCALE_BLOCK):
        for a, b, part in cls._chunk_messages(message, bounds, block):
            cls.decode_message(part, b - a, out[a:b], block)
        return out

    @classmethod
    def reduce_encode(cls, messages, numel, message, block=SCALE_BLOCK, divisor=1):
        total = torch.empty(numel, dtype=torch.float32, device=messages.device)
        cls.decode_messages(messages, numel, total, block, divisor)
        return cls.encode_message(total, message, block)


class Int8Compressor(_MessageCompressor):
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
    def code_bytes(cls, numel):
        return numel

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
    def _encode(cls, flat, codes, scales, block):
        int8_codec.encode(flat, codes.view(torch.int8), scales, block, cls.generator(flat.device))

    @classmethod
    def _decode_accumulate(cls, codes2d, scales2d, out, block):
        int8_codec.decode_accumulate(codes2d.view(torch.int8), scales2d, out, block)


class OneBitCompressor(_MessageCompressor):
    """float32 -> one sign bit per value and the mean |x| of each block (1-bit SGD); biased, so
    `hc.DistributedOptimizer` turns error feedback on for it unless told otherwise."""
    name = "onebit"
    bits = 1
    error_feedback = True

    @classmethod
    def code_bytes(cls, numel):
        return onebit_codec.sign_bytes(numel)

    @classmethod
    def _encode(cls, flat, codes, scales, block):
        onebit_codec.encode(flat, codes, scales, block)

    @classmethod
    def _decode_accumulate(cls, codes2d, scales2d, out, block):
        onebit_codec.decode_accumulate(codes2d, scales2d, out, block)
