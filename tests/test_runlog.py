"""labs.kit.runlog: atomic files, append/resume of CSV records, manifest, checkpoints."""
import json
import os
import platform
import shutil
import socket
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from labs.kit import runlog

pytestmark = pytest.mark.unit


# --- atomic writes ---------------------------------------------------------------------------

def test_atomic_write_replaces_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "sub" / "a.json"
    runlog.atomic_write_json(target, {"x": 1})
    runlog.atomic_write_json(target, {"x": 2, "nan": float("nan")})
    assert runlog.read_json(target)["x"] == 2
    assert [p.name for p in target.parent.iterdir()] == ["a.json"]


def test_failed_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "manifest.json"
    runlog.atomic_write_text(target, "old")

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        runlog.atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_read_json_of_missing_file_is_none(tmp_path):
    assert runlog.read_json(tmp_path / "nope.json") is None


# --- CSV records -----------------------------------------------------------------------------

COLUMNS = ["epoch", "step", "loss"]


def test_csv_log_is_read_by_pandas_and_appends_on_reopen(tmp_path):
    path = tmp_path / "steps.csv"
    with runlog.CsvLog(path, COLUMNS) as log:
        log.write({"epoch": 1, "step": 1, "loss": 2.5})
        log.write({"epoch": 1, "step": 2, "loss": float("nan")})
    with runlog.CsvLog(path, COLUMNS) as log:          # a resumed run
        log.write({"epoch": 2, "step": 3, "loss": 0.125})
    frame = pd.read_csv(path)
    assert list(frame.columns) == COLUMNS
    assert frame["step"].tolist() == [1, 2, 3]
    assert frame["loss"].isna().tolist() == [False, True, False]
    assert frame["loss"].iloc[2] == 0.125
    assert path.read_text().count("epoch,step,loss") == 1


def test_csv_rows_are_on_disk_before_close(tmp_path):
    path = tmp_path / "steps.csv"
    log = runlog.CsvLog(path, COLUMNS)
    log.write({"epoch": 1, "step": 1, "loss": 1.0})
    assert len(pd.read_csv(path)) == 1                 # another process could read it now
    log.close()


def test_csv_log_rejects_other_header_and_unknown_column(tmp_path):
    path = tmp_path / "steps.csv"
    runlog.CsvLog(path, COLUMNS).close()
    with pytest.raises(ValueError, match="header"):
        runlog.CsvLog(path, ["epoch", "loss"])
    with runlog.CsvLog(path, COLUMNS) as log, pytest.raises(KeyError, match="lr"):
        log.write({"epoch": 1, "lr": 0.1})


def test_torn_last_line_is_dropped_and_new_rows_start_clean(tmp_path):
    path = tmp_path / "steps.csv"
    with runlog.CsvLog(path, COLUMNS) as log:
        log.write({"epoch": 1, "step": 1, "loss": 1.0})
    with open(path, "a") as stream:                     # a crash in the middle of a row
        stream.write("1,2")
    with runlog.CsvLog(path, COLUMNS) as log:
        log.write({"epoch": 1, "step": 2, "loss": 0.5})
    header, rows = runlog.read_csv_rows(path)
    assert [r["step"] for r in rows] == ["1", "2"]


def test_truncate_csv_for_resume(tmp_path):
    path = tmp_path / "steps.csv"
    with runlog.CsvLog(path, COLUMNS) as log:
        for step in range(1, 8):
            log.write({"epoch": 1 + (step > 3) + (step > 6), "step": step, "loss": 1.0 / step})
    with open(path, "a") as stream:
        stream.write("3,8")                             # torn row of the interrupted epoch
    removed = runlog.truncate_csv(path, lambda row: int(row["epoch"]) <= 2)
    assert removed == 2                                 # step 7 (epoch 3) and the torn row
    frame = pd.read_csv(path)
    assert frame["step"].tolist() == [1, 2, 3, 4, 5, 6]
    with runlog.CsvLog(path, COLUMNS) as log:           # the resumed epoch 3 appends again
        log.write({"epoch": 3, "step": 7, "loss": 0.1})
    assert pd.read_csv(path)["step"].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert runlog.truncate_csv(tmp_path / "absent.csv", lambda row: True) == 0


