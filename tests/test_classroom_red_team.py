"""The grader's own red team (labs/classroom/red_team.py): hostile kits graded as one class
beside the solution and an honest failing kit (truncation), through the command, once for the
file. Each hostile kit gets its honest grade with its reason; the solution's and the honest
kit's rows are byte for byte those of grading each alone; the sheet is the grader's, written
once, the same whatever the order; nothing outside the kits' sandboxes changed.

TRICKS on step 2 only: every trick runs when the student side imports compression.py, and
steps 1 and 3 run the kit's code in the same sandbox. JUDGED tricks attack what the grader
judges (marks without the work: the test labels as predictions, an identity compressor, a
report typed by hand; outputs of the wrong shape): a second class, every step, beside the
solution and an honest failing kit (no_broadcast).
"""
import csv
import hashlib
import io
import re
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom import sandbox
from labs.classroom.__main__ import main
from labs.classroom.grade import Options, grade
from labs.classroom.mistakes import BY_NAME as MISTAKES
from labs.classroom.mistakes import seed
from labs.classroom.red_team import JUDGED, TRICKS, expected, plant
from labs.classroom.sheet import csv_text, escape, markdown

pytestmark = pytest.mark.multiprocess     # a sandboxed process per kit

ROOT = Path(__file__).resolve().parents[1]
# the memory eater meets its limit at 1 GiB, the disk fillers theirs at 256 MiB (a tmpfs's pages
# count as the sandbox's memory too: the disk must be the smaller, or memory ends them first),
# the flood its 64 MiB file (before it fills the disk)
LIMITS = sandbox.Limits(memory=1 << 30, disk=256 << 20, files=4096, file_size=64 << 20)
OPTIONS = dict(steps=("codecs",), codec_timeout=40, limits=LIMITS)
OUTSIDE = [Path(p) for p in ("/work/hostile-was-here", "/var/tmp/hostile-was-here",
                             "/root/hostile-was-here", "/usr/hostile-was-here")]


def _digests(paths):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def _rows(text, kit):
    return [row for row in csv.reader(io.StringIO(text)) if row and row[0] == kit]


