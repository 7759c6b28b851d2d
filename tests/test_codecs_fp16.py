"""float16 codecs against NumPy's casts, bit for bit (NaN payloads included).

Reference: `x.astype(np.float16)` and `h.astype(np.float32)`.  The torch codecs return int16
tensors holding the same bits; torch's own casts quiet NaNs and so differ from NumPy there,
which the fast path must correct.
"""
import warnings

import numpy as np
import pytest
import torch

from hvd_compress.codecs import fp16_numpy, fp16_torch

pytestmark = pytest.mark.unit


def reference_encode(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)               # overflow -> Inf is the point
        return x.astype(np.float16).view(np.uint16)


def reference_decode(codes: np.ndarray) -> np.ndarray:
    return codes.view(np.float16).astype(np.float32)


def f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.float32)


def edge_set() -> np.ndarray:
    """Every float32 exponent x ties at every float16 rounding position, boundaries, NaNs."""
    bits = []
    for e in range(256):
        base = e << 23
        for man in (0, 1, 0x7FFFFF, 0x400000):
            bits.append(base | man)
        for k in range(0, 1 << 10, 37):                              # a spread of 10-bit mantissas
            tie = base | (k << 13) | (1 << 12)
            bits += [tie - 1, tie, tie + 1, tie + (1 << 13)]
    vals = [0.0, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25,
            65504.0, 65519.0, 65520.0, 65536.0, 1e30, np.inf]
    bits += list(np.array(vals, dtype=np.float32).view(np.uint32))
    for k in range(0, 1 << 10, 13):                                  # subnormal midpoints
        mid = np.float32((k + 0.5) * 2.0 ** -24).view(np.uint32)
        bits += [mid - 1, mid, mid + 1]
    # NaN payloads: quiet, signalling, payload only in the 13 dropped bits, all ones
    bits += [0x7FC00000, 0x7F800001, 0x7F801FFF, 0x7F802000, 0x7FA5A5A5, 0x7FFFFFFF, 0x7FBFE000]
    bits = np.array(bits, dtype=np.uint64) & 0x7FFFFFFF
    return f32(np.concatenate([bits, bits | 0x80000000]))


def random_bits(n: int, seed: int) -> np.ndarray:
    return f32(np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint64))


ENCODERS = {
    "numpy": fp16_numpy.encode,
    "torch-fast": lambda x: fp16_torch.encode(torch.from_numpy(x)).numpy().view(np.uint16),
    "torch-bits": lambda x: fp16_torch.encode_bits(torch.from_numpy(x)).numpy().view(np.uint16),
}
DECODERS = {
    "numpy": fp16_numpy.decode,
    "numpy-bits": fp16_numpy.decode_bits,
    "torch-fast": lambda c: fp16_torch.decode(torch.from_numpy(c.view(np.int16))).numpy(),
    "torch-lookup": lambda c: fp16_torch.decode_lookup(torch.from_numpy(c.view(np.int16))).numpy(),
}


def assert_bits_equal(ours, ref, inputs):
    ours_b, ref_b = ours.view(np.uint16 if ours.itemsize == 2 else np.uint32), \
        ref.view(np.uint16 if ref.itemsize == 2 else np.uint32)
    bad = np.nonzero(ours_b != ref_b)[0]
    if bad.size:
        rows = [f"in={inputs.view(np.uint16 if inputs.itemsize == 2 else np.uint32)[i]:#x} "
                f"ours={ours_b[i]:#x} ref={ref_b[i]:#x}" for i in bad[:10]]
        pytest.fail(f"{bad.size} mismatches, first:\n" + "\n".join(rows))


def test_torch_casts_differ_from_numpy_on_nan_only():
    """Why the torch fast path needs its NaN correction (if this changes, revisit fp16_torch)."""
    x = f32([0x7F800001, 0x3F800000])
    assert torch.from_numpy(x).half().view(torch.int16).tolist()[0] != int(reference_encode(x)[0])
    assert torch.from_numpy(x).half().view(torch.int16).tolist()[1] == int(reference_encode(x)[1])


@pytest.mark.parametrize("value, code", [
    (1.0, 0x3C00), (-2.0, 0xC000), (65504.0, 0x7BFF), (65520.0, 0x7C00), (2.0 ** -24, 0x0001),
    (2.0 ** -25, 0x0000), (1.5 * 2.0 ** -24, 0x0002), (-0.0, 0x8000), (1 + 2.0 ** -11, 0x3C00),
])
def test_spec_values(value, code):
    """Values from the IEEE binary16 definition (independent of any library)."""
    x = np.array([value], dtype=np.float32)
    for path, enc in ENCODERS.items():
        assert int(enc(x)[0]) == code, path


@pytest.mark.parametrize("path", sorted(ENCODERS))
def test_encode_edge_set(path):
    x = edge_set()
    assert_bits_equal(ENCODERS[path](x), reference_encode(x), x)


@pytest.mark.parametrize("path", sorted(ENCODERS))
def test_encode_random_bit_patterns(path):
    x = random_bits(1 << 20, seed=11)
    assert_bits_equal(ENCODERS[path](x), reference_encode(x), x)


@pytest.mark.parametrize("path", sorted(ENCODERS))
def test_encode_gradient_like_values(path):
    rng = np.random.default_rng(12)
    x = (rng.standard_normal(1 << 18) * 10.0 ** rng.uniform(-9, 5, 1 << 18)).astype(np.float32)
    assert_bits_equal(ENCODERS[path](x), reference_encode(x), x)