def test_merge_csvs(tmp_path):
    parts = []
    for rank in range(3):
        path = tmp_path / f"steps_rank{rank}.csv"
        with runlog.CsvLog(path, ["rank", "step"]) as log:
            for step in range(rank + 1):
                log.write({"rank": rank, "step": step})
        parts.append(path)
    assert runlog.merge_csvs(parts, tmp_path / "steps.csv") == 6
    frame = pd.read_csv(tmp_path / "steps.csv")
    assert frame.groupby("rank").size().tolist() == [1, 2, 3]
    other = tmp_path / "other.csv"
    runlog.CsvLog(other, ["a"]).close()
    with pytest.raises(ValueError, match="header"):
        runlog.merge_csvs(parts + [other], tmp_path / "x.csv")


# --- timing ----------------------------------------------------------------------------------

def test_step_timer_accumulates_and_pops():
    timer = runlog.StepTimer()
    with timer("step"):
        with timer("a"):
            time.sleep(0.02)
        with timer("a"):
            time.sleep(0.01)
    seconds = timer.pop()
    assert seconds["a"] >= 0.03 and seconds["step"] >= seconds["a"]
    assert timer.pop() == {}
    with pytest.raises(RuntimeError):
        with timer("fails"):
            raise RuntimeError("boom")
    assert "fails" in timer.pop()                       # time is counted even on error


# --- manifest --------------------------------------------------------------------------------

def test_manifest_write_update_and_status_check(tmp_path):
    runlog.write_manifest(tmp_path, {"status": "running", "epochs_completed": 0})
    updated = runlog.update_manifest(tmp_path, status="complete", epochs_completed=3)
    assert runlog.read_manifest(tmp_path) == updated
    assert updated["epochs_completed"] == 3
    with pytest.raises(ValueError, match="status"):
        runlog.write_manifest(tmp_path, {"status": "done"})
    assert runlog.read_manifest(tmp_path)["status"] == "complete"   # unchanged
    with pytest.raises(FileNotFoundError):
        runlog.update_manifest(tmp_path / "none", status="failed")


def test_environment_describes_this_machine():
    env = runlog.environment()
    assert env["hostname"] == socket.gethostname()
    assert env["python"] == platform.python_version()
    assert env["torch"] == torch.__version__
    assert env["cpu_count"] == os.cpu_count()
    assert env["cpu_model"]
    if shutil.which("mpirun"):
        assert "mpi" in env["mpi"].lower()
    else:
        assert env["mpi"] == "none"
    assert isinstance(env["nics"], list) and isinstance(env["gpus"], list)
    json.dumps(env)                                     # fits in manifest.json


def test_git_commit_is_that_of_the_folder_given(tmp_path):
    """No checkout assumed: the commit of the folder the caller names, 'none' outside git."""
    assert runlog.git_commit(tmp_path) == "none"
    here = runlog.git_commit(Path(__file__).parent)
    if shutil.which("git") and here != "none":
        assert len(here.split("-")[0]) == 40
    assert runlog.environment(tmp_path)["git_commit"] == "none"


# --- checkpoints -----------------------------------------------------------------------------

def test_checkpoint_round_trip(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 2,
             "step": 17, "torch_rng": [torch.get_rng_state(), torch.get_rng_state()]}
    runlog.save_checkpoint(tmp_path / "checkpoint.pt", state)
    loaded = runlog.load_checkpoint(tmp_path / "checkpoint.pt")
    assert loaded["epoch"] == 2 and loaded["step"] == 17
    assert torch.equal(loaded["model"]["weight"], model.weight)
    fresh = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.5)
    fresh.load_state_dict(loaded["optimizer"])
    assert torch.equal(fresh.state_dict()["state"][0]["momentum_buffer"],
                       optimizer.state_dict()["state"][0]["momentum_buffer"])
    torch.set_rng_state(loaded["torch_rng"][1])
    with pytest.raises(FileNotFoundError):
        runlog.load_checkpoint(tmp_path / "missing.pt")
