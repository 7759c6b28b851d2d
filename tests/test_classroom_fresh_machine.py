"""The classroom grader on a fresh machine, from a clone anywhere (issue 53).

A clone of this checkout under /tmp, in a folder whose name holds spaces, with its virtualenv
under /tmp as well, its machine-level caches empty (HVD_CLASSROOM_CACHE and
HVD_COMPRESS_CACHE pointed at new folders; the latter holds only the Horovod sdist that
scripts/setup.sh downloads), grades several kits at once, each in its sandbox: the sandbox
reaches the venv below /tmp (whose tmpfs used to hide it: "the kit's code never started"),
the caches are made once, whole, by the first thread that needs them. Where no sandbox can
start (an interpreter reached through a folder no sandbox mounts), the grader says so and
stops, writing no sheet and no student a reason.

The clone's venv: this venv's files hard-linked into the clone's .venv (one file system), its
two files that name the checkout (the editable install's finder, the .pth of the checkout's
root) written anew for the clone, so it imports the clone's code, torch and Horovod without
installing either again.
"""
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom import pristine
from labs.classroom.mistakes import BY_NAME, seed

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def _tracked_and_new(root):
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                            capture_output=True, check=True).stdout.split(b"\0")
    return [name.decode() for name in listed if name]


def _link_tree(source, dest):
    """`source` as hard links under `dest` (its links as links); a copy where linking fails."""
    for top, dirs, files in os.walk(source):
        rel = Path(top).relative_to(source)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in dirs + files:
            src, dst = Path(top) / name, dest / rel / name
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
                if name in dirs:
                    dirs.remove(name)
            elif name in files:
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)


