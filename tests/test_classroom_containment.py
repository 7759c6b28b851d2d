"""What a kit can reach, graded (labs/classroom/red_team.py's KIT_TRICKS): hostile kits beside
the solution and an honest failing kit (truncation), as one class.

Step 3b's patch, read by the grader and applied in the kit's sandbox only: a patch naming a
path outside Horovod (`..`, absolute), making a link, a course patch that is a link to the
grader's own solution patch, a FIFO, a 40 GiB sparse file, a patch whose Horovod setup.py
runs code (it runs, in the kit's sandbox, as the sandbox's user: its uid, what it could read
and its detached process are on record). The trainer's logs copied back into a kit whose
runs/grader-np2 is a link to another kit's runs/np2; a trainer that starts 100 busy processes
of their own sessions beside the solution's trainer (a CPU share per sandbox). Each hostile
kit gets the marks its own work earns with a reason; the solution's and the honest kit's rows
are byte for byte those of grading them alone; nothing outside the sandboxes was read or
changed, no process of theirs is left; the venv's patched Horovod is read by none of them.
"""
import csv
import hashlib
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom import pristine, sandbox
from labs.classroom.grade import Options, grade
from labs.classroom.kit_runs import release, run_kit
from labs.classroom.mistakes import BY_NAME as MISTAKES
from labs.classroom.mistakes import seed
from labs.classroom.red_team import KIT_BY_NAME, plant_kit
from labs.classroom.sheet import csv_text

pytestmark = pytest.mark.multiprocess           # sandboxed kits, Horovod ranks in them

ROOT = Path(__file__).resolve().parents[1]
PATCH_TRICKS = ["patch_outside_the_tree", "patch_absolute_path", "patch_makes_a_link",
                "patch_is_the_solutions", "patch_is_a_fifo", "patch_is_sparse", "patch_runs_setup_py"]
OUTSIDE = [Path(p) for p in ("/var/tmp/hostile-patched", "/var/tmp/hostile-setup-ran",
                             "/work/hostile-setup-ran", "/root/hostile-setup-ran")]
PATCH_OPTIONS = dict(steps=("codecs", "intree"), codec_timeout=60, task_timeout=120)


def _rows(text, kit):
    return [row for row in csv.reader(io.StringIO(text)) if row and row[0] == kit]


def _sheet(text):
    found = {}
    for row in csv.DictReader(io.StringIO(text)):
        found.setdefault(row["kit"], {})[row["check"]] = row
    return found


def _digests(folder):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and not p.is_symlink()}


def _our_mounts(under):
    return [line for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[0] == "hvd-classroom" and line.split()[1].startswith(str(under))]


