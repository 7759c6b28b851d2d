"""Block-scaled codes (codecs/blocks.py): the torch path against the per-tensor codecs, and the
native C++ kernel against the torch path, bit for bit."""
import math

import pytest
import torch

from hvd_compress.codecs import E4M3, FP16, SCALE_BLOCK, blocks, fp8_torch, fp16_torch, native
from hvd_compress.codecs.scaling import pow2_scale

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
