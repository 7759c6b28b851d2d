"""The three roles of a compressed gradient exchange, as GRACE states them, in one place.

    Memory        compensate(name, x) before compressing; remember(name, x, kept) after
    Compressor    Horovod's two static methods; a PacketCompressor adds the bucket kernels
    Communicator  start(bucket) launches the collective; advance(exchanges) starts the later
                  phases of multi-phase routes; finish(exchange) leaves the reduced values
                  in the bucket

One step serves every route (communicators.py): compensate -> compress -> remember ->
collective -> decompress. Which Communicator carries a scheme is decided in one place,
`communicators.make_communicator`, from the names in registry.py.
"""
import torch
from horovod.torch.compression import Compressor

__all__ = ["Compressor", "PacketCompressor", "Memory", "Communicator", "flat_float32", "pad4"]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class PacketCompressor(Compressor):
    """Codes that allreduce cannot sum (a sum of float8 codes is meaningless): every rank
    decodes every rank's codes and reduces in float32.

    Per tensor (Horovod's interface, the course's in-tree route): `compress(tensor) ->
    (packet, ctx)`, a self-describing uint8 packet; `decompress(packet, ctx)`;
    `decode_packet(packet, out=)` -> flat float32; `packet_bytes(numel)`.
    Per bucket (the optimizer's hot path; one pass each, a scale per block of values):
    `message_bytes(numel, block)`, `encode_message(flat, message, block)`,
    `decode_messages(messages, numel, out, block)` (rank-order sum of n rows).
    """
    bits = None          # bits per value on the wire
    fmt = None           # the codec's number format (codecs.E4M3, codecs.FP16)

    @classmethod
    def decompress(cls, packet, ctx):
        """Decode a packet back to a tensor of the original shape and dtype (ctx), checking
        that the packet holds as many values as the tensor."""
        shape, dtype = ctx
        values = cls.decode_packet(packet)
        if values.numel() != shape.numel():
            raise ValueError(f"corrupt packet: {values.numel()} values for a tensor of shape "
                             f"{tuple(shape)} ({shape.numel()} values)")
        return values.view(shape).to(dtype)


def flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values in logical (row-major) order as contiguous float32, no copy if possible."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError("sparse tensors cannot be compressed to 8/16-bit codes; "
                        "densify them (sparse_as_dense) or exchange them uncompressed")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"8/16-bit gradient compression needs a floating-point tensor, "
                        f"got {tensor.dtype}")
    return tensor.detach().reshape(-1).to(torch.float32).contiguous()


def pad4(nbytes: int) -> int:
    return (nbytes + 3) & ~3


class Memory:
    """Error feedback's state (memory.py): what compression dropped, per bucket name."""

    def compensate(self, name, x):
        """x plus what the previous step dropped (x itself when there is nothing)."""
        raise NotImplementedError

    def remember(self, name, compensated, kept):
        """Store compensated - kept: exactly what this step's codes dropped."""
        raise NotImplementedError


class Communicator:
    """Carries buckets over one collective route (registry.Route) and counts the bytes."""
    route = None

    def start(self, bucket, memory=None):
        """Compress the bucket (with error feedback if `memory`) and launch its collective;
        return an exchange handle. Called from a gradient hook, so it must not block."""
        raise NotImplementedError

    def advance(self, exchanges):
        """Before the finishes: launch each exchange's later phase the moment its earlier one
        completes, in completion order (multi-phase routes; one-phase ones have nothing to do)."""

    def finish(self, exchange):
        """Wait for the exchange and write the reduced values into its bucket."""
        raise NotImplementedError
