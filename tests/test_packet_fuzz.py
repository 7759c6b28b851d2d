"""Packets checked (issue 15): a corrupt header or scale raises a clear error instead of
decoding into garbage gradients. Random bytes of Bit8/Bit16 packet headers and of bucket
messages' scales are flipped (fixed seeds, thousands of cases); every decode either raises
ValueError/RuntimeError naming the packet or message as corrupt, or (when the flip leaves a
header an encoder could have written) returns the right number of values. What no check can
see: a flip that leaves another valid header (another power of two; for E4M3 the sign of a
block's scale, which marks its max code as Inf), or a flip in the codes themselves."""
import random

import pytest
import torch

from hvd_compress.codecs import SCALE_BLOCK
from hvd_compress.compressors.scaled_float import HEADER_BYTES
from hvd_compress.compression import Compression

pytestmark = pytest.mark.unit


def gradient(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 1e-3


@pytest.mark.parametrize("scheme", ["bit8", "bit16"])
def test_flipped_header_bytes_raise_or_stay_valid(scheme):
    comp = getattr(Compression, scheme)
    rng = random.Random(15)
    raised = decoded = 0
    for case in range(2000):
        x = gradient(rng.randint(1, 300), case)
        packet, ctx = comp.compress(x)
        bad = packet.clone()
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(HEADER_BYTES)
            bad[i] ^= 1 << rng.randrange(8)
        try:
            out = comp.decompress(bad, ctx)
        except (ValueError, RuntimeError) as err:
            assert "corrupt" in str(err), str(err)
            raised += 1
            continue
        decoded += 1
        assert out.shape == x.shape
        scale = float(bad[:4].view(torch.float32))
        assert scale > 0 and scale == 2.0 ** round(torch.tensor(scale).log2().item())
    assert raised > 1000 and decoded > 0          # most flips break the header; some cannot


@pytest.mark.parametrize("scheme", ["bit8", "bit16"])
def test_wrong_length_raises(scheme):
    comp = getattr(Compression, scheme)
    packet, ctx = comp.compress(gradient(100, 0))
    for short in (packet[:-comp.fmt.code_bytes], packet[:HEADER_BYTES - 1], packet[:HEADER_BYTES]):
        with pytest.raises(ValueError, match="corrupt packet|not a packet"):
            comp.decompress(short, ctx)
    with pytest.raises(ValueError, match="corrupt packet"):
        comp.decompress(torch.cat([packet, packet[-comp.fmt.code_bytes:]]), ctx)


@pytest.mark.parametrize("scheme", ["bit8", "bit16"])
def test_flipped_bucket_scales_raise_or_stay_powers_of_two(scheme):
    comp = getattr(Compression, scheme)
    rng = random.Random(16)
    numel = 3 * SCALE_BLOCK + 17
    raised = 0
    for case in range(1000):
        messages = torch.zeros(2, comp.message_bytes(numel), dtype=torch.uint8)
        for r in range(2):
            comp.encode_message(gradient(numel, 2 * case + r), messages[r])
        r, i = rng.randrange(2), rng.randrange(4 * 4)          # a byte of one of 4 scales
        messages[r, i] ^= 1 << rng.randrange(8)
        scale = float(messages[r, i // 4 * 4:i // 4 * 4 + 4].view(torch.float32))
        valid = scale != 0 and abs(scale) == 2.0 ** round(torch.tensor(abs(scale)).log2().item()) \
            and 2.0 ** -126 <= abs(scale) < float("inf") and (scale > 0 or not comp.fmt.has_inf)
        try:
            comp.decode_messages(messages, numel, torch.empty(numel))
        except RuntimeError as err:
            assert "corrupt bucket message" in str(err)
            assert not valid
            raised += 1
            continue
        assert valid, f"scale {scale!r} decoded without an error"
    assert raised > 500
