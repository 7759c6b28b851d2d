"""labs/fsdp_mnist.py (the lab's networks on FSDP2) under real torchrun, 2 Gloo ranks: the lab's
run folder, every rank with the same full state, a resumed run equal to one that never
stopped; and its flags."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddprun

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = ROOT / "tests" / "data" / "mnist"
STEPS = 4


def torchrun(out, *flags, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--master-port", str(ddprun.free_port()), str(ROOT / "labs" / "fsdp_mnist.py"),
           "--data-dir", str(MNIST_DIR), "--split-test", "2000", "--epochs", "2",
           "--steps-per-epoch", str(STEPS), "--test-batch-size", "2000", "--out", str(out),
           "--no-progress", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done.stdout


@pytest.mark.multiprocess
def test_the_fsdp_trainer_keeps_the_labs_records_and_resumes_bit_for_bit(tmp_path):
    whole = tmp_path / "whole"
    said = torchrun(whole, "--fsdp-scheme", "bit8", "--error-feedback")
    manifest = json.loads((whole / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["config"] == "np2-bit8-fsdp-ef"
    assert manifest["controller"] == "torch-gloo" and manifest["collective"] == "alltoall"
    assert manifest["world_size"] == 2 and manifest["epochs_completed"] == 2
    assert manifest["error_feedback"] is True
    for rank in (0, 1):
        rows = list(csv.DictReader(open(whole / f"steps_rank{rank}.csv")))
        assert len(rows) == 2 * STEPS and all(float(r["bytes_sent"]) > 0 for r in rows)
    epochs = list(csv.DictReader(open(whole / "epochs.csv")))
    assert [int(e["epoch"]) for e in epochs] == [1, 2]
    assert all(0.0 < float(e["test_accuracy"]) <= 1.0 for e in epochs)
    # every rank gathered the same full state at each epoch's end (the trainer checks it)
    assert said.count("every rank holds the same full state") == 2, said
    state = torch.load(whole / "checkpoint.pt", weights_only=False)
    assert state["model"]["fc1.weight"].shape == (128, 9216)       # the full network, not a shard
    assert set(state["optimizer"]["state"]) >= {"fc1.weight", "conv1.bias"}
    assert len(state["compression_state"]) == 2                    # each rank's residuals
    assert all(s is not None for s in state["compression_state"])

    # stopped after epoch 1, then resumed: the same weights as the run that never stopped
    part = tmp_path / "part"
    torchrun(part, "--fsdp-scheme", "bit8", "--error-feedback", "--max-steps", str(STEPS))
    assert json.loads((part / "manifest.json").read_text())["status"] == "interrupted"
    torchrun(part, "--fsdp-scheme", "bit8", "--error-feedback", "--resume")
    resumed = torch.load(part / "checkpoint.pt", weights_only=False)
    assert resumed["epoch"] == 2
    for name, tensor in state["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name


@pytest.mark.multiprocess
def test_fsdp2s_own_reduce_scatter_and_its_cast_are_recorded(tmp_path):
    torchrun(tmp_path / "bf16", "--reduce-dtype", "bf16", "--epochs", "1", "--model", "horovod")
    manifest = json.loads((tmp_path / "bf16" / "manifest.json").read_text())
    assert manifest["config"] == "np2-none-fsdp-bf16reduce-small"
    assert manifest["collective"] == "reduce_scatter"
    rows = list(csv.DictReader(open(tmp_path / "bf16" / "steps_rank0.csv")))
    # FSDP2's bfloat16 reduce-scatter: (n - 1) padded shards of 2 bytes a value
    from labs.fsdp_mnist import reduce_scatter_bytes
    from labs.mnist import Net
    assert {float(r["bytes_sent"]) for r in rows} == {reduce_scatter_bytes(Net(), 2, 2)}


@pytest.mark.unit
def test_the_fsdp_trainers_flags():
    from labs import fsdp_mnist
    args = fsdp_mnist.parse_args(["--fsdp-scheme", "bf16"])
    assert args.compression == "bf16" and fsdp_mnist.config_name(args, 4) == "np4-bf16-fsdp"
    args = fsdp_mnist.parse_args([])
    assert args.fsdp_scheme == "none" and fsdp_mnist.config_name(args, 2) == "np2-none-fsdp"
    for bad in (["--bit8-allreduce"], ["--route", "alltoall"], ["--error-feedback"],
                ["--fsdp-scheme", "topk"], ["--use-adasum"]):
        with pytest.raises(SystemExit):
            fsdp_mnist.parse_args(bad)
    if not fsdp_mnist.weights_option():
        with pytest.raises(SystemExit):
            fsdp_mnist.parse_args(["--fsdp-weights", "bit8"])


@pytest.mark.unit
def test_reduce_scatter_bytes_pads_dim0_to_the_ranks():
    from labs.fsdp_mnist import reduce_scatter_bytes
    model = torch.nn.Linear(3, 5)            # weight 5x3, bias 5: dim 0 of 5 on 2 ranks: 3 rows
    assert reduce_scatter_bytes(model, 2, 4) == 1 * (3 * 3 + 3) * 4
    assert reduce_scatter_bytes(model, 4, 2) == 3 * (2 * 3 + 2) * 2
