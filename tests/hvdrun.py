"""Launch a worker script on real Horovod ranks and read what every rank checked."""
import subprocess
import sys
from pathlib import Path

from labs.kit.launch import horovodrun_command, launch_env

WORKERS = Path(__file__).parent / "workers"


def run_worker(script, np, controller, tmp_path, env_extra=None, timeout=900):
    """Run tests/workers/<script> on `np` ranks; assert it ended well on every rank and that
    every check passed on every rank. Returns the sorted list of check names."""
    check_dir = tmp_path / f"checks-{controller}-{np}"
    check_dir.mkdir()
    env = launch_env()
    env["HVDC_CHECK_DIR"] = str(check_dir)
    env.update(env_extra or {})
    proc = subprocess.run(horovodrun_command(np, [sys.executable, str(WORKERS / script)], controller),
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        errors = [l for l in out.splitlines() if "Error" in l and "horovod/runner" not in l]
        raise AssertionError(f"{script} failed on {np} ranks ({controller}):\n" + "\n".join(errors[:20])
                             + "\n--- output tail ---\n" + out[-3000:])
    logs = [(check_dir / f"rank{r}.txt").read_text().splitlines() for r in range(np)]
    assert all(log and log[-1] == "ALL CHECKS DONE" for log in logs), "a rank did not finish its checks"
    assert all(log == logs[0] for log in logs), "ranks passed different checks"
    return logs[0]
