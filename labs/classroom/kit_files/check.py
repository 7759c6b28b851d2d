"""The public checks of steps 2 and 3a (given): run them as often as you like, no solution needed.

    python check.py              # every check: PASS, or FAIL with the rule your code breaks
    python check.py --quiet      # only the failures
    python check.py --lang en    # English only (zh: 中文 only; default: both)

They hold your compression.py to its own docstring: the spec's examples (values whose codes
the spec fixes), every code decoded, round trips (every code, and every value between two
neighbouring codes: it must come back as the nearer one), the packet's layout, shapes and
dtypes, NaN and Inf, the scale, and the exchange on 2 ranks simulated in this process. A
failure names the rule broken and shows the input's bits (float32: sign, exponent, mantissa)
and the bits of the code expected and of the code got. The course's grader checks much more,
bit for bit against its reference, on inputs you do not see: passing here is necessary, not
sufficient.
"""
import math
import struct
import sys
import threading
import traceback
import types

import numpy as np
import torch

# the rules of the spec (compression.py's docstring), as a failure names them: (en, zh)
RULES = {
    "zero": ("+0 and -0 are codes 0x00 and 0x80: -0 keeps its sign",
             "+0、-0 的编码是 0x00、0x80：-0 保留符号"),
    "ties": ("round to nearest, ties to even (never truncate the mantissa): a value halfway "
             "between two codes goes to the one whose mantissa ends in 0",
             "就近舍入、平局取偶（不要截断尾数）：恰在两个编码正中间的值取尾数末位为 0 的那个"),
    "nearest": ("round to nearest, ties to even (never truncate the mantissa): a value goes to "
                "the nearer of the two codes around it",
                "就近舍入、平局取偶（不要截断尾数）：取离它更近的那个编码"),
    "subnormal": ("subnormal: results below 2^-6 go on the subnormal grid (exponent field 0, "
                  "multiples of 2^-9), rounded to nearest even, not flushed to zero",
                  "非规格数：小于 2^-6 的结果落在非规格数网格上（指数位为 0，2^-9 的倍数），"
                  "就近取偶，不能直接变成 0"),
    "saturate": ("saturate: a finite value beyond 448, and +-Inf, becomes +-448 (0x7E / 0xFE), "
                 "never NaN", "饱和：超过 448 的有限值和 ±Inf 变为 ±448（0x7E/0xFE），不能变成 NaN"),
    "nan": ("NaN: a NaN input becomes 0x7F with its sign (0xFF); codes 0x7F and 0xFF, and only "
            "they, decode to NaN", "NaN：NaN 输入编码为 0x7F（负号为 0xFF）；只有 0x7F、0xFF 解码为 NaN"),
    "decode": ("decode: code S.EEEE.MMM is (-1)^S * 2^(E-7) * (1 + M/8), or for E = 0 "
               "(-1)^S * 2^-6 * M/8", "解码：S.EEEE.MMM 的值为 (-1)^S * 2^(E-7) * (1 + M/8)，"
               "E = 0 时为 (-1)^S * 2^-6 * M/8"),
    "fp16": ("float16: exactly NumPy's x.astype(np.float16): round to nearest even, subnormals "
             "below 2^-14, overflow to +-Inf, NaN keeps its payload's top 10 bits",
             "float16：与 NumPy 的 x.astype(np.float16) 完全一致：就近取偶、小于 2^-14 的非规格数、"
             "溢出为 ±Inf、NaN 保留载荷高 10 位"),
    "scale": ("the scale: s is the largest power of two with amax * s <= 448 (Bit16: 65504; "
              "224 when the tensor holds Inf), amax the largest finite |value|; the values are "
              "multiplied by s before encoding and divided by s after decoding",
              "缩放：s 是满足 amax * s <= 448（Bit16 为 65504；含 Inf 时为 224）的最大 2 的幂，"
              "amax 为最大有限绝对值；编码前乘以 s，解码后除以 s"),
    "inf_flag": ("Inf: with +-Inf in the tensor, scale for 224 and set flag 1, so that the code "
                 "+-448 means +-Inf; NaN stays NaN, +-Inf stays +-Inf, 0 stays 0",
                 "Inf：张量含 ±Inf 时按 224 缩放并置标志 1，编码 ±448 即表示 ±Inf；"
                 "NaN 仍为 NaN，±Inf 仍为 ±Inf，0 仍为 0"),
    "packet": ("the packet: bytes 0..3 the float32 scale, 4..7 the uint32 flags, then the codes, "
               "all little-endian, one 1-D torch.uint8 tensor",
               "数据包：字节 0..3 为 float32 缩放，4..7 为 uint32 标志，随后是编码，全部小端序，"
               "为一维 torch.uint8 张量"),
    "endian": ("little-endian: each float16 code is stored low byte first, so that any rank "
               "can read any rank's packet", "小端序：每个 float16 编码先存低字节，任何 rank 都能读任何 rank 的数据包"),
    "shape": ("decompress gives back the tensor's shape and dtype (float32, float64, float16, "
              "bfloat16; empty and 0-d tensors too)",
              "解压后恢复原张量的形状和类型（float32、float64、float16、bfloat16；空张量和 0 维张量也一样）"),
    "exchange": ("the exchange: every rank allgathers every rank's packet, decodes each, sums the "
                 "values in float32 in rank order and divides by the number of ranks; never "
                 "average the codes", "交换：每个 rank 用 allgather 收集所有 rank 的数据包，逐个解码，"
                 "按 rank 顺序以 float32 求和再除以 rank 数；不要对编码求平均"),
}
# the rule a wrong code of each class of input breaks, in the order a failure names them:
# flushing subnormals also breaks the ties among them, whose cause is the subnormals
ORDER = ("zero", "nan", "saturate", "subnormal", "ties", "nearest")

