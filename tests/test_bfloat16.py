"""BF16Compressor (hvd_compress/compressors/bf16.py): the codec bit for bit against ml_dtypes.bfloat16
(round to nearest even), its messages, the float32 sum, and the routes it may take."""
import ml_dtypes
import numpy as np
import pytest
import torch

import hvd_compress as hc
from hvd_compress import registry
from hvd_compress.codecs.bfloat16 import decode_accumulate, encode
from hvd_compress.compressors import BF16Compressor
from hvd_compress.exchange.routes import make_communicator
from hvd_compress.costmodel import methods

pytestmark = pytest.mark.unit


def reference(values):
    """ml_dtypes' float32 -> bfloat16, as uint16 bit patterns."""
    return values.numpy().astype(ml_dtypes.bfloat16).view(np.uint16)


def codes_of(values):
    codes = torch.empty(values.numel(), dtype=torch.int16)
    return encode(values, codes).numpy().view(np.uint16)


def special_values():
    bits = [0, 1, 0x007FFFFF, 0x00800000, 0x3F800000, 0x3F808000, 0x3F818000, 0x3F80FFFF,
            0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF]
    bits += [b | 0x80000000 for b in bits]
    return torch.tensor(np.array(bits, dtype=np.uint32).view(np.int32)).view(torch.float32)


def test_codes_equal_ml_dtypes_on_special_values():
    """Ties to even, the largest finite rounding to Inf, subnormals, NaN payloads and signs."""
    x = special_values()
    with np.errstate(invalid="ignore"):
        assert np.array_equal(codes_of(x), reference(x))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_codes_equal_ml_dtypes_on_random_bit_patterns(seed):
    """A million float32 bit patterns, every exponent: the same 16 bits as ml_dtypes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2 ** 31, 2 ** 31, (1 << 20,), generator=gen, dtype=torch.int64)
    x = x.to(torch.int32).view(torch.float32)
    with np.errstate(invalid="ignore"):
        assert np.array_equal(codes_of(x), reference(x))


def test_decode_sums_in_float32_in_rank_order():
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(1001, generator=gen) * 10.0 ** k for k in (-3, 0, 3)]
    codes = torch.stack([torch.from_numpy(reference(r).view(np.int16)) for r in rows])
    out = torch.empty(1001)
    decode_accumulate(codes, out)
    expected = torch.from_numpy(codes[0].numpy().view(ml_dtypes.bfloat16).astype(np.float32))
    for r in codes[1:]:
        expected = expected + torch.from_numpy(r.numpy().view(ml_dtypes.bfloat16).astype(np.float32))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 255, 4097])
def test_messages_round_trip_and_match_the_cost_model(numel):
    comp = hc.Compression.bf16
    x = torch.randn(numel) * 1e-4
    size = comp.message_bytes(numel)
    assert size == registry.scheme("bf16").message_bytes(numel, 256) == (2 * numel + 3) // 4 * 4
    messages = torch.zeros(2, size, dtype=torch.uint8)
    comp.encode_message(x, messages[0])
    comp.encode_message(-2 * x, messages[1])
    out = torch.empty(numel)
    comp.decode_messages(messages, numel, out, divisor=2)
    rounded = x.to(torch.bfloat16).float()
    assert torch.equal(out, (rounded + (-2 * x).to(torch.bfloat16).float()) / 2)
    packet, ctx = comp.compress(x)
    assert packet.numel() == comp.packet_bytes(numel)
    assert torch.equal(comp.decompress(packet, ctx), rounded)
    if numel:
        with pytest.raises(ValueError, match="corrupt bucket message"):
            comp.decode_messages(messages[:, :size - 4], numel, out)


def test_routes_and_bytes():
    """The packet routes (two-phase by default), never Horovod's allreduce (horovod#4047)."""
    assert make_communicator(hc.Compression.bf16).route.value == "alltoall"
    assert make_communicator(hc.Compression.bf16, route="allgather").route.value == "allgather"
    with pytest.raises(ValueError, match="cannot travel by allreduce"):
        make_communicator(hc.Compression.bf16, route="allreduce")
    shapes = methods.MODEL_SHAPES["horovod"]                # 21,840 values in one bucket
    assert methods.bytes_per_step("bf16", shapes, 2, route="allgather") == 2 * 21840
    assert methods.bytes_per_step("bf16", shapes, 2) == methods.bytes_per_step("bf16", shapes, 2, route="alltoall")
