"""Step 2 graded in each kit's sandbox (labs.classroom.sandbox): the demo class graded once
through the command for the whole file; the solution passes, the untouched kit and each seeded
codec mistake fail with their reasons, the real cause named first; --exhaustive in the sandbox."""
import shutil
import tempfile
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom.grade import Options, codec_step, find_kits
from labs.classroom.mistakes import BY_NAME, MISTAKES, seed

pytestmark = pytest.mark.multiprocess     # a sandboxed process per kit: not the fast tier


@pytest.fixture
def fresh_kit(tmp_path):
    return classroom_kit.init(tmp_path / "kit")


def _read_sheet(csv_path):
    """{kit: {check: (passed, reason_en, reason_zh)}} of a grades.csv."""
    import csv
    with open(csv_path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    found = {}
    for row in rows:
        found.setdefault(row["kit"], {})[row["check"]] = (row["passed"] == "1", row["reason_en"],
                                                           row["reason_zh"])
    return found


@pytest.fixture(scope="module")
def demo_class(tmp_path_factory):
    """`demo` writes the class (solution, untouched, the seeded mistakes); `grade --steps
    codecs` grades it once, each kit in its sandbox: (folder, out, exit status, sheet)."""
    from labs.classroom.__main__ import main
    root = tmp_path_factory.mktemp("demo")
    assert main(["demo", str(root / "class")]) == 0
    out = root / "grades"
    status = main(["grade", str(root / "class"), "--steps", "codecs", "--lang", "both",
                   "--out", str(out)])
    return root / "class", out, status, _read_sheet(out / "grades.csv")


@pytest.fixture
def work():
    """A folder for sandboxed runs that the sandbox's user can reach (pytest's tmp_path is
    private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="classroom-test-"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _codec_checks(folder, work):
    return codec_step(folder, Options(), work)


def test_the_solution_passes_every_codec_check_in_its_sandbox(demo_class):
    _, _, _, sheet = demo_class
    checks = sheet["solution"]
    assert len(checks) == 4 + 2 * 5
    assert [name for name, c in checks.items() if not c[0]] == []


def test_the_untouched_kit_fails_every_codec_check_with_its_reason(demo_class):
    _, _, _, sheet = demo_class
    checks = sheet["untouched"]
    assert len(checks) == 14 and not any(c[0] for c in checks.values())
    for passed, en, zh in checks.values():
        assert "not written yet" in en and "NotImplementedError" in en, en
        assert "尚未实现" in zh


@pytest.mark.parametrize("mistake", [m for m in MISTAKES if m.step == "codecs"], ids=lambda m: m.name)
def test_each_codec_mistake_fails_its_check_with_its_reason(mistake, demo_class):
    _, _, _, sheet = demo_class
    checks = sheet[mistake.name]
    passed, en, zh = checks[mistake.check]
    assert not passed
    assert mistake.words in en, en
    assert zh
    # and the codec functions it did not touch still pass: the reason points at the mistake
    untouched = {"truncation": "decode_e4m3", "no_saturation": "encode_fp16",
                 "flush_subnormals": "Bit16Compressor.round_trip",
                 "nan_inf_lost": "Bit16Compressor.nan_inf", "no_scale": "Bit16Compressor.tiny_gradients",
                 "big_endian_fp16": "Bit8Compressor.packet"}[mistake.name]
    assert checks[untouched][0]


def test_the_reasons_name_the_real_cause_first(demo_class):
    """The class of input that broke, named first when it is the cause: truncation breaks the
    ties (and more); flushed subnormals break the subnormal ties too, yet are named as
    subnormals; a scale that is there but rounds wrong is not told to add the scale."""
    _, _, _, sheet = demo_class
    en = sheet["truncation"]["encode_e4m3"][1]
    assert en.startswith("encode_e4m3, ties:") and "Also wrong: normals" in en
    tiny = sheet["truncation"]["Bit8Compressor.tiny_gradients"][1]
    assert "none came back as 0" in tiny and "not rounded to nearest" in tiny
    assert "Multiply by the power-of-two scale" not in tiny
    flush = sheet["flush_subnormals"]["encode_e4m3"][1]
    assert flush.startswith("encode_e4m3, subnormals:") and "subnormal grid" in flush
    assert "Also wrong: ties" in flush
    no_scale = sheet["no_scale"]["Bit8Compressor.tiny_gradients"][1]
    assert "came back as 0" in no_scale and "power-of-two scale" in no_scale
    en = sheet["no_saturation"]["encode_e4m3"][1]
    assert "overflow" in en and "must be 0x7E, got 0x7F" in en and "Also wrong: inf" in en


def test_the_command_grades_a_class_into_one_table(demo_class, tmp_path):
    """One table in both languages and a CSV, exit status 1 (not all passed); a kit alone
    that passes: 0; a folder that is not there: 2."""
    from labs.classroom.__main__ import main
    root, out, status, sheet = demo_class
    assert status == 1
    kits = find_kits([root])
    assert len(kits) == 2 + len(MISTAKES) == len(sheet)
    en, zh = (out / "grades.md").read_text(), (out / "grades.zh.md").read_text()
    table = [line for line in en.splitlines() if line.startswith("| ")][1:]
    assert len(table) == len(kits)
    assert [row.split("|")[1].strip() for row in table] == sorted(k.name for k in kits)
    assert "| solution | ✅ 14/14 | 14/14 |" in en and "| untouched | ❌ 0/14 | 0/14 |" in en
    assert "| truncation | ❌ " in en and "2. Bit8/Bit16 编解码" in zh
    rows = (out / "grades.csv").read_text().splitlines()
    assert len(rows) == 1 + 14 * len(kits)
    assert sorted(p.name for p in out.iterdir()) == ["grades.csv", "grades.md", "grades.zh.md"]
    assert main(["grade", str(root / "solution"), "--steps", "codecs", "--out", str(tmp_path)]) == 0
    assert main(["grade", str(tmp_path / "nowhere")]) == 2


def test_a_compression_module_that_does_not_import_fails_with_the_error(fresh_kit, work):
    (fresh_kit / "compression.py").write_text("import numpy as np\ndef encode_e4m3(x:\n")
    [check] = _codec_checks(fresh_kit, work)
    assert not check.passed and "SyntaxError" in check.en


def test_the_exhaustive_check_on_a_range_of_inputs(tmp_path, work):
    """`grade --exhaustive` walks every float32 bit pattern in the kit's sandbox (a digest per
    chunk, the first chunk that differs asked again whole); here 2**18 of them around 1.0 and
    the top of the range (NaN payloads, Inf)."""
    from labs.classroom.replay import exhaustive
    for name, passes in (("solution", True), ("truncation", False)):
        folder = classroom_kit.init(tmp_path / name)
        if name == "solution":
            classroom_kit.install_solution(folder)
        else:
            seed(folder, BY_NAME[name])
        for inputs in (range(0x3F800000 - (1 << 17), 0x3F800000 + (1 << 17)),
                       range(0xFF800000 - (1 << 17), 0xFF800000 + (1 << 17))):
            check = exhaustive(folder, work, inputs=inputs, chunk=1 << 16)
            assert check.passed is passes, check.en
    assert "encode_e4m3 differs from the reference at float32 bits 0xFF8" in check.en   # a NaN