@pytest.fixture(scope="module")
def red_team(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("red")
    klass = root / "class"
    kits = {"solution": classroom_kit.install_solution(classroom_kit.init(klass / "solution")),
            "truncation": seed(classroom_kit.init(klass / "truncation"), MISTAKES["truncation"])}
    for trick in TRICKS:
        kits[trick.name] = plant(klass / (trick.folder or trick.name), trick)
    watched = sorted((ROOT / "labs" / "classroom").glob("*.py")) + [p / "compression.py" for p in kits.values()]
    before = _digests(watched)
    for path in OUTSIDE:
        assert not path.exists()
    monkeypatch_module.setattr("labs.classroom.__main__.Options",
                               lambda **kw: Options(**{**kw, "codec_timeout": 40, "limits": LIMITS}))
    out = root / "grades"
    status = main(["grade", str(klass), "--steps", "codecs", "--lang", "both", "--out", str(out)])
    return {"root": root, "kits": kits, "out": out, "status": status, "before": before,
            "after": _digests(watched), "csv": (out / "grades.csv").read_text(encoding="utf-8")}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _sheet(red):
    """{trick or kit name: its rows} (a trick's kit may have a folder name of its own)."""
    names = {escape(t.folder): t.name for t in TRICKS if t.folder}
    found = {}
    for row in csv.DictReader(io.StringIO(red["csv"])):
        found.setdefault(names.get(row["kit"], row["kit"]), []).append(row)
    return found


def _table(md):
    """The kit column of a Markdown sheet's table (cells split at unescaped `|`)."""
    return [re.split(r"(?<!\\)\|", line)[1].strip() for line in md.splitlines() if line.startswith("| ")][1:]


@pytest.mark.parametrize("trick", TRICKS, ids=lambda t: t.name)
def test_each_hostile_kit_gets_its_honest_grade_with_its_reason(red_team, trick):
    rows = _sheet(red_team)[trick.name]
    if not trick.words:                       # a working kit whose trick reaches nothing
        assert all(r["passed"] == "1" for r in rows) and len(rows) == 14
        return
    assert rows and not any(r["passed"] == "1" for r in rows), rows
    for r in rows:
        assert trick.words in r["reason_en"], (trick.name, r["reason_en"])
        assert r["reason_zh"]


def test_the_others_rows_are_those_of_grading_them_alone(red_team, tmp_path):
    kits = red_team["kits"]
    for name in ("solution", "truncation"):
        alone = grade([kits[name]], Options(**OPTIONS))
        assert _rows(csv_text(alone), name) == _rows(red_team["csv"], name)
    assert all(r["passed"] == "1" for r in _sheet(red_team)["solution"])
    truncation = {r["check"]: r for r in _sheet(red_team)["truncation"]}
    assert truncation["encode_e4m3"]["passed"] == "0" and "ties to even" in truncation["encode_e4m3"]["reason_en"]
    assert truncation["decode_e4m3"]["passed"] == "1"


def test_the_sheet_is_the_graders_written_once_and_the_same_in_any_order(red_team):
    out = red_team["out"]
    assert red_team["status"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["grades.csv", "grades.md", "grades.zh.md"]
    md = (out / "grades.md").read_text(encoding="utf-8")
    assert "everyone" not in md and "| solution | ✅ 14/14 | 14/14 |" in md
    assert _table(md) == [escape(n, markdown=True) for n in sorted(k.name for k in red_team["kits"].values())]
    # a part of the class graded in the reverse order: the same rows, byte for byte
    some = [red_team["kits"][n] for n in ("truncation", "forge_the_sheet", "solution", "change_another_row")]
    again = grade(list(reversed(some)), Options(**OPTIONS))
    for name in ("truncation", "forge_the_sheet", "solution", "change_another_row"):
        assert _rows(csv_text(again), name) == _rows(red_team["csv"], name)
    assert markdown(again) == markdown(grade(some, Options(**OPTIONS)))


def test_no_kit_name_forges_a_row_of_the_sheet(red_team):
    """forge_a_row's folder name holds a newline, a table row and a CSV line of the solution's:
    escaped, it is one cell of one row; every line of either sheet is one kit's."""
    md = (red_team["out"] / "grades.md").read_text(encoding="utf-8")
    assert [line for line in md.splitlines() if line.startswith("| solution ")] == ["| solution | ✅ 14/14 | 14/14 |"]
    lines = red_team["csv"].splitlines()
    assert len(lines) == 1 + sum(len(rows) for rows in _sheet(red_team).values())
    assert [line for line in lines if line.startswith("solution,")] == \
        [line for line in csv_text(grade([red_team["kits"]["solution"]], Options(**OPTIONS))).splitlines()[1:]]
    forged = [line for line in lines if line.startswith('"mallory')]
    assert len(forged) == 14 and all("\\n| solution |" in line for line in forged)


def test_nothing_outside_the_sandboxes_changed(red_team):
    assert red_team["after"] == red_team["before"]        # the grader's modules, every kit's code
    for path in OUTSIDE:
        assert not path.exists(), path
    assert not (red_team["kits"]["forge_the_sheet"].parent / "grades.md").exists()
    assert not (red_team["root"] / "hostile-was-here").exists()
    # no process of any sandbox outlived its grading (the fork bomb's children included); a
    # killed sandbox's init may stay a zombie a moment, until the host's init reaps it
    assert sandbox.processes_left() == []



def test_the_copied_solution_is_named_and_the_others_are_told_what_ended_them(red_team):
    sheet = {name: {r["check"]: r for r in rows} for name, rows in _sheet(red_team).items()}
    copy = sheet["copy_the_solution"]["encode_e4m3"]["reason_en"]
    assert "imports the reference solution (hvd_compress.codecs, labs.classroom" in copy, copy
    assert "did not finish in time" in sheet["sleep_forever"]["encode_e4m3"]["reason_en"]
    assert "ran out of the memory" in sheet["eat_the_memory"]["encode_e4m3"]["reason_en"]
    assert "exit status 0" in sheet["forge_the_sheet"]["encode_e4m3"]["reason_en"]
    assert list(sheet["flood_the_output"]) == ["compression.import"]


# --- the judged class: every step --------------------------------------------------------------

JUDGED_OPTIONS = dict(sizes=(2,), train_samples=1024, test_samples=250, min_accuracy=0.40,
                      codec_timeout=60, limits=LIMITS)
HONEST = ("solution", "no_broadcast")


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    root = tmp_path_factory.mktemp("judged")
    klass = root / "class"
    kits = {"solution": classroom_kit.install_solution(classroom_kit.init(klass / "solution")),
            "no_broadcast": seed(classroom_kit.init(klass / "no_broadcast"), MISTAKES["no_broadcast"])}
    for trick in JUDGED:
        kits[trick.name] = plant(klass / trick.name, trick)
    results = grade(list(kits.values()), Options(**JUDGED_OPTIONS))
    return {"kits": kits, "results": {kit.name: checks for kit, checks in results.items()},
            "csv": csv_text(results)}


@pytest.mark.parametrize("trick", JUDGED, ids=lambda t: t.name)
def test_each_kit_that_wants_marks_without_the_work_gets_what_its_work_earns(judged, trick):
    checks = judged["results"][trick.name]
    assert len(checks) == 28
    for check in checks:
        words = expected(trick, check.name)
        if words is None:
            assert check.passed, (trick.name, check.name, check.en)
        else:
            assert not check.passed and words in check.en and check.zh, (trick.name, check.name, check.en)


def test_the_honest_kits_rows_beside_them_are_those_of_grading_each_alone(judged):
    for name in HONEST:
        alone = grade([judged["kits"][name]], Options(**JUDGED_OPTIONS))
        assert _rows(csv_text(alone), name) == _rows(judged["csv"], name)
    solution = {c.name: c for c in judged["results"]["solution"]}
    assert [n for n, c in solution.items() if not c.passed] == ["report.filled", "report.own_runs"]
    failed = [c.name for c in judged["results"]["no_broadcast"] if not c.passed]
    assert failed == ["trainer.np2.broadcast", "trainer.np2.average", "report.filled", "report.own_runs"]
