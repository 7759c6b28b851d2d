"""The student's own check (labs/classroom/kit_files/check.py) teaches: each seeded mistake of
steps 2 and 3a fails it naming the rule broken, in English and Chinese, with the input's
float32 bits and the bits of the codes expected and got; its round trip fails a truncating
encoder (the old one encoded only the codes' own values, where truncating and rounding agree);
the solution and an honest kit written another way pass every check. check.py runs here in
this process on each kit's compression.py (tests/test_classroom_standalone.py runs the script
in a kit of its own)."""
import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom.mistakes import BY_NAME, seed

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve().parent
_count = itertools.count()

# mistake -> (the check that must fail, words of the rule it must name, bits it must show)
EXPECTED = {
    "truncation": ("encode_e4m3: the spec's examples", "round to nearest, ties to even", True),
    "no_saturation": ("encode_e4m3: the spec's examples", "saturate", True),
    "flush_subnormals": ("encode_e4m3: the spec's examples", "subnormal", True),
    "nan_inf_lost": ("round trips: shapes, dtypes, NaN, Inf, zeros, tiny gradients, the error bound",
                     "NaN stays NaN, +-Inf stays +-Inf", False),
    "no_scale": ("Bit8Compressor: the packet's layout, the scale", "the scale: s is the largest power of two", False),
    "big_endian_fp16": ("Bit16Compressor: the packet's layout, the scale, little-endian", "little-endian", False),
    "averaged_codes": ("allreduce: 2 ranks (simulated), the average of the decoded packets",
                       "never average the codes", False),
}
ROUND_TRIP = "encode_e4m3: round trips, and each value between two codes to the nearer one"


def _load(path):
    spec = importlib.util.spec_from_file_location(f"check_kit_{next(_count)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(kit):
    """{check: Problem or None} of the kit's own check.py on the kit's compression.py."""
    check = _load(kit / "check.py")
    return check, dict(check.run_checks(_load(kit / "compression.py")))


def _bits_shown(text):
    return ("float32 0x" in text and "sign" in text and "exponent" in text and "mantissa" in text
            and text.count(" = 0.") + text.count(" = 1.") >= 2)     # two codes as S.EEEE.MMM


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_seeded_mistake_fails_check_py_naming_its_rule(tmp_path, name):
    check, results = _check(seed(classroom_kit.init(tmp_path / name), BY_NAME[name]))
    which, words, bits = EXPECTED[name]
    problem = results[which]
    assert problem is not None, f"{name} passes {which!r}"
    en, zh, both = problem.text("en"), problem.text("zh"), problem.text("both")
    assert words in en, en
    assert check.RULES[problem.rule][1] in zh and check.RULES[problem.rule][1] in both, zh
    assert not any("\u4e00" <= ch <= "\u9fff" for ch in en), en            # en is English only
    if bits:
        assert _bits_shown(en) and _bits_shown(zh), en
    failed = [n for n, p in results.items() if p is not None]
    assert failed and all(results[n].rule not in ("raised", "todo") for n in failed), \
        {n: results[n].text("en") for n in failed}


def test_the_round_trip_fails_a_truncating_encoder(tmp_path):
    """The seeded truncation, and a truncating encoder of its own (each value to the code
    below it): the round trip names the rounding rule and shows the bits."""
    _, results = _check(seed(classroom_kit.init(tmp_path / "seeded"), BY_NAME["truncation"]))
    assert "round to nearest, ties to even" in results[ROUND_TRIP].text("en")
    kit = classroom_kit.install_solution(classroom_kit.init(tmp_path / "floor"))
    with open(kit / "compression.py", "a") as f:
        f.write('''
def encode_e4m3(x):
    """Truncates: every finite value to the largest code not above it."""
    x = np.asarray(x, dtype=np.float32)
    grid = E4M3_TABLE[:0x7F].astype(np.float64)
    a = np.abs(x.astype(np.float64))
    index = np.clip(np.searchsorted(grid, np.nan_to_num(a, posinf=1e9), side="right") - 1, 0, 0x7E)
    index = np.where(np.isnan(x), 0x7F, index)
    return (index | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)
''')
    _, results = _check(kit)
    text = results[ROUND_TRIP].text("en")
    assert "round to nearest, ties to even" in text and _bits_shown(text), text
    assert "it lies between" in text


def test_the_solution_and_honest_work_pass_and_the_untouched_kit_is_not_written(tmp_path):
    _, results = _check(classroom_kit.install_solution(classroom_kit.init(tmp_path / "solution")))
    assert all(p is None for p in results.values()), {n: p.text("en") for n, p in results.items() if p}
    honest = classroom_kit.init(tmp_path / "honest")
    (honest / "compression.py").write_text((HERE / "honest_compression.py").read_text())
    _, results = _check(honest)
    assert all(p is None for p in results.values()), {n: p.text("en") for n, p in results.items() if p}
    _, results = _check(classroom_kit.init(tmp_path / "untouched"))
    assert len(results) == 9 and all(p.rule == "todo" and "not written yet" in p.text("en")
                                     and "尚未编写" in p.text("zh") for p in results.values())


def test_the_bits_are_the_formats_fields():
    check = _load(classroom_kit.KIT_FILES / "check.py")
    assert check.float32_bits(1.1875) == ("1.1875 = float32 0x3F980000: sign 0, exponent 01111111 (2^0), "
                                          "mantissa 00110000000000000000000")
    assert check.float32_bits(-2.0 ** -140).startswith("-7.174648137343064e-43 = float32 0x80000200: sign 1, "
                                                       "exponent 00000000 (subnormal)")
    assert check.e4m3_bits(0x3A) == "0x3A = 0.0111.010: sign 0, exponent 0111 (2^0), mantissa 010 = 1.25"
    assert check.e4m3_bits(0x81).endswith("(subnormal), mantissa 001 = -0.001953125")
    assert "(NaN)" in check.e4m3_bits(0xFF)
    assert check.fp16_bits(0x7C00) == ("0x7C00 = 0.11111.0000000000: sign 0, exponent 11111 (Inf), "
                                       "mantissa 0000000000 = inf")
    # the formula the messages use gives the spec's values
    values = np.array([check.e4m3_value(c) for c in range(256)])
    assert np.isnan(values[[0x7F, 0xFF]]).all() and values[0x7E] == 448 and values[0x01] == 2.0 ** -9
