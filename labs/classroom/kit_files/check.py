"""The public checks of step 2 (given): run them as often as you like, no solution needed.

    python check.py            # every check, PASS or FAIL with what is wrong
    python check.py --quiet    # only the failures

They hold your compression.py to its own docstring: the spec's examples (values whose codes
the spec fixes), round trips of every code, the packet's layout, shapes and dtypes, NaN and
Inf. The course's grader checks much more, bit for bit against its reference, on inputs you
do not see: passing here is necessary, not sufficient.
"""
import math
import sys
import traceback

import numpy as np
import torch

# (value, E4M3 code) fixed by the spec: rounding to nearest even, saturation, NaN, signs
E4M3_EXAMPLES = [
    (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (-1.0, 0xB8), (448.0, 0x7E), (-448.0, 0xFE),
    (449.0, 0x7E), (1e4, 0x7E), (float("inf"), 0x7E), (float("-inf"), 0xFE),
    (float("nan"), 0x7F), (2.0 ** -6, 0x08), (2.0 ** -9, 0x01), (2.0 ** -10, 0x00),
    (3 * 2.0 ** -10, 0x02), (1.0625, 0x38), (1.1875, 0x3A), (464.0, 0x7E), (1e-30, 0x00),
]
RESULTS = []


def check(name):
    def wrap(fn):
        def run(compression):
            try:
                problem = fn(compression)
            except NotImplementedError as err:
                problem = f"not written yet ({err})"
            except Exception as err:
                frame = traceback.extract_tb(err.__traceback__)[-1]
                problem = f"raised {type(err).__name__}: {err} (line {frame.lineno})"
            RESULTS.append((name, problem))
        run.__name__ = fn.__name__
        CHECKS.append(run)
        return run
    return wrap


CHECKS = []


@check("encode_e4m3: the spec's examples")
def e4m3_examples(c):
    x = np.array([v for v, _ in E4M3_EXAMPLES], dtype=np.float32)
    got = np.asarray(c.encode_e4m3(x.copy()))
    if got.dtype != np.uint8 or got.shape != x.shape:
        return f"must return uint8 codes of the input's shape, got {got.dtype} {got.shape}"
    for (value, want), code in zip(E4M3_EXAMPLES, got):
        if int(code) != want:
            return f"{value!r} must be 0x{want:02X}, got 0x{int(code):02X}"


@check("decode_e4m3: every code, and encode(decode(c)) == c")
def e4m3_codes(c):
    codes = np.arange(256, dtype=np.uint8)
    values = np.asarray(c.decode_e4m3(codes.copy()))
    if values.dtype != np.float32 or values.shape != codes.shape:
        return f"must return float32 of the codes' shape, got {values.dtype} {values.shape}"
    nan = np.isnan(values)
    if sorted(np.flatnonzero(nan).tolist()) != [0x7F, 0xFF]:
        return f"the NaN codes are 0x7F and 0xFF only; NaN came from {np.flatnonzero(nan).tolist()}"
    if values[0x7E] != 448.0 or values[0x01] != 2.0 ** -9 or values[0x38] != 1.0:
        return "0x7E is 448, 0x01 is 2^-9, 0x38 is 1.0"
    back = np.asarray(c.encode_e4m3(values.copy()))
    bad = [i for i in range(256) if not nan[i] and int(back[i]) != i]
    if bad:
        return f"code 0x{bad[0]:02X} decodes to {float(values[bad[0]])!r}, which encodes to 0x{int(back[bad[0]]):02X}"


@check("encode_fp16 / decode_fp16: NumPy's float16, every code")
def fp16(c):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(2000) * 10.0 ** rng.integers(-9, 6, 2000),
                        [0.0, -0.0, 65504, 65520, 1e9, np.inf, -np.inf, np.nan]]).astype(np.float32)
    got = np.asarray(c.encode_fp16(x.copy()))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    if got.dtype != np.uint16 or got.shape != x.shape:
        return f"must return uint16 of the input's shape, got {got.dtype} {got.shape}"
    bad = np.flatnonzero(got != want)
    if len(bad):
        return f"{float(x[bad[0]])!r} must be 0x{int(want[bad[0]]):04X}, got 0x{int(got[bad[0]]):04X}"
    codes = np.arange(1 << 16, dtype=np.uint16)
    values = np.asarray(c.decode_fp16(codes.copy()))
    ref = codes.view(np.float16).astype(np.float32)
    same = (values.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(values) & np.isnan(ref))
    if values.dtype != np.float32 or not same.all():
        i = int(np.flatnonzero(~same)[0]) if values.dtype == np.float32 else 0
        return f"code 0x{i:04X} must decode to {float(ref[i])!r}"


