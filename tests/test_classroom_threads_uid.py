"""The grader grades kits in threads, each kit's runs in a sandbox whose processes run as a user
id of their own (sandbox.new_uid): RLIMIT_NPROC counts a user's processes, so a kit's fork
bomb must count against its own sandbox only. These tests run sandbox.run with bwrap's start
replaced by a stand-in that records the user id it was given and holds the "sandbox" open as
long as the test says: one kit's long sandbox (a full Horovod build takes minutes) while
another thread's kits come and go, as a class with one slow kit does."""
import threading
import time

import pytest

from labs.classroom import sandbox

pytestmark = pytest.mark.unit


class _Group:
    idle, memory = None, True

    def __init__(self, *args, **kwargs):
        pass

    def oom_killed(self):
        return False

    def cpu_seconds(self):
        return None

    def close(self):
        pass


@pytest.fixture
def fake_bwrap(monkeypatch):
    """{"live": uids of the sandboxes running now, "clashes": a uid given to a sandbox while
    another one still ran as it}; Popen(argv) with "hold" in argv waits for the event."""
    state = {"live": [], "clashes": [], "release": threading.Event(), "started": threading.Event()}
    lock = threading.Lock()

    class Popen:
        def __init__(self, argv, **kwargs):
            self.pid = 1 << 22
            self.uid = int(next(a for a in argv if a.startswith("--reuid=")).split("=")[1])
            self.hold = "hold" in argv
            with lock:
                if self.uid in state["live"]:
                    state["clashes"].append(self.uid)
                state["live"].append(self.uid)
            if self.hold:
                state["started"].set()

        def wait(self, timeout=None):
            if self.hold:
                state["release"].wait(10)
            with lock:
                state["live"].remove(self.uid)
            return 0

    monkeypatch.setattr(sandbox, "available", lambda: None)
    monkeypatch.setattr(sandbox, "hand_over", lambda folder, uid: None)
    monkeypatch.setattr(sandbox, "mounts", lambda *args, **kwargs: [])
    monkeypatch.setattr(sandbox, "_Cgroup", _Group)
    monkeypatch.setattr(sandbox.subprocess, "Popen", Popen)
    return state


def _run(tmp_path, name, *argv):
    folder = tmp_path / name
    dirs = {n: folder / n for n in ("kit", "out", "tmp", "grader")}
    for d in dirs.values():
        d.mkdir(parents=True)
    return sandbox.run(["python", *argv], kit_copy=dirs["kit"], out_dir=dirs["out"],
                       tmp_dir=dirs["tmp"], grader_dir=dirs["grader"], log_path=folder / "log")


def test_a_sandbox_keeps_its_user_id_to_itself_while_other_kits_come_and_go(tmp_path, fake_bwrap):
    slow = threading.Thread(target=_run, args=(tmp_path, "slow", "hold"))
    slow.start()
    try:
        assert fake_bwrap["started"].wait(10)
        for i in range(40):                 # the other threads' kits, one after another
            assert _run(tmp_path, f"quick{i}").status == 0
    finally:
        fake_bwrap["release"].set()
        slow.join()
    assert fake_bwrap["clashes"] == [], "a sandbox ran as the user id of one still running"


def test_sixteen_sandboxes_at_once_each_run_as_a_user_of_its_own(tmp_path, fake_bwrap):
    threads = [threading.Thread(target=_run, args=(tmp_path, f"kit{i}", "hold")) for i in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(fake_bwrap["live"]) < 16 and time.monotonic() < deadline:
        time.sleep(0.01)
    running = len(fake_bwrap["live"])
    fake_bwrap["release"].set()
    for t in threads:
        t.join()
    assert running == 16
    assert fake_bwrap["clashes"] == []