@pytest.mark.parametrize("path", sorted(DECODERS))
def test_decode_all_65536_codes(path):
    codes = np.arange(1 << 16, dtype=np.uint16)
    assert_bits_equal(DECODERS[path](codes), reference_decode(codes), codes)


def test_fast_path_handles_nan_anywhere():
    """A single NaN deep in a large tensor: only its block is redone, bits still NumPy's."""
    x = np.random.default_rng(4).standard_normal(1_000_003).astype(np.float32)
    x[777_777] = f32([0xFF800001])[0]                                 # signalling NaN, negative
    assert_bits_equal(ENCODERS["torch-fast"](x), reference_encode(x), x)
    codes = reference_encode(x)
    codes[5] = 0x7C01
    assert_bits_equal(DECODERS["torch-fast"](codes), reference_decode(codes), codes)


def test_fast_path_inf_minus_inf_is_not_mistaken():
    """+Inf and -Inf sum to NaN: the fast path then checks blocks and must stay exact."""
    x = np.array([np.inf, -np.inf, 1.0, 70000.0], dtype=np.float32)
    assert_bits_equal(ENCODERS["torch-fast"](x), reference_encode(x), x)


def test_torch_fast_path_is_active_and_falls_back(monkeypatch):
    assert fp16_torch.cast_is_exact("cpu")
    monkeypatch.setattr(fp16_torch, "cast_is_exact", lambda *a: False)
    x = edge_set()
    assert_bits_equal(ENCODERS["torch-fast"](x), reference_encode(x), x)
    codes = np.arange(1 << 16, dtype=np.uint16)
    assert_bits_equal(DECODERS["torch-fast"](codes), reference_decode(codes), codes)


@pytest.mark.parametrize("shape", [(), (0,), (2, 0), (7,), (3, 5, 11), (300_001,)])
def test_shapes(shape):
    x = np.asarray(np.random.default_rng(0).standard_normal(shape) * 1000, dtype=np.float32)
    c = fp16_numpy.encode(x)
    assert c.shape == x.shape and c.dtype == np.uint16
    assert fp16_numpy.decode(c).shape == x.shape
    ct = fp16_torch.encode(torch.from_numpy(x))
    assert ct.shape == x.shape and ct.dtype == torch.int16 and ct.is_contiguous()
    assert np.array_equal(ct.numpy().view(np.uint16), c)
    dt = fp16_torch.decode(ct)
    assert dt.shape == x.shape and np.array_equal(dt.numpy(), fp16_numpy.decode(c))


def test_out_buffers_and_half_view():
    x = np.linspace(-70000, 70000, 999, dtype=np.float32).reshape(9, 111)
    out = np.empty(x.shape, np.uint16)
    assert fp16_numpy.encode(x, out=out) is out
    dec = np.empty(x.shape, np.float32)
    assert fp16_numpy.decode(out, out=dec) is dec
    tout = torch.empty(x.shape, dtype=torch.int16)
    assert fp16_torch.encode(torch.from_numpy(x), out=tout) is tout
    assert torch.equal(tout.view(torch.float16), torch.from_numpy(x).half())   # no NaN here
    tdec = torch.empty(x.shape)
    assert fp16_torch.decode(tout, out=tdec) is tdec
    assert np.array_equal(tdec.numpy(), dec)


def test_errors():
    with pytest.raises(TypeError, match="float32"):
        fp16_numpy.encode(np.zeros(3, np.float64))
    with pytest.raises(TypeError, match="float32"):
        fp16_torch.encode(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="uint16"):
        fp16_numpy.decode(np.zeros(3, np.int16))
    with pytest.raises(TypeError, match="int16"):
        fp16_torch.decode(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError):
        fp16_numpy.encode(np.zeros(4, np.float32), out=np.empty(5, np.uint16))
    with pytest.raises(ValueError):
        fp16_torch.decode(torch.zeros(4, dtype=torch.int16), out=torch.empty(2, 2))


@pytest.mark.parametrize("scale", [2.0 ** 20, 2.0 ** -9, 0.3, 1.0])
def test_scale_argument_equals_encoding_the_product(scale):
    x = np.concatenate([random_bits(1 << 15, seed=21), edge_set()])
    with np.errstate(all="ignore"):                               # NaN/Inf inputs in the product
        expected = reference_encode(x * np.float32(scale) if scale != 1.0 else x)
    xt = torch.from_numpy(x)
    assert_bits_equal(fp16_numpy.encode(x, scale=scale), expected, x)
    assert_bits_equal(fp16_torch.encode(xt, scale=scale).numpy().view(np.uint16), expected, x)
    assert_bits_equal(fp16_torch.encode_bits(xt, scale=scale).numpy().view(np.uint16), expected, x)


def test_many_blocks_with_a_partial_last_block(monkeypatch):
    monkeypatch.setattr(fp16_numpy, "BLOCK", 1000)
    monkeypatch.setattr(fp16_torch, "BLOCK", 1000)
    x = random_bits(10_007, seed=23)
    ref = reference_encode(x)
    for path in ENCODERS:
        assert_bits_equal(ENCODERS[path](x), ref, x)
    with np.errstate(all="ignore"):
        assert_bits_equal(fp16_torch.encode(torch.from_numpy(x), scale=4.0).numpy().view(np.uint16),
                          reference_encode(x * np.float32(4.0)), x)
    for path in DECODERS:
        assert_bits_equal(DECODERS[path](ref), reference_decode(ref), ref)
