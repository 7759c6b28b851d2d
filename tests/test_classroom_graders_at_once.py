"""Two grader processes on one machine, each the PID 1 of a PID namespace of its own, as a
grader is in a container of its own (the same pid every time it starts): two real Python
processes running the grader's sandbox.py, their kits in real bubblewrap sandboxes.

- At once: their kits' sandboxes never run as the same user id (RLIMIT_NPROC counts a user's
  processes machine-wide: a kit's fork bomb beside another kit of the same id would spend
  that kit's processes). Graders whose pids were equal modulo 50000 shared one pool of ids.
- One after the other, the first killed while its kit ran (a grader that crashed, before it
  closed its kit's cgroups): the second's kit runs with every limit of its own cgroup (its
  memory, its processes, its CPU share), whatever the crashed grader left. A cgroup folder
  already there was skipped, silently, and the kit ran without them.

Then, in this process, the two ways such a folder can be met now that it is named for the
sandbox's user id (sandbox.cgroup_name): with a process of the dead grader's kit still in it
(killed, the folder made afresh), and one that cannot be removed (a process frozen in it: the
grading stops, saying which folder and what to do).
"""
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from labs.classroom import sandbox

pytestmark = pytest.mark.interpreter       # grader processes of their own, sandboxed Pythons

ROOT = Path(__file__).resolve().parents[1]
LIMITS = sandbox.Limits(seconds=60, memory=768 << 20, tasks=300)

# A grader in a PID namespace of its own (ctypes: Python 3.11 has no os.unshare): the process
# forks once, its child is that namespace's PID 1 and runs the grader's sandbox: one kit's
# sandbox, whose Python prints its user id and waits for /grader/go (made by the grader when
# the test says so on its stdin). The grader prints its host pid, the sandbox's user id, then
# (with "limits") the cgroup limits its sandbox's processes run under, read from the host.
GRADER = r'''
import ctypes, json, os, sys, threading, time
from pathlib import Path
CLONE_NEWPID = 0x20000000
if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWPID) != 0:
    sys.exit(f"unshare(CLONE_NEWPID): errno {ctypes.get_errno()}")
child = os.fork()
if child:
    _, status = os.waitpid(child, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
assert os.getpid() == 1, os.getpid()
print("host pid", os.readlink("/proc/self"), flush=True)
from labs.classroom import sandbox

work, show_limits = Path(sys.argv[1]), sys.argv[2] == "limits"
folders = {n: work / n for n in ("kit", "out", "tmp", "grader")}
for folder in folders.values():
    folder.mkdir(parents=True)
os.chmod(folders["grader"], 0o755)
probe = ("import os, time\nprint('uid', os.getuid(), flush=True)\n"
         "while not os.path.exists('/grader/go'):\n    time.sleep(0.05)\n")
limits = sandbox.Limits(seconds=60, memory=MEMORY, tasks=TASKS)
ended = []
thread = threading.Thread(target=lambda: ended.append(sandbox.run(
    [sys.executable, "-c", probe], kit_copy=folders["kit"], out_dir=folders["out"],
    tmp_dir=folders["tmp"], grader_dir=folders["grader"], limits=limits, log_path=work / "log")))
thread.start()
deadline = time.monotonic() + 60
log = ""
while "uid" not in log:
    assert time.monotonic() < deadline and thread.is_alive(), f"the sandbox did not start: {log}"
    time.sleep(0.05)
    log = (work / "log").read_text() if (work / "log").exists() else ""
uid = int(log.split("uid")[1].split()[0])
print("uid", uid, flush=True)


if show_limits:
    print("limits", json.dumps(sandbox_limits(uid)), flush=True)
sys.stdin.readline()
(folders["grader"] / "go").touch()
thread.join()
print("ended", ended[0].status, ended[0].killed_by, flush=True)
'''


def sandbox_limits(uid):
    """{pid: the limits its cgroups hold} of every process running as `uid` (a sandbox's), read
    on the host: its memory group's limit, its pids group's, and whether it has a CPU group
    other than the grader's own (this process's)."""
    import os

    def controller_file(pid, controller, name):
        for line in open(f"/proc/{pid}/cgroup"):
            _, names, path = line.rstrip("\n").split(":", 2)
            if controller in names.split(","):
                try:
                    return open(f"/sys/fs/cgroup/{controller}{path}/{name}").read().strip()
                except OSError:
                    return None
        return None

    own_cpu = [line for line in open("/proc/self/cgroup") if ":cpu:" in line]
    found = {}
    for pid in os.listdir("/proc"):
        try:
            if not pid.isdigit() or open(f"/proc/{pid}/status").read().split("Uid:")[1].split()[0] != str(uid):
                continue
            found[pid] = {"memory": controller_file(pid, "memory", "memory.limit_in_bytes"),
                          "pids": controller_file(pid, "pids", "pids.max"),
                          "cpu_own_group": [line for line in open(f"/proc/{pid}/cgroup")
                                            if ":cpu:" in line] != own_cpu}
        except OSError:
            continue
    return found


