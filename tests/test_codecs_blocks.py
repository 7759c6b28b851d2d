"""Block-scaled codes (codecs/blocks.py): the torch path against the per-tensor codecs, and the
native C++ kernel against the torch path, bit for bit."""
import os

import pytest
import torch

from hvd_compress.codecs import E4M3, FP16, SCALE_BLOCK, blocks, fp8_torch, fp16_torch, native
from hvd_compress.codecs.scaling import pow2_scale

pytestmark = pytest.mark.unit

FORMATS = [E4M3, FP16]


def mixed(n, seed=0, specials=True):
    """Magnitudes over 1e-12..1e6 (past E4M3's and float16's ranges), signs, zeros, and NaN/Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-12, 7, (n,), generator=g).float()
    if specials and n > 10:
        x[::97] = 0.0
        x[1::101] = -0.0
        x[2::331] = float("nan")
        x[3::467] = float("inf")
        x[4::613] = float("-inf")
        x[5::89] = torch.tensor(1e-40)             # float32 subnormals
    return x


def encoded(x, fmt, block, fn=blocks.encode):
    codes = torch.empty(x.numel(), dtype=blocks.code_dtype(fmt))
    scales = torch.empty(blocks.num_blocks(x.numel(), block))
    fn(x, fmt, codes, scales, block)
    return codes, scales


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_native_kernel_is_built():
    assert blocks.native_available(), (
        "the C++ kernel is not built: scripts/setup.sh builds it "
        "(python -m hvd_compress.codecs.native); the test suite runs after set-up")
    assert native.module().uses_f16c() == (os.environ.get("HVD_COMPRESS_F16C") != "0" and _cpu_has("avx2", "f16c"))


def _cpu_has(*flags):
    with open("/proc/cpuinfo") as f:
        words = set(f.read().split())
    return all(flag in words for flag in flags)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("block", [1, 7, SCALE_BLOCK, 1000])
def test_reference_is_the_per_tensor_codec_block_by_block(fmt, block):
    x = mixed(3001, seed=block)
    codes, scales = encoded(x, fmt, block, blocks.encode_reference)
    for b, a in enumerate(range(0, x.numel(), block)):
        xb = x[a:a + block]
        finite = xb[torch.isfinite(xb)]
        amax = float(finite.abs().max()) if finite.numel() else 0.0
        inf_at_max = not fmt.has_inf and bool(torch.isinf(xb).any())
        s = pow2_scale(amax, fmt.max_finite / 2 if inf_at_max else fmt.max_finite)
        assert float(scales[b]) == (-s if inf_at_max else s)
        if fmt is FP16:
            expected = fp16_torch.encode(xb.contiguous(), scale=s)
        else:
            expected = fp8_torch.encode(xb.contiguous(), fmt, saturate=True, scale=s)
        assert torch.equal(codes[a:a + block], expected), f"block {b}"


@pytest.mark.parametrize("amax", [0.0, 1e-45, 1e-40, 2.0 ** -126, 1e-3, 1.0, 448.0, 449.0,
                                  65504.0, 65505.0, 3.4e38])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_block_scales_are_pow2_scale(amax, fmt):
    x = torch.tensor([amax, -amax / 3, 0.0], dtype=torch.float32)
    scales = blocks.block_scales(x, fmt, 3)
    assert float(scales[0]) == pow2_scale(float(x[0]), fmt.max_finite)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("numel,block", [(1, 1), (255, SCALE_BLOCK), (256, SCALE_BLOCK), (257, SCALE_BLOCK),
                                         (100_003, SCALE_BLOCK), (10_000, 7), (4096, 4096), (5000, 1)])
def test_native_encode_equals_the_torch_path(fmt, numel, block):
    x = mixed(numel, seed=numel + block)
    n_codes, n_scales = encoded(x, fmt, block, blocks.encode)
    r_codes, r_scales = encoded(x, fmt, block, blocks.encode_reference)
    assert same_bits(n_codes, r_codes) and same_bits(n_scales, r_scales)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("block", [SCALE_BLOCK, 7])
def test_native_decode_accumulate_equals_the_torch_path(fmt, ranks, block):
    numel = 20_011
    nb = blocks.num_blocks(numel, block)
    width = fmt.code_bytes
    # rows as views into one gathered buffer, as the communicators see them
    row_bytes = 4 * nb + ((width * numel + 3) & ~3)
    gathered = torch.zeros(ranks, row_bytes, dtype=torch.uint8)
    for r in range(ranks):
        codes, scales = encoded(mixed(numel, seed=r), fmt, block)
        gathered[r, :4 * nb] = scales.view(torch.uint8)
        gathered[r, 4 * nb:4 * nb + width * numel] = codes.view(torch.uint8)
    scales = gathered[:, :4 * nb].view(torch.float32)
    codes = gathered[:, 4 * nb:4 * nb + width * numel].view(blocks.code_dtype(fmt))
    fast = blocks.decode_accumulate(codes, scales, fmt, torch.empty(numel), block)
    ref = blocks.decode_accumulate_reference(codes, scales, fmt, torch.empty(numel), block)
    assert same_bits(fast, ref)
    one = blocks.decode(codes[0], scales[0], fmt, torch.empty(numel), block)
    assert same_bits(one, blocks.decode_accumulate_reference(codes[:1], scales[:1], fmt,
                                                             torch.empty(numel), block))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_special_values_survive(fmt):
    x = torch.tensor([1e-3, float("nan"), float("inf"), -float("inf"), -2e-3, 0.0] * 50)
    codes, scales = encoded(x, fmt, SCALE_BLOCK)
    back = blocks.decode(codes, scales, fmt, torch.empty_like(x))
    assert torch.isnan(back[1::6]).all()
    assert (back[2::6] == float("inf")).all() and (back[3::6] == -float("inf")).all()
    assert torch.isfinite(back[0::6]).all() and (back[5::6] == 0).all()
    assert (scales < 0).all() != fmt.has_inf     # E4M3 marks the block, float16 has Inf codes


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_error_bound_per_block(fmt):
    """Values whose scaled magnitude is a normal number of the format come back within a
    relative 2**-(man_bits + 1) (docs/codecs.md)."""
    g = torch.Generator().manual_seed(3)            # three decades, like a layer's gradients
    x = 10.0 ** (-6 + 3 * torch.rand(50_000, generator=g)) * torch.sign(torch.randn(50_000, generator=g))
    codes, scales = encoded(x, fmt, SCALE_BLOCK)
    back = blocks.decode(codes, scales, fmt, torch.empty_like(x))
    s = scales.abs().repeat_interleave(SCALE_BLOCK)[:x.numel()]
    normal = (x.abs() * s) >= fmt.min_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert normal.float().mean() > 0.5
    assert float(rel.max()) <= 2.0 ** -(fmt.man_bits + 1)


def test_bad_arguments_are_refused():
    x = torch.ones(10)
    with pytest.raises(ValueError, match="scales"):
        blocks.encode(x, E4M3, torch.empty(10, dtype=torch.uint8), torch.empty(2), 256)
    with pytest.raises(ValueError, match="codes"):
        blocks.encode(x, FP16, torch.empty(10, dtype=torch.uint8), torch.empty(1), 256)
    with pytest.raises(TypeError, match="float32"):
        blocks.encode(x.double(), E4M3, torch.empty(10, dtype=torch.uint8), torch.empty(1), 256)
    with pytest.raises(ValueError, match="block"):
        blocks.num_blocks(10, 0)


def test_kernel_follows_torch_thread_setting():
    """One thread per rank in the lab: the kernel must not spawn its own."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x = mixed(1 << 16, seed=9)
        assert same_bits(encoded(x, E4M3, SCALE_BLOCK)[0], encoded(x, E4M3, SCALE_BLOCK, blocks.encode_reference)[0])
    finally:
        torch.set_num_threads(before)


