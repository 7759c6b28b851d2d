"""labs/ddp_mnist.py under real torchrun with --max-restarts 1: rank 1 crashes once in epoch 2
(tests/ddp_workers/dies_once.py), torchrun's agent ends rank 0 and starts both again, and the
job goes on from the lab's checkpoint of epoch 1 with the hook's state (auto's residuals) and
finishes; auto's plan, saved in that checkpoint, is not taken up but made again (the ranks
changed, as on Horovod's elastic reset). Seconds of training: 10 steps an epoch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import ddprun

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
STEPS, DIE_AT = 10, 13             # rank 1 dies having trained 13 steps: epoch 2, batch 3


def test_torchrun_restarts_a_dead_rank_and_the_run_resumes_from_its_checkpoint(tmp_path):
    out, notes = tmp_path / "run", tmp_path / "attempts"
    notes.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--max-restarts", "1", "--monitor-interval", "0.2",
           "--master-port", str(ddprun.free_port()),
           str(ROOT / "tests" / "ddp_workers" / "dies_once.py"),
           "--data-dir", str(ROOT / "tests" / "data" / "mnist"), "--split-test", "8000",
           "--epochs", "2", "--steps-per-epoch", str(STEPS), "--auto-allreduce",
           "--out", str(out), "--no-progress"]
    env = dict(os.environ, HVDC_DIE_AT_STEP=str(DIE_AT), HVDC_ATTEMPT_DIR=str(notes),
               OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    log = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, log
    attempts = {(a["attempt"], a["rank"]): a
                for a in (json.loads(p.read_text()) for p in notes.glob("*.json"))}
    # torchrun started each rank twice: the fault, then the restart
    assert set(attempts) == {(0, 0), (0, 1), (1, 0), (1, 1)}, (sorted(attempts), log)
    assert attempts[(0, 1)].get("died_at") == DIE_AT
    for rank in (0, 1):
        assert attempts[(0, rank)]["first_epoch"] == 1
        assert attempts[(0, rank)]["hook_state_loaded"] == []
        again = attempts[(1, rank)]
        assert again["first_epoch"] == 2, again          # from epoch 1's checkpoint
        # the hook's state of that checkpoint, auto's plan in it but left out (made again)
        assert again["hook_state_loaded"] == [{"scheme": "auto/per-bucket", "steps": STEPS,
                                               "with_plan": True, "plan": False}], again
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["epochs_completed"] == 2
    epochs = pd.read_csv(out / "epochs.csv")
    assert list(epochs["epoch"]) == [1, 2]
    steps = pd.read_csv(out / "steps.csv")
    assert len(steps) == 2 * 2 * STEPS                       # every step once, on both ranks
    assert not steps.duplicated(["rank", "epoch", "batch"]).any()
    events = steps[steps["epoch"] == 2]["plan_event"].astype("string").fillna("")
    assert not events.str.contains("restored").any(), list(events)
    assert events.str.contains("planned|fallback").any(), list(events)
