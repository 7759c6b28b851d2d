"""The compressors docs/extending.md writes, one file each under docs/examples/: the page shows
the E5M2 file as it is, and the sub-byte E2M1 file is bit for bit the format's specification
(tests/e2m1_reference.py) through its codec, its bucket messages and its packets, and reaches
the cost model's CLI by HVD_COMPRESS_SCHEMES alone. On 2 ranks: tests/workers/contract_checks.py."""
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import e2m1_reference as ref

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"


def test_the_page_shows_the_e5m2_file_as_it_is():
    text = (ROOT / "docs" / "extending.md").read_text()
    found = re.search(r"<!-- example: (\S+) -->\s*```python\n(.*?)```", text, re.S)
    assert found and found.group(1) == "e5m2_example.py"
    assert found.group(2) == (EXAMPLES / "e5m2_example.py").read_text()


def special_values():
    """Every code's value and the ties between them (times powers of two), signed zeros, the
    ends of float32, Inf and NaN: the cases a rounding or scaling rule gets wrong."""
    grid = [ref.magnitude(c) for c in range(8)]
    ties = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    near = [t * (1 + d) for t in ties for d in (-2 ** -20, 2 ** -20)]
    out = []
    for k in (-3, 0, 7):
        out += [sign * v * 2.0 ** k for v in grid + ties + near for sign in (1, -1)]
    return out + [0.0, -0.0, 3.4028234663852886e38, -1e-45, 1e-40, 2.0 ** -126]


def blocks_of(values, block):
    return [values[a:a + block] for a in range(0, len(values), block)]