GRADER = (GRADER.replace("MEMORY", str(LIMITS.memory)).replace("TASKS", str(LIMITS.tasks))
          .replace("from labs.classroom import sandbox\n",
                   "from labs.classroom import sandbox\n" + inspect.getsource(sandbox_limits)))
WANTED = {"memory": str(LIMITS.memory), "pids": str(LIMITS.tasks), "cpu_own_group": True}


@pytest.fixture
def base():
    """A folder the sandboxes' users may pass; at the end, the cgroups a killed grader of the
    test left are removed (a live one, a process in it, refuses: EBUSY)."""
    if sandbox.available():
        pytest.skip(sandbox.available())
    folder = Path(tempfile.mkdtemp(prefix="classroom-graders-"))
    folder.chmod(0o755)                 # the sandbox's user passes it to its folders
    before = _our_groups()
    yield folder
    for group in sorted(_our_groups() - before, key=lambda f: -len(f.name)):
        try:
            group.rmdir()
        except OSError:
            pass
    shutil.rmtree(folder, ignore_errors=True)


class Grader:
    def __init__(self, work, limits=False):
        self.proc = subprocess.Popen([sys.executable, "-c", GRADER, str(work), "limits" if limits else "-"],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.host_pid = int(self.line("host pid"))     # its namespace's PID 1, as the host sees it

    def line(self, word):
        """The value after `word` on the grader's next line that starts with it."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(10)
                raise AssertionError(f"the grader ended before {word!r}: {self.proc.stderr.read()[-3000:]}")
            if line.startswith(word + " "):
                return line[len(word) + 1:].strip()

    def finish(self):
        out, err = self.proc.communicate("go\n", timeout=60)
        assert self.proc.returncode == 0, err[-3000:]
        return out

    def kill(self):
        """Its namespace's PID 1 killed (and with it the namespace, its sandbox), then itself;
        the PID 1 only while it is still its child (its pid is not another's yet)."""
        try:
            stat = Path(f"/proc/{self.host_pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                os.kill(self.host_pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
        self.proc.kill()
        self.proc.wait(10)


def _live(uid):
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if text.split("Uid:")[1].split()[0] == str(uid) and "State:\tZ" not in text:
            found.append(status.parent.name)
    return found


CONTROLLERS = ("cpu", "cpuacct", "memory", "pids")


def _our_groups():
    """The sandboxes' cgroup folders there are now, below the grader's own groups (v1)."""
    own, found = sandbox._own_groups(), set()
    for controller in CONTROLLERS:
        base = Path("/sys/fs/cgroup") / controller / own.get(controller, "").strip("/")
        found |= set(base.glob("hvd-classroom-*"))
    return found


def test_two_graders_at_once_never_give_two_kits_one_user_id(base):
    first, second = Grader(base / "a"), Grader(base / "b")
    try:
        uids = [int(first.line("uid")), int(second.line("uid"))]
        assert uids[0] != uids[1], (f"two graders' kits, running at once, both ran as user id "
                                    f"{uids[0]}")
        for grader in (first, second):
            assert "ended 0 " in grader.finish() + " "
    finally:
        first.kill()
        second.kill()
    assert not any(_live(uid) for uid in uids)


def test_a_kit_after_a_crashed_grader_runs_with_the_limits_of_its_own_cgroup(base):
    before = _our_groups()
    crashed = Grader(base / "crashed")
    try:
        uid = int(crashed.line("uid"))
        os.kill(crashed.host_pid, signal.SIGKILL)       # its PID namespace, its sandbox with it
        deadline = time.monotonic() + 20
        while _live(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _live(uid), "the crashed grader's sandbox outlived it"
    finally:
        crashed.kill()
    left = _our_groups() - before
    if not any("/memory/" in str(folder) for folder in left):
        pytest.skip("this host gives the sandboxes no v1 memory cgroup: nothing is left to test")
    nxt = Grader(base / "next", limits=True)
    try:
        uid = int(nxt.line("uid"))
        found = json.loads(nxt.line("limits"))
        assert found, "no process of the kit's sandbox was seen"
        for pid, limits in found.items():
            assert limits == WANTED, f"process {pid} of the kit's sandbox ran without its limits: {limits}"
        assert "ended 0 " in nxt.finish() + " "
    finally:
        nxt.kill()
    assert not _live(uid)


# --- a cgroup an earlier grading left, in-process: its name is the sandbox's user id ---------

PROBE = ("import os, time\nprint('uid', os.getuid(), flush=True)\n"
         "while not os.path.exists('/grader/go'):\n    time.sleep(0.05)\n")


def _stale(uid):
    """The cgroup folders a grader killed while its sandbox of `uid` ran leaves: {controller:
    folder} (v1), made here; {} where this host mounts no v1 memory controller."""
    own, made = sandbox._own_groups(), {}
    if not Path("/sys/fs/cgroup/memory/cgroup.procs").is_file():
        return made
    for controller in CONTROLLERS:
        base = Path("/sys/fs/cgroup") / controller / own.get(controller, "").strip("/")
        if (base / "cgroup.procs").is_file():
            made[controller] = base / sandbox.cgroup_name(uid)
            made[controller].mkdir()
    if "cpu" in made:
        made["idle"] = made["cpu"].with_name(made["cpu"].name + "-idle")
        made["idle"].mkdir()
    return made


def _run_probe(base, uid):
    """sandbox.run of PROBE as `uid`, in a thread: (thread, grader folder, ended)."""
    folders = {n: base / n for n in ("kit", "out", "tmp", "grader")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    folders["grader"].chmod(0o755)
    ended = []

    def body():
        try:
            ended.append(sandbox.run([sys.executable, "-c", PROBE], kit_copy=folders["kit"],
                                     out_dir=folders["out"], tmp_dir=folders["tmp"],
                                     grader_dir=folders["grader"], limits=LIMITS,
                                     log_path=base / "log", uid=uid))
        except sandbox.SandboxError as err:
            ended.append(err)
    thread = threading.Thread(target=body)
    thread.start()
    return thread, folders["grader"], ended


def test_a_cgroup_left_with_a_process_in_it_is_emptied_and_the_kit_gets_its_limits(base):
    uid = sandbox.new_uid()
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        stale = _stale(uid)
        if not stale:
            pytest.skip("no v1 memory cgroup on this host")
        (stale["memory"] / "cgroup.procs").write_text(str(sleeper.pid))   # the dead grader's kit's
        thread, grader, ended = _run_probe(base, uid)
        deadline = time.monotonic() + 60
        while not (base / "log").exists() or "uid" not in (base / "log").read_text():
            assert thread.is_alive() and time.monotonic() < deadline, ended
            time.sleep(0.05)
        found = sandbox_limits(uid)
        (grader / "go").touch()
        thread.join(60)
        assert found and all(limits == WANTED for limits in found.values()), found
        assert ended[0].status == 0, ended
        assert sleeper.wait(10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
        sandbox.free_uid(uid)


def test_a_cgroup_left_that_cannot_be_removed_stops_the_grading_saying_why(base):
    """A process frozen in it (the freezer's: a SIGKILL waits for its thaw) keeps the folder:
    the sandbox is refused, with the folder named, and no group of it is left made."""
    freezer = Path("/sys/fs/cgroup/freezer/hvd-classroom-test-frozen")
    if not Path("/sys/fs/cgroup/freezer/cgroup.procs").is_file():
        pytest.skip("no v1 freezer on this host")
    uid = sandbox.new_uid()
    sleeper = subprocess.Popen(["sleep", "600"])
    freezer.mkdir()
    try:
        stale = _stale(uid)
        if not stale:
            pytest.skip("no v1 memory cgroup on this host")
        (freezer / "cgroup.procs").write_text(str(sleeper.pid))
        (freezer / "freezer.state").write_text("FROZEN")
        (stale["memory"] / "cgroup.procs").write_text(str(sleeper.pid))
        for controller in ("cpu", "cpuacct", "pids", "idle"):    # those alone can be made afresh
            if controller in stale:
                stale[controller].rmdir()
        thread, grader, ended = _run_probe(base, uid)
        thread.join(60)
        assert isinstance(ended[0], sandbox.SandboxError), ended
        assert (f"{stale['memory']} is left from an earlier grading and cannot be removed"
                in str(ended[0])), ended[0]
        assert not (base / "log").exists() or "uid" not in (base / "log").read_text()
        assert not [c for c in stale if c != "memory" and stale[c].exists()]
    finally:
        (freezer / "freezer.state").write_text("THAWED")
        sleeper.kill()
        sleeper.wait()
        for folder in [*_stale_folders(uid), freezer]:
            try:
                folder.rmdir()
            except OSError:
                pass
        sandbox.free_uid(uid)


def _stale_folders(uid):
    own = sandbox._own_groups()
    found = []
    for controller in CONTROLLERS:
        folder = Path("/sys/fs/cgroup") / controller / own.get(controller, "").strip("/") / sandbox.cgroup_name(uid)
        found += [folder.with_name(folder.name + "-idle"), folder]
    return [f for f in found if f.exists()]
