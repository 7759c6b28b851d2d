"""The trainers' held-out evaluations on 2 real ranks (Horovod's horovodrun, and DDP under
torchrun): when they come and what they record, the stop at a target accuracy, --resume, and
the claim the time-to-accuracy grid rests on, that DDP's own allreduce and Horovod's float32
allreduce take the same steps (at 2 ranks, bit for bit)."""
import subprocess
import sys

import pandas as pd
import pytest

from conftest import MNIST_DIR, ROOT
from labs.kit import tta
from labs.kit import runlog
from labs.kit.launch import horovodrun_command, launch_env

pytestmark = pytest.mark.multiprocess

PYTHON = sys.executable
# the small net on 7,000 MNIST test images (1,000 held out), 12 steps an epoch, an evaluation
# every 5 steps and after each epoch's last (in batches of 20: an evaluation takes long enough
# to be seen in the epoch's time)
FLAGS = ["--dataset", "mnist", "--data-dir", str(MNIST_DIR), "--split-test", "8000",
         "--model", "horovod", "--epochs", "2", "--steps-per-epoch", "12", "--lr", "0.1",
         "--holdout", "1000", "--eval-every", "5", "--test-batch-size", "20", "--no-progress"]
EVAL_STEPS = [5, 10, 12, 15, 20, 24]


def horovod(out, extra=(), check=True):
    cmd = horovodrun_command(2, [PYTHON, str(ROOT / "labs" / "mnist.py"), "--out", str(out)]
                             + FLAGS + list(extra), controller="gloo", cached_build_check=True)
    return finish(cmd, check)


def ddp(out, extra=()):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(port), str(ROOT / "labs" / "ddp_mnist.py"), "--out", str(out)] + FLAGS + list(extra)
    return finish(cmd, True)


def finish(cmd, check):
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(launch_env(), OMP_NUM_THREADS="1"))
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def float32(tmp_path_factory):
    out = tmp_path_factory.mktemp("tta") / "np2-none"
    horovod(out)
    return out


def test_evaluations_come_every_n_steps_and_after_each_epoch(float32):
    evals = pd.read_csv(float32 / "evals.csv")
    assert evals["step"].tolist() == EVAL_STEPS
    assert evals["epoch"].tolist() == [1, 1, 1, 2, 2, 2]
    assert (evals["samples"] == evals["step"] * 64 * 2).all()      # every rank's images
    assert (evals["holdout_samples"] == 1000).all()
    assert evals["holdout_accuracy"].between(0, 1).all() and (evals["eval_s"] > 0).all()
    manifest = runlog.read_manifest(float32)
    assert manifest["data"]["train_samples"] == 7000 and manifest["data"]["holdout_samples"] == 1000
    # the run's start is its rank 0 process's, before it loaded anything
    assert manifest["process_start_unix"] < manifest["start_unix"]
    times = tta.run_times(float32)
    assert 0 < times.startup_s < 300 and times.epoch_end_s > 0


def test_the_epochs_training_time_leaves_the_evaluations_out(float32):
    """epochs.csv's epoch_s is the training loop alone: the steps' own times add up to it
    (within the loop's bookkeeping), the held-out evaluations inside the loop excluded."""
    epochs, steps = pd.read_csv(float32 / "epochs.csv"), tta.read_steps(float32)
    evals = pd.read_csv(float32 / "evals.csv")
    for epoch, rows in steps.groupby("epoch"):
        inside = evals[evals["epoch"] == epoch]["eval_s"].sum()
        recorded = epochs.loc[epochs["epoch"] == epoch, "epoch_s"].iloc[0]
        assert rows["step_s"].sum() <= recorded < rows["step_s"].sum() + 0.5 * inside


def test_ddp_default_allreduce_takes_float32s_steps_bit_for_bit(float32, tmp_path):
    """What labs/bench/tta_grid.py's STEPS_OF rests on: at 2 ranks a + b is the same float in
    either order, so DDP's allreduce and Horovod's (through hvd_compress's none) train the same
    weights; a hook that rounds (DDP's fp16_compress_hook) does not."""
    ddp(tmp_path / "ddp-none")
    mine, theirs = pd.read_csv(float32 / "evals.csv"), pd.read_csv(tmp_path / "ddp-none" / "evals.csv")
    assert theirs["step"].tolist() == EVAL_STEPS
    assert theirs["holdout_loss"].tolist() == mine["holdout_loss"].tolist()
    ddp(tmp_path / "ddp-fp16", ["--ddp-fp16"])
    rounded = pd.read_csv(tmp_path / "ddp-fp16" / "evals.csv")
    assert rounded["holdout_loss"].tolist() != mine["holdout_loss"].tolist()
    assert runlog.read_manifest(tmp_path / "ddp-fp16")["config"] == "np2-fp16-ddphook-small"


def test_a_run_stops_at_the_first_evaluation_that_reaches_its_target(float32, tmp_path):
    evals = pd.read_csv(float32 / "evals.csv")
    # an evaluation above every one before it: the rerun (the same seed, the same steps) stops
    # exactly there
    best = evals["holdout_accuracy"].cummax().shift(fill_value=-1)
    index = next(i for i in range(1, len(evals)) if evals["holdout_accuracy"][i] > best[i])
    target = float(evals["holdout_accuracy"][index])
    done = horovod(tmp_path / "stop", ["--target-accuracy", f"{target}"])
    stopped = pd.read_csv(tmp_path / "stop" / "evals.csv")
    assert stopped["step"].tolist() == EVAL_STEPS[:index + 1]
    manifest = runlog.read_manifest(tmp_path / "stop")
    assert manifest["status"] == "complete" and "reached after" in manifest["reason"]
    assert "target reached" in done.stdout
    assert tta.read_steps(tmp_path / "stop")["step"].max() == EVAL_STEPS[index]


def test_a_resumed_run_records_each_evaluation_once(float32, tmp_path):
    out = tmp_path / "resumed"
    horovod(out, ["--max-steps", "17"])
    assert pd.read_csv(out / "evals.csv")["step"].tolist() == [5, 10, 12, 15]
    horovod(out, ["--resume"])
    again, whole = pd.read_csv(out / "evals.csv"), pd.read_csv(float32 / "evals.csv")
    assert again["step"].tolist() == EVAL_STEPS
    assert again["holdout_loss"].tolist() == whole["holdout_loss"].tolist()
