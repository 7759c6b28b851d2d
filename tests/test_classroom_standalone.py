"""The kit stands alone: `init` writes a folder that sets itself up in a fresh virtualenv where
the project is not installed (its own setup.sh: Debian packages, torch, the data), then runs
the serial trainer and the public checks there, with no checkout on the path."""
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from labs.classroom import kit as classroom_kit

pytestmark = [pytest.mark.build, pytest.mark.slow]     # the kit's setup.sh builds a venv

SOLUTION = Path(classroom_kit.SOLUTION_FILES) / "compression.py"


def _run(argv, cwd, timeout=900):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_kit_sets_itself_up_and_runs_without_the_project(tmp_path):
    kit = classroom_kit.init(tmp_path / "alice")
    start = time.perf_counter()
    setup = _run(["bash", "setup.sh", "--no-horovod"], kit)
    setup_seconds = time.perf_counter() - start
    assert setup.returncode == 0, setup.stdout + setup.stderr
    python = str(kit / ".venv" / "bin" / "python")
    # the project is nowhere in reach of the kit's Python
    for module in ("hvd_compress", "labs"):
        probe = _run([python, "-c", f"import {module}"], kit)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, module
    start = time.perf_counter()
    train = _run([python, "train.py", "--epochs", "1", "--train-samples", "256",
                  "--test-samples", "200", "--log-interval", "100"], kit)
    assert train.returncode == 0, train.stdout + train.stderr
    assert "test loss" in train.stdout and "accuracy" in train.stdout
    check = _run([python, "check.py"], kit)
    run_seconds = time.perf_counter() - start
    assert check.returncode == 1 and "0/9 public checks passed" in check.stdout, check.stdout
    assert "not written yet" in check.stdout
    shutil.copyfile(SOLUTION, kit / "compression.py")       # the work done: every check passes
    check = _run([python, "check.py"], kit)
    assert check.returncode == 0 and "9/9 public checks passed" in check.stdout, check.stdout
    print(f"setup {setup_seconds:.0f} s, serial trainer + check {run_seconds:.0f} s")
