"""The grader's own red team (labs/classroom/red_team.py): hostile kits graded as one class
beside the solution and an honest failing kit (truncation), through the command, once for the
file. Each hostile kit gets its honest grade with its reason; the solution's and the honest
kit's rows are byte for byte those of grading each alone; the sheet is the grader's, written
once, the same whatever the order; nothing outside the kits' sandboxes changed.

Step 2 only: every trick runs when the student side imports compression.py, and steps 1 and 3
run the kit's code in the same sandbox (tests/test_classroom_grade.py grades those steps).
"""
import csv
import hashlib
import io
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom import sandbox
from labs.classroom.__main__ import main
from labs.classroom.grade import Options, grade
from labs.classroom.mistakes import BY_NAME as MISTAKES
from labs.classroom.mistakes import seed
from labs.classroom.red_team import TRICKS, plant
from labs.classroom.sheet import csv_text, markdown

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
        kits[trick.name] = plant(klass / trick.name, trick)
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
    found = {}
    for row in csv.DictReader(io.StringIO(red["csv"])):
        found.setdefault(row["kit"], []).append(row)
    return found


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
    table = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ")][1:]
    assert table == sorted(red_team["kits"])
    # a part of the class graded in the reverse order: the same rows, byte for byte
    some = [red_team["kits"][n] for n in ("truncation", "forge_the_sheet", "solution", "change_another_row")]
    again = grade(list(reversed(some)), Options(**OPTIONS))
    for name in ("truncation", "forge_the_sheet", "solution", "change_another_row"):
        assert _rows(csv_text(again), name) == _rows(red_team["csv"], name)
    assert markdown(again) == markdown(grade(some, Options(**OPTIONS)))


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
