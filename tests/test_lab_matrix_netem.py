"""The run matrix with --netem-rate: the multi-process rows run over an emulated network
(labs.netem, one namespace per rank), and every record says so."""
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import ROOT

from labs.kit import matrix as run_matrix
from labs.kit.launch import launch_env

MATRIX = ["-m", "labs.kit.matrix"]          # the run matrix, as a user starts it


@pytest.mark.netns
@pytest.mark.slow
def test_matrix_row_over_an_emulated_1gbit_network_with_delay(tmp_path, mnist_dir,
                                                              emulated_network):
    out = tmp_path / "matrix"
    # 5 steps a rank (640 images), then the evaluation of the 640 images left: --split-test 640
    # left 9,360 to evaluate, nine tenths of the run's compute
    cmd = [sys.executable, *MATRIX, "--dataset", "mnist", "--data-dir", str(mnist_dir),
           "--split-test", "9360", "--steps-per-epoch", "5", "--epochs", "1", "--lr", "0.1",
           "--model", "horovod",
           "--momentum", "0.5", "--only", "np2-bit8",
           "--netem-rate", "1gbit", "--netem-delay", "1ms", "--out", str(out), "--quiet",
           "--timeout", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), cwd=ROOT,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "logs" / "np2-bit8.log").read_text()
    assert "labs.netem run -n 2 --rate 1gbit --delay 1ms" in log   # launched through netem,
    assert "netem: 2 ranks, each with rate 1000 Mbit/s, delay 1 ms" in log   # not horovodrun
    manifest = json.loads((out / "np2-bit8" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["world_size"] == 2
    assert manifest["network"]["emulated"] is True
    assert manifest["network"]["rate_bps"] == 1e9
    assert manifest["network"]["delay_s"] == 0.001
    assert manifest["network"]["delay_via"] in ("netem", "bridge")
    summary = pd.read_csv(out / "summary.csv")
    assert summary["run"].tolist() == ["np2-bit8"]
    assert summary["netem_rate_bps"].tolist() == [1e9]
    assert summary["netem_delay_s"].tolist() == [0.001]
    # bytes checked, not only counted: each rank's eth0 sent at least the gradient bytes it
    # counted, plus framing and control traffic (not twice as much: a 2-rank allgather of
    # 22 KB packets, 5 steps a rank)
    row = summary.iloc[0]
    assert row["bytes_per_step"] <= row["wire_bytes_per_step"] < 2 * row["bytes_per_step"]
    epochs = pd.read_csv(out / "np2-bit8" / "epochs.csv")
    assert epochs["wire_tx_bytes"].notna().all() and (epochs["wire_tx_bytes"] > 0).all()
    # the exchange's span is timed: it contains the launch span and lasts at least as long
    # as the link needs for the bytes (1 Gbit/s)
    assert 0 <= row["launch_span_ms"] <= row["exchange_ms"]
    assert row["exchange_ms"] >= 1000 * 8 * row["bytes_per_step"] / 1e9
    settings = json.loads((out / "matrix.json").read_text())["settings"]
    assert settings["netem_rate"] == "1gbit" and settings["netem_delay"] == "1ms"
    # the same folder is not reused by a matrix on another network: the settings differ (the
    # matrix's own decision, in process: a refused matrix launches nothing)
    spec = run_matrix.select(run_matrix.course_runs(), "np2-bit8")[0]
    for dropped, why in ((("--netem-delay", "1ms"), "netem delay"),
                         (("--netem-rate", "1gbit", "--netem-delay", "1ms"), "netem rate")):
        args = run_matrix.parse_args([a for a in cmd[3:] if a not in dropped])
        with pytest.raises(SystemExit, match=why):
            run_matrix.plan(spec, args, out / "np2-bit8")
    assert run_matrix.plan(spec, run_matrix.parse_args(cmd[3:]), out / "np2-bit8") == "skip"


@pytest.mark.unit
def test_default_folder_is_kept_apart():
    assert Path(run_matrix.parse_args(["--netem-rate", "1gbit"]).out).name == "matrix-netem-1gbit"
    assert Path(run_matrix.parse_args([]).out).name == "matrix"
    assert Path(run_matrix.parse_args(["--netem-rate", "1gbit", "--netem-delay", "1ms"]).out
                ).name == "matrix-netem-1gbit-1ms"
    with pytest.raises(SystemExit):
        run_matrix.parse_args(["--netem-rate", "1gbps"])       # bytes, not bits: refused
    for bad in (["--netem-delay", "1ms"],                       # a delay needs an emulated link
                ["--netem-rate", "1gbit", "--netem-delay", "1 fortnight"]):
        with pytest.raises(SystemExit):
            run_matrix.parse_args(bad)


@pytest.mark.interpreter
def test_dry_run_prints_the_netem_command_and_writes_nothing(tmp_path):
    out = tmp_path / "m"
    done = subprocess.run([sys.executable, *MATRIX, "--dry-run", "--only", "np2-bit8",
                           "--netem-rate", "100mbit", "--netem-delay", "0.5ms", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "labs.netem run -n 2 --rate 100mbit --delay 0.5ms" in done.stdout
    assert not out.exists()
