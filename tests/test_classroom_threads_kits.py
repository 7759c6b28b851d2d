"""grade() grades its kits in threads, and a kit's grading writes into the kit's folder (the
grader's trainer logs, copied back into runs/grader-np<n>, then read by the logs check). A kit
named twice (a class's folder and one of its kits, `grade class/ class/alice`) was graded by two
threads at once: one thread's copy removed the logs the other had just written, before the
other read them. These tests run grade() with the sandbox's start stubbed out and each kit's
grading replaced by those two real steps (grade._copy_logs_back, then job_checks.log_check),
the second thread's copy made while the first reads, as the threads can interleave."""
import threading
from types import SimpleNamespace

import pytest

from labs.classroom import grade as grader, nofollow
from labs.classroom.job_checks import log_check

pytestmark = pytest.mark.unit

STEPS = "epoch,step,seconds,loss,size\n1,0,0.05,2.3,2\n1,1,0.05,2.2,2\n"
EPOCHS = "epoch,test_loss,test_accuracy,size\n1,0.9,0.6,2\n"


def _sandbox_copy(folder):
    logs = folder / "runs" / "grader-np2"
    logs.mkdir(parents=True)
    for r in (0, 1):
        (logs / f"steps-rank{r}.csv").write_text(STEPS)
    (logs / "epochs-rank0.csv").write_text(EPOCHS)
    return SimpleNamespace(kit_copy=folder)


@pytest.fixture
def graded_twice(tmp_path, monkeypatch):
    """grade() whose kits' grading copies the logs back and checks them: the first thread to
    copy reads its logs only once a second thread (the same kit's, if any) has started to
    copy its own (or 2 s have passed)."""
    run = _sandbox_copy(tmp_path / "sandbox-kit")
    lock, order = threading.Lock(), []
    copied, second_copying, checked = threading.Event(), threading.Event(), threading.Event()
    write_at = nofollow.write_at

    def paused_write_at(folder, name, data):
        if threading.current_thread() is not order[0]:
            second_copying.set()            # its unlinks of the old logs are done
            checked.wait(2)
        return write_at(folder, name, data)

    def grade_kit(kit, options, work, test_set, hide=None):
        with lock:
            order.append(threading.current_thread())
            first = order[0] is threading.current_thread()
        if not first:
            copied.wait(2)
        log_dir = grader._copy_logs_back(run, kit, 2)
        if first:
            copied.set()
            second_copying.wait(2)
        check = log_check("trainer.np2.logs", log_dir, 2)
        if first:
            checked.set()
        return [check]

    monkeypatch.setattr(nofollow, "write_at", paused_write_at)
    monkeypatch.setattr(grader, "grade_kit", grade_kit)
    monkeypatch.setattr(grader.sandbox, "available", lambda: None)
    monkeypatch.setattr(grader.sandbox, "canary", lambda work: None)
    monkeypatch.setattr(grader.pristine, "folder", lambda: None)
    monkeypatch.setattr(grader, "held_out_labels", lambda work, data_dir=None: {})
    return lambda kits: grader.grade(kits, grader.Options(steps=("exchange",), parallel=3))


def test_a_kit_named_twice_is_graded_once_and_its_logs_check_passes(tmp_path, graded_twice):
    kit = tmp_path / "class" / "alice"
    kit.mkdir(parents=True)
    results = graded_twice([kit, tmp_path / "class" / ".." / "class" / "alice"])
    assert len(results) == 2
    for checks in results.values():
        assert [(c.name, c.passed, c.en) for c in checks] == [("trainer.np2.logs", True, "")]


def test_two_kits_are_each_graded(tmp_path, graded_twice):
    kits = [tmp_path / "alice", tmp_path / "bob"]
    for kit in kits:
        kit.mkdir()
    results = graded_twice(kits)
    assert list(results) == kits and all(c.passed for checks in results.values() for c in checks)
    assert all((kit / "runs" / "grader-np2" / "steps-rank1.csv").read_text() == STEPS for kit in kits)