@pytest.fixture(scope="module")
def base():
    """A folder other users may pass (as a class's folder under /tmp would be)."""
    folder = Path(tempfile.mkdtemp(prefix="classroom-containment-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def patch_class(base):
    """The solution, truncation and each patch trick graded as one class (codecs and 3b)."""
    klass = base / "patch-class"
    kits = {"solution": classroom_kit.install_solution(classroom_kit.init(klass / "solution")),
            "truncation": seed(classroom_kit.init(klass / "truncation"), MISTAKES["truncation"])}
    setup_py = (pristine.folder() / "src" / pristine.TOP / "setup.py").read_text()
    for name in PATCH_TRICKS:
        kits[name] = plant_kit(klass / name, KIT_BY_NAME[name], setup_py)
    for path in OUTSIDE:
        assert not path.exists(), path
    watched = [ROOT / "labs" / "classroom" / "solution_files", kits["solution"], kits["truncation"]]
    before = [_digests(folder) for folder in watched]
    results = grade(sorted(kits.values()), Options(**PATCH_OPTIONS))
    return {"kits": kits, "csv": csv_text(results), "watched": watched, "before": before}


@pytest.mark.parametrize("name", PATCH_TRICKS)
def test_each_hostile_patch_gets_what_its_work_earns_with_its_reason(patch_class, name):
    trick = KIT_BY_NAME[name]
    rows = _sheet(patch_class["csv"])[name]
    intree = {check: row for check, row in rows.items() if check.startswith("intree.")}
    assert list(intree) == ["intree.patch", "intree.build", "intree.allreduce", "intree.optimizer"]
    assert not any(r["passed"] == "1" for check, r in intree.items() if check != "intree.patch"
                   or trick.check == "intree.patch"), intree
    assert trick.words in intree[trick.check]["reason_en"], intree[trick.check]["reason_en"]
    assert intree[trick.check]["reason_zh"]
    codecs = [r for check, r in rows.items() if not check.startswith("intree.")]
    if name == "patch_is_sparse":               # 40 GiB, as far as its size says: not copied in
        assert all(r["passed"] == "0" and "larger than 64 MiB" in r["reason_en"] for r in codecs)
        return
    # the codecs are the base kit's own work: the solution's pass, the untouched kit's do not
    assert all(r["passed"] == ("1" if trick.base == "solution" else "0") for r in codecs)


def test_the_setup_py_of_a_students_patch_ran_in_the_kits_sandbox_only(patch_class):
    reason = _sheet(patch_class["csv"])["patch_runs_setup_py"]["intree.build"]["reason_en"]
    uid = int(reason.split("uid=")[1].split()[0])
    assert uid >= 200000, reason                  # the sandbox's own user, never root
    assert "shadow=PermissionError" in reason and "found=0" in reason, reason
    for path in OUTSIDE:                          # what it wrote where root could
        assert not path.exists(), path
    assert sandbox.processes_left() == []         # its detached process went with its sandbox


def test_the_others_rows_are_those_of_grading_them_alone(patch_class):
    kits = patch_class["kits"]
    for name in ("solution", "truncation"):
        alone = grade([kits[name]], Options(**PATCH_OPTIONS))
        assert _rows(csv_text(alone), name) == _rows(patch_class["csv"], name)
    solution = _sheet(patch_class["csv"])["solution"]
    assert all(r["passed"] == "1" for r in solution.values()) and len(solution) == 14 + 4


def test_nothing_outside_the_sandboxes_changed(patch_class):
    assert [_digests(folder) for folder in patch_class["watched"]] == patch_class["before"]
    for path in OUTSIDE:
        assert not path.exists(), path
    assert _our_mounts("/tmp") == []              # every sandbox's tmpfs unmounted
    assert sandbox.processes_left() == []


def test_no_sandbox_reads_the_venvs_patched_horovod(base):
    """The venv's horovod/torch/compression.py is the project's course patch (step 3b's answer);
    inside a sandbox the same path holds the sdist's, and no bytecode of the patched one."""
    installed = pristine.installed()
    stock = pristine.folder() / "src" / pristine.TOP / "horovod" / "torch" / "compression.py"
    assert b"bit8" in (installed / "torch" / "compression.py").read_bytes()
    assert b"bit8" not in stock.read_bytes()
    kit = classroom_kit.init(base / "reader")
    probe = (f"import glob, hashlib; p = {str(installed / 'torch')!r}; "
             "print('sha', hashlib.sha256(open(p + '/compression.py', 'rb').read()).hexdigest()); "
             "print('pycache', len(glob.glob(p + '/__pycache__/*')))")
    work = base / "reader-work"
    work.mkdir(mode=0o711)
    try:
        run = run_kit(kit, work, "probe", [sys.executable, "-c", probe])
        assert run.outcome.status == 0, run.outcome.output
        assert f"sha {hashlib.sha256(stock.read_bytes()).hexdigest()}" in run.outcome.output
        assert "pycache 0" in run.outcome.output
    finally:
        release(work)


# --- the trainer: the copy-back of its logs, and a CPU hog beside the solution ---------------

SMALL = dict(steps=("trainer",), sizes=(2,), train_samples=1024, test_samples=250,
             min_accuracy=0.40, task_timeout=180)


@pytest.fixture(scope="module")
def trainer_class(base):
    klass = base / "trainer-class"
    kits = {"solution": classroom_kit.install_solution(classroom_kit.init(klass / "solution")),
            "truncation": seed(classroom_kit.init(klass / "truncation"), MISTAKES["truncation"])}
    own_logs = kits["solution"] / "runs" / "np2"         # the solution's own runs, for its report
    own_logs.mkdir(parents=True)
    for r in range(2):
        (own_logs / f"steps-rank{r}.csv").write_text("epoch,step,seconds,loss,size\n1,0,0.05,2.3,2\n")
    for name in ("logs_link_to_another_kit", "hog_the_cores_beside"):
        kits[name] = plant_kit(klass / name, KIT_BY_NAME[name])
    before = _digests(own_logs)
    results = grade(sorted(kits.values()), Options(**SMALL, parallel=len(kits)))
    return {"kits": kits, "csv": csv_text(results), "own_logs": own_logs, "before": before}


@pytest.mark.slow
def test_the_copy_back_follows_no_link_into_another_kit(trainer_class):
    kits = trainer_class["kits"]
    assert _digests(trainer_class["own_logs"]) == trainer_class["before"]
    grader_logs = kits["logs_link_to_another_kit"] / "runs" / "grader-np2"
    assert grader_logs.is_dir() and not grader_logs.is_symlink()
    assert (grader_logs / "steps-rank0.csv").is_file()
    rows = _sheet(trainer_class["csv"])["logs_link_to_another_kit"]
    assert all(r["passed"] == "1" for r in rows.values()), rows    # its work: the solution's


@pytest.mark.slow
def test_a_cpu_hog_beside_the_solution_changes_none_of_its_rows(trainer_class):
    kits = trainer_class["kits"]
    hog = _sheet(trainer_class["csv"])["hog_the_cores_beside"]
    assert hog["trainer.np2.runs"]["passed"] == "0"
    assert "hogged the cores" in hog["trainer.np2.runs"]["reason_en"]
    for name in ("solution", "truncation"):
        alone = grade([kits[name]], Options(**SMALL))
        assert _rows(csv_text(alone), name) == _rows(trainer_class["csv"], name)
    assert all(r["passed"] == "1" for r in _sheet(trainer_class["csv"])["solution"].values())
    assert sandbox.processes_left() == []
