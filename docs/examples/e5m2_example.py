"""E5M2Compressor: gradients as OCP E5M2 codes (5 exponent bits, 2 mantissa bits), with a
power-of-two scale per block of values, decoded and summed in float32 by every rank."""
from hvd_compress.compressors.blockcodec import BlockCodec
from hvd_compress.codecs import E5M2, blocks
from hvd_compress.registry import Route, Scheme, register


class E5M2Compressor(BlockCodec):
    name = "e5m2"
    bits = 8

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        """float32 values -> one E5M2 byte each and a float32 scale per block."""
        blocks.encode(flat, E5M2, codes, scales, block=block)

    @classmethod
    def decode_blocks(cls, codes, scales, out, block):
        """Rows of codes (one per rank, in rank order) -> their sum in float32, into out."""
        blocks.decode_accumulate(codes, scales, E5M2, out, block=block)


register(Scheme(
    name="e5m2", bits=8, routes=(Route.ALLGATHER, Route.ALLTOALL),
    summary="scaled OCP E5M2, reduced in float32",
    compressor=E5M2Compressor, flag="--e5m2-allreduce",
    code_bytes=lambda numel: numel))          # one byte a value
