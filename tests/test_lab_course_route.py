"""--optimizer horovod (the course's in-tree route: Horovod's own hvd.DistributedOptimizer with
hvd.Compression.bit8 of the patched Horovod) against --optimizer plugin, on real MNIST with real
horovodrun.

With `--scale-block tensor` the plugin gives every gradient tensor one scale, as the course's
packets do; both routes gather every rank's codes and sum the decoded values in rank order, so
the two trainings are bit-identical by construction: the test asserts equality, not closeness.
(The plugin's default, a scale per 256 values in fused buckets, is checked against the
per-tensor interface block by block in tests/workers/exchange_checks.py.)
"""
import json
from pathlib import Path

import pandas as pd
import pytest

from test_lab import lab_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def routes(shared_runs, mnist_dir):
    """{route: run folder} of one 2-process bit8 epoch each: tests/test_lab.py's np2-bit8 run
    (--scale-block tensor: one scale per tensor, as the course's packets) and the same flags
    with --optimizer horovod, both shared runs (trained side by side with test_lab.py's)."""
    folders = lab_runs(shared_runs, ["np2-bit8", "np2-bit8-horovod"])
    return {"plugin": folders["np2-bit8"], "horovod": folders["np2-bit8-horovod"]}


@pytest.mark.multiprocess
def test_the_two_routes_train_bit_identically(routes):
    plugin, horovod = (pd.read_csv(routes[r] / "epochs.csv") for r in ("plugin", "horovod"))
    assert len(plugin) == len(horovod) == 1
    assert horovod["test_accuracy"].iloc[-1] == plugin["test_accuracy"].iloc[-1]
    assert horovod["test_loss"].tolist() == plugin["test_loss"].tolist()
    assert horovod["train_loss"].tolist() == plugin["train_loss"].tolist()
    assert plugin["test_accuracy"].iloc[-1] > 0.9          # and it did learn something
    steps = {r: pd.read_csv(routes[r] / "steps.csv") for r in routes}
    merged = steps["plugin"].merge(steps["horovod"], on=["rank", "step"], suffixes=("", "_hvd"))
    assert len(merged) == len(steps["plugin"]) == len(steps["horovod"]) == 2 * 63
    assert (merged["loss"] == merged["loss_hvd"]).all()


@pytest.mark.multiprocess
def test_horovod_route_records_what_it_can_measure(routes):
    steps = pd.read_csv(routes["horovod"] / "steps.csv")
    plugin = pd.read_csv(routes["plugin"] / "steps.csv")
    # Horovod's optimizer works in hooks and synchronize(): no per-phase times, honestly NaN
    for column in ("copy_s", "compress_s", "communicate_s", "decompress_s"):
        assert steps[column].isna().all()
    assert (steps["step_s"] > 0).all() and (steps["update_s"] > 0).all()
    assert (steps["forward_backward_s"] + steps["update_s"] <= steps["step_s"] + 1e-4).all()
    # bytes from the packet sizes (8-byte header + codes per tensor, to n-1 ranks); the plugin
    # counts what it really sends: a 4-byte scale + codes padded to 4 bytes per tensor
    assert steps["bytes_sent"].nunique() == 1 and plugin["bytes_sent"].nunique() == 1
    tensors, n = 8, 2                                       # the lab's Net: 4 layers
    gap = steps["bytes_sent"].iloc[0] - plugin["bytes_sent"].iloc[0]
    assert 0 < gap <= (n - 1) * 4 * tensors and plugin["bytes_sent"].iloc[0] > 0


@pytest.mark.multiprocess
def test_manifest_records_the_route(routes):
    plugin, horovod = (json.loads((routes[r] / "manifest.json").read_text())
                       for r in ("plugin", "horovod"))
    assert plugin["route"] == "plugin" and horovod["route"] == "horovod"
    assert plugin["reduction"] == horovod["reduction"] == "allgather"
    # Horovod's small network (COMMON): the name says so, after the route's variant
    assert plugin["config"] == "np2-bit8-small" and horovod["config"] == "np2-bit8-horovod-small"
    assert horovod["status"] == "complete"



@pytest.mark.unit
@pytest.mark.parametrize("argv", [
    ["--optimizer", "horovod", "--bit8-allreduce", "--route", "alltoall"],
    ["--optimizer", "horovod", "--bit8-allreduce", "--error-feedback"],
    ["--optimizer", "horovod", "--bit16-allreduce", "--error-feedback", "--route", "alltoall"],
])
def test_horovod_route_refuses_plugin_only_flags(lab, capsys, argv):
    with pytest.raises(SystemExit) as stop:
        lab.parse_args(argv)
    assert stop.value.code == 2
    assert "--optimizer horovod" in capsys.readouterr().err


@pytest.mark.unit
def test_optimizer_and_route_flags_default_and_choices(lab, capsys):
    args = lab.parse_args([])
    assert (args.optimizer, args.route) == ("plugin", None)
    args = lab.parse_args(["--optimizer", "horovod", "--bit8-allreduce", "--route", "allgather"])
    assert (args.optimizer, args.route) == ("horovod", "allgather")
    with pytest.raises(SystemExit):
        lab.parse_args(["--route", "mpi"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("old", [["--route", "horovod"], ["--route", "plugin"],
                                 ["--reduction", "alltoall"]])
def test_the_first_versions_spellings_are_refused(lab, capsys, old):
    """--route plugin|horovod (now --optimizer) and --reduction (now --route) are gone: a usage
    error, not a silent other meaning."""
    with pytest.raises(SystemExit) as stop:
        lab.parse_args(["--bit8-allreduce"] + old)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err or "unrecognized arguments" in err
