"""scripts/run_matrix.py --netem-rate: the multi-process rows run over an emulated network
(scripts/netem.py, one namespace per rank), and every record says so."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from hvd_compress.launch import launch_env

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = (ROOT / ".." / "shared" / "data" / "mnist").resolve()
MATRIX = str(ROOT / "scripts" / "run_matrix.py")
NETEM = str(ROOT / "scripts" / "netem.py")


def netem_unavailable():
    if os.geteuid() != 0:
        return "network emulation needs root"
    done = subprocess.run([sys.executable, NETEM, "check"], capture_output=True, text=True,
                          timeout=60)
    return None if done.returncode == 0 else f"netem.py check failed: {done.stdout}"


def test_matrix_row_over_an_emulated_1gbit_network(tmp_path):
    problem = netem_unavailable()
    if problem:
        pytest.skip(problem)
    out = tmp_path / "matrix"
    cmd = [sys.executable, MATRIX, "--dataset", "mnist", "--data-dir", str(MNIST_DIR),
           "--split-test", "640", "--epochs", "1", "--lr", "0.1", "--only", "np2-bit8",
           "--netem-rate", "1gbit", "--out", str(out), "--quiet", "--timeout", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), cwd=ROOT,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "logs" / "np2-bit8.log").read_text()
    assert "netem.py run -n 2 --rate 1gbit" in log          # launched through netem, not
    assert "netem: 2 ranks, each with rate 1000 Mbit/s" in log   # horovodrun
    manifest = json.loads((out / "np2-bit8" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["world_size"] == 2
    assert manifest["network"]["emulated"] is True
    assert manifest["network"]["rate_bps"] == 1e9
    summary = pd.read_csv(out / "summary.csv")
    assert summary["run"].tolist() == ["np2-bit8"]
    assert summary["netem_rate_bps"].tolist() == [1e9]
    assert json.loads((out / "matrix.json").read_text())["settings"]["netem_rate"] == "1gbit"
    # the same folder is not reused by a loopback matrix: the settings differ
    again = subprocess.run([a for a in cmd if a not in ("--netem-rate", "1gbit")],
                           capture_output=True, text=True, env=launch_env(), cwd=ROOT,
                           timeout=120)
    assert again.returncode != 0 and "netem rate" in again.stdout + again.stderr


def test_default_folder_is_kept_apart():
    sys.path.insert(0, str(ROOT / "scripts"))
    import run_matrix
    assert Path(run_matrix.parse_args(["--netem-rate", "1gbit"]).out).name == "matrix-netem-1gbit"
    assert Path(run_matrix.parse_args([]).out).name == "matrix"
    with pytest.raises(SystemExit):
        run_matrix.parse_args(["--netem-rate", "1gbps"])       # bytes, not bits: refused
