"""The fork server of a kit's sandbox (labs/classroom/fork_server.py): what a kit's own runs can
do to it and to each other, now that they share one sandbox and one parent.

A kit planted with code that runs when compression.py is imported (in step 2's run and on every
rank) tries each thing below; the solution underneath must still be graded as the solution, run
by run: step 2's calls, then the exchange on 2 ranks, then on 4 (the same exchange: no trainer,
to keep the file cheap).
"""
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit
from labs.classroom import sandbox
from labs.classroom.grade import Options, codec_step, codec_task, job_collect, job_task, judge_route
from labs.classroom.kit_runs import release, run_tasks

pytestmark = pytest.mark.multiprocess      # Horovod ranks forked in a sandbox

OPTIONS = Options(steps=("codecs", "exchange"), codec_timeout=60, task_timeout=90)

# code run at every import of compression.py; IN_CALLS / RANK tell which run imports it
PREAMBLE = '''
import os, sys, time, glob, signal
IN_CALLS = len(sys.argv) > 1 and sys.argv[1] == "calls"
RANK = os.environ.get("HOROVOD_RANK")
SIZE = os.environ.get("HOROVOD_SIZE")
'''

TRICKS = {
    # every signal it can send at the fork server (PID 1, and its parent), from every run
    "signal_the_server": '''
for _pid in {1, os.getppid()}:
    for _sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        try:
            os.kill(_pid, _sig)
        except OSError:
            pass
''',
    # a process forked away (twice, in a session of its own) from step 2's run and from rank 1
    # of the 2-rank job, writing garbage into every later run's output folder for a minute
    # (the earlier runs' are the kit's own to spoil, as its outputs are in any run)
    "fork_away": '''
if IN_CALLS or (RANK == "1" and SIZE == "2"):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            _mine = os.path.dirname(sys.argv[-1]) if IN_CALLS else sys.argv[-1]
            open(os.path.join(_mine, "away-started"), "w").close()
            _end, _before = time.time() + 60, set(glob.glob("/out/*/"))
            while time.time() < _end:
                for _out in glob.glob("/out/*/"):
                    if _out not in _before:
                        for _name in ("rank0.json", "rank1.json", "rank2.json", "rank3.json", "results.json"):
                            try:
                                with open(os.path.join(_out, _name), "w") as _f:
                                    _f.write("{forged")
                            except OSError:
                                pass
                time.sleep(0.01)
        os._exit(0)
    time.sleep(0.5)                       # the forked-away process has started
''',
}


def _plant(folder, code):
    kit = classroom_kit.install_solution(classroom_kit.init(folder))
    path = kit / "compression.py"
    path.write_text(path.read_text() + "\n" + PREAMBLE + code)
    return kit


def _grade_runs(kit, work, codec_seconds=None):
    """Step 2 and the exchange on 2 and 4 ranks, each a task of the kit's one sandbox."""
    options = Options(**{**OPTIONS.__dict__, **({"codec_timeout": codec_seconds} if codec_seconds else {})})
    tasks = [codec_task(options)] + [job_task(n, options, None, True, None, False) for n in (2, 4)]
    work.mkdir(mode=0o711)
    runs = run_tasks(kit, work, tasks, limits=options.limits)
    codecs = codec_step(kit, options, work, runs["codecs"])
    exchange = {}
    for n in (2, 4):
        run, records = job_collect(runs[f"np{n}"], n, options)
        assert sorted(records) == list(range(n)), (n, runs[f"np{n}"].outcome)
        usable = {r: rec for r, rec in records.items() if "garbage" not in rec}
        assert sorted(usable) == list(range(n)), records
        exchange[n] = judge_route(usable, n, "exchange")
    report = [json.loads(line) for line in (work / "sandbox" / "report.jsonl").read_text().splitlines()]
    assert report[0] == {"ready": True}         # the fork server started, before any run
    return runs, codecs, exchange, report[1:]


def _all_passed(codecs, exchange):
    assert [c.name for c in codecs if not c.passed] == []
    for n, routes in exchange.items():
        for r, compressors in routes.items():
            assert all(c["ok"] for c in compressors.values()), (n, r, compressors)


@pytest.fixture(scope="module")
def root():
    """Kits and the grader's work folders, where a sandbox's user may pass (as grade()'s)."""
    base = Path(tempfile.mkdtemp(prefix="classroom-fork-server-"))
    base.chmod(0o711)
    yield base
    release(base)                               # every sandbox's tmpfs below it
    shutil.rmtree(base, ignore_errors=True)


def test_no_signal_from_a_run_reaches_the_fork_server(root):
    kit = _plant(root / "signal", TRICKS["signal_the_server"])
    runs, codecs, exchange, report = _grade_runs(kit, root / "signal-work")
    assert [t["name"] for t in report] == ["codecs", "np2", "np4"]
    assert all(t["status"] == 0 and not t["timeout"] for t in report), report
    _all_passed(codecs, exchange)


def test_a_process_forked_away_reaches_no_later_run(root):
    kit = _plant(root / "away", TRICKS["fork_away"])
    runs, codecs, exchange, report = _grade_runs(kit, root / "away-work")
    # it did start, from step 2 and from rank 1 of the 2-rank job, and wrote nothing the
    # next runs kept: each run's folder is made after the last run's processes are all gone
    assert (runs["codecs"].out / "away-started").exists()
    assert (runs["np2"].out / "away-started").exists()
    assert not (runs["np4"].out / "away-started").exists()
    _all_passed(codecs, exchange)
    assert sandbox.processes_left() == []


def test_a_run_over_its_time_is_stopped_and_the_next_run_starts(root):
    kit = _plant(root / "slow", "if IN_CALLS:\n    time.sleep(3600)\n")
    runs, codecs, exchange, report = _grade_runs(kit, root / "slow-work", codec_seconds=5)
    assert report[0]["timeout"] and runs["codecs"].outcome.killed_by == "timeout"
    assert all("did not finish in time" in c.en for c in codecs)
    for n, routes in exchange.items():
        assert all(c["ok"] for compressors in routes.values() for c in compressors.values())


def test_the_fork_server_refuses_to_run_outside_a_sandbox(tmp_path):
    """As any process but a PID namespace's init, its sweep (kill(-1)) would reach far more
    than a kit's processes: it refuses to start."""
    import subprocess
    import sys
    from labs.classroom.kit_runs import FORK_SERVER, STUDENT_SIDE
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tasks": []}))
    done = subprocess.run([sys.executable, str(FORK_SERVER), str(plan)], capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(STUDENT_SIDE.parent)})
    assert done.returncode != 0 and "PID 1" in done.stderr

