"""Bit8Compressor / Bit16Compressor on one process: packets, error bounds, special values, odd tensors."""

import pytest
import torch

import hvd_compress as hc
from hvd_compress.codecs import E4M3, fp8_torch
from hvd_compress.codecs import SCALE_BLOCK
from hvd_compress.exchange.routes import make_communicator
from hvd_compress.compressors.scaled_float import HEADER_BYTES, read_header
from labs.kit.data import read_idx
from hvd_compress.exchange.fusion import buckets_by_size
from hvd_compress.exchange.memory import ResidualMemory

pytestmark = pytest.mark.unit

COMPRESSORS = [hc.Compression.bit8, hc.Compression.bit16]
# relative error bound for values that are normal numbers of the code format after scaling
BOUND = {"bit8": 2.0 ** -4, "bit16": 2.0 ** -11}
MIN_NORMAL = {"bit8": 2.0 ** -6, "bit16": 2.0 ** -14}


def roundtrip(comp, t):
    packet, ctx = comp.compress(t)
    return packet, comp.decompress(packet, ctx)


def gradient_like(n=100_000, seed=0):
    """Magnitudes spread over 1e-7..1e-2, both signs: what gradients look like."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (-7 + 5 * torch.rand(n, generator=g))
    return mag * torch.sign(torch.randn(n, generator=g))


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
def test_packet_layout(comp):
    t = gradient_like(1001)
    packet, _ = comp.compress(t)
    assert packet.dtype == torch.uint8 and packet.dim() == 1
    assert packet.numel() == HEADER_BYTES + comp.fmt.code_bytes * t.numel()
    scale, flags = read_header(packet)
    mantissa, _ = __import__("math").frexp(scale)
    assert mantissa == 0.5, f"scale {scale} is not a power of two"
    assert flags == 0
    # the scale puts the largest magnitude in the top binade of the format
    top = 448.0 if comp.name == "bit8" else 65504.0
    assert top / 2 < float(t.abs().max()) * scale <= top


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
def test_roundtrip_relative_error_bound(comp):
    t = gradient_like()
    packet, back = roundtrip(comp, t)
    scale, _ = read_header(packet)
    normal = t.abs() * scale >= MIN_NORMAL[comp.name]
    rel = ((back - t).abs() / t.abs())[normal]
    assert normal.float().mean() > 0.5, "the test should cover mostly normal values"
    assert float(rel.max()) <= BOUND[comp.name]
    # subnormal results: absolute error at most half the smallest subnormal step, unscaled
    step = (2.0 ** -9 if comp.name == "bit8" else 2.0 ** -24) / scale
    if comp.name == "bit8":
        assert (~normal).any(), "5 decades exceed E4M3's normal range: some must be subnormal"
    if (~normal).any():
        assert float((back - t).abs()[~normal].max()) <= step / 2


def test_bit8_matches_codec_on_scaled_values():
    """The packet's codes are exactly the codec's encoding of x * scale."""
    t = gradient_like(5000, seed=3)
    packet, _ = hc.Compression.bit8.compress(t)
    scale, _ = read_header(packet)
    assert torch.equal(packet[HEADER_BYTES:], fp8_torch.encode(t * scale, E4M3))


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
def test_nan_and_inf_survive(comp):
    t = gradient_like(64, seed=1)
    t[3], t[10], t[20] = float("nan"), float("inf"), float("-inf")
    _, back = roundtrip(comp, t)
    assert torch.isnan(back[3])
    assert back[10] == float("inf") and back[20] == float("-inf")
    finite = torch.isfinite(t)
    assert bool(torch.isfinite(back[finite]).all())
    rel = ((back - t).abs() / t.abs())[finite & (t.abs() > 1e-4)]
    # with Inf present bit8 gives up one binade of range, never precision of normal values
    assert float(rel.max()) <= BOUND[comp.name]


def test_bit8_largest_finite_value_is_not_taken_for_inf():
    t = torch.tensor([448.0, -448.0, 1.0, float("inf")])
    _, back = roundtrip(hc.Compression.bit8, t)
    assert back.tolist() == [448.0, -448.0, 1.0, float("inf")]


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
def test_all_nan_and_all_zero_tensors(comp):
    _, back = roundtrip(comp, torch.full((5,), float("nan")))
    assert bool(torch.isnan(back).all())
    _, back = roundtrip(comp, torch.zeros(5))
    assert torch.equal(back, torch.zeros(5))
    _, back = roundtrip(comp, torch.tensor([-0.0]))
    assert str(float(back[0])) == "-0.0"


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_dtypes_come_back(comp, dtype):
    t = (gradient_like(300, seed=2) * 1e3).to(dtype)
    _, back = roundtrip(comp, t)
    assert back.dtype == dtype and back.shape == t.shape
    ref = t.float()
    ok = ref.abs() > 1e-3
    assert float(((back.float() - ref).abs() / ref.abs())[ok].max()) <= max(BOUND[comp.name], 2.0 ** -7)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
def test_odd_tensors(comp):
    _, back = roundtrip(comp, torch.empty(0, 3))
    assert back.shape == (0, 3)
    _, back = roundtrip(comp, torch.tensor(0.125))
    assert back.shape == () and float(back) == 0.125
    base = gradient_like(2 * 3 * 4 * 5, seed=4).view(2, 3, 4, 5)
    _, expected = roundtrip(comp, base)
    _, back = roundtrip(comp, base.transpose(1, 3))                      # non-contiguous
    assert torch.equal(back, expected.transpose(1, 3))
    _, back = roundtrip(comp, base.contiguous(memory_format=torch.channels_last))
    assert torch.equal(back, expected)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
def test_bad_input_is_refused(comp):
    with pytest.raises(TypeError, match="floating-point"):
        comp.compress(torch.arange(4))
    with pytest.raises(TypeError, match="sparse"):
        comp.compress(torch.eye(3).to_sparse())
    packet, ctx = comp.compress(torch.ones(4))
    with pytest.raises(ValueError):
        comp.decompress(packet[:5], ctx)                                   # shorter than a header
    if comp.fmt.code_bytes == 2:
        with pytest.raises(ValueError, match="multiple"):
            comp.decode_packet(packet[:-1])


def real_gradients(mnist_dir):
    """Gradients of a small CNN on real MNIST images (the course's model, one batch)."""
    images = torch.from_numpy(read_idx(mnist_dir / "t10k-images-idx3-ubyte.gz").copy()).float()
    labels = torch.from_numpy(read_idx(mnist_dir / "t10k-labels-idx1-ubyte.gz").copy()).long()
    x = ((images[:256] / 255 - 0.1307) / 0.3081).unsqueeze(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 10, 5), torch.nn.MaxPool2d(2), torch.nn.ReLU(),
                              torch.nn.Conv2d(10, 20, 5), torch.nn.MaxPool2d(2), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(320, 50), torch.nn.ReLU(),
                              torch.nn.Linear(50, 10))
    torch.nn.functional.cross_entropy(net(x), labels[:256]).backward()
    return [p.grad.clone() for p in net.parameters()]


