"""One Horovod job per (controller, world size) runs every worker check of that configuration.

Each launch pays Horovod's start-up (horovodrun, Gloo's rendezvous or mpirun, hvd.init, the
imports), so the worker modules (tests/workers/<name>.py, each a run(hvd)) share one job per
configuration: tests/workers/suite.py runs them in order and logs, per rank, each module's
checks between BEGIN and END lines. A test asks for its module's checks with `passed_checks`;
the first test of a configuration starts the job, later ones read its cached logs.

What a test sees:
- its module passed on every rank (same checks everywhere): the sorted check names;
- it failed: a pytest failure naming the module, the rank, the check and its error (and the
  traceback), with where each other rank stopped;
- an earlier module ended the job: "not run", naming the module, rank and check that did.
A rank that fails exits at once and the launcher ends its partners, which may be waiting in a
collective; a job in which no rank logs a check for STALL_S seconds (a wedged collective) is
killed, and the tests say where each rank stood.

One environment for all modules of a job: with more than 2 ranks, HOROVOD_FUSION_THRESHOLD=0.
A ring allreduce's summation order, with 3 or more ranks, depends on where a tensor sits in
Horovod's fused buffer, so the bit-for-bit comparisons with a lone hvd.allreduce (exchange,
course route) need fusion off; the other modules compare with references of their own
(allgathers, sums in rank order, or tolerances), which hold either way, so fusion off costs them
nothing. Horovod's fusion buffer itself is still exercised by every 2-rank job (default
fusion; with 2 ranks a sum is the same in either order).

In every job the ranks wait for Horovod's collectives by sleeping between polls
(tests/workers/suite.py, wait_by_sleeping), not in Horovod's synchronize() spin: under Gloo with
3 or 4 ranks on 2 cores the spinning ranks held the cores that Gloo's and Horovod's threads
needed for every hop of a collective, and the jobs took about twice as long (docs/testing.md).

Which modules run where (SUITE) is the coverage that the separate launches had: every module at
2 ranks on Gloo and MPI; the exchange's routes also at 3 ranks (Gloo; its optimizer checks,
exchange_optimizer, which depend on no world size, at 2 and 4 only); the exchange and the
quantizers at 4 on both, gradient views and the course route at 4 on Gloo; Top-K, PowerSGD and
Compression.auto at 4 on MPI only (FOUR_ON_MPI): a Gloo collective with 4 ranks on 2 cores
costs tens of milliseconds where MPI's costs one or two, and what these modules add at 4 ranks
(their references over 4 ranks' gradients, the byte formulas at n = 4) does not depend on the
controller, while Gloo carries their collectives at 2 ranks (docs/testing.md); and, at 2 ranks, the
checks that once called hvd.init() in the test process itself (wait_for, the benchmark's timing
loop). Adding a module is one line in SUITE (and its run(hvd) in tests/workers/). Running a
subset of the tests (a file, -k) starts jobs with only the modules the selected tests read.

What a launch costs besides its checks, and what is not paid: horovodrun's own build check
(a process that imports torch to ask gloo_built()/mpi_built(), about 2 s of a core before any
rank starts) is answered once per Horovod build (labs/kit/horovodrun.py,
cached_build_check=True); after the last module the ranks shut Horovod down together and leave
by os._exit, without the interpreter's teardown of torch (suite.py).

The jobs that must fail (MUST_FAIL: a rank that fails a check, a wedged rank; the disagreeing
ranks run first in the failing one, each refusal a collective every rank completes) are
launches of their own, never in a shared job. The first test that reads one (uses_must_fail_job,
must_fail_job) starts every one that the collected tests read, overlapped: the wedged job first,
the others once its ranks have logged, so that their start-up (torch imported on each rank)
runs while it waits out its 5 s of silence; each is judged on its own logs and bounds.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from labs.kit.launch import horovodrun_command, launch_env

# Imported under a second name (`tests.hvdrun` beside `hvdrun`), this module would be a second
# module with a second job cache, and every job would run twice (it did: 55 s of the suite).
if __name__ != "hvdrun":
    raise ImportError(f"import this module as `hvdrun` (from hvdrun import across_ranks, "
                      f"passed_checks), not as {__name__!r}: one name, one cache of jobs")

WORKERS = Path(__file__).parent / "workers"


def _log_format():
    """The rank log's frame lines, from the module that writes them (tests/workers/checks.py,
    loaded by path: the workers' directory is not put on the test process's import path)."""
    spec = importlib.util.spec_from_file_location("hvdc_worker_checks", WORKERS / "checks.py")
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    return checks.BEGIN, checks.END, checks.FAILED, checks.DONE


BEGIN, END, FAILED, DONE = _log_format()

TWO = [("gloo", 2), ("mpi", 2)]
FOUR = [("gloo", 2), ("gloo", 4), ("mpi", 2), ("mpi", 4)]
FOUR_ON_MPI = [("gloo", 2), ("mpi", 2), ("mpi", 4)]     # 4 ranks under MPI only: see above

# worker module -> the (controller, ranks) whose job runs it. A job runs its modules in this
# order: the quick ones first, so that a failure in the long exchange hides none of them.
SUITE = {
    "wait_for_checks": TWO,
    "bench_checks": TWO,
    "grad_views": [("gloo", 2), ("mpi", 2), ("gloo", 4)],
    "odd_gradients": TWO,
    "course_route": [("gloo", 2), ("gloo", 4), ("mpi", 2)],
    "topk_checks": FOUR_ON_MPI,
    "powersgd_checks": FOUR_ON_MPI,
    "quantizer_checks": FOUR,
    "auto_checks": FOUR_ON_MPI,
    "auto_tta_checks": FOUR_ON_MPI,
    "exchange_checks": [("gloo", 2), ("gloo", 3), ("gloo", 4), ("mpi", 2), ("mpi", 4)],
    "exchange_optimizer": FOUR,      # not at 3 ranks: nothing in it depends on the world size
    "overlap_checks": [("gloo", 2)],  # schedule="overlap" against "wait", every scheme
    # its chunks and pieces against the bucket whole, on both packet routes, at 2 and 4 ranks
    "overlap_priority": FOUR,
    # the same buckets as the DDP hook's (tests/test_ddp.py compares the digests)
    "engine_digests": [("gloo", 2), ("gloo", 4)],
    # last: it registers plugin schemes (e5m2, e2m1: docs/examples) in the ranks' registry
    "contract_checks": TWO,
}

# The jobs that must fail, each a launch of its own (never in a shared job: a rank that fails
# ends its job): name -> (controller, modules, environment, seconds of silence that mean wedged).
# A failing check ends the job at once; the disagreements run first in the same launch, since
# every refusal is a collective that every rank completes before it raises, so they leave
# Horovod as they found it (tests/workers/disagreeing_ranks.py). The wedged job is killed after
# 5 s of silence: both its ranks log their one check within milliseconds of opening their logs.
MUST_FAIL = {
    "gloo-fails": ("gloo", ["disagreeing_ranks", "fails_on_one_rank", "wait_for_checks"],
                   {"HVDC_FAIL": "check"}, None),
    "mpi-fails": ("mpi", ["disagreeing_ranks", "fails_on_one_rank", "wait_for_checks"],
                  {"HVDC_FAIL": "check"}, None),
    "gloo-wedged": ("gloo", ["fails_on_one_rank", "wait_for_checks"], {"HVDC_FAIL": "wedge"}, 5),
}

STARTUP_S = 300      # until every rank has begun its log (horovodrun, rendezvous, hvd.init)
STALL_S = 300        # then no rank logged a check for this long: wedged (a check takes seconds)
LIMIT_S = 3600       # the whole job, however it progresses


def across_ranks(module):
    """Parametrize a test over (controller, np) for every job that runs `module`; the test reads
    its checks with passed_checks(request)."""
    def mark(test):
        test.worker_module = module
        return pytest.mark.parametrize("controller,np", SUITE[module])(test)
    return mark


def passed_checks(request):
    """The sorted names of the checks that the requesting test's module passed on every rank of
    its job, or a pytest failure that says which check failed where, or why it did not run."""
    module = request.function.worker_module
    params = request.node.callspec.params
    config = (params["controller"], params["np"])
    job = _JOBS.get(config)
    if job is None:
        modules = _wanted(request.session.items, config)
        job = _JOBS[config] = run_job(*config, modules, request.getfixturevalue("tmp_path_factory")
                                      .mktemp(f"job-{config[0]}-{config[1]}"))
    names, problem = job.module_checks(module)
    if problem:
        pytest.fail(problem, pytrace=False)
    return names


_JOBS = {}
_MUST_FAIL_JOBS = {}


def uses_must_fail_job(name):
    """Mark a test that reads the MUST_FAIL job `name` (a format string of its parameters,
    "{controller}-fails"), so that the first such test starts every job the collected tests read."""
    def mark(test):
        test.must_fail_job = name
        return test
    return mark


def must_fail_job(request):
    """The finished Job that the requesting test reads (its uses_must_fail_job name). The first
    call runs every MUST_FAIL job that a collected test reads, overlapped: the wedged job first,
    the others once its ranks have logged, so that they start while it waits out its silence
    (a failing job's start-up is the import of torch on each rank, CPU the wait leaves idle);
    each job is still timed and judged on its own."""
    name = _must_fail_name(request.node)
    if name not in _MUST_FAIL_JOBS:
        wanted = [n for n in MUST_FAIL if n in {_must_fail_name(i) for i in request.session.items}]
        base = request.getfixturevalue("tmp_path_factory")
        _MUST_FAIL_JOBS.update(run_overlapped({n: (*MUST_FAIL[n], base.mktemp(f"job-{n}"))
                                               for n in wanted}))
    return _MUST_FAIL_JOBS[name]


def _must_fail_name(item):
    name = getattr(getattr(item, "function", None), "must_fail_job", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    return name.format(**params) if name else None


def run_overlapped(jobs, head_start_s=120):
    """{name: Job} for {name: (controller, modules, env, stall_s, workdir)}, all on 2 ranks: the
    ones with a stall_s (wedged) start first, the others when every rank of those has logged a
    check (or after head_start_s), side by side in threads."""
    from concurrent.futures import ThreadPoolExecutor

    def start(pool, name):
        controller, modules, env, stall_s, workdir = jobs[name]
        return pool.submit(run_job, controller, 2, modules, workdir, env, stall_s or STALL_S)
    wedged = [n for n in jobs if jobs[n][3]]
    with ThreadPoolExecutor(max_workers=len(jobs) or 1) as pool:
        futures = {n: start(pool, n) for n in wedged}
        deadline = time.monotonic() + head_start_s
        while time.monotonic() < deadline and not all(_all_logged(jobs[n][4], 2) or futures[n].done()
                                                      for n in wedged):
            time.sleep(0.2)
        futures.update({n: start(pool, n) for n in jobs if n not in futures})
        return {n: futures[n].result() for n in jobs}


def _all_logged(workdir, np):
    """Has every rank of the job in `workdir` logged a check (a line that is not a frame)?"""
    for r in range(np):
        f = workdir / f"rank{r}.txt"
        if not f.exists() or not any(line and not line.startswith("## ")
                                     for line in f.read_text().splitlines()):
            return False
    return True


def _wanted(items, config):
    """The modules that the collected tests of `config` read, in SUITE's order."""
    wanted = set()
    for item in items:
        module = getattr(getattr(item, "function", None), "worker_module", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if module and (params.get("controller"), params.get("np")) == config:
            wanted.add(module)
    return [m for m in SUITE if m in wanted and config in SUITE[m]]


@dataclass
class RankLog:
    """What one rank wrote: each module's checks, whether it ended, and why it stopped."""
    checks: dict = field(default_factory=dict)      # module -> names logged so far
    ended: set = field(default_factory=set)
    seconds: dict = field(default_factory=dict)     # module -> how long it ran (once ended)
    failure: tuple = None                           # (time, module, what went wrong)
    traceback: str = ""
    done: bool = False
    current: str = None                             # the module begun last

    @classmethod
    def parse(cls, text, traceback=""):
        log = cls(traceback=traceback)
        for line in text.splitlines():
            if line.startswith(BEGIN):
                when, _, log.current = line[len(BEGIN):].partition(" ")
                log.checks[log.current] = []
                began = float(when)
            elif line.startswith(END):
                when, _, module = line[len(END):].partition(" ")
                log.ended.add(module)
                log.seconds[module] = round(float(when) - began, 3)
            elif line.startswith(FAILED):
                when, _, rest = line[len(FAILED):].partition(" ")
                module, _, what = rest.partition(": ")
                log.failure = (float(when), module, what)
            elif line == DONE:
                log.done = True
            elif log.current is not None:
                log.checks[log.current].append(line)
        return log

    def where(self):
        """Where this rank stood when the job ended, in words."""
        if self.done:
            return "finished every module"
        if self.failure:
            return f"failed in {self.failure[1]}: {self.failure[2]}"
        if self.current is None:
            return "ran no module"
        last = self.checks[self.current][-1:] or ["(none yet)"]
        return f"stopped in {self.current} after check {last[0]!r}"


@dataclass
class Job:
    """One finished (or killed) job: its ranks' logs and how the launcher ended."""
    controller: str
    np: int
    modules: list
    returncode: int
    logs: list                                       # RankLog per rank, None: wrote no log
    output: str                                      # the launcher's stdout and stderr
    killed: str = ""                                 # why the job was killed, if it was
    seconds: float = 0.0                             # the launch, start to end
    workdir: Path = None                             # its rank logs and launcher output

    def module_checks(self, module):
        """(sorted names, None) if `module` passed on every rank, else (None, the message)."""
        where = f"{module} on {self.np} ranks ({self.controller})"
        if module not in self.modules:
            return None, f"{where}: not in this job (modules {self.modules})"
        if any(log is None for log in self.logs):
            return None, f"{where}: not run: {self.summary()}"
        failed = sorted((log.failure[0], r) for r, log in enumerate(self.logs)
                        if log.failure and log.failure[1] == module)
        if failed:                  # the first to fail: the others may have failed because of it
            r = failed[0][1]
            log = self.logs[r]
            return None, (f"{where} FAILED on rank {r}: {log.failure[2]}\n{self.ranks()}\n"
                          f"--- rank {r}'s traceback ---\n{log.traceback}")
        if all(module in log.ended for log in self.logs):
            names = [sorted(log.checks[module]) for log in self.logs]
            if any(n != names[0] for n in names):
                diff = {r: sorted(set(names[0]) ^ set(n)) for r, n in enumerate(names) if n != names[0]}
                return None, f"{where}: ranks passed different checks (vs rank 0): {diff}"
            if self.returncode != 0 and all(log.done for log in self.logs):
                return None, f"{where}: every check passed, but {self.summary()}"
            return names[0], None
        if all(module not in log.checks for log in self.logs):
            return None, f"{where}: not run: {self.summary()}"
        return None, f"{where}: cut short: {self.summary()}"

    def ranks(self):
        return "\n".join(f"rank {r}: {log.where() if log else 'wrote no log'}" for r, log in enumerate(self.logs))

    def summary(self):
        """How the job ended, for a module that did not finish."""
        how = self.killed or f"ended with exit status {self.returncode}"
        failures = sorted((log.failure, r) for r, log in enumerate(self.logs) if log and log.failure)
        if failures:
            (_, module, what), r = failures[0]
            how += f"; first failure: rank {r} in {module}: {what}"
        return f"the job {how}\n{self.ranks()}\n--- launcher output (tail) ---\n{self.output[-3000:]}"


def run_job(controller, np, modules, workdir, env_extra=None, stall_s=STALL_S):
    """Run tests/workers/suite.py with `modules` on `np` ranks; never raises for what the ranks
    did (the Job says it), and never outlives a wedged rank."""
    env = launch_env()
    env.update(env_extra or {})
    env["HVDC_CHECK_DIR"] = str(workdir)
    if np > 2:
        env["HOROVOD_FUSION_THRESHOLD"] = "0"      # see the module's docstring
    command = horovodrun_command(np, [sys.executable, str(WORKERS / "suite.py"), *modules], controller,
                                 cached_build_check=True)
    rank_files = [workdir / f"rank{r}.txt" for r in range(np)]
    killed = ""
    with open(workdir / "launcher.out", "w+") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        start = last_progress = time.monotonic()
        logged = None
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            started = [f for f in rank_files if f.exists()]
            progress = (len(started), sum(f.stat().st_size for f in started))
            if progress != logged:
                logged, last_progress = progress, now
            if len(started) < np and now - start > STARTUP_S:
                killed = f"was killed: not every rank had started after {STARTUP_S} s"
            elif len(started) == np and now - last_progress > stall_s:
                killed = f"was killed: no rank logged a check for {stall_s} s (wedged?)"
            elif now - start > LIMIT_S:
                killed = f"was killed: it ran over {LIMIT_S} s"
            if killed:
                _end(proc)
                break
        out.seek(0)
        output = out.read()
    logs = []
    for r, f in enumerate(rank_files):
        tb = workdir / f"rank{r}.traceback"
        logs.append(RankLog.parse(f.read_text(), tb.read_text() if tb.exists() else "") if f.exists() else None)
    job = Job(controller, np, list(modules), proc.returncode, logs, output, killed,
              round(time.monotonic() - start, 1), workdir)
    (workdir / "job.json").write_text(json.dumps({                 # what a job costs, and where
        "controller": controller, "np": np, "returncode": proc.returncode, "killed": killed,
        "seconds": job.seconds, "module_seconds": [log.seconds if log else None for log in logs]}, indent=1))
    return job


def _end(proc):
    """SIGTERM to the launcher's session (horovodrun then ends its ranks), SIGKILL if it stays."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass
