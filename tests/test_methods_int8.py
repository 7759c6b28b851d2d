"""int8 block codec: exact where no rounding is needed, unbiased, seeded, NaN policy."""
import pytest
import torch

from hvd_compress.codecs import int8

pytestmark = pytest.mark.unit

B = 256


def _roundtrip(x, gen):
    nb = int8.num_blocks(x.numel(), B)
    codes = torch.empty(x.numel(), dtype=torch.int8)
    scales = torch.empty(nb, dtype=torch.float32)
    int8.encode(x, codes, scales, B, gen)
    out = torch.zeros_like(x)
    int8.decode_accumulate(codes.view(1, -1), scales.view(1, -1), out, B)
    return out, codes, scales


def test_exact_when_values_are_code_multiples():
    ints = torch.randint(-127, 128, (600,)).float()
    ints[::256] = 127.0                      # amax 127 in every block: scale exactly 1
    out, _, scales = _roundtrip(ints * 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(scales, torch.ones(3))
    assert torch.equal(out, ints)


def test_zero_block_and_empty():
    out, codes, scales = _roundtrip(torch.zeros(300), torch.Generator().manual_seed(1))
    assert torch.equal(out, torch.zeros(300)) and torch.equal(scales, torch.zeros(2))
    out, _, _ = _roundtrip(torch.zeros(0), torch.Generator().manual_seed(1))
    assert out.numel() == 0


def test_unbiased_over_seeds():
    torch.manual_seed(3)
    x = torch.randn(1000) * 1e-3
    n = 400
    acc = torch.zeros_like(x)
    for seed in range(n):
        acc += _roundtrip(x, torch.Generator().manual_seed(seed))[0]
    mean = acc / n
    scale = x.abs().max() / 127              # per-value error is < scale, variance <= scale^2/4
    bound = 5 * (scale / 2) / n ** 0.5       # 5 sigma per value
    assert (mean - x).abs().max() <= bound
    assert (_roundtrip(x, torch.Generator().manual_seed(0))[0] - x).abs().max() < x.abs().max() / 127 + 1e-9


def test_deterministic_per_seed_and_differs_across_seeds():
    x = torch.randn(777)
    a = _roundtrip(x, torch.Generator().manual_seed(5))[1]
    b = _roundtrip(x, torch.Generator().manual_seed(5))[1]
    c = _roundtrip(x, torch.Generator().manual_seed(6))[1]
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(bad):
    x = torch.randn(10)
    x[3] = bad
    with pytest.raises(ValueError, match="non-finite"):
        _roundtrip(x, torch.Generator().manual_seed(0))


def test_decode_accumulate_sums_ranks_in_order():
    xs = [torch.randn(300) for _ in range(3)]
    enc = [_roundtrip(x, torch.Generator().manual_seed(i))[1:] for i, x in enumerate(xs)]
    out = torch.zeros(300)
    int8.decode_accumulate(torch.stack([e[0] for e in enc]), torch.stack([e[1] for e in enc]), out, B)
    ref = torch.zeros(300)
    for c, s in enc:
        int8.decode_accumulate(c.view(1, -1), s.view(1, -1), ref, B)
    assert torch.allclose(out, ref) and (out - sum(xs)).abs().max() < 3 * 4 / 127 * 4


def test_each_named_stream_rounds_alike_whatever_the_order_of_the_encodes():
    """The two-phase route re-encodes buckets in the order their first phases complete (timing):
    each bucket's stream (roles.rounding_stream) makes its codes independent of that order.
    Two streams differ, and outside any stream the codec keeps its one stream per device."""
    from hvd_compress.compressors.int8 import Int8Compressor
    from hvd_compress.roles import rounding_stream
    torch.manual_seed(4)
    xs = {"a": torch.randn(700), "b": torch.randn(700)}

    def encode(name):
        codes = torch.empty(700, dtype=torch.uint8)
        scales = torch.empty(int8.num_blocks(700, B))
        with rounding_stream(name):
            Int8Compressor.encode_blocks(xs[name], codes, scales, B)
        return codes

    try:
        Int8Compressor.reseed(7)
        forward = {name: encode(name) for name in ("a", "b")}
        Int8Compressor.reseed(7)
        backward = {name: encode(name) for name in ("b", "a")}
        assert all(torch.equal(forward[k], backward[k]) for k in "ab")
        xs["b"] = xs["a"]
        Int8Compressor.reseed(7)
        assert not torch.equal(encode("a"), encode("b"))
    finally:
        Int8Compressor.reseed(0)
