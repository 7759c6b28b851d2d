"""float8 codecs (E4M3, E5M2) against their references, bit for bit.

References (each mode names the library it must equal; see docs/codecs.md):
  E4M3 saturate=True   torch 2.13 `x.to(torch.float8_e4m3fn)` (saturates overflow and Inf)
  E4M3 saturate=False  ml_dtypes `x.astype(float8_e4m3fn)`   (overflow and Inf -> NaN)
  E5M2 saturate=False  torch `x.to(torch.float8_e5m2)`       (overflow -> Inf); ml_dtypes too,
                       except the NaN bit pattern (ml_dtypes writes 0x7E, torch 0x7F)
  E5M2 saturate=True   torch's cast of x with finite values clamped to +-57344 first
  decode               `codes.view(torch.float8_*).float()`, NaN bit patterns included
Inputs: a fixed edge set (every float32 exponent, ties at every binade, subnormal and
overflow boundaries, zeros, infinities, NaN payloads) and 2**20 random bit patterns.
"""
import csv
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from conftest import ROOT, load_script
from hvd_compress.codecs import E4M3, E5M2, Float8Format, fp8_numpy, fp8_torch

pytestmark = pytest.mark.unit

FORMATS = [E4M3, E5M2]
MODES = [(fmt, sat) for fmt in FORMATS for sat in (True, False)]
MODE_IDS = [f"{fmt.name}-{'sat' if sat else 'nonsat'}" for fmt, sat in MODES]


# ---- references ----------------------------------------------------------------------------
def torch_dtype(fmt):
    return getattr(torch, fmt.torch_dtype_name)


def ml_dtype(fmt):
    return getattr(ml_dtypes, fmt.torch_dtype_name)


def reference_encode(x: np.ndarray, fmt: Float8Format, saturate: bool) -> np.ndarray:
    """uint8 codes from the library each mode is defined by."""
    if fmt is E4M3 and not saturate:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)       # overflow -> NaN is the point
            return x.astype(ml_dtype(fmt)).view(np.uint8)
    t = torch.from_numpy(x)
    if fmt is E5M2 and saturate:
        t = torch.where(torch.isfinite(t), t.clamp(-fmt.max_finite, fmt.max_finite), t)
    return t.to(torch_dtype(fmt)).view(torch.uint8).numpy()


def reference_decode(codes: np.ndarray, fmt: Float8Format) -> np.ndarray:
    return torch.from_numpy(codes).view(torch_dtype(fmt)).float().numpy()


def f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.float32)


def edge_set(fmt: Float8Format) -> np.ndarray:
    """Hand-picked float32 inputs where an 8-bit encoder can go wrong, both signs."""
    shift = 23 - fmt.man_bits
    half = 1 << (shift - 1)
    bits = []
    # every float32 exponent, with mantissas: zero, smallest, largest, and each tie pattern
    for e in range(256):
        base = e << 23
        for man in (0, 1, 0x400000, 0x7FFFFF):
            bits.append(base | man)
        # ties at every binade: exactly halfway between two 8-bit neighbours, and +-1 ulp
        for k in range(1 << fmt.man_bits):
            tie = base | (k << shift) | half
            bits += [tie - 1, tie, tie + 1]
    vals = [
        0.0, fmt.min_subnormal, fmt.min_subnormal / 2, fmt.min_subnormal * 1.5,
        fmt.min_normal, fmt.min_normal - fmt.min_subnormal / 2, fmt.min_normal - fmt.min_subnormal,
        fmt.max_finite, 448.0, 464.0, 465.0, 479.0, 480.0, 481.0, 512.0,
        57344.0, 61439.0, 61440.0, 61441.0, 65536.0, 1e30, 3.4028235e38, np.inf,
    ]
    bits += list(np.array(vals, dtype=np.float32).view(np.uint32))
    # every subnormal code value, its midpoints and their float32 neighbours
    for k in range(1 << fmt.man_bits):
        mid = np.float32((k + 0.5) * fmt.min_subnormal).view(np.uint32)
        bits += [mid - 1, mid, mid + 1]
    # NaN payloads: quiet, signalling, lowest, highest
    bits += [0x7FC00000, 0x7F800001, 0x7FA00000, 0x7FFFFFFF, 0x7F801000, 0x7FBFFFFF]
    bits = np.array(bits, dtype=np.uint64) & 0x7FFFFFFF
    return f32(np.concatenate([bits, bits | 0x80000000]))


def random_bits(n: int, seed: int) -> np.ndarray:
    return f32(np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint64))