def test_scaling_keeps_real_gradients_that_plain_e4m3_flushes(mnist_dir):
    grads = real_gradients(mnist_dir)
    flat = torch.cat([g.reshape(-1) for g in grads])
    assert 1e-7 < float(flat.abs().median()) < 1e-2, "these should look like gradients"
    scaled = torch.cat([roundtrip(hc.Compression.bit8, g)[1].reshape(-1) for g in grads])
    unscaled = fp8_torch.decode(fp8_torch.encode(flat, E4M3), E4M3)
    err = lambda approx: float((approx - flat).norm() / flat.norm())
    zeroed = lambda approx: float(((approx == 0) & (flat != 0)).float().mean())
    print(f"relative L2 error: scaled {err(scaled):.4f}, unscaled {err(unscaled):.4f}; "
          f"flushed to zero: scaled {zeroed(scaled):.3f}, unscaled {zeroed(unscaled):.3f}")
    assert err(scaled) < 0.05
    assert err(unscaled) > 5 * err(scaled)
    assert zeroed(unscaled) > 0.3 > 10 * zeroed(scaled)


def test_error_feedback_residual_is_what_quantisation_dropped():
    comp, memory = hc.Compression.bit8, ResidualMemory()
    g1, g2 = gradient_like(500, seed=5), gradient_like(500, seed=6)
    c1 = memory.compensate("w", g1)
    assert torch.equal(c1, g1)
    packet, _ = comp.compress(c1)
    r1 = memory.remember("w", c1, comp.decode_packet(packet))
    assert torch.equal(r1, c1 - comp.decode_packet(packet))
    c2 = memory.compensate("w", g2)
    assert torch.equal(c2, g2 + r1)
    # over steps, what was sent plus what is still owed equals what was computed
    sent = comp.decode_packet(packet)
    packet2, _ = comp.compress(c2)
    r2 = memory.remember("w", c2, comp.decode_packet(packet2))
    total = sent + comp.decode_packet(packet2) + r2
    assert torch.allclose(total, g1 + g2, rtol=0, atol=1e-9)


def test_fusion_buckets():
    ts = [torch.randn(10), torch.randn(3, 4), torch.randn(1000), torch.randn(2)]
    assert buckets_by_size(ts, 0) == [[0], [1], [2], [3]]
    assert buckets_by_size(ts, 10 ** 9) == [[0, 1, 2, 3]]
    assert buckets_by_size(ts, 4 * 30) == [[0, 1], [2], [3]]
    with pytest.raises(ValueError):
        buckets_by_size(ts, -1)