def _packet_parts(packet):
    raw = packet.numpy().tobytes()
    return (float(np.frombuffer(raw[:4], "<f4")[0]), int(np.frombuffer(raw[4:8], "<u4")[0]), raw[8:])


def _layout(c, name, largest, encode, width):
    compressor = getattr(c, name)
    x = torch.randn(257, generator=torch.Generator().manual_seed(1)) * 1e-3
    packet, ctx = compressor.compress(x)
    if not (isinstance(packet, torch.Tensor) and packet.dtype == torch.uint8 and packet.dim() == 1):
        return "the packet must be a 1-D torch.uint8 tensor"
    if packet.numel() != 8 + width * 257:
        return f"the packet has {packet.numel()} bytes, the spec's {8 + width * 257}"
    s, flags, codes = _packet_parts(packet)
    amax = float(x.abs().max())
    m, _ = math.frexp(s)
    if m != 0.5 or not (amax * s <= largest < 2 * amax * s):
        return f"header scale {s!r}: the largest power of two with amax * s <= {largest:g}"
    if flags != 0:
        return f"header flags {flags}: 0 for a tensor without Inf"
    want = np.asarray(encode((x.numpy() * np.float32(s)).astype(np.float32)))
    if codes != want.astype(want.dtype.newbyteorder("<")).tobytes():
        return "the codes are not your encoder's codes of x * s, little-endian"
    y = compressor.decompress(packet, ctx)
    decoded = (np.asarray(getattr(c, "decode_e4m3" if width == 1 else "decode_fp16")(want)) / np.float32(s))
    if not torch.equal(y, torch.from_numpy(decoded.astype(np.float32))):
        return "decompress is not decode(codes) / s"


@check("Bit8Compressor: the packet's layout")
def bit8_layout(c):
    return _layout(c, "Bit8Compressor", 448.0, c.encode_e4m3, 1)


@check("Bit16Compressor: the packet's layout")
def bit16_layout(c):
    return _layout(c, "Bit16Compressor", 65504.0, c.encode_fp16, 2)


@check("Bit8Compressor: Inf sets flag 1 and the scale to 224")
def bit8_inf(c):
    x = torch.tensor([1.0, float("inf"), -3.0, 5e-3])
    s, flags, _ = _packet_parts(c.Bit8Compressor.compress(x)[0])
    if flags != 1 or s != 64.0:
        return f"scale {s!r} flags {flags}: with Inf, s is the largest power of two with amax * s <= 224 (64 here), flag 1"


@check("round trips: shapes, dtypes, NaN, Inf, zeros, tiny gradients")
def round_trips(c):
    g = torch.Generator().manual_seed(2)
    for name in ("Bit8Compressor", "Bit16Compressor"):
        compressor = getattr(c, name)
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            for shape in ((), (0,), (7,), (3, 5)):
                x = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
                y = compressor.decompress(*compressor.compress(x))
                if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
                    return f"{name}: a {dtype} tensor of shape {tuple(shape)} came back as {getattr(y, 'dtype', type(y))} {tuple(getattr(y, 'shape', ()))}"
        x = torch.tensor([1e-3, float("nan"), float("inf"), -float("inf"), 0.0, -2e-3])
        y = compressor.decompress(*compressor.compress(x)).float()
        if not (torch.isnan(y[1]) and y[2] == float("inf") and y[3] == -float("inf") and y[4] == 0):
            return f"{name}: NaN, +Inf, -Inf, 0 came back as {y[1:5].tolist()}"
        tiny = torch.full((64,), 1.5e-7)
        y = compressor.decompress(*compressor.compress(tiny)).float()
        if bool((y == 0).any()):
            return f"{name}: gradients of 1.5e-7 came back as 0: scale before encoding"


def main(argv):
    sys.path.insert(0, ".")
    try:
        import compression
    except Exception as err:
        print(f"FAIL compression.py does not import: {type(err).__name__}: {err}")
        return 1
    for run in CHECKS:
        run(compression)
    quiet = "--quiet" in argv
    for name, problem in RESULTS:
        if problem or not quiet:
            print(f"{'FAIL' if problem else 'PASS'} {name}" + (f": {problem}" if problem else ""))
    failed = sum(1 for _, p in RESULTS if p)
    print(f"{len(RESULTS) - failed}/{len(RESULTS)} public checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
