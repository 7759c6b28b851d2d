"""Command-line edge cases of labs/mnist.py, as a user meets them: a clear message, exit code 2,
and no run folder left behind.

argparse and check_args run before Horovod starts, so the table of bad values is checked in
process (parse_args exits 2 with the message on stderr); one real process proves what the user
sees (exit code 2, the message, no traceback, no run folder), and two 2-rank launches, side by
side, prove that a data set too small for the ranks stops every rank with one message.
"""
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import MNIST_DIR, ROOT

from labs.kit import data as lab_data
from labs.kit.launch import horovodrun_command, launch_env

TRAINER = str(ROOT / "labs" / "mnist.py")


def lab(argv, out, ranks=1):
    cmd = [sys.executable, TRAINER, "--data-dir", str(MNIST_DIR), "--out", str(out)] + argv
    if ranks > 1:
        cmd = horovodrun_command(ranks, cmd, controller="gloo", cached_build_check=True)
    return subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), cwd=ROOT,
                          timeout=300)


@pytest.mark.unit
@pytest.mark.parametrize("argv,message", [
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["--epochs", "-3"], "--epochs must be at least 1, got -3"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--test-batch-size", "-1"], "--test-batch-size must be at least 1"),
    (["--lr", "-0.1"], "--lr must be a positive number, got -0.1"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--lr", "inf"], "--lr must be a positive number"),
    (["--momentum", "-0.5"], "--momentum must be in [0, 1)"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
    (["--num-threads", "0"], "--num-threads must be at least 1"),
    (["--step-timeout", "-1"], "--step-timeout must be >= 0"),
    (["--step-timeout", "nan"], "--step-timeout must be >= 0"),
    (["--step-timeout-floor", "0"], "--step-timeout-floor must be > 0 seconds, got 0.0"),
    (["--step-timeout-floor", "nan"], "--step-timeout-floor must be > 0"),
    (["--epochs", "two"], "invalid int value: 'two'"),
    (["--topk-allreduce", "0"], "--topk-allreduce RATIO must be in (0, 1]"),
    (["--topk-allreduce", "1.5"], "--topk-allreduce RATIO must be in (0, 1]"),
    (["--powersgd-allreduce", "0"], "--powersgd-allreduce RANK must be at least 1"),
    (["--int8-allreduce", "--onebit-allreduce"], "not allowed with argument"),
    (["--onebit-allreduce", "--route", "alltoall"], "not to onebit with alltoall"),
    (["--topk-allreduce", "0.01", "--route", "allgather"], "not to topk with allgather"),
    (["--error-feedback"], "--error-feedback needs a compressed exchange"),
    (["--int8-allreduce", "--optimizer", "horovod"], "the other methods need --optimizer plugin"),
])
def test_bad_values_are_clear_errors(lab, capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as stop:
        lab.parse_args(["--data-dir", str(tmp_path), "--out", str(tmp_path / "run")] + argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.unit
@pytest.mark.parametrize("split", [10000, 60000])
def test_split_test_beyond_the_data_is_a_clear_error(tmp_path, split):
    """Larger than the data: the MNIST test set has 10,000 images, one must be left to test on.
    (load_data turns this error into every rank's exit 2: tests/test_lab.py's missing-data
    test runs that path in a real process.)"""
    with pytest.raises(lab_data.DataError) as error:
        lab_data.load_dataset("mnist", str(tmp_path), split_test=split)   # before any file
    assert f"--split-test must be between 1 and 9999 (the test set has 10000 images), got {split}" \
        == str(error.value)


@pytest.mark.interpreter
def test_a_bad_value_in_a_real_process(tmp_path):
    """What the user sees: exit code 2, the message, no traceback, no run folder."""
    done = subprocess.run([sys.executable, TRAINER, "--data-dir", str(tmp_path), "--out",
                           str(tmp_path / "run"), "--epochs", "0"],
                          capture_output=True, text=True, env=launch_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--epochs must be at least 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.unit
def test_step_timeout_zero_disables_the_watchdog():
    from labs.kit.watchdog import FLOOR_S
    from labs.mnist import parse_args
    assert parse_args(["--step-timeout", "0"]).step_timeout == 0
    assert parse_args([]).step_timeout is None          # adaptive: labs/kit/watchdog.py
    assert parse_args([]).step_timeout_floor == FLOOR_S  # the adaptive limit's default floor
    assert parse_args(["--step-timeout-floor", "5"]).step_timeout_floor == 5


# --split-test 1: one training image for two processes; 9999: one test image left for two.
TOO_SMALL = {"training": "1", "test": "9999"}


@pytest.fixture(scope="module")
def too_many_ranks(tmp_path_factory):
    """{set: (the 2-rank launch's result, its --out)} for each split of TOO_SMALL, the two
    launched side by side (each is start-up: horovodrun, imports, the rendezvous)."""
    outs = {name: tmp_path_factory.mktemp(f"too-small-{name}") / "run" for name in TOO_SMALL}
    with ThreadPoolExecutor(max_workers=len(TOO_SMALL)) as pool:
        done = {name: pool.submit(lab, ["--split-test", split], outs[name], 2)
                for name, split in TOO_SMALL.items()}
    return {name: (done[name].result(), outs[name]) for name in TOO_SMALL}


@pytest.mark.multiprocess
def test_more_ranks_than_training_samples(too_many_ranks):
    """--split-test 1 on 2 ranks: one training image for two processes."""
    done, run_dir = too_many_ranks["training"]
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "the training set has 1 samples but there are 2 ranks" in out, out[-3000:]
    assert 'mnist.py", line' not in out      # horovodrun's own traceback, none of the lab's
    assert not run_dir.exists()


@pytest.mark.multiprocess
def test_more_ranks_than_test_samples(too_many_ranks):
    """--split-test 9999 on 2 ranks: one test image left for two processes."""
    done, run_dir = too_many_ranks["test"]
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "the test set has 1 samples but there are 2 ranks" in out, out[-3000:]
    assert not run_dir.exists()


@pytest.mark.unit
def test_model_basic_is_the_pytorch_examples_network():
    import torch
    from labs.kit.table import config_name
    from labs.mnist import MODELS, parse_args
    basic = MODELS["basic"]()
    assert sum(p.numel() for p in basic.parameters()) == 1_199_882
    assert sum(p.numel() for p in MODELS["horovod"]().parameters()) == 21_840
    out = basic(torch.zeros(3, 1, 28, 28))
    assert out.shape == (3, 10) and torch.allclose(out.exp().sum(1), torch.ones(3))
    assert parse_args([]).model == "basic"          # the lab's default (docs/lab.md, Defaults)
    assert config_name(parse_args(["--model", "basic", "--bit8-allreduce"]), 2) == "np2-bit8"
    assert config_name(parse_args(["--model", "horovod", "--bit8-allreduce"]), 2) == "np2-bit8-small"
    assert config_name(parse_args(["--bit8-allreduce"]), 2) == "np2-bit8"


@pytest.mark.unit
def test_method_flags_name_their_runs():
    from labs.kit.table import config_name
    from labs.mnist import parse_args
    names = {tuple(a): config_name(parse_args(a), 2) for a in (
        ["--int8-allreduce"], ["--onebit-allreduce"], ["--topk-allreduce", "0.01"],
        ["--topk-allreduce", "0.1"], ["--powersgd-allreduce", "2"], ["--powersgd-allreduce", "4"],
        ["--int8-allreduce", "--route", "alltoall"])}
    assert list(names.values()) == ["np2-int8", "np2-onebit", "np2-topk", "np2-topk-ratio0.1",
                                    "np2-powersgd", "np2-powersgd-rank4", "np2-int8-alltoall"]
    assert parse_args(["--onebit-allreduce"]).error_feedback is None     # the method's default
