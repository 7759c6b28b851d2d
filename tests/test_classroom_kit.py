"""labs.classroom in one process: the kit holds no solution, the in-process checks of step 2
pass the solution and fail the untouched kit and each seeded codec mistake with its reason,
the report checks, the grade sheet."""
import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom.checks import STEPS, fail, ok
from labs.classroom.grade import GradeError, Options, find_kits, in_process_checks
from labs.classroom.intree import patch_check
from labs.classroom.mistakes import BY_NAME, MISTAKES, seed
from labs.classroom.report_checks import report_checks
from labs.classroom.sheet import csv_text, markdown

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_kit(tmp_path):
    return classroom_kit.init(tmp_path / "kit")


@pytest.fixture(scope="module")
def solution_checks(tmp_path_factory):
    folder = classroom_kit.install_solution(classroom_kit.init(tmp_path_factory.mktemp("s") / "kit"))
    return in_process_checks(folder, Options())


def _squash(text):
    return re.sub(r"\s+", " ", text).strip()


def _bodies(source):
    """{qualified name: body source without its docstring} of every function in `source`."""
    tree = ast.parse(source)
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
            found[f"{node.name}@{node.lineno}"] = _squash("\n".join(ast.get_source_segment(source, stmt) for stmt in body))
    return found


def _kit_text(folder):
    return {p.relative_to(folder): _squash(p.read_text(errors="replace"))
            for p in folder.rglob("*") if p.is_file()}


def test_the_kit_holds_no_solution(fresh_kit):
    """No function body of the course's solution (its files, and the project's own code the
    solution rests on) appears anywhere in the kit."""
    from hvd_compress.exchange import routes as communicators
    from hvd_compress import compressors
    from hvd_compress.codecs import fp8_numpy, fp16_numpy, reference
    from labs import mnist
    given = set(_bodies((fresh_kit / "train.py").read_text()).values())   # the starting point
    solution = {}
    for path in classroom_kit.SOLUTION_FILES.glob("*.py"):
        for name, body in _bodies(path.read_text()).items():
            if body not in given:                                    # the student's work
                solution[f"{path.name}:{name}"] = body
    for module in (fp8_numpy, fp16_numpy, reference, compressors, communicators, mnist):
        for name, body in _bodies(inspect.getsource(module)).items():
            if module is not mnist or name.split("@")[0] in ("make_optimizer", "train", "test", "main"):
                solution[f"{module.__name__}:{name}"] = body
    assert len(solution) > 40
    texts = _kit_text(fresh_kit)
    for name, body in solution.items():
        if len(body) < 40:      # `return out`, `pass`: shared by any code
            continue
        for path, text in texts.items():
            assert body not in text, f"{path} holds the solution of {name}"
    # the project's course patch: none of its added lines
    added = [l[1:].strip() for l in (ROOT / "patches" / "course-bit8-bit16.patch").read_text().splitlines()
             if l.startswith("+") and not l.startswith("+++") and len(l.strip()) > 30]
    patch = (fresh_kit / "patches" / "course-bit8-bit16.patch").read_text()
    assert added and not any(line in patch for line in added)


def test_the_kit_calls_no_horovod_and_leaves_the_work_undone(fresh_kit):
    for path in fresh_kit.glob("*.py"):
        if path.name == "kitlog.py":           # given: it asks Horovod for the rank, if any
            continue
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names} | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any("horovod" in (m or "") or m == "DistributedSampler" for m in imported), path
    source = (fresh_kit / "compression.py").read_text()
    assert source.count("raise NotImplementedError") == 9
    assert "ties to even" in source and "saturates" in source and "little-endian" in source
    # the given patches are the project's, byte for byte (the build cache's key matches)
    for name in classroom_kit.GIVEN_PATCHES:
        assert (fresh_kit / "patches" / name).read_bytes() == (ROOT / "patches" / name).read_bytes()


def test_init_refuses_a_folder_with_work_in_it(fresh_kit):
    with pytest.raises(classroom_kit.KitError, match="not empty"):
        classroom_kit.init(fresh_kit)