def per_block(comp, x, block):
    """x through the per-tensor interface, one block at a time: the bucket path's reference."""
    out = torch.empty_like(x)
    for a in range(0, x.numel(), block):
        out[a:a + block] = comp.decode_packet(comp.compress(x[a:a + block])[0])
    return out


def with_specials(x):
    x = x.clone()
    x[3], x[700], x[701], x[1500] = float("nan"), float("inf"), float("-inf"), float("nan")
    return x


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
@pytest.mark.parametrize("numel,block", [(2049, SCALE_BLOCK), (1000, 7), (5, SCALE_BLOCK), (300, 300), (1, 1)])
def test_bucket_message_equals_per_tensor_packets_block_by_block(comp, numel, block):
    for x in (gradient_like(numel, seed=numel), with_specials(gradient_like(2049, seed=1))[:numel]):
        message = torch.zeros(comp.message_bytes(numel, block), dtype=torch.uint8)
        assert message.numel() % 4 == 0
        assert message.numel() >= comp.fmt.code_bytes * numel + 4 * -(-numel // block)
        comp.encode_message(x, message, block)
        out = comp.decode_message(message, numel, torch.empty(numel), block)
        expected = per_block(comp, x, block)
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_decode_messages_sums_ranks_in_order(comp, n):
    numel = 1000
    rows = [with_specials(gradient_like(2049, seed=10 + r))[:numel] if r == 1 else gradient_like(numel, seed=10 + r)
            for r in range(n)]
    size = comp.message_bytes(numel)
    messages = torch.zeros(n, size, dtype=torch.uint8)
    for r in range(n):
        comp.encode_message(rows[r], messages[r])
    out = comp.decode_messages(messages, numel, torch.empty(numel))
    expected = per_block(comp, rows[0], SCALE_BLOCK)
    for r in range(1, n):
        expected = expected + per_block(comp, rows[r], SCALE_BLOCK)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
def test_block_scaling_is_no_worse_than_per_tensor_scaling_on_real_gradients(comp, mnist_dir):
    flat = torch.cat([g.reshape(-1) for g in real_gradients(mnist_dir)])    # one bucket of the whole net
    message = torch.zeros(comp.message_bytes(flat.numel()), dtype=torch.uint8)
    blocked = comp.decode_message(comp.encode_message(flat, message), flat.numel(), torch.empty_like(flat))
    whole = comp.decode_packet(comp.compress(flat)[0])
    err = lambda approx: float((approx - flat).norm() / flat.norm())
    nonzero = flat != 0
    mean_rel = lambda approx: float(((approx - flat).abs() / flat.abs())[nonzero].mean())
    print(f"{comp.name}: relative L2 error {err(blocked):.2e} with a scale per {SCALE_BLOCK} values, "
          f"{err(whole):.2e} with one per bucket; mean relative error per value "
          f"{mean_rel(blocked):.2e} vs {mean_rel(whole):.2e}")
    assert err(blocked) <= err(whole) and mean_rel(blocked) <= mean_rel(whole)
    assert err(blocked) < BOUND[comp.name]


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: c.name)
def test_corrupt_headers_are_refused(comp):
    packet, _ = comp.compress(gradient_like(64))
    for scale, flags in ((3.0, 0), (float("nan"), 0), (float("inf"), 0), (0.0, 0), (-2.0, 0), (1.0, 6)):
        bad = packet.clone()
        bad[0:4] = torch.tensor([scale], dtype=torch.float32).view(torch.uint8)
        bad[4:8] = torch.tensor([flags], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(ValueError, match="corrupt packet header"):
            comp.decode_packet(bad)
    if comp.fmt.has_inf:                 # float16 has Inf: the Inf flag is never set
        bad = packet.clone()
        bad[4:8] = torch.tensor([1], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(ValueError, match="corrupt packet header"):
            comp.decode_packet(bad)


def test_routes_are_chosen_in_one_place():
    from hvd_compress.registry import Route
    assert make_communicator(hc.Compression.none).route == Route.ALLREDUCE
    assert make_communicator(hc.Compression.fp16).route == Route.ALLREDUCE
    assert make_communicator(hc.Compression.bit8).route == Route.ALLGATHER
    assert make_communicator(hc.Compression.bit16).route == Route.ALLTOALL
    assert make_communicator(hc.Compression.bit8, "alltoall").route == Route.ALLTOALL
    with pytest.raises(ValueError, match="cannot travel by allreduce"):
        make_communicator(hc.Compression.bit8, "allreduce")
    with pytest.raises(ValueError, match="cannot travel by allgather"):
        make_communicator(hc.Compression.none, "allgather")
    with pytest.raises(ValueError, match="route must be one of"):
        make_communicator(hc.Compression.bit8, "ring")
    with pytest.raises(ValueError, match="scale_block"):
        make_communicator(hc.Compression.bit8, scale_block=0)
    # one scale per tensor (the course's packets) travels unfused
    assert make_communicator(hc.Compression.bit8, scale_block=None).fusion_threshold_bytes == 0
