"""labs.classroom: the kit holds no solution; step 2, graded in each kit's sandbox, passes the
solution and fails the untouched kit and each seeded codec mistake with its reason (one
grading of the demo class, through the command, for the whole file); the patch's route, the
report checks, the grade sheet."""
import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom.checks import STEPS, fail, ok
from labs.classroom.grade import GradeError, find_kits
from labs.classroom.intree import patch_check
from labs.classroom.mistakes import BY_NAME, MISTAKES, seed
from labs.classroom.report_checks import report_checks
from labs.classroom.sheet import csv_text, markdown

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_kit(tmp_path):
    return classroom_kit.init(tmp_path / "kit")


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


def test_the_patch_check_reads_the_hunks_and_the_route(fresh_kit, tmp_path):
    assert "holds no diff yet" in patch_check(fresh_kit).en
    patch = fresh_kit / "patches" / classroom_kit.COURSE_PATCH
    patch.write_text("--- a/horovod/torch/compression.py\n+++ b/horovod/torch/compression.py\n"
                     "@@ -1 +1 @@\n-a\n+        import compression\n")
    check = patch_check(fresh_kit)
    assert not check.passed and "mpi_ops.py" in check.en and "optimizer.py" in check.en
    classroom_kit.install_solution(fresh_kit)
    assert patch_check(fresh_kit).passed
    # the project's own patch routes bit8/bit16 to hvd_compress: as a student's patch, it fails
    patch.write_bytes((ROOT / "patches" / classroom_kit.COURSE_PATCH).read_bytes())
    check = patch_check(fresh_kit)
    assert not check.passed and "routes hvd.Compression.bit8/.bit16 to hvd_compress" in check.en, check.en
    assert "not to your kit's compression.py" in check.en and check.zh


def _write_run(folder, name, size, accuracy):
    run = folder / "runs" / name
    run.mkdir(parents=True)
    (run / "epochs-rank0.csv").write_text(f"epoch,test_loss,test_accuracy,size\n1,0.5,{accuracy},{size}\n")
    for r in range(size):
        (run / f"steps-rank{r}.csv").write_text(f"epoch,step,seconds,loss,size\n1,0,0.05,2.3,{size}\n"
                                                f"1,1,0.07,2.1,{size}\n")


@pytest.mark.interpreter
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




def test_the_similarity_report_sees_through_renaming_and_ignores_the_given_text(tmp_path):
    """A solution with its names and comments changed is the solution's twin; the untouched
    kit has nothing of its own; a kit written differently is far; the report is only read
    (tests/test_classroom_similarity.py: every evasion, the project's code, honest work)."""
    from labs.classroom.__main__ import main
    from labs.classroom.similarity import compare
    klass = tmp_path / "class"
    solution = classroom_kit.install_solution(classroom_kit.init(klass / "solution"))
    twin = classroom_kit.init(klass / "twin")
    text = (solution / "compression.py").read_text()
    text = re.sub(r"\bx\b", "values", text).replace("codes", "kodes").replace("largest", "top")
    (twin / "compression.py").write_text(re.sub(r"#.*", "", text).replace('"""', "'''"))
    classroom_kit.init(klass / "untouched")
    other = classroom_kit.init(klass / "other")
    (other / "compression.py").write_text((other / "check.py").read_text())   # unrelated code
    pairs, sizes = compare(find_kits([klass]))
    scores = {(p.a, p.b): p for p in pairs}
    assert scores[("solution", "twin")].per_file["compression.py"][0] == 1.0
    assert scores[("twin", "reference solution")].per_file["compression.py"][0] == 1.0
    kit_pairs = [p for p in pairs if p.kind == "kits"]
    assert kit_pairs[0].a == "solution" and kit_pairs[0].b == "twin"
    assert sizes["untouched"] == 0 and scores[("other", "solution")].score < 0.2
    assert scores[("other", "reference solution")].score < 0.2
    assert main(["similar", str(klass), "--out", str(tmp_path)]) == 0
    report = (tmp_path / "similarity.md").read_text()
    assert re.search(r"\| solution - twin \| ⚠ 100% \(\d+\) \|", report)
    assert "untouched" in report and "Never a grade" in report