def test_the_solution_passes_every_in_process_check(solution_checks):
    assert len(solution_checks) == 4 + 2 * 5
    assert [c.name for c in solution_checks if not c.passed] == []


def test_the_untouched_kit_fails_every_in_process_check_with_its_reason(fresh_kit):
    checks = in_process_checks(fresh_kit, Options())
    assert len(checks) == 14 and not any(c.passed for c in checks)
    for c in checks:
        assert "not written yet" in c.en and "NotImplementedError" in c.en, c.en
        assert "尚未实现" in c.zh


@pytest.mark.parametrize("mistake", [m for m in MISTAKES if m.step == "codecs"], ids=lambda m: m.name)
def test_each_codec_mistake_fails_its_check_with_its_reason(mistake, tmp_path):
    folder = seed(classroom_kit.init(tmp_path / "kit"), mistake)
    checks = {c.name: c for c in in_process_checks(folder, Options())}
    assert not checks[mistake.check].passed
    assert mistake.words in checks[mistake.check].en, checks[mistake.check].en
    assert checks[mistake.check].zh
    # and the codec functions it did not touch still pass: the reason points at the mistake
    untouched = {"truncation": "decode_e4m3", "no_saturation": "encode_fp16",
                 "nan_inf_lost": "Bit16Compressor.nan_inf", "no_scale": "Bit16Compressor.tiny_gradients",
                 "big_endian_fp16": "Bit8Compressor.packet"}[mistake.name]
    assert checks[untouched].passed


def test_the_reasons_name_the_class_of_input_that_broke(tmp_path):
    folder = seed(classroom_kit.init(tmp_path / "kit"), BY_NAME["truncation"])
    check = {c.name: c for c in in_process_checks(folder, Options())}["encode_e4m3"]
    assert check.details["cls"] == "ties" and "normals" in check.details["classes"]
    folder = seed(classroom_kit.init(tmp_path / "kit2"), BY_NAME["no_saturation"])
    check = {c.name: c for c in in_process_checks(folder, Options())}["encode_e4m3"]
    assert check.details["classes"] == ["overflow", "inf"]
    assert "must be 0x7E, got 0x7F" in check.en


def test_a_compression_module_that_does_not_import_fails_with_the_error(fresh_kit):
    (fresh_kit / "compression.py").write_text("import numpy as np\ndef encode_e4m3(x:\n")
    [check] = in_process_checks(fresh_kit, Options())
    assert not check.passed and "SyntaxError" in check.en


def test_the_patch_check_reads_the_hunks(fresh_kit, tmp_path):
    assert "holds no diff yet" in patch_check(fresh_kit).en
    patch = fresh_kit / "patches" / classroom_kit.COURSE_PATCH
    patch.write_text("--- a/horovod/torch/compression.py\n+++ b/horovod/torch/compression.py\n@@ -1 +1 @@\n-a\n+b\n")
    check = patch_check(fresh_kit)
    assert not check.passed and "mpi_ops.py" in check.en and "optimizer.py" in check.en
    classroom_kit.install_solution(fresh_kit)
    assert patch_check(fresh_kit).passed


def _write_run(folder, name, size, accuracy):
    run = folder / "runs" / name
    run.mkdir(parents=True)
    (run / "epochs-rank0.csv").write_text(f"epoch,test_loss,test_accuracy,size\n1,0.5,{accuracy},{size}\n")
    for r in range(size):
        (run / f"steps-rank{r}.csv").write_text(f"epoch,step,seconds,loss,size\n1,0,0.05,2.3,{size}\n"
                                                f"1,1,0.07,2.1,{size}\n")


def test_the_report_checks(fresh_kit):
    checks = report_checks(fresh_kit)
    assert [c.passed for c in checks] == [False, False] and "python report.py" in checks[0].en
    _write_run(fresh_kit, "np2-none", 2, 0.8123)
    _write_run(fresh_kit, "np4-bit8", 4, 0.7999)
    subprocess.run([sys.executable, "report.py"], cwd=fresh_kit, check=True, capture_output=True)
    assert all(c.passed for c in report_checks(fresh_kit))
    report = fresh_kit / "report.md"
    report.write_text(report.read_text().replace("81.23%", "91.23%"))     # typed by hand
    check = report_checks(fresh_kit)[1]
    assert not check.passed and "81.23%" in check.en and "91.23%" in check.en


