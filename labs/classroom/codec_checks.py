"""Step 2 graded in one process: the kit's codecs and compressors against the course's reference.

The reference is the project's own code (hvd_compress.codecs: fp8_numpy, fp16_numpy, the bit
recipe in reference.py; hvd_compress.compressors: the packet). The spec written in the kit's
compression.py fixes every bit, so every check compares bits, and a failure names the class
of input that broke (ties, overflow, NaN, ...), one example, and the rule it broke.
"""
import functools

import numpy as np

from hvd_compress.codecs import E4M3, fp16_numpy, fp8_numpy

from .checks import fail, ok, raised

STEP = "codecs"

# the rule each class of input must follow (en, zh): what a failure of that class says
E4M3_RULES = {
    "zeros": ("+0 and -0 are codes 0x00 and 0x80", "+0、-0 的编码是 0x00、0x80"),
    "ties": ("round to nearest, ties to even (never truncate the mantissa)",
             "就近舍入、平局取偶（不要截断尾数）"),
    "normals": ("re-bias the exponent (127 -> 7) and round the mantissa to 3 bits, to nearest "
                "even", "指数换偏置（127 -> 7），尾数就近取偶舍入到 3 位"),
    "subnormals": ("results below 2^-6 go on the subnormal grid (multiples of 2^-9), rounded "
                   "to nearest even; float32 subnormals become 0",
                   "小于 2^-6 的结果落在非规格数网格（2^-9 的倍数）上，就近取偶"),
    "overflow": ("finite values beyond 448 saturate to +-448 (0x7E / 0xFE), they do not become "
                 "NaN", "超过 448 的有限值饱和到 ±448（0x7E/0xFE），不能变成 NaN"),
    "inf": ("+-Inf saturates to +-448 (0x7E / 0xFE): E4M3 has no Inf code",
            "±Inf 饱和到 ±448（0x7E/0xFE）：E4M3 没有 Inf 编码"),
    "nan": ("NaN becomes 0x7F, with its sign (0xFF)", "NaN 编码为 0x7F（负号为 0xFF）"),
}
FP16_RULES = {
    "zeros": ("+0 and -0 are 0x0000 and 0x8000", "+0、-0 的编码是 0x0000、0x8000"),
    "ties": ("round to nearest, ties to even (never truncate the mantissa)",
             "就近舍入、平局取偶（不要截断尾数）"),
    "normals": ("re-bias the exponent (127 -> 15), round the mantissa to 10 bits, to nearest "
                "even", "指数换偏置（127 -> 15），尾数就近取偶舍入到 10 位"),
    "subnormals": ("results below 2^-14 go on the subnormal grid (multiples of 2^-24)",
                   "小于 2^-14 的结果落在非规格数网格（2^-24 的倍数）上"),
    "overflow": ("finite values that round beyond 65504 become +-Inf (0x7C00 / 0xFC00)",
                 "舍入后超过 65504 的有限值变为 ±Inf（0x7C00/0xFC00）"),
    "inf": ("+-Inf stays +-Inf (0x7C00 / 0xFC00)", "±Inf 保持 ±Inf（0x7C00/0xFC00）"),
    "nan": ("NaN keeps its sign and the top 10 bits of its payload, at least 1 (as NumPy)",
            "NaN 保留符号和载荷的高 10 位，至少为 1（与 NumPy 相同）"),
}


def _f32(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _both_signs(x):
    x = np.asarray(x, dtype=np.float32)
    return np.concatenate([x, -x])


@functools.lru_cache(maxsize=None)
def float_classes(fmt_name):
    """A sample of every class of float32 input for one format, built from the format's own
    grid: ties are exact midpoints of neighbouring codes, with their neighbours either side."""
    rng = np.random.default_rng(26)
    if fmt_name == "e4m3":
        grid = fp8_numpy.decode_table(E4M3)[:0x7F]                   # 0 .. 448, finite
        min_normal, max_finite, bump = 2.0 ** -6, 448.0, [449, 464, 464.1, 480, 1e4, 3.4e38]
    else:
        grid = fp16_numpy.decode_table()[:0x7C00]                    # 0 .. 65504
        min_normal, max_finite, bump = 2.0 ** -14, 65504.0, [65505, 65519, 65520, 65536, 1e9, 3.4e38]
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    mids = mids[mids > 0]
    ties = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    normals = np.exp2(rng.uniform(np.log2(min_normal), np.log2(max_finite), 3000)).astype(np.float32)
    subnormals = np.concatenate([rng.uniform(0, min_normal, 500).astype(np.float32),
                                 _f32([1, 2, 0x7FFFFF, 0x400000])])           # float32 subnormals
    nan_bits = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000, 0x7F802000]
    return {
        "zeros": np.array([0.0, -0.0], dtype=np.float32),
        "ties": _both_signs(ties),
        "normals": _both_signs(normals),
        "subnormals": _both_signs(subnormals),
        "overflow": _both_signs(np.array(bump, dtype=np.float32)),
        "inf": np.array([np.inf, -np.inf], dtype=np.float32),
        "nan": np.concatenate([_f32(nan_bits), _f32([b | 0x80000000 for b in nan_bits])]),
    }