def _point_at(venv, checkout):
    """The venv's files that name this checkout, replaced (never written through: they are hard
    links to this venv's) by ones that name the clone."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    named = (site / "hvd_compress_checkout.pth").read_text().strip()     # the checkout it names
    for path in list(site.glob("__editable__*")) + list(site.glob("hvd_compress_checkout.pth")):
        text = path.read_text().replace(named, str(checkout))
        path.unlink()
        path.write_text(text)
    for cache in site.glob("__pycache__/__editable__*"):
        cache.unlink()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    root = Path(tempfile.mkdtemp(prefix="classroom fresh ", dir="/tmp"))
    root.chmod(0o755)
    checkout = root / "a clone"
    for name in _tracked_and_new(ROOT):
        if (ROOT / name).is_file() and not (ROOT / name).is_symlink():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    venv = checkout / ".venv"
    _link_tree(Path(sys.prefix), venv)
    _point_at(venv, checkout)
    caches = {"HVD_CLASSROOM_CACHE": root / "empty caches" / "classroom",
              "HVD_COMPRESS_CACHE": root / "empty caches" / "hvd-compress"}
    (caches["HVD_COMPRESS_CACHE"] / "sdist").mkdir(parents=True)
    os.link(pristine.sdist(), caches["HVD_COMPRESS_CACHE"] / "sdist" / pristine.sdist().name)
    klass = root / "class"
    classroom_kit.install_solution(classroom_kit.init(klass / "solution"))
    classroom_kit.install_solution(classroom_kit.init(klass / "solution too"))
    classroom_kit.init(klass / "untouched")
    seed(classroom_kit.init(klass / "truncation"), BY_NAME["truncation"])
    env = {**os.environ, **{k: str(v) for k, v in caches.items()}}
    env.pop("PYTHONPATH", None)
    yield {"root": root, "checkout": checkout, "venv": venv, "caches": caches, "class": klass, "env": env}
    shutil.rmtree(root, ignore_errors=True)


def _grade(fresh, out):
    return subprocess.run([str(fresh["venv"] / "bin" / "python"), "-m", "labs.classroom", "grade",
                           str(fresh["class"]), "--steps", "codecs,intree", "--parallel", "4",
                           "--out", str(out)], cwd=fresh["checkout"], env=fresh["env"],
                          capture_output=True, text=True, timeout=3000)


@pytest.fixture(scope="module")
def graded(fresh):
    where = subprocess.run([str(fresh["venv"] / "bin" / "python"), "-c",
                            "import labs, sys; print(labs.__file__); print(sys.prefix)"],
                           cwd="/", env=fresh["env"], capture_output=True, text=True, check=True)
    assert where.stdout.splitlines() == [str(fresh["checkout"] / "labs" / "__init__.py"), str(fresh["venv"])]
    done = _grade(fresh, fresh["root"] / "grades")
    assert (fresh["root"] / "grades" / "grades.csv").is_file(), done.stderr[-3000:]
    rows = {}
    for row in csv.DictReader(io.StringIO((fresh["root"] / "grades" / "grades.csv").read_text())):
        rows.setdefault(row["kit"], {})[row["check"]] = row
    return done, rows


def test_a_class_graded_four_at_once_from_a_clone_under_tmp(graded):
    done, rows = graded
    assert done.returncode == 1, done.stderr[-3000:]
    for name in ("solution", "solution too"):
        assert [c for c, r in rows[name].items() if r["passed"] != "1"] == [], rows[name]
        assert len(rows[name]) == 14 + 4
    untouched = rows["untouched"]
    assert not any(r["passed"] == "1" for r in untouched.values())
    assert all("not written yet" in r["reason_en"] for c, r in untouched.items() if not c.startswith("intree."))
    assert "holds no diff yet" in untouched["intree.patch"]["reason_en"]
    truncation = rows["truncation"]
    assert "ties to even" in truncation["encode_e4m3"]["reason_en"]
    assert all(truncation[c]["passed"] == "1" for c in ("intree.patch", "intree.build", "intree.allreduce"))
    assert not any("never started" in r["reason_en"] for kit in rows.values() for r in kit.values())


def test_the_caches_were_made_whole_once(graded, fresh):
    made = sorted(p.name for p in (fresh["caches"]["HVD_CLASSROOM_CACHE"] / "hvd-classroom-horovod").iterdir())
    assert len(made) == 1 and made[0].startswith(pristine.TOP), made      # no half-built .build-*
    assert not [line for line in Path("/proc/self/mounts").read_text().splitlines()
                if line.startswith("hvd-classroom ") and str(fresh["root"]) in line.replace("\\040", " ")]


def test_the_pristine_horovod_is_made_atomically_by_threads_and_processes(tmp_path, monkeypatch):
    """Four threads and two processes ask for the pristine Horovod at once, from an empty cache:
    one folder, whole, the same for all; no temporary folder left."""
    monkeypatch.setenv("HVD_CLASSROOM_CACHE", str(tmp_path))
    code = "from labs.classroom import pristine; print(pristine.folder())"
    others = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "HVD_CLASSROOM_CACHE": str(tmp_path)})
              for _ in range(2)]
    found, errors = [], []

    def ask():
        try:
            found.append(pristine.folder())
        except Exception as err:            # noqa: BLE001  (any error fails the test below)
            errors.append(err)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    found += [Path(p.communicate(timeout=300)[0].strip()) for p in others]
    assert errors == [] and all(p.returncode == 0 for p in others)
    assert len(set(found)) == 1
    assert [p.name for p in (tmp_path / "hvd-classroom-horovod").iterdir()] == [found[0].name]
    assert (found[0] / "site" / "horovod" / "torch" / "compression.py").is_file()


def test_where_no_sandbox_starts_the_grader_says_so_and_stops(graded, fresh):
    """The venv's interpreter reached through a folder no sandbox mounts (a link under /tmp):
    bwrap cannot exec it. The grader stops with its reason, before any kit; no sheet."""
    python3 = fresh["venv"] / "bin" / "python3"
    target = os.readlink(python3)
    hop = fresh["root"] / "elsewhere"
    hop.mkdir()
    (hop / "python3").symlink_to(target)
    python3.unlink()
    python3.symlink_to(hop / "python3")
    try:
        done = _grade(fresh, fresh["root"] / "no-sheet")
    finally:
        python3.unlink()
        python3.symlink_to(target)
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    assert "cannot sandbox the kits" in done.stderr and "No such file or directory" in done.stderr, done.stderr
    assert not (fresh["root"] / "no-sheet").exists()
