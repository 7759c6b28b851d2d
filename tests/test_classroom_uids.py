"""The sandboxes' user ids (labs/classroom/uids.py), one process: each id held by an flock on a
file of its own while its sandbox runs, which another open of the file (another grader, or this
one) cannot take; an id a live process still runs as is skipped; a lock folder another user
could write is refused. tests/test_classroom_graders_at_once.py runs two real graders at once."""
import fcntl
import os
import subprocess
import time

import pytest

from labs.classroom import uids

pytestmark = pytest.mark.unit


@pytest.fixture
def locks(tmp_path, monkeypatch):
    folder = tmp_path / "run" / "uids"
    folder.parent.mkdir(mode=0o755)
    monkeypatch.setattr(uids, "LOCKS", folder)
    return folder


def _taken_elsewhere(folder, uid):
    """Whether another open of uid's lock file (another grader's) finds it held."""
    fd = os.open(folder / str(uid), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_an_id_is_held_while_its_sandbox_runs_and_free_after(locks):
    first, second = uids.take(), uids.take()
    try:
        assert first != second and uids.LOW <= min(first, second) < uids.LOW + uids.POOL
        assert _taken_elsewhere(locks, first) and _taken_elsewhere(locks, second)
    finally:
        uids.give_back(first)
        uids.give_back(second)
    assert not _taken_elsewhere(locks, first)
    assert {first, second} <= uids.used() and not ({first, second} & uids.held())


def test_an_id_another_grader_holds_is_never_given(locks):
    probe = uids.take()
    uids.give_back(probe)
    locks.mkdir(exist_ok=True)
    others = []
    for step in range(1, 4):                # another grader holds the next ids this one would take
        uid = uids.LOW + (probe - uids.LOW + step) % uids.POOL
        fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        others.append((uid, fd))
    try:
        got = uids.take()
        uids.give_back(got)
        assert got not in {uid for uid, _ in others}
    finally:
        for _, fd in others:
            os.close(fd)


def test_an_id_a_live_process_still_runs_as_is_skipped(locks):
    probe = uids.take()
    uids.give_back(probe)
    nxt = uids.LOW + (probe - uids.LOW + 1) % uids.POOL
    left = subprocess.Popen(["setpriv", f"--reuid={nxt}", f"--regid={nxt}", "--clear-groups",
                             "sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while nxt not in uids._live_uids() and time.monotonic() < deadline:
            time.sleep(0.01)
        got = uids.take()
        uids.give_back(got)
        assert got != nxt
    finally:
        left.kill()
        left.wait()


@pytest.mark.parametrize("how", ["others_write", "a_link"])
def test_a_lock_folder_another_user_could_write_is_refused(locks, tmp_path, how):
    if how == "others_write":
        locks.mkdir(mode=0o777)
        locks.chmod(0o777)
    else:
        (tmp_path / "elsewhere").mkdir()
        locks.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(uids.UidError, match="only root may write"):
        uids.take()
