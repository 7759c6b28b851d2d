"""Elastic training (labs/elastic.py) under horovodrun's elastic mode (Gloo), on three slots of
this machine, each under a name of its own (Horovod blacklists a whole host when a worker on it
fails). A rank is killed with SIGKILL in epoch 2 of 3 and its slot taken off the discovery
list; the others roll back to the last commit and go on with two ranks; the slot is listed
again and a new rank joins. The run must end on its own, with no step recorded twice, every
sample of every epoch used once, and a final accuracy no more than one point below the same run
with no fault. (Not "within one point" both ways: the shrunk epoch takes more, smaller steps, and
the small network's third epoch moves by up to two points either way; CI once saw 78.9% after
the fault against 77.05% without.)"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pandas as pd
import pytest

from conftest import ROOT

from labs.kit import runlog
from labs.kit.launch import launch_env

HOSTS = ["localhost:1", "127.0.0.1:1", f"{socket.gethostname()}:1"]
# Horovod's small network at its example's lr and momentum (the measurements in docs/lab.md).
FLAGS = ["--dataset", "fashion-mnist", "--epochs", "3", "--bit8-allreduce", "--no-progress",
         "--commit-every", "10", "--model", "horovod", "--lr", "0.01", "--momentum", "0.5"]
TRAIN = 60000


def launch(out, hosts_file):
    hosts_file.write_text("\n".join(HOSTS) + "\n")
    env = launch_env()
    env["HVDC_HOSTS_FILE"] = str(hosts_file)
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "3", "--min-np",
           "2", "--max-np", "3", "--host-discovery-script", str(ROOT / "scripts" / "discover_hosts.sh"),
           "--blacklist-cooldown-range", "5", "10",
           sys.executable, str(ROOT / "labs" / "elastic.py"), "--out", str(out)] + FLAGS
    log = open(out.parent / f"{out.name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)


def wait_for(what, timeout, poll=0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what.__doc__}")


def finish(proc, timeout=900):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def epochs_done(out):
    path = out / "epochs.csv"
    return len(pd.read_csv(path)) if path.is_file() and path.stat().st_size else 0


@pytest.fixture(scope="module")
def fashion():
    if not os.path.isfile("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        pytest.fail("Fashion-MNIST is missing: scripts/setup.sh installs dataset-fashion-mnist")


def test_killed_rank_rolls_back_goes_on_and_its_slot_rejoins(fashion, tmp_path):
    straight = tmp_path / "straight"
    assert finish(launch(straight, tmp_path / "hosts-straight")) == 0, \
        (tmp_path / "straight.log").read_text()[-3000:]

    out, hosts = tmp_path / "faulty", tmp_path / "hosts"
    proc = launch(out, hosts)

    def in_epoch_2():
        """epoch 1 finished"""
        return epochs_done(out) >= 1
    wait_for(in_epoch_2, 600)
    time.sleep(3)
    pid, host = (out / "pids" / "rank2").read_text().split()
    killed = time.time()
    os.kill(int(pid), signal.SIGKILL)
    hosts.write_text("\n".join(h for h in HOSTS if not h.startswith(host + ":")) + "\n")

    def shrunk():
        """the job going on with 2 ranks"""
        m = runlog.read_manifest(out)
        return [e for e in m["membership"] if e["world_size"] == 2]
    shrink = wait_for(shrunk, 120)[0]
    hosts.write_text("\n".join(HOSTS) + "\n")                   # the slot is back
    relisted = time.time()
    code = finish(proc)
    assert code == 0, (tmp_path / "faulty.log").read_text()[-3000:]

    manifest = runlog.read_manifest(out)
    assert manifest["status"] == "complete"
    sizes = [e["world_size"] for e in manifest["membership"]]
    assert sizes[:3] == [3, 2, 3], manifest["membership"]       # start, shrink, rejoin
    rejoin = manifest["membership"][2]
    steps = pd.read_csv(out / "steps.csv")
    assert not steps["step"].duplicated().any()
    assert steps["step"].tolist() == list(range(1, len(steps) + 1))
    assert {2, 3} <= set(steps["world_size"])
    for epoch, rows in steps.groupby("epoch"):                  # every sample once an epoch
        assert TRAIN - 3 < rows["samples"].sum() <= TRAIN, epoch
    epochs, ref = pd.read_csv(out / "epochs.csv"), pd.read_csv(straight / "epochs.csv")
    assert epochs["epoch"].tolist() == [1, 2, 3]
    lost = ref["test_accuracy"].iloc[-1] - epochs["test_accuracy"].iloc[-1]
    assert lost <= 0.01, (epochs["test_accuracy"].tolist(), ref["test_accuracy"].tolist())
    figures = {"detect_s": shrink["unix"] - killed, "steps_rolled_back": shrink["steps_rolled_back"],
               "rejoin_s_after_relisting": rejoin["unix"] - relisted,
               "accuracy": float(epochs["test_accuracy"].iloc[-1]),
               "accuracy_uninterrupted": float(ref["test_accuracy"].iloc[-1])}
    (tmp_path / "figures.json").write_text(json.dumps(figures))
    print("elastic figures:", json.dumps(figures))