def encode(comp, x, block):
    """The example's codes and scales of float32 values x, as the message layout holds them."""
    codes = torch.zeros(-(-x.numel() // 2), dtype=torch.uint8)
    scales = torch.zeros(-(-x.numel() // block), dtype=torch.float32)
    comp.encode_blocks(x, codes, scales, block)
    return codes, scales


def same(a, b):
    """Equal bits, NaN included."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("block", [1, 3, 16, 256])
def test_e2m1_codes_are_the_formats_on_special_values(e2m1, block):
    comp = e2m1.E2M1Compressor
    values = [float(torch.tensor(v, dtype=torch.float32)) for v in special_values()]
    x = torch.tensor(values, dtype=torch.float32)
    codes, scales = encode(comp, x, block)
    packed, want_scales = ref.encode_row(values, block)
    assert scales.tolist() == want_scales
    assert bytes(codes.tolist()) == packed
    out = torch.full_like(x, 123.0)                       # out's old contents must not count
    comp.decode_blocks(codes.view(1, -1), scales.view(1, -1), out, block)
    assert same(out, ref.decode_sum([(packed, want_scales)], len(values), block))


@pytest.mark.parametrize("numel,block", [(1, 256), (7, 2), (1001, 256), (4096, 32)])
def test_e2m1_nan_and_inf_survive_and_codes_pack_two_a_byte(e2m1, numel, block):
    comp = e2m1.E2M1Compressor
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen) * torch.logspace(-6, 6, numel)
    x[::97] = math.nan
    x[5::113] = math.inf
    x[6::131] = -math.inf
    codes, scales = encode(comp, x, block)
    assert codes.numel() == -(-numel // 2)
    packed, want_scales = ref.encode_row(x.tolist(), block)
    assert bytes(codes.tolist()) == packed and scales.tolist() == want_scales
    out = torch.empty(numel)
    comp.decode_blocks(codes.view(1, -1), scales.view(1, -1), out, block)
    assert torch.equal(out.isnan(), x.isnan())
    inf = x.isinf()
    assert torch.equal(out[inf], x[inf])
    finite = ~(inf | x.isnan())
    # each finite value comes back within half a step of its block's grid (<= 1/4 of 2**-k
    # below 1, <= 1/4 of the value's magnitude above)
    s = scales.abs().repeat_interleave(block)[:numel]
    err = (out - x).abs()[finite] * s[finite]
    assert (err <= torch.maximum(torch.tensor(0.25), 0.25 * (x.abs() * s)[finite]) + 1e-6).all()


def test_e2m1_messages_of_several_ranks_sum_in_rank_order_and_divide(e2m1):
    """A bucket message per rank, through BlockCodec's layout ([scales | packed codes | pad]),
    decoded and averaged: the reference's float32 sum in rank order, to the bit."""
    comp = e2m1.E2M1Compressor
    numel, block, n = 999, 256, 3
    assert comp.message_bytes(numel, block) == 4 * 4 + (500 + 3) // 4 * 4
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(numel, generator=gen) * 10 ** r for r in range(n)]
    messages = torch.zeros(n, comp.message_bytes(numel, block), dtype=torch.uint8)
    for r, x in enumerate(xs):
        comp.encode_message(x, messages[r], block)
    out = torch.empty(numel)
    comp.decode_messages(messages, numel, out, block, divisor=n)
    rows = [ref.encode_row(x.tolist(), block) for x in xs]
    assert torch.equal(out, ref.decode_sum(rows, numel, block, divisor=n))
    # a message too short, or with a scale that is no power of two, is refused
    with pytest.raises(ValueError, match="corrupt bucket message"):
        comp.decode_messages(messages[:, :8].contiguous(), numel, out, block)
    bad = messages.clone()
    bad[1, :4] = torch.tensor([3.0]).view(torch.uint8)
    with pytest.raises(ValueError, match="powers of two"):
        comp.decode_messages(bad, numel, out, block)


def test_e2m1_packets_round_trip_through_horovods_interface(e2m1):
    comp = e2m1.E2M1Compressor
    t = torch.randn(5, 7, dtype=torch.float64)
    packet, ctx = comp.compress(t)
    back = comp.decompress(packet, ctx)
    assert back.shape == t.shape and back.dtype == t.dtype
    packed, scales = ref.encode_row(t.float().reshape(-1).tolist(), 256)
    assert torch.equal(back.float().reshape(-1), ref.decode_sum([(packed, scales)], 35, 256))


@pytest.mark.interpreter
def test_the_e2m1_file_alone_reaches_the_cost_model_cli():
    """Named in HVD_COMPRESS_SCHEMES, nothing else edited: a row of --methods with the bytes
    its messages have, and its 4 bits priced on both packet exchanges (one process for both
    commands: the file imports torch, which takes seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES), str(ROOT)]),
               HVD_COMPRESS_SCHEMES="e2m1_example")
    script = """if True:
        import contextlib, io, sys
        from hvd_compress.costmodel.__main__ import main
        for argv in (["--methods", "basic", "--nodes", "2", "4", "--bandwidth", "100Mbit/s",
                      "--latency", "50us", "--format", "csv"],
                     ["--nodes", "8", "--size", "32MiB", "--bandwidth", "10Gbit/s",
                      "--latency", "1ms", "--bits", "4", "--format", "csv"]):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                main(argv)
            print(text.getvalue(), end="====\\n")
    """
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    methods_csv, predict_csv, _ = out.stdout.split("====\n")
    rows = pd.read_csv(io.StringIO(methods_csv))
    e2m1 = rows[rows.method == "e2m1"].set_index("n")
    bit8 = rows[rows.method == "bit8"].set_index("n")
    # the basic net's buckets at 2 ranks: (n-1) x [4 bytes a 256-block | half a byte a value]
    from hvd_compress.costmodel import methods
    counts = [methods.numel(s) for s in methods.MODEL_SHAPES["basic"]]
    expected = sum(4 * -(-b // 256) + (-(-b // 2) + 3) // 4 * 4 for b in methods.buckets(counts))
    assert e2m1.loc[2, "bytes_per_rank"] == expected and e2m1.loc[2, "route"] == "allgather"
    assert (e2m1.bytes_per_rank < 0.6 * bit8.bytes_per_rank).all()
    predicted = pd.read_csv(io.StringIO(predict_csv))
    assert set(predicted.scheme) == {"allgather", "alltoall"} and (predicted.bits == 4).all()