def test_the_sheet_is_one_table_for_a_class_in_both_languages(tmp_path):
    a, b = tmp_path / "alice", tmp_path / "bob"
    results = {a: [ok("codecs", "encode_e4m3"), fail("trainer", "trainer.np2.shard", "shard it", "分片")],
               b: [ok("codecs", "encode_e4m3"), ok("trainer", "trainer.np2.shard")]}
    en, zh = markdown(results, "en"), markdown(results, "zh")
    assert "| alice | ❌ 0/1 | ✅ 1/1 | 1/2 |" in en and "| bob | ✅ 1/1 | ✅ 1/1 | 2/2 |" in en
    assert "- `trainer.np2.shard`: shard it" in en and "- `trainer.np2.shard`: 分片" in zh
    assert STEPS["trainer"][1] in zh
    rows = csv_text(results).splitlines()
    assert rows[0] == "kit,step,check,passed,reason_en,reason_zh" and len(rows) == 5


def test_find_kits_reads_a_folder_of_submissions(tmp_path):
    for name in ("bob", "alice"):
        classroom_kit.init(tmp_path / "class" / name)
    (tmp_path / "class" / "notes").mkdir()
    assert [k.name for k in find_kits([tmp_path / "class"])] == ["alice", "bob"]
    with pytest.raises(GradeError, match="neither a kit"):
        find_kits([tmp_path / "class" / "notes"])


def test_the_command_grades_a_class_into_one_table(tmp_path):
    """`demo` writes the class (solution, untouched, the seeded mistakes); `grade` on the
    folder gives one table in both languages and a CSV, exit status 1 (not all passed)."""
    from labs.classroom.__main__ import main
    assert main(["demo", str(tmp_path / "class")]) == 0
    kits = find_kits([tmp_path / "class"])
    assert len(kits) == 2 + len(MISTAKES)
    out = tmp_path / "grades"
    assert main(["grade", str(tmp_path / "class"), "--steps", "codecs", "--lang", "both",
                 "--out", str(out)]) == 1
    en, zh = (out / "grades.md").read_text(), (out / "grades.zh.md").read_text()
    table = [line for line in en.splitlines() if line.startswith("| ")][1:]
    assert len(table) == len(kits)
    assert "| solution | ✅ 14/14 | 14/14 |" in en and "| untouched | ❌ 0/14 | 0/14 |" in en
    assert "| truncation | ❌ " in en and "2. Bit8/Bit16 编解码" in zh
    rows = (out / "grades.csv").read_text().splitlines()
    assert len(rows) == 1 + 14 * len(kits)
    assert main(["grade", str(tmp_path / "class" / "solution"), "--steps", "codecs"]) == 0
    assert main(["grade", str(tmp_path / "nowhere")]) == 2


def test_the_exhaustive_check_on_a_range_of_inputs(tmp_path):
    """`grade --exhaustive` walks every float32 bit pattern; here 2**18 of them around 1.0
    and the top of the range (NaN payloads, Inf)."""
    from labs.classroom.codec_checks import exhaustive_check
    from labs.classroom.rank_job import kit_on_path
    import importlib
    for name, passes in (("solution", True), ("truncation", False)):
        folder = classroom_kit.init(tmp_path / name)
        if name == "solution":
            classroom_kit.install_solution(folder)
        else:
            seed(folder, BY_NAME[name])
        with kit_on_path(folder):
            module = importlib.import_module("compression")
            for inputs in (range(0x3F800000 - (1 << 17), 0x3F800000 + (1 << 17)),
                           range(0xFF800000 - (1 << 17), 0xFF800000 + (1 << 17))):
                check = exhaustive_check(module, chunk=1 << 16, inputs=inputs)
                assert check.passed is passes, check.en
    assert "encode_e4m3 differs from the reference at float32 bits 0xFF8" in check.en   # a NaN
