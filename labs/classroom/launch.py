"""Horovod jobs of the grader: one launch runs the tasks of many kits; a job that dies or
hangs is run again kit by kit, so one student's wedged trainer costs only that student."""
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from labs.kit.launch import horovodrun_command, launch_env


def run(np, module, args, timeout, pythonpath=()):
    """`python -m module args` on `np` Gloo ranks; (exit status or None on timeout, output tail)."""
    env = launch_env()
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = horovodrun_command(np, [sys.executable, "-m", module, *map(str, args)], "gloo")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out[-2000:]
    except subprocess.TimeoutExpired:
        # SIGTERM first: horovodrun then ends the ranks it started (they run in sessions of
        # their own); whatever is left of the launch's group is killed after 10 s
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return None, (out or "")[-2000:]


def read_ranks(out, np):
    """{rank: record} of the ranks that wrote out/rank<R>.json."""
    records = {}
    for r in range(np):
        path = Path(out) / f"rank{r}.json"
        if path.is_file():
            records[r] = json.loads(path.read_text())
    return records


def run_tasks(np, tasks, task_timeout):
    """rank_job's tasks on `np` ranks, batched; {kit: {rank: record}} and, for kits whose job
    failed, the launch's status and output tail under the key None."""
    def launch(batch):
        with tempfile.TemporaryDirectory(prefix="classroom-job-") as tmp:
            job = Path(tmp) / "job.json"
            job.write_text(json.dumps({"tasks": batch}))
            return run(np, "labs.classroom.rank_job", [job], 60 + task_timeout * len(batch))

    for task in tasks:                             # no record of an earlier grading counts
        for old in Path(task["out"]).glob("rank*.json"):
            old.unlink()
    status, tail = launch(tasks)
    results = {task["kit"]: read_ranks(task["out"], np) for task in tasks}
    missing = [t for t in tasks if len(results[t["kit"]]) < np]
    if missing and len(tasks) > 1:
        for task in missing:                       # isolate: each unfinished kit alone
            status, tail = launch([task])
            results[task["kit"]] = read_ranks(task["out"], np)
            results[task["kit"]][None] = (status, tail)
    elif missing:
        results[missing[0]["kit"]][None] = (status, tail)
    return results
