"""One torch.distributed job (Gloo, world size n) runs every DDP-side worker check of that size.

The torch.distributed twin of tests/hvdrun.py: n ranks of tests/ddp_workers/suite.py, started
as torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT in
the environment) but without torchrun's agent, so a launch costs the ranks' imports and one
rendezvous on loopback. Each module's run(dist) logs its checks as the Horovod workers do
(tests/workers/checks.py), and the logs are read by hvdrun's RankLog and Job, so a failure names
the module, the rank and the check. The first test of a world size starts the job with every
module the collected tests read; later tests read its cached logs.
"""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdrun import Job, RankLog

WORKERS = Path(__file__).parent / "ddp_workers"
ROOT = Path(__file__).resolve().parents[1]

# worker module -> world sizes whose job runs it
SUITE = {
    "engine_ops": (2, 4),
    "hook_checks": (2, 4),
    "hook_state": (2,),
    "rebuild": (2,),
    "user_models": (2,),
    "powersgd_ddp": (2, 4),
    "auto_tta_ddp": (2, 4),
}
LIMIT_S = 900          # the whole job: a wedged collective ends here, not in a hang

_JOBS = {}


def across_sizes(module):
    """Parametrize a test over the world sizes whose job runs `module`."""
    def mark(test):
        test.ddp_module = module
        return pytest.mark.parametrize("np", SUITE[module])(test)
    return mark


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(np, modules, workdir, env_extra=None, limit_s=LIMIT_S):
    """Run suite.py with `modules` on `np` ranks; a Job (hvdrun's) of what each rank logged."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(np), LOCAL_WORLD_SIZE=str(np), HVDC_CHECK_DIR=str(workdir),
               PYTHONPATH=os.pathsep.join([str(WORKERS), str(ROOT / "tests" / "workers"),
                                           str(ROOT / "tests"), str(ROOT)]),
               OMP_NUM_THREADS="1", **(env_extra or {}))
    start, procs = time.monotonic(), []
    out = open(workdir / "launcher.out", "w+")
    for r in range(np):
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "suite.py"), *modules],
                                      env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                      stdout=out, stderr=subprocess.STDOUT))
    killed = ""
    try:
        for p in procs:
            p.wait(timeout=max(1, limit_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        killed = f"killed after {limit_s} s"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # one rank failing leaves the others in a collective: they were killed above or exit
    codes = [p.returncode for p in procs]
    out.seek(0)
    logs = []
    for r in range(np):
        path = workdir / f"rank{r}.txt"
        tb = workdir / f"rank{r}.traceback"
        logs.append(RankLog.parse(path.read_text(), tb.read_text() if tb.exists() else "")
                    if path.exists() else None)
    return Job("torch-gloo", np, list(modules), max(codes, key=abs), logs, out.read(), killed,
               round(time.monotonic() - start, 1), workdir)


def passed_checks(request):
    """The sorted names of the checks the requesting test's module passed on every rank."""
    module = request.function.ddp_module
    np = request.node.callspec.params["np"]
    job = _JOBS.get(np)
    if job is None:
        wanted = [m for m in SUITE if np in SUITE[m] and any(
            getattr(getattr(item, "function", None), "ddp_module", None) == m
            for item in request.session.items)]
        job = _JOBS[np] = run_job(np, wanted, request.getfixturevalue("tmp_path_factory")
                                  .mktemp(f"ddp-job-{np}"))
    names, problem = job.module_checks(module)
    if problem:
        pytest.fail(problem, pytrace=False)
    return names


def job_dir(np):
    """The folder of the job of world size np (its rank logs and what the modules wrote)."""
    return _JOBS[np].workdir
