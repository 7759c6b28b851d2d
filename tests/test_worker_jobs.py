"""The shared worker jobs (tests/hvdrun.py): how the rank logs become each test's result (pure,
on synthetic logs), and, on real ranks, that a failing or wedged rank ends the job with its
check and rank named and the later modules reported as not run."""
import os
from pathlib import Path

import pytest

from hvdrun import BEGIN, DONE, END, FAILED, MUST_FAIL, SUITE, Job, RankLog, must_fail_job, uses_must_fail_job


def log(*lines, traceback=""):
    return RankLog.parse("\n".join(lines) + "\n", traceback)


def job(*logs, returncode=0, modules=("a", "b", "c"), killed=""):
    return Job("gloo", len(logs), list(modules), returncode, list(logs), "launcher said this", killed)


def begin(module, when=100.0):
    return f"{BEGIN}{when} {module}"


def end(module, when=101.0):
    return f"{END}{when} {module}"


PASSED_A = [begin("a"), "a.one", "a.two", end("a", 102.5)]


@pytest.mark.unit
def test_a_module_that_ended_everywhere_gives_its_sorted_checks():
    j = job(log(*PASSED_A, begin("b"), "b.x", end("b"), begin("c"), end("c"), DONE),
            log(*PASSED_A, begin("b"), "b.x", end("b"), begin("c"), end("c"), DONE))
    assert j.module_checks("a") == (["a.one", "a.two"], None)
    assert j.module_checks("c") == ([], None)
    assert j.logs[0].seconds == {"a": 2.5, "b": 1.0, "c": 1.0}


@pytest.mark.unit
def test_a_failed_check_names_module_rank_check_error_and_where_the_others_stood():
    # rank 1 fails a check; rank 0, waiting for it in a collective, fails after (Horovod shut
    # down), and rank 2 is ended by the launcher: rank 1's failure is the one to name
    j = job(log(*PASSED_A, begin("b"), "b.x", FAILED + "1700000001.0 b: HorovodInternalError: shut down"),
            log(*PASSED_A, begin("b"), "b.x", FAILED + "1700000000.5 b: check 'b.y' failed: 3 != 4",
                traceback="Traceback ...\nCheckFailed: rank 1: b.y failed 3 != 4"),
            log(*PASSED_A, begin("b"), "b.x"),
            returncode=1)
    assert j.module_checks("a") == (["a.one", "a.two"], None)     # it passed before b failed
    names, problem = j.module_checks("b")
    assert names is None
    assert "b on 3 ranks (gloo) FAILED on rank 1: check 'b.y' failed: 3 != 4" in problem
    assert "rank 0: failed in b: HorovodInternalError: shut down" in problem
    assert "rank 2: stopped in b after check 'b.x'" in problem
    assert "CheckFailed: rank 1: b.y failed 3 != 4" in problem
    names, problem = j.module_checks("c")
    assert names is None and problem.startswith("c on 3 ranks (gloo): not run: the job ended with exit status 1")
    assert "first failure: rank 1 in b: check 'b.y' failed: 3 != 4" in problem
    assert "rank 1: failed in b: check 'b.y' failed: 3 != 4" in problem and "launcher said this" in problem


@pytest.mark.unit
def test_a_killed_job_says_why_and_where_each_rank_stood():
    j = job(log(*PASSED_A, begin("b"), "b.x"), log(*PASSED_A, begin("b")), returncode=-15,
            killed="was killed: no rank logged a check for 300 s (wedged?)")
    names, problem = j.module_checks("b")
    assert names is None and "cut short: the job was killed: no rank logged a check for 300 s" in problem
    assert "rank 0: stopped in b after check 'b.x'" in problem
    assert "rank 1: stopped in b after check '(none yet)'" in problem
    assert j.module_checks("c")[1].startswith("c on 2 ranks (gloo): not run: the job was killed")


@pytest.mark.unit
def test_ranks_that_passed_different_checks_fail():
    j = job(log(*PASSED_A, DONE), log(begin("a"), "a.one", end("a"), DONE), modules=["a"])
    names, problem = j.module_checks("a")
    assert names is None and "ranks passed different checks (vs rank 0): {1: ['a.two']}" in problem


@pytest.mark.unit
def test_a_job_that_failed_after_every_check_still_fails():
    j = job(log(*PASSED_A, DONE), log(*PASSED_A, DONE), modules=["a"], returncode=134)
    names, problem = j.module_checks("a")
    assert names is None and "every check passed, but the job ended with exit status 134" in problem


@pytest.mark.unit
def test_a_rank_without_a_log_means_nothing_ran():
    j = job(log(*PASSED_A, DONE), None, modules=["a"], returncode=1)
    names, problem = j.module_checks("a")
    assert names is None and "not run" in problem and "rank 1: wrote no log" in problem


@pytest.mark.unit
def test_the_suite_names_real_modules_and_configurations():
    workers = os.path.join(os.path.dirname(__file__), "workers")
    for module, configs in SUITE.items():
        assert os.path.isfile(os.path.join(workers, module + ".py")), module
        assert configs and all(c in ("gloo", "mpi") and n >= 2 for c, n in configs), module
    for name, (controller, modules, env, stall_s) in MUST_FAIL.items():
        assert controller in ("gloo", "mpi") and name.startswith(controller), name
        assert all(os.path.isfile(os.path.join(workers, m + ".py")) for m in modules), name


def _alive(job_dir):
    """Processes still running for the job whose log folder is `job_dir` (launcher, ranks): the
    jobs that must fail run side by side, so a job's processes are told by their environment."""
    mine = f"HVDC_CHECK_DIR={job_dir}".encode()
    alive = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mine in (proc / "environ").read_bytes().split(b"\0"):
                alive.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:                 # ended meanwhile, or not ours to read
            pass
    return alive


@pytest.mark.multiprocess
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
@uses_must_fail_job("{controller}-fails")
def test_a_failing_rank_ends_the_job_and_is_named(controller, request):
    j = must_fail_job(request)        # disagreeing_ranks, then fails_on_one_rank, then wait_for_checks
    assert j.seconds < 240                                    # rank 0 did not wait forever
    assert j.returncode != 0 and not j.killed
    names, problem = j.module_checks("fails_on_one_rank")
    assert names is None
    assert "FAILED on rank 1: check 'planted.failure' failed: planted detail 42" in problem, problem
    # rank 0, left waiting in the allreduce, was ended by the launcher (MPI) or saw Horovod
    # shut down (Gloo): either way its line says so, and rank 1 is the one named above
    assert ("rank 0: stopped in fails_on_one_rank after check 'before.passes'" in problem
            or "rank 0: failed in fails_on_one_rank: HorovodInternalError" in problem), problem
    assert "fails_on_one_rank.py" in problem                  # rank 1's traceback
    names, problem = j.module_checks("wait_for_checks")
    assert names is None and "not run" in problem, problem
    assert not _alive(j.workdir)


@pytest.mark.multiprocess
@uses_must_fail_job("gloo-wedged")
def test_a_wedged_rank_gets_the_job_killed_and_is_named(request):
    # killed after 5 s of silence (hvdrun.MUST_FAIL): both ranks log 'before.passes' within
    # milliseconds of opening their logs (the stall is timed from then)
    j = must_fail_job(request)
    assert j.seconds < 240
    names, problem = j.module_checks("fails_on_one_rank")
    assert names is None and "the job was killed: no rank logged a check for 5 s" in problem, problem
    assert problem.count("stopped in fails_on_one_rank after check 'before.passes'") == 2, problem
    assert "not run" in j.module_checks("wait_for_checks")[1]
    assert not _alive(j.workdir)


@pytest.mark.unit
def test_the_job_cache_has_one_name():
    """Imported as tests.hvdrun beside hvdrun, the jobs ran twice (two caches): refused."""
    import importlib
    with pytest.raises(ImportError, match="as `hvdrun`"):
        importlib.import_module("tests.hvdrun")
    import hvdrun
    assert hvdrun.__name__ == "hvdrun"
