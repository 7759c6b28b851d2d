"""The grader reads a student's patch itself (labs/classroom/patchfile.py, nofollow.py): what
it takes applies exactly as `patch` applies the original; each hostile patch is refused with a
reason for the student, before any tool sees it: an absolute path, `..`, a git symlink, a
special mode, a binary patch, a rename, a name outside Horovod 0.28.1's tree, a hunk whose
counts lie, a course patch that is a link (to the grader's own solution patch), a FIFO (no
hang), a device, a 40 GiB sparse file (no MemoryError), a file over the cap.
"""
import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom import nofollow, patchfile, pristine
from labs.classroom.intree import patch_check, prepare, sdist_tree

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
COURSE = classroom_kit.COURSE_PATCH
PATCHES = [ROOT / "patches" / "build-cxx17.patch", ROOT / "patches" / "course-bit8-bit16.patch",
           ROOT / "patches" / "gloo-post-receives-first.patch",
           ROOT / "labs" / "classroom" / "solution_files" / COURSE]


def _tree_of(diffs, dest):
    """The sdist's files that `diffs` name, copied under dest from the unpacked sdist."""
    src = pristine.folder() / "src" / pristine.TOP
    for diff in diffs:
        target = dest / diff.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((src / diff.path).read_bytes())


@pytest.mark.parametrize("path", PATCHES, ids=lambda p: p.name)
def test_what_the_grader_writes_again_applies_as_the_original(path, tmp_path):
    text = path.read_text()
    diffs = patchfile.parse(text)
    assert diffs and all(d.kind == "modify" for d in diffs)
    patchfile.check_tree(diffs, sdist_tree())
    results = {}
    for variant, patch in (("original", text), ("rewritten", patchfile.text(diffs))):
        _tree_of(diffs, tmp_path / variant)
        done = subprocess.run(["patch", "-p1", "--batch", "-d", str(tmp_path / variant)],
                              input=patch, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        results[variant] = {d.path: (tmp_path / variant / d.path).read_bytes() for d in diffs}
    assert results["original"] == results["rewritten"]


def test_text_before_and_between_the_sections_is_not_a_diff():
    kit_text = (ROOT / "labs" / "classroom" / "kit_files" / "patches" / COURSE).read_text()
    assert patchfile.parse(kit_text) == []
    wrapped = kit_text + "\n" + (ROOT / "labs" / "classroom" / "solution_files" / COURSE).read_text()
    assert [d.path for d in patchfile.parse(wrapped)] == ["horovod/torch/compression.py",
                                                         "horovod/torch/mpi_ops.py",
                                                         "horovod/torch/optimizer.py"]


GOOD = "--- a/horovod/torch/compression.py\n+++ b/horovod/torch/compression.py\n@@ -1 +1 @@\n-a\n+b\n"
HOSTILE = {
    "absolute": ("--- /etc/shadow\n+++ /etc/shadow\n@@ -1 +1 @@\n-a\n+b\n", "absolute path"),
    "dotdot": ("--- a/../../etc/shadow\n+++ b/../../etc/shadow\n@@ -1 +1 @@\n-a\n+b\n", "`..`"),
    "git_symlink": ("diff --git a/horovod/leak.py b/horovod/leak.py\nnew file mode 120000\n"
                    "index 0000000..1111111\n--- /dev/null\n+++ b/horovod/leak.py\n@@ -0,0 +1 @@\n"
                    "+/etc/shadow\n\\ No newline at end of file\n", "symbolic link"),
    "git_special": ("diff --git a/horovod/x b/horovod/x\nnew file mode 160000\n--- /dev/null\n"
                    "+++ b/horovod/x\n@@ -0,0 +1 @@\n+Subproject\n", "mode 160000"),
    "binary": ("diff --git a/horovod/a.so b/horovod/a.so\nGIT binary patch\nliteral 1\nIcmZ\n",
               "binary patch"),
    "binary_diff": ("Binary files a/horovod/a.so and b/horovod/a.so differ\n", "binary patch"),
    "rename": ("diff --git a/horovod/torch/compression.py b/horovod/torch/c.py\nsimilarity index 90%\n"
               "rename from horovod/torch/compression.py\nrename to horovod/torch/c.py\n", "renames"),
    "two_names": ("--- a/horovod/torch/compression.py\n+++ b/horovod/torch/mpi_ops.py\n@@ -1 +1 @@\n"
                  "-a\n+b\n", "a rename"),
    "context_diff": ("*** a/horovod/torch/compression.py\n--- b/horovod/torch/compression.py\n"
                     "***************\n", "context diff"),
    "short_hunk": ("--- a/horovod/torch/compression.py\n+++ b/horovod/torch/compression.py\n"
                   "@@ -1,3 +1,3 @@\n-a\n+b\n", "cut short"),
    "quoted": ('--- "a/horovod/torch/x y.py"\n+++ "b/horovod/torch/x y.py"\n@@ -1 +1 @@\n-a\n+b\n',
               "quoted"),
    "nul": ("--- a/horovod/torch/compression.py\n+++ b/horovod/torch/compression.py\n@@ -1 +1 @@\n"
            "-a\n+\0\n", "NUL"),
}
OUTSIDE = {
    "not_in_tree": ("--- a/horovod/torch/secret.py\n+++ b/horovod/torch/secret.py\n@@ -1 +1 @@\n-a\n+b\n",
                    "not one of Horovod 0.28.1's files"),
    "new_outside": ("--- /dev/null\n+++ b/elsewhere/x.py\n@@ -0,0 +1 @@\n+x\n", "outside Horovod"),
    "new_existing": ("--- /dev/null\n+++ b/setup.py\n@@ -0,0 +1 @@\n+x\n", "already holds"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_patch_is_refused_with_its_reason(name):
    text, words = HOSTILE[name]
    with pytest.raises(patchfile.PatchError) as refused:
        patchfile.check_tree(patchfile.parse(patchfile.decode(text.encode(), "p"), "p"), sdist_tree())
    assert words in refused.value.en, refused.value.en
    assert refused.value.zh


@pytest.mark.parametrize("name", OUTSIDE)
def test_a_patch_outside_horovods_tree_is_refused(name):
    text, words = OUTSIDE[name]
    with pytest.raises(patchfile.PatchError) as refused:
        patchfile.check_tree(patchfile.parse(text, "p"), sdist_tree(), "p")
    assert words in refused.value.en, refused.value.en


def test_a_new_file_inside_horovods_folders_is_taken():
    diffs = patchfile.parse("--- /dev/null\n+++ b/horovod/torch/bit8.py\n@@ -0,0 +1 @@\n+x = 1\n")
    patchfile.check_tree(diffs, sdist_tree())
    assert diffs[0].kind == "create" and patchfile.text(diffs).startswith("--- /dev/null\n+++ b/horovod/torch/bit8.py")


def test_non_utf8_is_refused():
    with pytest.raises(patchfile.PatchError, match="not UTF-8"):
        patchfile.decode(b"--- a/x\n\xff\n", "p")


# --- the course patch as a kit holds it: read by the grader, never through a link --------------

@pytest.fixture
def solution_kit(tmp_path):
    return classroom_kit.install_solution(classroom_kit.init(tmp_path / "kit"))


def _patch(kit):
    return kit / "patches" / COURSE


def test_the_solutions_patch_passes_and_takes_the_python_route(solution_kit):
    assert patch_check(solution_kit).passed
    prepared = prepare(solution_kit)
    assert prepared.ready and prepared.route == "python" and [n for n, _ in prepared.patches] == [COURSE]


def test_a_course_patch_that_is_a_link_to_the_graders_solution_is_refused(solution_kit):
    _patch(solution_kit).unlink()
    _patch(solution_kit).symlink_to(ROOT / "labs" / "classroom" / "solution_files" / COURSE)
    check = patch_check(solution_kit)
    assert not check.passed and "symbolic link" in check.en, check.en
    assert not prepare(solution_kit).ready


def test_a_patches_folder_that_is_a_link_is_refused(solution_kit, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (solution_kit / "patches").rename(elsewhere)
    (solution_kit / "patches").symlink_to(elsewhere)
    check = patch_check(solution_kit)
    assert not check.passed and "symbolic link" in check.en, check.en


def test_a_fifo_course_patch_is_refused_without_a_hang(solution_kit):
    _patch(solution_kit).unlink()
    os.mkfifo(_patch(solution_kit))
    found = []
    reader = threading.Thread(target=lambda: found.append(patch_check(solution_kit)), daemon=True)
    reader.start()
    reader.join(10)
    assert found, "patch_check hung on a FIFO"
    assert not found[0].passed and "a FIFO" in found[0].en, found[0].en


def test_a_device_course_patch_is_never_opened(solution_kit):
    _patch(solution_kit).unlink()
    os.mknod(_patch(solution_kit), stat.S_IFCHR | 0o600, os.makedev(1, 5))      # /dev/zero's
    check = patch_check(solution_kit)
    assert not check.passed and "a device" in check.en, check.en


def test_a_sparse_40_gib_course_patch_is_refused_without_reading_it(solution_kit):
    with open(_patch(solution_kit), "r+b") as handle:
        handle.truncate(40 << 30)
    check = patch_check(solution_kit)
    assert not check.passed and "larger than" in check.en and "KiB" in check.en, check.en


def test_a_course_patch_over_the_cap_is_refused(solution_kit):
    text = _patch(solution_kit).read_text()
    _patch(solution_kit).write_text(text + "#" * patchfile.MAX_BYTES)
    check = patch_check(solution_kit)
    assert not check.passed and "larger than" in check.en, check.en


def test_a_series_naming_a_patch_outside_the_kit_is_not_built(solution_kit):
    series = solution_kit / "patches" / "series"
    series.write_text(series.read_text() + "../../../etc/shadow\n")
    prepared = prepare(solution_kit)
    assert not prepared.ready
    build = {c.name: c for c in prepared.checks}["intree.build"]
    assert not build.passed and "patches/series names '../../../etc/shadow'" in build.en, build.en


def test_a_given_patch_that_is_a_link_is_not_built(solution_kit, tmp_path):
    given = solution_kit / "patches" / "build-cxx17.patch"
    secret = tmp_path / "secret.patch"
    secret.write_text(given.read_text())
    given.unlink()
    given.symlink_to(secret)
    prepared = prepare(solution_kit)
    build = {c.name: c for c in prepared.checks}["intree.build"]
    assert not prepared.ready and "symbolic link" in build.en, build.en


# --- nofollow: the reader and the writer of a kit's files ------------------------------------

def test_no_link_anywhere_below_the_kit_is_followed(tmp_path):
    kit, other = tmp_path / "kit", tmp_path / "other"
    (other / "runs" / "np2").mkdir(parents=True)
    (other / "runs" / "np2" / "steps-rank0.csv").write_text("theirs")
    (kit / "runs").mkdir(parents=True)
    (kit / "runs" / "grader-np2").symlink_to(other / "runs" / "np2")
    data, why = nofollow.read(kit, "runs/grader-np2/steps-rank0.csv", 1 << 20)
    assert data is None and "symbolic link" in why
    # the grader's own folder in the kit: the link is removed, never what it names
    folder = nofollow.replace_folder(kit, "runs/grader-np2")
    try:
        nofollow.write_at(folder, "steps-rank0.csv", b"the grader's")
    finally:
        os.close(folder)
    assert (other / "runs" / "np2" / "steps-rank0.csv").read_text() == "theirs"
    assert not (kit / "runs" / "grader-np2").is_symlink()
    assert (kit / "runs" / "grader-np2" / "steps-rank0.csv").read_text() == "the grader's"


def test_a_link_in_the_grader_s_folder_is_replaced_not_written_through(tmp_path):
    kit, victim = tmp_path / "kit", tmp_path / "victim.csv"
    victim.write_text("keep")
    (kit / "runs" / "grader-np2").mkdir(parents=True)
    (kit / "runs" / "grader-np2" / "steps-rank0.csv").symlink_to(victim)
    folder = nofollow.replace_folder(kit, "runs/grader-np2")
    try:
        nofollow.write_at(folder, "steps-rank0.csv", b"new")
    finally:
        os.close(folder)
    assert victim.read_text() == "keep"
    assert (kit / "runs" / "grader-np2" / "steps-rank0.csv").read_bytes() == b"new"


def test_head_and_tail_are_bounded(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"a" * 100 + b"b" * 100)
    assert nofollow.read(tmp_path, "log", 50, "head")[0] == b"a" * 50
    assert nofollow.read(tmp_path, "log", 50, "tail")[0] == b"b" * 50
    assert nofollow.read(tmp_path, "log", 50)[0] is None