ENCODERS = {
    "numpy": lambda x, fmt, sat: fp8_numpy.encode(x, fmt, sat),
    "torch-fast": lambda x, fmt, sat: fp8_torch.encode(torch.from_numpy(x), fmt, sat).numpy(),
    "torch-bits": lambda x, fmt, sat: fp8_torch.encode_bits(torch.from_numpy(x), fmt, sat).numpy(),
}


def assert_codes_equal(ours, ref, x):
    bad = np.nonzero(ours != ref)[0]
    if bad.size:
        rows = [f"x={x[i]!r} bits={x.view(np.uint32)[i]:#010x} ours={ours[i]:#04x} ref={ref[i]:#04x}"
                for i in bad[:10]]
        pytest.fail(f"{bad.size} mismatches, first:\n" + "\n".join(rows))


# ---- the references behave as the docs claim ------------------------------------------------
def test_torch_e4m3_cast_saturates_and_ml_dtypes_gives_nan():
    x = np.array([448, 464, 465, 480, 1e6, np.inf, -np.inf, -1e6], dtype=np.float32)
    t = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert t == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
    m = reference_encode(x, E4M3, saturate=False).tolist()
    assert m == [0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0x7F, 0xFF, 0xFF]


def test_e5m2_references_agree_except_nan_bits():
    x = random_bits(1 << 16, seed=5)
    t = reference_encode(x, E5M2, saturate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        m = x.astype(ml_dtypes.float8_e5m2).view(np.uint8)
    nan = np.isnan(x)
    assert np.array_equal(t[~nan], m[~nan])
    assert set(t[nan] & 0x7F) == {0x7F} and set(m[nan] & 0x7F) == {0x7E}


# ---- spec values, written from the OCP tables (independent of any library) -----------------
@pytest.mark.parametrize("value, code", [
    (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (-2.0, 0xC0), (448.0, 0x7E), (2.0 ** -6, 0x08),
    (2.0 ** -9, 0x01), (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02), (1.0625, 0x38), (1.1875, 0x3A),
])
def test_e4m3_spec_values(value, code):
    x = np.array([value], dtype=np.float32)
    assert fp8_numpy.encode(x, E4M3)[0] == code
    assert fp8_torch.encode_bits(torch.from_numpy(x), E4M3)[0].item() == code


@pytest.mark.parametrize("value, sat, code", [
    (57344.0, True, 0x7B), (61440.0, True, 0x7B), (61440.0, False, 0x7C), (61439.0, False, 0x7B),
    (np.inf, True, 0x7C), (-np.inf, False, 0xFC), (2.0 ** -16, False, 0x01), (2.0 ** -14, True, 0x04),
    (1.0, True, 0x3C), (1.125, False, 0x3C), (1.375, False, 0x3E),
])
def test_e5m2_spec_values(value, sat, code):
    x = np.array([value], dtype=np.float32)
    assert fp8_numpy.encode(x, E5M2, sat)[0] == code
    assert fp8_torch.encode_bits(torch.from_numpy(x), E5M2, sat)[0].item() == code


def test_format_fields():
    assert (E4M3.max_code, E4M3.inf_code, E5M2.max_code, E5M2.inf_code) == (0x7E, None, 0x7B, 0x7C)
    assert E4M3.max_finite == (1 + 6 / 8) * 2.0 ** (15 - E4M3.bias)
    assert E5M2.max_finite == (1 + 3 / 4) * 2.0 ** (30 - E5M2.bias)
    assert E4M3.min_subnormal == 2.0 ** (1 - E4M3.bias - E4M3.man_bits)
    assert [c for c in range(256) if E4M3.is_nan_code(c)] == [0x7F, 0xFF]
    assert [c for c in range(256) if E5M2.is_nan_code(c)] == [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]
    with pytest.raises(Exception):
        E4M3.bias = 8                                           # frozen


# ---- encode vs references --------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(ENCODERS))
@pytest.mark.parametrize("fmt, sat", MODES, ids=MODE_IDS)
def test_encode_edge_set(path, fmt, sat):
    x = edge_set(fmt)
    assert_codes_equal(ENCODERS[path](x, fmt, sat), reference_encode(x, fmt, sat), x)


@pytest.mark.parametrize("path", sorted(ENCODERS))
@pytest.mark.parametrize("fmt, sat", MODES, ids=MODE_IDS)
def test_encode_random_bit_patterns(path, fmt, sat):
    x = random_bits(1 << 20, seed=hash((path, fmt.name, sat)) % 1000)
    assert_codes_equal(ENCODERS[path](x, fmt, sat), reference_encode(x, fmt, sat), x)


@pytest.mark.parametrize("path", sorted(ENCODERS))
@pytest.mark.parametrize("fmt, sat", MODES, ids=MODE_IDS)
def test_encode_gradient_like_values(path, fmt, sat):
    """Normal floats in the range the compressor feeds (mostly normal and subnormal codes)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(1 << 18) * 10.0 ** rng.uniform(-8, 3, 1 << 18)).astype(np.float32)
    assert_codes_equal(ENCODERS[path](x, fmt, sat), reference_encode(x, fmt, sat), x)


@pytest.mark.parametrize("fmt, sat", MODES, ids=MODE_IDS)
def test_torch_fast_path_is_active_and_falls_back(fmt, sat, monkeypatch):
    # torch 2.13 on CPU: the probe accepts torch's cast for every mode (requirements pin 2.13)
    assert fp8_torch.cast_is_exact(fmt, sat, "cpu")
    # where the probe says no, encode must still be exact (it is encode_bits then)
    monkeypatch.setattr(fp8_torch, "cast_is_exact", lambda *a: False)
    x = edge_set(fmt)
    assert_codes_equal(ENCODERS["torch-fast"](x, fmt, sat), reference_encode(x, fmt, sat), x)


# ---- decode -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_decode_all_codes_bit_identical_to_torch(fmt):
    codes = np.arange(256, dtype=np.uint8)
    ref = reference_decode(codes, fmt).view(np.uint32)
    for ours in (fp8_numpy.decode(codes, fmt), fp8_numpy.decode_bits(codes, fmt),
                 fp8_torch.decode(torch.from_numpy(codes), fmt).numpy()):
        bad = np.nonzero(ours.view(np.uint32) != ref)[0]
        assert bad.size == 0, [(hex(c), hex(ours.view(np.uint32)[c]), hex(ref[c])) for c in bad]


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_decode_matches_ml_dtypes_values(fmt):
    codes = np.arange(256, dtype=np.uint8)
    ours = fp8_numpy.decode(codes, fmt)
    ml = codes.view(ml_dtype(fmt)).astype(np.float32)
    nan = np.array([fmt.is_nan_code(int(c)) for c in codes])
    assert np.array_equal(np.isnan(ours), nan) and np.array_equal(np.isnan(ml), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), ml[~nan].view(np.uint32))   # -0.0 too


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_decode_random_codes_large(fmt):
    codes = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    ref = reference_decode(codes, fmt).view(np.uint32)
    assert np.array_equal(fp8_numpy.decode(codes, fmt).view(np.uint32), ref)
    assert np.array_equal(fp8_torch.decode(torch.from_numpy(codes), fmt).numpy().view(np.uint32), ref)


@pytest.mark.parametrize("fmt, sat", MODES, ids=MODE_IDS)
def test_roundtrip_of_representable_values_is_identity(fmt, sat):
    """Every finite 8-bit value encodes back to its own code."""
    codes = np.array([c for c in range(256) if not fmt.is_nan_code(c)
                      and (fmt.inf_code is None or c & 0x7F != fmt.inf_code)], dtype=np.uint8)
    values = fp8_numpy.decode(codes, fmt)
    assert np.array_equal(fp8_numpy.encode(values, fmt, sat), codes)
    assert np.array_equal(fp8_torch.encode(torch.from_numpy(values), fmt, sat).numpy(), codes)


# ---- shapes, out=, errors ----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (4, 3, 7), (70_001,)])
def test_shapes_numpy_and_torch(shape):
    x = np.asarray(np.random.default_rng(0).standard_normal(shape) * 100, dtype=np.float32)
    c = fp8_numpy.encode(x, E4M3)
    assert c.shape == x.shape and c.dtype == np.uint8 and c.flags.c_contiguous
    d = fp8_numpy.decode(c, E4M3)
    assert d.shape == x.shape and d.dtype == np.float32
    ct = fp8_torch.encode(torch.from_numpy(x), E4M3)
    assert ct.shape == x.shape and ct.dtype == torch.uint8 and ct.is_contiguous()
    assert np.array_equal(ct.numpy(), c)
    dt = fp8_torch.decode(ct, E4M3)
    assert dt.shape == x.shape and np.array_equal(dt.numpy(), d)
    assert np.array_equal(fp8_torch.encode_bits(torch.from_numpy(x), E4M3).numpy(), c)


def test_non_contiguous_input_gives_contiguous_output():
    x = np.random.default_rng(1).standard_normal((64, 33)).astype(np.float32)
    xt = x.T                                                      # F-ordered view
    assert np.array_equal(fp8_numpy.encode(xt, E5M2), fp8_numpy.encode(np.ascontiguousarray(xt), E5M2))
    t = torch.from_numpy(x).t()
    assert torch.equal(fp8_torch.encode(t, E5M2), fp8_torch.encode(t.contiguous(), E5M2))
    assert fp8_torch.encode(t, E5M2).is_contiguous()


def test_out_buffers_are_filled_and_returned():
    x = np.linspace(-500, 500, 1001, dtype=np.float32).reshape(7, 143)
    out = np.empty(x.shape, np.uint8)
    assert fp8_numpy.encode(x, E4M3, out=out) is out
    assert np.array_equal(out, reference_encode(x, E4M3, True))
    dec = np.empty(x.shape, np.float32)
    assert fp8_numpy.decode(out, E4M3, out=dec) is dec
    assert np.array_equal(dec, reference_decode(out, E4M3))
    xt = torch.from_numpy(x)
    tout = torch.empty(x.shape, dtype=torch.uint8)
    assert fp8_torch.encode(xt, E4M3, out=tout) is tout
    assert fp8_torch.encode_bits(xt, E4M3, out=tout) is tout
    assert np.array_equal(tout.numpy(), out)
    tdec = torch.empty(x.shape)
    assert fp8_torch.decode(tout, E4M3, out=tdec) is tdec
    assert np.array_equal(tdec.numpy(), dec)


def test_requires_grad_input_is_accepted():
    x = torch.tensor([1.0, -3.0, 1000.0], requires_grad=True)
    assert fp8_torch.encode(x, E4M3).tolist() == [0x38, 0xC4, 0x7E]


@pytest.mark.parametrize("bad", [
    np.zeros(3, np.float64), np.zeros(3, np.float16), np.zeros(3, np.int32), [1.0, 2.0], 1.5,
])
def test_numpy_encode_rejects_non_float32(bad):
    with pytest.raises(TypeError, match="float32"):
        fp8_numpy.encode(bad, E4M3)


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float16),
                                 torch.zeros(3, dtype=torch.bfloat16), np.zeros(3, np.float32)])
def test_torch_encode_rejects_non_float32(bad):
    for enc in (fp8_torch.encode, fp8_torch.encode_bits):
        with pytest.raises(TypeError, match="float32"):
            enc(bad, E4M3)


def test_decode_rejects_non_uint8_codes():
    with pytest.raises(TypeError, match="uint8"):
        fp8_numpy.decode(np.zeros(3, np.int8), E4M3)
    with pytest.raises(TypeError, match="uint8"):
        fp8_torch.decode(torch.zeros(3, dtype=torch.int8), E4M3)


def test_bad_out_buffers_are_rejected():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(TypeError):
        fp8_numpy.encode(x, E4M3, out=np.empty((2, 3), np.int8))
    with pytest.raises(ValueError):
        fp8_numpy.encode(x, E4M3, out=np.empty(6, np.uint8))
    with pytest.raises(ValueError):
        fp8_numpy.encode(x, E4M3, out=np.empty((3, 2), np.uint8).T)          # not C-contiguous
    xt = torch.zeros(2, 3)
    with pytest.raises(TypeError):
        fp8_torch.encode(xt, E4M3, out=torch.empty(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError):
        fp8_torch.encode(xt, E4M3, out=torch.empty(6, dtype=torch.uint8))
    with pytest.raises(ValueError):
        fp8_torch.decode(torch.zeros(2, 3, dtype=torch.uint8), E4M3, out=torch.empty(3, 2).t())


def test_numpy_scalar_is_accepted_as_0d():
    c = fp8_numpy.encode(np.float32(3.0), E4M3)
    assert c.shape == () and int(c) == 0x44                     # 3 = 1.5 * 2**1: 0.1000.100
    assert fp8_numpy.decode(np.uint8(0x40), E4M3).shape == ()


# ---- scale= (fused multiply, no full-size temporary) ------------------------------------------
@pytest.mark.parametrize("scale", [2.0 ** 16, 2.0 ** -7, 0.1, 3, 1.0, np.float32(2.0 ** 5)])
@pytest.mark.parametrize("fmt, sat", MODES, ids=MODE_IDS)
def test_scale_argument_equals_encoding_the_product(fmt, sat, scale):
    rng = np.random.default_rng(9)
    x = np.concatenate([random_bits(1 << 14, seed=9), edge_set(fmt),
                        (rng.standard_normal(1 << 14) * 1e-4).astype(np.float32)])
    with np.errstate(all="ignore"):                               # NaN/Inf inputs in the product
        expected = reference_encode(x * np.float32(scale) if float(scale) != 1.0 else x, fmt, sat)
    xt = torch.from_numpy(x)
    assert_codes_equal(fp8_numpy.encode(x, fmt, sat, scale=scale), expected, x)
    assert_codes_equal(fp8_torch.encode(xt, fmt, sat, scale=scale).numpy(), expected, x)
    assert_codes_equal(fp8_torch.encode_bits(xt, fmt, sat, scale=scale).numpy(), expected, x)


def test_scale_leaves_input_untouched_and_fills_out():
    x = torch.linspace(-1e-3, 1e-3, 300_001)
    before = x.clone()
    out = torch.empty(x.shape, dtype=torch.uint8)
    assert fp8_torch.encode(x, E4M3, out=out, scale=2.0 ** 18) is out
    assert torch.equal(x, before)
    assert torch.equal(out, (x * 2.0 ** 18).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("fmt, sat", MODES, ids=MODE_IDS)
def test_many_blocks_with_a_partial_last_block(fmt, sat, monkeypatch):
    """Small block sizes force the block loops through many full blocks and a short tail."""
    monkeypatch.setattr(fp8_numpy, "BLOCK", 1000)
    monkeypatch.setattr(fp8_torch, "BLOCK", 1000)
    x = random_bits(10_007, seed=17)
    ref = reference_encode(x, fmt, sat)
    for path in ENCODERS:
        assert_codes_equal(ENCODERS[path](x, fmt, sat), ref, x)
    with np.errstate(all="ignore"):
        scaled_ref = reference_encode(x * np.float32(0.5), fmt, sat)
    assert_codes_equal(fp8_torch.encode(torch.from_numpy(x), fmt, sat, scale=0.5).numpy(), scaled_ref, x)
    codes = ref
    assert np.array_equal(fp8_numpy.decode(codes, fmt).view(np.uint32), reference_decode(codes, fmt).view(np.uint32))
    assert np.array_equal(fp8_torch.decode(torch.from_numpy(codes), fmt).numpy().view(np.uint32),
                          reference_decode(codes, fmt).view(np.uint32))


# ---- the scripts that check and time the codecs -------------------------------------------------
def test_numpy_and_torch_fill_the_same_table_of_operations():
    """reference.encode_bits_block is the one bit-level encoder; NumPy and torch each give it
    every operation it calls, under the same names."""
    from hvd_compress.codecs import numpy_common, reference, torch_common
    names = set(vars(numpy_common.NUMPY_OPS))
    assert names == set(vars(torch_common.TORCH_OPS))
    assert names == set(reference.ELEMENTWISE_OPS) | {"copyto", "int32", "float32"}


def test_exhaustive_checker_passes_on_boundary_chunks_and_fails_on_a_bug(tmp_path, monkeypatch, capsys):
    script = load_script(ROOT / "scripts" / "check_codecs_exhaustive.py", "check_codecs_exhaustive")
    # 2**16-value chunks around 448..480 (0x43E0..), 57344..65536 (0x4760..) and Inf/NaN (0x7F80..)
    args = ["--chunk-bits", "16", "--chunks", "0x43e8", "0x4770", "0x7f80", "0xff80",
            "--threads", str(torch.get_num_threads()), "--out", str(tmp_path / "ok.json")]
    assert script.main(args) == 0
    assert '"ok": true' in (tmp_path / "ok.json").read_text()
    broken = lambda x, fmt, sat=True, out=None, **kw: np.zeros(x.shape, np.uint8)   # noqa: E731
    monkeypatch.setattr(script.fp8_numpy, "encode", broken)
    args[-1] = str(tmp_path / "bad.json")
    assert script.main(args) == 1
    assert "FAILED" in capsys.readouterr().out


def test_bench_script_writes_csv_and_headline(tmp_path, capsys):
    from labs.bench import codec as bench
    out = tmp_path / "codec.csv"
    bench.main(["--n", "5000", "--reps", "1", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    ops = {(r["impl"], r["op"]) for r in rows}
    assert ("torch", "cast round trip") in ops and ("ours-torch", "encode+decode") in ops
    assert all(float(r["best_ms"]) > 0 for r in rows)
    assert "headline:" in capsys.readouterr().out.strip().splitlines()[-1]
