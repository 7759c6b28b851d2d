"""A dead or wedged rank ends a 2-process lab run, under Gloo and MPI, with a clear error,
no process left behind and the records written so far intact.

Each case starts a 5-epoch run, waits until both ranks are writing steps (a wedged case: until
rank 1 has written its first epoch's last step, so the stop meets the first evaluation or
checkpoint, whose limit is still start-up's), then sends rank 1 SIGKILL (dead) or SIGSTOP
(wedged: alive, silent).  A wedged rank under MPI would hang the job for good without the
lab's step watchdog.  The wedged cases run the watchdog's adaptive
limit (no --step-timeout) with its floor lowered from 20 s to FLOOR_S (--step-timeout-floor):
the run's steps are fast, so the floor is the limit, and the job must end with an error that
names rank 1 (issue 15) without waiting the default floor out; that the default limit (20 s
floor) ends a stall within 60 s is tests/test_watchdog.py's.  The four cases run overlapping
(CASES), each timed from its own signal; the measured seconds from the signal to the
launcher's exit are printed (pytest -s). The full disk's two serial runs start once the last
case has sent its signal, beside the cases' waits (DiskFull).
"""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import MNIST_DIR, ROOT

from labs.kit import runlog
from labs.kit.launch import horovodrun_command, launch_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TRAINER = str(ROOT / "labs" / "mnist.py")
STEP_TIMEOUT = 20        # the dead-rank cases fix it; the wedged ones run the adaptive limit
FLOOR_S = 5              # ... with this floor: a healthy step here takes well under 0.5 s
BOUND_S = 90            # launcher must be gone this long after the signal
WEDGED_BOUND_S = 60     # issue 15: a wedged rank ends the job within 60 s
START_TIMEOUT_S = 240   # slow shared machine: importing torch + Horovod on 2 ranks
EPOCH_ROWS = -(-8000 // (2 * 64))   # a rank's steps in an epoch: 8000 images, 2 ranks, 64 a batch
STEPS_PER_EPOCH = 20    # the full disk's run: a checkpoint fills the disk, not the step rows


# What each case's output must say.  A dead rank: the launcher names rank 1 and its SIGKILL
# (horovodrun's Gloo launcher: exit status 128 + 9; Open MPI: the signal); under Gloo rank 0's
# manifest names it too, from its heartbeat's pid (not "a deadlock?"), whether rank 0's failed
# collective or horovodrun's SIGTERM ended it first (only the former prints it).  A wedged rank: the
# lab's watchdog names the stall and the rank (issue 15).
WEDGED = ["no training step finished", "Stalled: rank 1"]
CAUSES = {("gloo", "kill"): ["Process 1 exit with status code 137"],
          ("mpi", "kill"): ["process rank 1 with PID", "exited on signal 9 (Killed)"],
          ("gloo", "stop"): WEDGED, ("mpi", "stop"): WEDGED}


def alive(pid):
    """True if `pid` runs (a zombie, already dead but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def steps_written(path):
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def wait_for_steps(proc, run_dir, rows=10, poll_s=0.5):
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before training (exit {proc.returncode}):\n"
                                 + proc.stdout.read()[-3000:])
        if all(steps_written(run_dir / f"steps_rank{r}.csv") >= rows for r in (0, 1)):
            return [int((run_dir / "pids" / f"rank{r}.pid").read_text()) for r in (0, 1)]
        time.sleep(poll_s)
    raise AssertionError(f"no steps written within {START_TIMEOUT_S} s")


# The four cases overlap: each starts when the one before has sent its signal, so its start-up
# (horovodrun, imports, Horovod's rendezvous, the first steps) runs while the one before waits
# for its watchdog and its launcher's teardown (horovodrun's Gloo launcher gives a stopped rank
# 5 s to answer SIGTERM before it kills it). The wedged cases go first: theirs are the longest
# waits. A case's own seconds are still counted from its own signal.
CASES = [("gloo", "stop"), ("mpi", "stop"), ("gloo", "kill"), ("mpi", "kill")]


class Case:
    """One 2-process run, its rank 1 killed or stopped, and what came of it (for the test to
    assert): the launcher's exit code and output, the seconds from the signal to its exit, the
    ranks left alive, or the error that stopped the case before its signal."""

    def __init__(self, controller, how, run_dir):
        self.controller, self.how, self.run_dir = controller, how, run_dir
        self.code = self.seconds = self.error = None
        self.output, self.pids, self.outlived = "", [], []
        self.signalled = threading.Event()          # set once signalled, or failed before

    def command(self):
        return horovodrun_command(2, [sys.executable, TRAINER, "--data-dir", str(MNIST_DIR),
                                      "--split-test", "8000", "--epochs", "5", "--lr", "0.1",
                                      "--model", "horovod", "--momentum", "0.5",
                                      "--bit8-allreduce", "--no-progress",
                                      "--out", str(self.run_dir)]
                                 + (["--step-timeout", str(STEP_TIMEOUT)] if self.how == "kill"
                                    else ["--step-timeout-floor", str(FLOOR_S)]),
                                 self.controller, cached_build_check=True)

    def run(self, after=None):
        """Wait for `after` (the case before) to have signalled, then run this case."""
        try:
            if after is not None:
                after.signalled.wait()
            self._run()
        except BaseException as err:                # the test re-raises it, named
            self.error = err
        finally:
            self.signalled.set()

    def _run(self):
        proc = subprocess.Popen(self.command(), env=launch_env(), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            # a wedged rank is stopped at the first epoch's end: the first evaluation and
            # checkpoint have no limit learnt yet (start-up's: 300 s), the hardest case
            self.pids = (wait_for_steps(proc, self.run_dir) if self.how == "kill" else
                         wait_for_steps(proc, self.run_dir, EPOCH_ROWS, poll_s=0.02))
            os.kill(self.pids[1], signal.SIGKILL if self.how == "kill" else signal.SIGSTOP)
            signalled = time.monotonic()
            self.signalled.set()
            try:
                self.code = proc.wait(timeout=BOUND_S)
            except subprocess.TimeoutExpired:
                self.code = None
            self.seconds = time.monotonic() - signalled
            self.output = proc.stdout.read() if self.code is not None else ""
            deadline = time.monotonic() + 15     # nothing of the run may be left alive
            while any(alive(p) for p in self.pids) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.outlived = [p for p in self.pids if alive(p)]
        finally:
            for pid in self.pids:                # never leave a stopped or orphaned rank behind
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if not self.output:                  # a launcher that outlived the bound: what
                self.output = said_so_far(proc)   # it said, for the failure's message
            proc.stdout.close()


def said_so_far(proc):
    """What a killed launcher wrote to its pipe, without waiting on a writer that outlived it."""
    fd, chunks = proc.stdout.fileno(), []
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks).decode(errors="replace")


class DiskFull:
    """The full disk's two serial runs (test_disk_full_keeps_the_checkpoint_and_resumes): made
    in a thread of their own, started by the cases' fixture once the last case has sent its
    signal (the cases then mostly wait), or by the test itself; what they left is kept for
    the test to assert (the error that stopped them included)."""

    def __init__(self, base):
        self.base, self.thread, self.error, self.found = base, None, None, {}

    def start(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def result(self):
        self.start()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.found

    def _run(self):
        try:
            self.found = fill_the_disk_and_resume(self.base)
        except BaseException as err:                # the test re-raises it
            self.error = err


@pytest.fixture(scope="module")
def disk_full(tmp_path_factory):
    """The full disk's runs, not started yet; ended before the module's teardown (its tmpfs
    unmounted) even where its test was not selected."""
    scenario = DiskFull(tmp_path_factory.mktemp("disk-full"))
    yield scenario
    if scenario.thread is not None:
        scenario.thread.join()


@pytest.fixture(scope="module")
def cases(tmp_path_factory, disk_full):
    """{(controller, how): Case}, the four run overlapping (CASES says how); the full disk's
    runs start once the last case has signalled (as root: they mount a tmpfs)."""
    done, threads, before = {}, [], None
    for controller, how in CASES:
        case = Case(controller, how, tmp_path_factory.mktemp(f"{controller}-{how}") / "run")
        thread = threading.Thread(target=case.run, args=(before,), daemon=True)
        thread.start()
        done[(controller, how)], before = case, case
        threads.append(thread)
    before.signalled.wait()
    if os.geteuid() == 0:
        disk_full.start()
    for thread in threads:
        thread.join()
    return done


@pytest.mark.parametrize("how", ["kill", "stop"])
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_dead_or_wedged_rank_ends_the_job(cases, controller, how):
    case = cases[(controller, how)]
    if case.error is not None:
        raise case.error
    code, seconds, output = case.code, case.seconds, case.output
    print(f"\n{controller} {how}: launcher exit {code} after {seconds:.1f} s")
    said = [line for line in output.splitlines() if "watchdog" in line or "no training step" in line]
    print("\n".join(said))
    assert code is not None, (f"launcher still running {BOUND_S} s after SIG{how.upper()}; "
                              f"its output:\n{output[-3000:]}")
    assert code != 0
    # a clear error that names the cause: the launcher saying rank 1 was killed, or the
    # lab's watchdog naming the wedged rank
    for cause in CAUSES[(controller, how)]:
        assert cause in output, f"{cause!r} not in:\n{output[-3000:]}"
    if how == "stop":
        assert seconds < WEDGED_BOUND_S, (f"{seconds:.0f} s from the stall to the end; "
                                              f"the watchdog said:\n" + "\n".join(said))
    assert not case.outlived, "a rank outlived its launcher"
    # the run says it did not complete, and what it wrote before the failure is readable
    manifest = runlog.read_manifest(case.run_dir)
    assert manifest is not None and manifest["status"] != "complete"
    print(f"  manifest status {manifest['status']!r}: {manifest.get('reason')}")
    if (controller, how) == ("gloo", "kill"):
        assert manifest["status"] == "failed", manifest
        assert "Dead: rank 1 (process" in manifest.get("reason", ""), manifest.get("reason")
    for r in (0, 1):
        steps = pd.read_csv(case.run_dir / f"steps_rank{r}.csv")
        assert len(steps) >= 10 and steps["loss"].notna().all()
        assert list(steps.columns) == runlog.STEP_COLUMNS


def fill_the_disk_and_resume(base):
    """--out on a 360 KiB tmpfs, 3 epochs: what the run that fills it left (its exit, output,
    manifest, checkpoint's epoch, temp files), then a copy of it on a roomy disk resumed."""
    import shutil
    disk = base / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=360k", "tmpfs", str(disk)], check=True)
    flags = [sys.executable, TRAINER, "--data-dir", str(MNIST_DIR), "--split-test", "8000",
             "--epochs", "3", "--lr", "0.1", "--no-progress", "--model", "horovod", "--momentum", "0.5",
             "--steps-per-epoch", str(STEPS_PER_EPOCH)]
    found = {}
    try:
        found["full"] = subprocess.run(flags + ["--out", str(disk / "run")], env=launch_env(),
                                       cwd=ROOT, capture_output=True, text=True, timeout=600)
        found["manifest"] = runlog.read_manifest(disk / "run")
        found["checkpoint_epoch"] = runlog.load_checkpoint(disk / "run" / "checkpoint.pt")["epoch"]
        found["temp_files"] = list((disk / "run").glob(".checkpoint.pt.*"))
        shutil.copytree(disk / "run", base / "roomy")
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    found["resumed"] = subprocess.run(flags + ["--out", str(base / "roomy"), "--resume"],
                                      env=launch_env(), cwd=ROOT, capture_output=True,
                                      text=True, timeout=600)
    found["roomy"] = base / "roomy"
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a disk that fills up) needs root")
def test_disk_full_keeps_the_checkpoint_and_resumes(disk_full):
    """--out on a 360 KiB tmpfs: epoch 1's checkpoint fits, epoch 2's does not (issue 15: disk
    trouble). The run ends with a clear error and exit 3, epoch 1's checkpoint intact; copied
    to a roomy disk, --resume finishes the run with every step recorded once. The disk fills
    with checkpoints (the small network and its momentum, 186 KB each: the second beside the
    first does not fit), not with step rows: STEPS_PER_EPOCH steps an epoch suffice. (The runs
    are made beside the dead and wedged cases: DiskFull.)"""
    found = disk_full.result()
    full = found["full"]
    assert full.returncode == 3, full.stdout[-2000:] + full.stderr[-2000:]
    assert "No space left on device" in full.stdout and "--resume" in full.stdout, full.stdout[-2000:]
    manifest = found["manifest"]
    assert manifest["status"] == "failed" and "cannot write the run's records" in manifest["reason"]
    assert manifest["epochs_completed"] == 1
    assert found["checkpoint_epoch"] == 1
    assert not found["temp_files"]                                     # no torn temp file left
    resumed, roomy = found["resumed"], found["roomy"]
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert runlog.read_manifest(roomy)["status"] == "complete"
    steps = pd.read_csv(roomy / "steps_rank0.csv")
    assert not steps.duplicated(["epoch", "batch"]).any()
    assert sorted(steps.epoch.unique()) == [1, 2, 3] and len(steps) == 3 * STEPS_PER_EPOCH
    assert list(pd.read_csv(roomy / "epochs.csv").epoch) == [1, 2, 3]