def _hex(code, width):
    return f"0x{int(code):0{width}X}"


MIN_NORMAL = {"e4m3": 2.0 ** -6, "fp16": 2.0 ** -14}


def _first_cause(broken, fmt_name):
    """The class to name first: the first broken class, unless subnormals are broken and every
    wrong input of the first class lies in the subnormal range (a codec that flushes
    subnormals breaks the ties there too: the cause is the subnormals, not the rounding)."""
    classes = [b[0] for b in broken]
    if "subnormals" in classes:
        cls, x, _, _, bad = broken[0]
        if cls != "subnormals" and bool((np.abs(x[bad]) < MIN_NORMAL[fmt_name]).all()):
            return "subnormals"
    return classes[0]


def encoder_check(name, student, reference, fmt_name, rules, width, code_dtype):
    """The student's encoder against the reference on every class; the first class that
    breaks is named with an example and its rule, the others are listed."""
    broken = []
    for cls, x in float_classes(fmt_name).items():
        want = reference(x)
        try:
            got = np.asarray(student(x.copy()))
        except Exception as err:
            return raised(STEP, name, name, err)
        if got.shape != x.shape or got.dtype != code_dtype:
            return fail(STEP, name,
                        f"{name} must return {np.dtype(code_dtype).name} codes of the input's shape "
                        f"{x.shape}; got {got.dtype} {got.shape}.",
                        f"{name} 应返回与输入同形状 {x.shape} 的 {np.dtype(code_dtype).name} 编码；"
                        f"实际为 {got.dtype} {got.shape}。")
        bad = np.flatnonzero(got != want)
        if len(bad):
            broken.append((cls, x, got, want, bad))
    if not broken:
        return ok(STEP, name)
    first = _first_cause(broken, fmt_name)
    broken.sort(key=lambda b: b[0] != first)
    cls, x, got, want, bad = broken[0]
    i = bad[0]
    others = ", ".join(b[0] for b in broken[1:])
    en_rule, zh_rule = rules[cls]
    example = (f"{float(x[i])!r} (bits {_hex(x.view(np.uint32)[i], 8)}) must be "
               f"{_hex(want[i], width)}, got {_hex(got[i], width)}")
    return fail(STEP, name,
                f"{name}, {cls}: {example} ({len(bad)} of {x.size} inputs of this class wrong). "
                f"Rule: {en_rule}." + (f" Also wrong: {others}." if others else ""),
                f"{name}，{cls} 类：{example}（该类 {x.size} 个输入中 {len(bad)} 个错误）。"
                f"规则：{zh_rule}。" + (f" 另有错误的类：{others}。" if others else ""),
                cls=cls, classes=[b[0] for b in broken])


def decoder_check(name, student, codes, reference):
    """Every code decoded, against the reference's float32 bits (any NaN matches a NaN)."""
    want = reference(codes)
    try:
        got = np.asarray(student(codes.copy()))
    except Exception as err:
        return raised(STEP, name, name, err)
    if got.shape != codes.shape or got.dtype != np.float32:
        return fail(STEP, name, f"{name} must return float32 of the codes' shape; got {got.dtype} {got.shape}.",
                    f"{name} 应返回与编码同形状的 float32；实际为 {got.dtype} {got.shape}。")
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)
    if not len(bad):
        return ok(STEP, name)
    i = bad[0]
    width = 2 if codes.dtype == np.uint8 else 4
    return fail(STEP, name,
                f"{name}: code {_hex(codes[i], width)} must decode to {float(want[i])!r}, got "
                f"{float(got[i])!r} ({len(bad)} of {codes.size} codes wrong).",
                f"{name}：编码 {_hex(codes[i], width)} 应解码为 {float(want[i])!r}，实际为 "
                f"{float(got[i])!r}（{codes.size} 个编码中 {len(bad)} 个错误）。")


def codec_checks(module):
    """The four codec functions of the kit's compression module."""
    e4m3 = functools.partial(fp8_numpy.encode, fmt=E4M3, saturate=True)
    return [
        encoder_check("encode_e4m3", getattr(module, "encode_e4m3", None) or _missing("encode_e4m3"),
                      e4m3, "e4m3", E4M3_RULES, 2, np.uint8),
        decoder_check("decode_e4m3", getattr(module, "decode_e4m3", None) or _missing("decode_e4m3"),
                      np.arange(256, dtype=np.uint8), lambda c: fp8_numpy.decode(c, E4M3)),
        encoder_check("encode_fp16", getattr(module, "encode_fp16", None) or _missing("encode_fp16"),
                      fp16_numpy.encode, "fp16", FP16_RULES, 4, np.uint16),
        decoder_check("decode_fp16", getattr(module, "decode_fp16", None) or _missing("decode_fp16"),
                      np.arange(1 << 16, dtype=np.uint16), fp16_numpy.decode),
    ]


def _missing(name):
    def missing(*_):
        raise NotImplementedError(f"compression.py has no {name}")
    return missing