# (value, E4M3 code, rule) fixed by the spec
E4M3_EXAMPLES = [
    (0.0, 0x00, "zero"), (-0.0, 0x80, "zero"), (1.0, 0x38, "nearest"), (-1.0, 0xB8, "nearest"),
    (448.0, 0x7E, "nearest"), (-448.0, 0xFE, "nearest"), (1.25, 0x3A, "nearest"),
    (1.2, 0x3A, "nearest"), (0.3, 0x2A, "nearest"), (17.0, 0x58, "nearest"), (-0.1, 0x9D, "nearest"),
    (1.0625, 0x38, "ties"), (1.1875, 0x3A, "ties"), (1.1875 + 2 ** -20, 0x3A, "nearest"),
    (1.1875 - 2 ** -20, 0x39, "nearest"), (2.0 ** -6, 0x08, "subnormal"),
    (7 * 2.0 ** -9, 0x07, "subnormal"), (2.0 ** -9, 0x01, "subnormal"), (2.0 ** -10, 0x00, "subnormal"),
    (3 * 2.0 ** -10, 0x02, "subnormal"), (2.75 * 2.0 ** -9, 0x03, "subnormal"),
    (0.75 * 2.0 ** -9, 0x01, "subnormal"), (1e-30, 0x00, "subnormal"), (449.0, 0x7E, "saturate"),
    (464.0, 0x7E, "saturate"), (1e4, 0x7E, "saturate"), (-1e4, 0xFE, "saturate"),
    (float("inf"), 0x7E, "saturate"), (float("-inf"), 0xFE, "saturate"), (float("nan"), 0x7F, "nan"),
    (-float("nan"), 0xFF, "nan"),
]
# codes whose values the spec fixes: (code, value)
E4M3_VALUES = [(0x00, 0.0), (0x01, 2.0 ** -9), (0x07, 7 * 2.0 ** -9), (0x08, 2.0 ** -6),
               (0x38, 1.0), (0x39, 1.125), (0x3A, 1.25), (0x58, 16.0), (0x7E, 448.0),
               (0x81, -(2.0 ** -9)), (0xB8, -1.0), (0xFE, -448.0)]
TEXT = {"input": ("input", "输入"), "expected": ("expected", "应为"), "got": ("got", "实际"),
        "todo": ("not written yet", "尚未编写"), "raised": ("raised", "抛出异常")}