def random_bits(n, seed):
    """n float32 values from uniformly random bit patterns: every exponent, subnormals, Inf,
    NaNs with every payload."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("block", [1, 7, SCALE_BLOCK, 10_007])
def test_native_equals_the_torch_path_on_random_bit_patterns(fmt, block):
    x = random_bits(10_007, seed=block)
    n_codes, n_scales = encoded(x, fmt, block, blocks.encode)
    r_codes, r_scales = encoded(x, fmt, block, blocks.encode_reference)
    assert same_bits(n_codes, r_codes) and same_bits(n_scales, r_scales)
    fast = blocks.decode(n_codes, n_scales, fmt, torch.empty_like(x), block)
    ref = blocks.decode_accumulate_reference(n_codes.view(1, -1), n_scales.view(1, -1), fmt,
                                             torch.empty_like(x), block)
    assert same_bits(fast, ref)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_native_plain_encoder_is_the_per_tensor_codec(fmt):
    """encode_values (no scale; what scripts/check_codecs_exhaustive.py runs on all 2**32
    inputs) against the per-tensor torch codecs."""
    x = random_bits(1 << 16, seed=5)
    codes = torch.empty(x.numel(), dtype=blocks.code_dtype(fmt))
    native.module().encode_values(x, codes, fmt.name)
    ref = fp16_torch.encode(x) if fmt is FP16 else fp8_torch.encode(x, fmt, saturate=True)
    assert same_bits(codes, ref)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
def test_empty_and_one_block_per_tensor(fmt, native_on, monkeypatch):
    """numel 0 (no blocks) and block >= numel (the per-tensor packets: one scale)."""
    if not native_on:
        monkeypatch.setattr(blocks, "_use_native", lambda t, f: False)
    empty = torch.empty(0)
    codes, scales = encoded(empty, fmt, SCALE_BLOCK)
    assert codes.numel() == 0 and scales.numel() == 0 and blocks.num_blocks(0) == 0
    assert blocks.decode(codes, scales, fmt, torch.empty(0)).numel() == 0
    assert blocks.decode_accumulate(codes.view(2, 0), scales.view(2, 0), fmt, torch.empty(0)).numel() == 0
    x = mixed(1000, seed=11, specials=False)
    for block in (1000, 4096):
        codes, scales = encoded(x, fmt, block)
        s = pow2_scale(float(x.abs().max()), fmt.max_finite)
        assert scales.tolist() == [s]
        ref = fp16_torch.encode(x, scale=s) if fmt is FP16 else fp8_torch.encode(x, fmt, scale=s)
        assert torch.equal(codes, ref)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
def test_decode_accumulate_sums_in_rank_order(fmt, native_on, monkeypatch):
    """((d0 + d1) + d2) + d3 in float32: rounding makes the order visible, so every rank must
    use this one."""
    if not native_on:
        monkeypatch.setattr(blocks, "_use_native", lambda t, f: False)
    numel = 2048
    g = torch.Generator().manual_seed(1)
    big, small = torch.randn(numel, generator=g) * 2.0 ** 30, torch.randn(numel, generator=g)
    rows = [big, small, -big, small * 3]
    enc = [encoded(r, fmt, SCALE_BLOCK) for r in rows]
    codes = torch.stack([c for c, _ in enc])
    scales = torch.stack([s for _, s in enc])
    dec = [blocks.decode(c, s, fmt, torch.empty(numel)) for c, s in enc]
    expected = ((dec[0] + dec[1]) + dec[2]) + dec[3]
    got = blocks.decode_accumulate(codes, scales, fmt, torch.empty(numel))
    assert same_bits(got, expected)
    other_order = ((dec[0] + dec[2]) + dec[1]) + dec[3]
    assert not torch.equal(expected, other_order)      # the order matters on this data


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_block_scaling_is_no_worse_than_per_tensor_scaling(fmt):
    """Gradient-like data (layers whose magnitudes differ by decades, one bucket): the error of
    one scale per block is at most that of one scale for the whole bucket, value by value (a
    block's scale is never smaller, and a power of two leaves the normal range's relative
    rounding as it is), and the smallest layer, which one scale flushes to subnormals or zero,
    keeps its relative 2**-(man_bits+1) bound (docs/codecs.md)."""
    g = torch.Generator().manual_seed(4)
    tiny_scale = 1e-7 if fmt.code_bytes == 1 else 1e-12    # past one scale's normal range
    layers = [torch.randn(n, generator=g) * m for n, m in
              [(5000, 1e-2), (3000, 1e-5), (8000, 3e-4), (777, tiny_scale), (4000, 2e-3)]]
    x = torch.cat(layers)
    codes, scales = encoded(x, fmt, SCALE_BLOCK)
    block_err = (blocks.decode(codes, scales, fmt, torch.empty_like(x)) - x).abs()
    one = blocks.num_blocks(x.numel(), x.numel())
    codes1, scales1 = encoded(x, fmt, x.numel())
    assert one == 1 and scales1.numel() == 1
    tensor_err = (blocks.decode(codes1, scales1, fmt, torch.empty_like(x), x.numel()) - x).abs()
    assert bool((block_err <= tensor_err).all())
    tiny = slice(16000, 16777)                        # the tiny layer
    bound = 2.0 ** -(fmt.man_bits + 1)
    s_block = scales.abs().repeat_interleave(SCALE_BLOCK)[:x.numel()][tiny]
    normal_block = x[tiny].abs() * s_block >= fmt.min_normal
    normal_tensor = x[tiny].abs() * scales1.abs() >= fmt.min_normal
    assert float(normal_block.float().mean()) > 0.7 and float(normal_tensor.float().mean()) < 0.05
    assert float((block_err / x.abs())[tiny][normal_block].max()) <= bound


# ---- whole bucket messages (encode_message / decode_messages) and the kernels behind them ----

def reference_messages(comp, rows, block, divisor):
    """Encode each row by the torch path, sum the decodes in rank order, divide: the reference."""
    n, numel = rows.shape
    size = comp.message_bytes(numel, block)
    messages = torch.zeros(n, size, dtype=torch.uint8)
    for r in range(n):
        codes, scales = comp.message_views(messages[r], numel, block)
        blocks.encode_reference(rows[r].contiguous(), comp.fmt, codes, scales, block)
    codes, scales = comp.message_views(messages, numel, block)
    out = torch.empty(numel)
    blocks.decode_accumulate_reference(codes, scales, comp.fmt, out, block)
    return messages, out.div_(divisor) if divisor != 1 else out


@pytest.mark.parametrize("divisor", [1, 2, 3])
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("numel,block", [(1, SCALE_BLOCK), (1000, SCALE_BLOCK), (21_840, SCALE_BLOCK),
                                         (777, 5), (4097, 4097)])
@pytest.mark.parametrize("scheme", ["bit8", "bit16"])
def test_native_messages_equal_the_torch_path(scheme, numel, block, ranks, divisor):
    from hvd_compress.compression import Compression
    comp = getattr(Compression, scheme)
    rows = torch.stack([mixed(numel, seed=numel + 31 * r) for r in range(ranks)])
    expected_messages, expected = reference_messages(comp, rows, block, divisor)
    messages = torch.zeros_like(expected_messages)
    for r in range(ranks):
        comp.encode_message(rows[r].contiguous(), messages[r], block)
    assert torch.equal(messages, expected_messages)
    out = torch.full((numel,), 7.0)
    comp.decode_messages(messages, numel, out, block, divisor)
    assert same_bits(out, expected)


def chunked_messages(comp, rows, chunk, divisor):
    """reference_messages by the native kernel, `chunk` values (a multiple of SCALE_BLOCK) a
    call: blocks are coded independently, so a bucket coded in aligned pieces is the bucket
    coded whole; each piece's output stays under kStreamBytes, where the kernel stores as
    usual (the path the tests above hold to the torch path bit for bit)."""
    n, numel = rows.shape
    messages = torch.zeros(n, comp.message_bytes(numel, SCALE_BLOCK), dtype=torch.uint8)
    codes, scales = comp.message_views(messages, numel, SCALE_BLOCK)
    out = torch.empty(numel)
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        b0, b1 = start // SCALE_BLOCK, blocks.num_blocks(stop)
        for r in range(n):
            blocks.encode(rows[r, start:stop], comp.fmt, codes[r, start:stop], scales[r, b0:b1])
        blocks.decode_accumulate(codes[:, start:stop], scales[:, b0:b1], comp.fmt,
                                 out[start:stop])
    return messages, out.div_(divisor) if divisor != 1 else out


@pytest.mark.parametrize("scheme", ["bit8", "bit16"])
def test_native_messages_large_enough_to_stream(scheme):
    """Past kernels_x86.h's kStreamBytes the kernel writes with non-temporal stores: the same
    bits as the same bucket coded in pieces that stay under it."""
    from hvd_compress.compression import Compression
    comp = getattr(Compression, scheme)
    numel = (8 << 20) // comp.fmt.code_bytes + 1001          # codes and values both past 8 MiB
    chunk = 1 << 20                                          # 1-2 MiB of codes, 4 MiB of values
    assert native.module() is not None and chunk % SCALE_BLOCK == 0
    assert numel * comp.fmt.code_bytes > 8 << 20 > chunk * 4
    rows = torch.stack([mixed(numel, seed=r) for r in range(2)])
    expected_messages, expected = chunked_messages(comp, rows, chunk, 2)
    messages = torch.zeros_like(expected_messages)
    for r in range(2):
        comp.encode_message(rows[r].contiguous(), messages[r])
    assert torch.equal(messages, expected_messages)
    out = torch.empty(numel)
    comp.decode_messages(messages, numel, out, SCALE_BLOCK, 2)
    assert same_bits(out, expected)


@pytest.mark.interpreter
def test_portable_kernel_equals_the_torch_path():
    """HVD_COMPRESS_F16C=0: the portable loops of kernels.h, which CPUs without F16C run."""
    import subprocess
    import sys
    script = (
        "import sys, torch; sys.path.insert(0, 'tests')\n"
        "from test_codecs_blocks import SCALE_BLOCK, test_native_messages_equal_the_torch_path as check\n"
        "from hvd_compress.codecs import native\n"
        "assert not native.module().uses_f16c()\n"
        "for scheme in ('bit8', 'bit16'):\n"
        "    for numel, block in ((21_840, SCALE_BLOCK), (777, 5), (1 << 17, SCALE_BLOCK)):\n"
        "        check(scheme, numel, block, 3, 3)\n"
        "print('portable kernel OK')\n")
    env = dict(os.environ, HVD_COMPRESS_F16C="0")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert proc.returncode == 0 and "portable kernel OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("bad", [3.0, 0.0, -0.0, float("nan"), float("inf"), 1e-40, 2.0 ** 127 * 1.5])
@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("scheme", ["bit8", "bit16"])
def test_corrupt_bucket_scale_raises(scheme, native_on, bad, monkeypatch):
    """A scale that no encoder writes (not a finite power of two) raises, naming the message as
    corrupt, instead of decoding into garbage gradients (issue 15: packets checked)."""
    from hvd_compress.compression import Compression
    comp = getattr(Compression, scheme)
    if not native_on:
        monkeypatch.setattr(blocks, "_use_native", lambda t, f: False)
    numel = 1000
    messages = torch.zeros(2, comp.message_bytes(numel), dtype=torch.uint8)
    for r in range(2):
        comp.encode_message(mixed(numel, seed=r), messages[r])
    comp.decode_messages(messages, numel, torch.empty(numel))          # intact: fine
    messages[1, 4:8].view(torch.float32)[0] = bad                       # rank 1, block 1
    with pytest.raises(RuntimeError, match="corrupt bucket message"):
        comp.decode_messages(messages, numel, torch.empty(numel))


@pytest.mark.parametrize("block", [SCALE_BLOCK, 5, None])
@pytest.mark.parametrize("scheme", ["bit8", "bit16"])
def test_chunk_ops_native_equal_torch_path(scheme, block, monkeypatch):
    """encode_chunks / decode_chunks / reduce_encode (the two-phase route's calls): the native
    kernel and the torch composition of encode_message / decode_messages give the same bits."""
    from hvd_compress.compression import Compression
    comp = getattr(Compression, scheme)
    numel = 3000
    x = mixed(numel, seed=9)
    align = block or 1
    bounds = [0, 7 * align if block else 1000, 7 * align if block else 1000, numel]   # an empty chunk too
    size = comp.chunks_bytes(bounds, block)

    def run():
        message = torch.zeros(size, dtype=torch.uint8)
        comp.encode_chunks(x, message, bounds, block)
        out = torch.full((numel,), 7.0)
        comp.decode_chunks(message, bounds, out, block)
        a, b = bounds[0], bounds[1]
        rows = torch.stack([message[:comp.message_bytes(b - a, block or b - a)]] * 3)
        again = torch.zeros(comp.message_bytes(b - a, block or b - a), dtype=torch.uint8)
        comp.reduce_encode(rows, b - a, again, block, 3)
        return message, out, again

    native_bits = run()
    monkeypatch.setattr(blocks, "_use_native", lambda t, f: False)
    torch_bits = run()
    for n, t in zip(native_bits, torch_bits):
        assert same_bits(n, t)
    # and decode_chunks inverts encode_chunks chunk by chunk, as decode_message does
    out = torch.empty(numel)
    offset = 0
    for a, b in zip(bounds, bounds[1:]):
        s = comp.message_bytes(b - a, block or max(b - a, 1))
        comp.decode_message(torch_bits[0][offset:offset + s], b - a, out[a:b], block or max(b - a, 1))
        offset += s
    assert same_bits(out, torch_bits[1])
