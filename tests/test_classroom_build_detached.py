"""Step 3b's full build, in a kit's sandbox, when the student's setup.py leaves a process behind:
a double-forked sleeper of a session of its own that keeps a pipe of the build open (its
inherited stdout and stderr: the pipe pip reads setup.py's output from; or, reopened through
/proc, the pipe the build side reads pip's output from). Every writer of a pipe must close it
before its reader sees its end, so pip (or the build side) waited for the sleeper, and the
build lasted to its time limit (build_timeout, 30 minutes) instead of ending with its setup.py.

Each test builds with a short limit (BUILD_S) so that it fails fast: the build must end within
seconds of its setup.py, with setup.py's own error as its reason, the process it left behind
counted, and nothing of it left running."""
import difflib
import shutil
import tempfile
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom import pristine, sandbox
from labs.classroom.checks import ok
from labs.classroom.intree import SITE, Prepared, build_task, built
from labs.classroom.kit import COURSE_PATCH
from labs.classroom.kit_runs import release, run_tasks

pytestmark = pytest.mark.build              # pip runs the kit's setup.py in its sandbox

BUILD_S = 60                                # the build's limit here (the grader's: 1800 s)
ENDS_WITHIN_S = 25                          # a copy of the sdist, `patch`, pip's start: seconds

# what a student's patch puts first in Horovod's setup.py
SLEEPERS = {
    "holds_pips_pipe": '''import os as _os, sys as _sys, time as _time
if _os.fork() == 0:                         # detached, with setup.py's stdout and stderr
    _os.setsid()
    if _os.fork() == 0:
        _time.sleep(10 ** 6)
    _os._exit(0)
print("error: hostile setup.py left a sleeper", file=_sys.stderr, flush=True)
_sys.exit(1)
''',
    "holds_the_build_sides_pipe": '''import os as _os, sys as _sys, time as _time
_pip = _os.getppid()
if _os.fork() == 0:                         # detached, with pip's own stdout (the build side's pipe)
    _os.setsid()
    if _os.fork() == 0:
        _held = _os.open(f"/proc/{_pip}/fd/1", _os.O_WRONLY)
        _null = _os.open("/dev/null", _os.O_WRONLY)
        _os.dup2(_null, 1)                  # pip's pipe let go: only the build side's is held
        _os.dup2(_null, 2)
        _time.sleep(10 ** 6)
    _os._exit(0)
print("error: hostile setup.py left a sleeper", file=_sys.stderr, flush=True)
_sys.exit(1)
''',
}


@pytest.fixture(scope="module")
def base():
    if sandbox.available():
        pytest.skip(sandbox.available())
    folder = Path(tempfile.mkdtemp(prefix="classroom-detached-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _prepared(code):
    """A kit's step 3b as intree.prepare makes it for a patch of setup.py: the full route."""
    old = (pristine.folder() / "src" / pristine.TOP / "setup.py").read_text().splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(old, code.splitlines(keepends=True) + old,
                                        "a/setup.py", "b/setup.py"))
    return Prepared([ok("intree", "intree.patch")], True, SITE, "full", [(COURSE_PATCH, diff)])


@pytest.mark.parametrize("name", sorted(SLEEPERS))
def test_a_build_ends_with_its_setup_py_not_with_the_process_it_left(base, name):
    kit = classroom_kit.init(base / name / "kit")
    work = base / name / "work"
    work.mkdir(mode=0o711)
    prepared = _prepared(SLEEPERS[name])
    try:
        runs = run_tasks(kit, work, [build_task(prepared, BUILD_S)])
        run = runs["build"]
        check = built(prepared, run).checks[1]
    finally:
        release(work)
    outcome = run.outcome
    assert outcome.killed_by != "timeout", (f"the build waited {outcome.seconds:.0f} s, to its "
                                            f"limit, for the process its setup.py left")
    assert outcome.seconds < ENDS_WITHIN_S, outcome.seconds
    assert not check.passed and "hostile setup.py left a sleeper" in check.en, check.en
    assert outcome.left_behind >= 1 and "left running on its own was stopped" in check.en, check.en
    assert check.zh and "已终止" in check.zh
    assert sandbox.processes_left() == []