RESULTS = []
CHECKS = []


class Problem(Exception):
    """What a check found wrong: the rule broken and what shows it (lines of bits and values)."""

    def __init__(self, rule, *lines, zh_lines=None, both_lines=None):
        super().__init__(rule)
        self.rule, self.lines = rule, list(lines)
        self.zh_lines = list(zh_lines) if zh_lines is not None else self.lines
        self.both_lines = both_lines

    def text(self, lang):
        """The rule, then what shows it: in English, Chinese, or both (the rule in each
        language, then each line once where the two say it alike)."""
        en, zh = RULES.get(self.rule, (None, None))
        if lang == "en":
            return "\n    ".join([en] * (en is not None) + self.lines)
        if lang == "zh":
            return "\n    ".join([zh] * (zh is not None) + self.zh_lines)
        lines = self.both_lines
        if lines is None:
            lines = [l for pair in zip(self.lines, self.zh_lines) for l in dict.fromkeys(pair)]
        return "\n    ".join([r for r in (en, zh) if r is not None] + lines)


# ---- bits, for the messages ------------------------------------------------------------------
def float32_bits(x):
    """'1.1875 = float32 0x3F980000: sign 0, exponent 01111111 (2^0), mantissa 001100...'"""
    bits = int(np.asarray(x, dtype=np.float32).reshape(()).view(np.uint32))
    sign, exponent, mantissa = bits >> 31, (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exponent == 0xFF:
        what = "Inf" if mantissa == 0 else "NaN"
    elif exponent == 0:
        what = "subnormal" if mantissa else "zero"
    else:
        what = f"2^{exponent - 127}"
    return (f"{float(np.float32(x))!r} = float32 0x{bits:08X}: sign {sign}, exponent {exponent:08b} "
            f"({what}), mantissa {mantissa:023b}")


def e4m3_value(code):
    """The value of an E4M3 code by the spec's formula (for the messages)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 7
    if exponent == 15 and mantissa == 7:
        return float("nan")
    if exponent == 0:
        return sign * 2.0 ** -6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


def e4m3_bits(code):
    """'0x3A = 0.0111.010: sign 0, exponent 0111 (2^0), mantissa 010 = 1.25'"""
    code = int(code) & 0xFF
    sign, exponent, mantissa = code >> 7, (code >> 3) & 0xF, code & 7
    what = "subnormal" if exponent == 0 else "NaN" if (exponent, mantissa) == (15, 7) else f"2^{exponent - 7}"
    return (f"0x{code:02X} = {sign}.{exponent:04b}.{mantissa:03b}: sign {sign}, exponent {exponent:04b} "
            f"({what}), mantissa {mantissa:03b} = {e4m3_value(code)!r}")


def fp16_bits(code):
    code = int(code) & 0xFFFF
    sign, exponent, mantissa = code >> 15, (code >> 10) & 0x1F, code & 0x3FF
    what = ("subnormal" if exponent == 0 else ("Inf" if mantissa == 0 else "NaN") if exponent == 31
            else f"2^{exponent - 15}")
    value = float(np.array(code, dtype=np.uint16).view(np.float16))
    return (f"0x{code:04X} = {sign}.{exponent:05b}.{mantissa:010b}: sign {sign}, exponent "
            f"{exponent:05b} ({what}), mantissa {mantissa:010b} = {value!r}")


def _labelled(key, text):
    en, zh = TEXT[key]
    return f"{en}: {text}", f"{zh}：{text}", f"{en} / {zh}: {text}"


def code_problem(rule, x, want, got, bits, note=None):
    """A wrong code: the rule, the input's float32 fields, the codes expected and got."""
    lines = [_labelled("input", float32_bits(x)), _labelled("expected", bits(want)),
             _labelled("got", bits(got))]
    notes = [note] if note else []
    return Problem(rule, *[l[0] for l in lines], *[n[0] for n in notes],
                   zh_lines=[l[1] for l in lines] + [n[1] for n in notes],
                   both_lines=[l[2] for l in lines] + [t for n in notes for t in n])


def first_by_rule(found):
    """The failure to name: found is [(rule, problem)], the first rule in ORDER wins; but a
    subnormal failure is the cause only when every failure is a subnormal one (an encoder
    that truncates also misplaces some subnormals: its cause is the rounding)."""
    rules = {rule for rule, _ in found}
    if "subnormal" in rules and rules & {"ties", "nearest"}:
        found = [f for f in found if f[0] != "subnormal"]
    return min(found, key=lambda f: ORDER.index(f[0]) if f[0] in ORDER else len(ORDER))[1]


# ---- the checks ----------------------------------------------------------------------------
def check(name):
    def wrap(fn):
        def run(compression):
            try:
                fn(compression)
                problem = None
            except Problem as found:
                problem = found
            except NotImplementedError as err:
                problem = Problem("todo", f"{TEXT['todo'][0]} ({err})", zh_lines=[f"{TEXT['todo'][1]}（{err}）"])
            except Exception as err:
                frame = traceback.extract_tb(err.__traceback__)[-1]
                text = f"{type(err).__name__}: {err} (line {frame.lineno} of {frame.filename.split('/')[-1]})"
                problem = Problem("raised", f"{TEXT['raised'][0]} {text}", zh_lines=[f"{TEXT['raised'][1]} {text}"])
            RESULTS.append((name, problem))
        run.__name__ = fn.__name__
        CHECKS.append(run)
        return run
    return wrap


def _codes(c, name, x, dtype):
    got = np.asarray(getattr(c, name)(x.copy()))
    if got.dtype != dtype or got.shape != x.shape:
        raise Problem("shape", f"{name} must return {np.dtype(dtype).name} codes of the input's shape "
                               f"{x.shape}, got {got.dtype} {got.shape}",
                      zh_lines=[f"{name} 必须返回与输入形状 {x.shape} 相同的 {np.dtype(dtype).name} 编码，"
                                f"实际为 {got.dtype} {got.shape}"])
    return got


@check("encode_e4m3: the spec's examples")
def e4m3_examples(c):
    x = np.array([v for v, _, _ in E4M3_EXAMPLES], dtype=np.float32)
    got = _codes(c, "encode_e4m3", x, np.uint8)
    found = [(rule, code_problem(rule, x[i], want, got[i], e4m3_bits))
             for i, (_, want, rule) in enumerate(E4M3_EXAMPLES) if int(got[i]) != want]
    if found:
        raise first_by_rule(found)


@check("decode_e4m3: every code")
def e4m3_decode(c):
    codes = np.arange(256, dtype=np.uint8)
    values = np.asarray(c.decode_e4m3(codes.copy()))
    if values.dtype != np.float32 or values.shape != codes.shape:
        raise Problem("shape", f"decode_e4m3 must return float32 of the codes' shape, got {values.dtype} {values.shape}",
                      zh_lines=[f"decode_e4m3 必须返回与编码形状相同的 float32，实际为 {values.dtype} {values.shape}"])
    nan = np.flatnonzero(np.isnan(values)).tolist()
    if nan != [0x7F, 0xFF]:
        wrong = next(i for i in range(256) if (i in (0x7F, 0xFF)) != (i in nan))
        raise Problem("nan", f"code {e4m3_bits(wrong)} decoded to {float(values[wrong])!r}")
    for code, want in E4M3_VALUES + [(0x80, -0.0)]:
        got = float(values[code])
        if got != want or math.copysign(1, got) != math.copysign(1, want):
            raise Problem("zero" if want == 0 else "decode",
                          f"code {e4m3_bits(code)}, decoded to {got!r} ({float32_bits(got)})")
    # codes 0x00..0x7E increase, and code 0x80 | c is -(code c)
    bad = [c + 1 for c in range(0x7E) if not values[c + 1] > values[c]]
    bad += [c | 0x80 for c in range(1, 0x7F) if values[c | 0x80] != -values[c]]
    if bad:
        raise Problem("decode", f"code {e4m3_bits(bad[0])} decoded to {float(values[bad[0]])!r}, "
                                f"after {float(values[(bad[0] & 0x7F) - 1])!r}",
                      zh_lines=[f"编码 {e4m3_bits(bad[0])} 解码为 {float(values[bad[0]])!r}，"
                                f"前一个编码为 {float(values[(bad[0] & 0x7F) - 1])!r}"])


def _neighbour_inputs(values):
    """For each two neighbouring positive codes c, c+1 (values v0 < v1): inputs a quarter,
    half and three quarters of the way and one float32 step either side of halfway, each
    with the code it must become, the rule it tests and the two codes around it; then values
    beyond 448 (saturate)."""
    cases = []
    for code in range(0x7E):
        v0, v1 = float(values[code]), float(values[code + 1])
        mid = (v0 + v1) / 2                          # exact in float32: 5 significant bits
        even = code if code % 2 == 0 else code + 1
        below = float(np.nextafter(np.float32(mid), np.float32(0)))
        above = float(np.nextafter(np.float32(mid), np.float32(1e9)))
        subnormal = code + 1 <= 0x08                 # below 2^-6: the subnormal grid
        for x, want, kind in ((v0 + (v1 - v0) / 4, code, "nearest"), (mid, even, "ties"),
                              (below, code, "nearest"), (above, code + 1, "nearest"),
                              (v0 + 3 * (v1 - v0) / 4, code + 1, "nearest")):
            cases.append((x, want, "subnormal" if subnormal else kind, (code, code + 1)))
    for x in (448.5, 463.9, 464.0, 1000.0, 3.0e38, float("inf")):
        cases.append((x, 0x7E, "saturate", None))
    return cases + [(-x, want | 0x80, rule, around and (around[0] | 0x80, around[1] | 0x80))
                    for x, want, rule, around in cases]


def _rule_of_code(code):
    return "zero" if code in (0x00, 0x80) else "subnormal" if (code & 0x78) == 0 else "nearest"


@check("encode_e4m3: round trips, and each value between two codes to the nearer one")
def e4m3_round_trip(c):
    codes = np.arange(256, dtype=np.uint8)
    values = np.asarray(c.decode_e4m3(codes.copy()), dtype=np.float32)
    finite = [i for i in range(256) if not np.isnan(values[i])]
    back = _codes(c, "encode_e4m3", values[finite], np.uint8)
    found = [(_rule_of_code(i), code_problem(_rule_of_code(i), values[i], i, int(back[n]), e4m3_bits,
                                             (f"the value of code 0x{i:02X} must encode to 0x{i:02X}",
                                              f"编码 0x{i:02X} 的值必须编码回 0x{i:02X}")))
             for n, i in enumerate(finite) if int(back[n]) != i]
    if not found:                                  # the codes' values come back: now between them
        cases = _neighbour_inputs(values)
        x = np.array([case[0] for case in cases], dtype=np.float32)
        got = _codes(c, "encode_e4m3", x, np.uint8)
        for i, (_, want, rule, around) in enumerate(cases):
            if int(got[i]) == want:
                continue
            note = None
            if around:
                lo, hi = (float(values[k]) for k in around)
                note = (f"it lies between 0x{around[0]:02X} ({lo!r}) and 0x{around[1]:02X} ({hi!r})",
                        f"它位于 0x{around[0]:02X}（{lo!r}）与 0x{around[1]:02X}（{hi!r}）之间")
            found.append((rule, code_problem(rule, x[i], want, int(got[i]), e4m3_bits, note)))
    if found:
        raise first_by_rule(found)


@check("encode_fp16 / decode_fp16: NumPy's float16, every code")
def fp16(c):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(2000) * 10.0 ** rng.integers(-9, 6, 2000),
                        [0.0, -0.0, 65504, 65519, 65520, 1e9, np.inf, -np.inf, np.nan,
                         1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -25, 3 * 2.0 ** -25]]).astype(np.float32)
    got = _codes(c, "encode_fp16", x, np.uint16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    bad = np.flatnonzero(got != want)
    if len(bad):
        i = int(bad[0])
        raise code_problem("fp16", x[i], int(want[i]), int(got[i]), fp16_bits)
    codes = np.arange(1 << 16, dtype=np.uint16)
    values = np.asarray(c.decode_fp16(codes.copy()))
    ref = codes.view(np.float16).astype(np.float32)
    if values.dtype != np.float32 or values.shape != ref.shape:
        raise Problem("shape", f"decode_fp16 must return float32 of the codes' shape, got {values.dtype} {values.shape}")
    same = (values.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(values) & np.isnan(ref))
    if not same.all():
        i = int(np.flatnonzero(~same)[0])
        raise Problem("fp16", f"code {fp16_bits(i)}", f"{TEXT['expected'][0]}: {float32_bits(ref[i])}",
                      f"{TEXT['got'][0]}: {float32_bits(values[i])}",
                      zh_lines=[f"编码 {fp16_bits(i)}", f"{TEXT['expected'][1]}：{float32_bits(ref[i])}",
                                f"{TEXT['got'][1]}：{float32_bits(values[i])}"])


def _packet_parts(packet):
    raw = packet.numpy().tobytes()
    return (float(np.frombuffer(raw[:4], "<f4")[0]), int(np.frombuffer(raw[4:8], "<u4")[0]), raw[8:])


def _scale_problem(s, amax, largest):
    want = 2.0 ** math.floor(math.log2(largest / amax))
    while amax * want > largest:
        want /= 2
    while amax * want * 2 <= largest:
        want *= 2
    return Problem("scale", f"amax {amax!r}, header scale {s!r} ({float32_bits(s)})",
                   f"{TEXT['expected'][0]}: {want!r} ({float32_bits(want)}): amax * s = {amax * want!r} <= {largest:g}",
                   zh_lines=[f"amax {amax!r}，包头缩放 {s!r}（{float32_bits(s)}）",
                             f"{TEXT['expected'][1]}：{want!r}（{float32_bits(want)}）：amax * s = {amax * want!r} <= {largest:g}"])


def _layout(c, name, largest, encode, width, bits):
    compressor = getattr(c, name)
    x = torch.randn(257, generator=torch.Generator().manual_seed(1)) * 1e-3
    packet, ctx = compressor.compress(x)
    if not (isinstance(packet, torch.Tensor) and packet.dtype == torch.uint8 and packet.dim() == 1):
        raise Problem("packet", f"got {type(packet).__name__} {getattr(packet, 'dtype', '')} "
                                f"of shape {tuple(getattr(packet, 'shape', ()))}")
    if packet.numel() != 8 + width * 257:
        raise Problem("packet", f"257 values: {8 + width * 257} bytes, got {packet.numel()}")
    s, flags, codes = _packet_parts(packet)
    amax = float(x.abs().max())
    if math.frexp(s)[0] != 0.5 or not (amax * s <= largest < 2 * amax * s):
        raise _scale_problem(s, amax, largest)
    if flags != 0:
        raise Problem("inf_flag", f"header flags {flags}: 0 for a tensor without Inf")
    want = np.asarray(encode((x.numpy() * np.float32(s)).astype(np.float32)))
    little = want.astype(want.dtype.newbyteorder("<")).tobytes()
    if codes != little:
        if width == 2 and codes == want.astype(want.dtype.newbyteorder(">")).tobytes():
            raise Problem("endian", f"code 0 is {bits(want[0])}: bytes {little[:2].hex(' ')}, "
                                    f"got {codes[:2].hex(' ')} (high byte first)")
        i = next(n for n in range(257) if codes[n * width:(n + 1) * width] != little[n * width:(n + 1) * width])
        got = int.from_bytes(codes[i * width:(i + 1) * width], "little")
        raise code_problem("packet", x[i].item() * s, int(want[i]), got, bits,
                           ("the codes must be your encoder's codes of x * s",
                            "编码必须是你的编码器对 x * s 的编码"))
    y = compressor.decompress(packet, ctx)
    decoded = np.asarray(getattr(c, "decode_e4m3" if width == 1 else "decode_fp16")(want)) / np.float32(s)
    if not torch.equal(y, torch.from_numpy(decoded.astype(np.float32))):
        raise Problem("scale", "decompress must be decode(codes) / s")


@check("Bit8Compressor: the packet's layout, the scale")
def bit8_layout(c):
    _layout(c, "Bit8Compressor", 448.0, c.encode_e4m3, 1, e4m3_bits)


@check("Bit16Compressor: the packet's layout, the scale, little-endian")
def bit16_layout(c):
    _layout(c, "Bit16Compressor", 65504.0, c.encode_fp16, 2, fp16_bits)


@check("Bit8Compressor: Inf sets flag 1 and the scale for 224")
def bit8_inf(c):
    x = torch.tensor([1.0, float("inf"), -3.0, 5e-3])
    s, flags, _ = _packet_parts(c.Bit8Compressor.compress(x)[0])
    if flags != 1 or s != 64.0:
        raise Problem("inf_flag", f"input [1.0, inf, -3.0, 0.005]: scale {s!r} flags {flags}; expected "
                                  f"scale 64.0 (3 * 64 <= 224 < 3 * 128), flags 1",
                      zh_lines=[f"输入 [1.0, inf, -3.0, 0.005]：缩放 {s!r}，标志 {flags}；应为缩放 64.0"
                                f"（3 * 64 <= 224 < 3 * 128），标志 1"])


@check("round trips: shapes, dtypes, NaN, Inf, zeros, tiny gradients, the error bound")
def round_trips(c):
    g = torch.Generator().manual_seed(2)
    for name, rel in (("Bit8Compressor", 2.0 ** -4), ("Bit16Compressor", 2.0 ** -11)):
        compressor = getattr(c, name)
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            for shape in ((), (0,), (7,), (3, 5)):
                x = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
                y = compressor.decompress(*compressor.compress(x))
                if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
                    raise Problem("shape", f"{name}: a {dtype} tensor of shape {tuple(shape)} came back as "
                                           f"{getattr(y, 'dtype', type(y))} {tuple(getattr(y, 'shape', ()))}")
        x = torch.tensor([1e-3, float("nan"), float("inf"), -float("inf"), 0.0, -2e-3])
        y = compressor.decompress(*compressor.compress(x)).float()
        if not (torch.isnan(y[1]) and y[2] == float("inf") and y[3] == -float("inf") and y[4] == 0):
            raise Problem("inf_flag", f"{name}: NaN, +Inf, -Inf, 0 came back as {y[1:5].tolist()}",
                          zh_lines=[f"{name}：NaN、+Inf、-Inf、0 还原为 {y[1:5].tolist()}"])
        tiny = torch.full((64,), 1.5e-7)
        y = compressor.decompress(*compressor.compress(tiny)).float()
        if bool((y == 0).any()):
            raise Problem("scale", f"{name}: 64 gradients of 1.5e-7 ({float32_bits(1.5e-7)}) came back as 0: "
                                   f"multiply by s before encoding",
                          zh_lines=[f"{name}：64 个 1.5e-7 的梯度还原为 0：编码前先乘以 s"])
        # every value in the format's normal range after scaling comes back within half a step
        x = torch.randn(4096, generator=g) * 1e-3
        y = compressor.decompress(*compressor.compress(x))
        amax = float(x.abs().max())
        normal = x.abs() >= amax * 2.0 ** -7 if name == "Bit8Compressor" else x.abs() >= amax * 2.0 ** -20
        error = ((y - x).abs() / x.abs())[normal]
        if bool((error > rel).any()):
            i = int(torch.nonzero(normal)[int(error.argmax())])
            raise Problem("nearest", f"{name}: {x[i].item()!r} ({float32_bits(x[i].item())}) came back as "
                                     f"{y[i].item()!r}, a relative error of {float(error.max()):.3g} > {rel:g} "
                                     f"(half a step of the mantissa)",
                          zh_lines=[f"{name}：{x[i].item()!r}（{float32_bits(x[i].item())}）还原为 {y[i].item()!r}，"
                                    f"相对误差 {float(error.max()):.3g} > {rel:g}（尾数半步）"])


# ---- the exchange, 2 ranks simulated in threads -------------------------------------------
class _TwoRanks:
    """A stand-in for horovod.torch with 2 ranks, each a thread of this process: allgather
    concatenates the ranks' tensors along dimension 0, as Horovod does."""

    def __init__(self):
        self.local, self.barrier, self.slots = threading.local(), threading.Barrier(2, timeout=20), [None, None]

    def module(self):
        hvd = types.ModuleType("horovod.torch")
        hvd.rank = hvd.local_rank = lambda: self.local.rank
        hvd.size = hvd.local_size = lambda: 2
        hvd.allgather = self.allgather
        hvd.is_initialized = lambda: True
        hvd.init = lambda *a, **k: None
        return hvd

    def allgather(self, tensor, name=None, process_set=None):
        self.slots[self.local.rank] = tensor
        self.barrier.wait()
        out = torch.cat([self.slots[0], self.slots[1]], 0)
        self.barrier.wait()
        return out


def _exchange(c, compressor, inputs):
    world = _TwoRanks()
    saved = {k: sys.modules.get(k) for k in ("horovod", "horovod.torch")}
    package = types.ModuleType("horovod")
    package.torch = world.module()
    sys.modules["horovod"], sys.modules["horovod.torch"] = package, package.torch
    module_hvd = getattr(c, "hvd", None)
    if module_hvd is not None:
        c.hvd = package.torch                  # a compression.py that imported Horovod at the top
    results, errors = [None, None], []

    def rank(r):
        world.local.rank = r
        try:
            results[r] = c.allreduce(inputs[r].clone(), compressor)
        except Exception as err:
            errors.append(err)
            world.barrier.abort()

    try:
        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
        if module_hvd is not None:
            c.hvd = module_hvd
    if errors:
        raise errors[0]
    return results


@check("allreduce: 2 ranks (simulated), the average of the decoded packets")
def exchange(c):
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(6, 7, generator=g) * 1e-3, torch.randn(6, 7, generator=g) * 3e-3]
    for name in ("Bit8Compressor", "Bit16Compressor"):
        compressor = getattr(c, name)
        decoded = [compressor.decompress(*compressor.compress(x)).float().reshape(-1) for x in inputs]
        want = ((decoded[0] + decoded[1]) / 2).reshape(6, 7)
        got = _exchange(c, compressor, inputs)
        for r, y in enumerate(got):
            if not isinstance(y, torch.Tensor) or y.shape != want.shape or not torch.equal(y.float(), want):
                i = 0 if not isinstance(y, torch.Tensor) or y.shape != want.shape else \
                    int(torch.nonzero((y.float() != want).reshape(-1))[0])
                shown = y.reshape(-1)[i].item() if isinstance(y, torch.Tensor) and y.numel() > i else y
                raise Problem("exchange", f"{name}, rank {r}: element {i} is {shown!r}, expected {want.reshape(-1)[i].item()!r} "
                                          f"(= ({decoded[0][i].item()!r} + {decoded[1][i].item()!r}) / 2)",
                              zh_lines=[f"{name}，rank {r}：第 {i} 个元素为 {shown!r}，应为 {want.reshape(-1)[i].item()!r}"
                                        f"（= ({decoded[0][i].item()!r} + {decoded[1][i].item()!r}) / 2）"])


def run_checks(compression):
    """[(check, Problem or None)] of every check on the module `compression`."""
    del RESULTS[:]
    for run in CHECKS:
        run(compression)
    return list(RESULTS)


def main(argv):
    lang = argv[argv.index("--lang") + 1] if "--lang" in argv and argv.index("--lang") + 1 < len(argv) else "both"
    sys.path.insert(0, ".")
    try:
        import compression
    except Exception as err:
        print(f"FAIL compression.py does not import: {type(err).__name__}: {err}")
        return 1
    results = run_checks(compression)
    quiet = "--quiet" in argv
    for name, problem in results:
        if problem is None:
            if not quiet:
                print(f"PASS {name}")
        else:
            print(f"FAIL {name}\n    {problem.text(lang)}")
    failed = sum(1 for _, p in results if p)
    print(f"{len(results) - failed}/{len(results)} public checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
