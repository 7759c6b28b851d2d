"""Elastic training (labs/elastic.py) under horovodrun's elastic mode (Gloo), on three slots of
this machine, each under a name of its own (Horovod blacklists a whole host when a worker on it
fails). A rank is killed with SIGKILL in epoch 2 of 6, halfway between two commits, and its slot
taken off the discovery list; the others roll back to the last commit and go on with two ranks;
the slot is listed again and a new rank joins. The run must end on its own, with no step recorded twice,
every sample of every epoch used once, and a final accuracy no lower than the same training's
with no fault, within what two runs with different batches show on 2,000 test images (NOISE
below; one-sided: the shrunk epochs take more, smaller steps).

The test proves detection, rollback and rejoin, not training, so the data is small: the first
8,000 Fashion-MNIST test images train (--split-test), the other 2,000 test; 6 epochs of 42
steps at 3 ranks. What decides the job's length is waiting, not training: the survivor that
does not see the dead rank's socket close waits out Gloo's timeout in the collectives
(DETECT_S, 5 s here; labs/elastic.py's default is 10 s; its rendezvous, where ranks wait for a
joining one, have 60 s), and the new rank's start. The run with no fault (the reference) is the
same trainer in one process with the same global batches (REFERENCE), started with it. After
the shrink the job must still be training when the slot comes back: Horovod blacklists the
slot when the survivors meet again, not when its rank dies, for the cooldown
(--blacklist-cooldown-range 1 2: 2 s), then the discovery lists it within a second and the
survivors meet the new rank at their next commit. The four epochs left give that
about 270 steps at 2 ranks, some 15 s at the 54 ms a step seen under load 4, against the 2-3 s
the slot takes to come back (4 epochs of this set were once done before the slot came back,
with a 10 s cooldown); the new rank's start is waited for in the rendezvous, not trained
through.
"""
import json
import math
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

pytestmark = pytest.mark.multiprocess     # not slow: 37 s idle (2-core Zen 4), main's version

HOSTS = ["localhost:1", "127.0.0.1:1", f"{socket.gethostname()}:1"]
TRAIN = 8000
TESTED = 10000 - TRAIN
# Two runs whose batches differ (the fault changes them from epoch 2 on) end apart by chance:
# here 0.0-1.2 points either way, epoch by epoch (2026-11-24: a fault-free-equivalent 1.2 point
# gap failed the one-point bound this test had); the one-process reference (77.35% every time:
# one process, one seed) minus faulty runs: +0.35, -0.9, -3.0, -1.8 points. Two standard errors
# of the difference of two accuracies near 80% on TESTED images, 2 * sqrt(2 * 0.8 * 0.2 / 2000) = 2.5 points; a lost
# rollback (weights re-initialised, a step skipped or applied twice at scale) costs far more.
NOISE = 2 * (2 * 0.8 * 0.2 / TESTED) ** 0.5
COMMIT_EVERY = 5
# Gloo's timeout in the collectives (labs/elastic.py's detection; its default 10 s): how long the
# survivor that does not see the dead rank's socket close waits. A healthy rank never makes
# another wait that long: Horovod's background thread (C++, no GIL) takes part in every
# negotiation cycle while its Python thread is busy (main's joining rank built its model and
# optimizer, torch._dynamo's import, 16.8 s under load 15 while the others waited in the
# broadcast under a 10 s timeout), so only a whole process stopped for 5 s would trip it; the
# second init's rendezvous is among processes all running (they leave the first together); the
# first, where ranks wait for a starting one, keeps 60 s (labs/elastic.py's init_twice).
DETECT_S = 5
EPOCHS = 6
STEPS_3_RANKS = math.ceil(TRAIN / (3 * 64))     # 42 steps an epoch at 3 ranks
# Horovod's small network at the lab's lr and momentum (0.02, 0.9; labs/kit/flags.py): on this
# small set its accuracy rose 74.7, 75.5, 77.1, 77.5, 79.2% in epochs 2-6, where Horovod's
# example's 0.01 and 0.5 went 66.1, 67.4, 69.8% in epochs 2-4 and dipped 3.5 points in one
# faulty run's epoch 3.
BATCH, LR = 64, 0.02               # the lab's (labs/mnist.py, labs/kit/flags.py), said here
COMMON = ["--dataset", "fashion-mnist", "--split-test", str(TRAIN), "--epochs", str(EPOCHS),
          "--bit8-allreduce", "--no-progress", "--commit-every", str(COMMIT_EVERY),
          "--model", "horovod"]
FLAGS = COMMON + ["--batch-size", str(BATCH), "--lr", str(LR)]
# The run with no fault: the same trainer in one process, the same global batches (a step at 3
# ranks takes the next 3 x 64 samples of the epoch's order, every third to each rank; here the
# same 192 in one batch), the same lr (0.02 x 3 ranks) and momentum: the same training in
# expectation (the dropout masks and bit8's rounding differ) for a third of the processes (a
# 3-rank job was the reference before issue 23's fourth round: 3 ranks' imports and Gloo
# beside the faulty job)
REFERENCE = COMMON + ["--batch-size", str(3 * BATCH), "--lr", str(3 * LR)]


def launch_reference(out):
    """labs/elastic.py in one process, no horovodrun: Horovod's world of one (Gloo: MPI
    cannot be initialised again after the second init's shutdown)."""
    env = launch_env()
    env.update(HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo")
    log = open(out.parent / f"{out.name}.log", "w")
    return subprocess.Popen([sys.executable, str(ROOT / "labs" / "elastic.py"), "--out", str(out)]
                            + REFERENCE, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)


def launch(out, hosts_file):
    hosts_file.write_text("\n".join(HOSTS) + "\n")
    env = launch_env()
    env["HVDC_HOSTS_FILE"] = str(hosts_file)
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "3", "--min-np",
           "2", "--max-np", "3", "--host-discovery-script", str(ROOT / "scripts" / "discover_hosts.sh"),
           "--blacklist-cooldown-range", "1", "2", "--gloo-timeout-seconds", str(DETECT_S),
           sys.executable, str(ROOT / "labs" / "elastic.py"), "--out", str(out)] + FLAGS
    log = open(out.parent / f"{out.name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)


def wait_for(what, timeout, poll=0.1):
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


def rows_in(path):
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def epochs_done(out):
    return rows_in(out / "epochs.csv")


@pytest.fixture(scope="module")
def killed_and_rejoined(tmp_path_factory):
    """The faulty run and, beside it, the same training with no fault in one process: {out,
    straight, killed, shrink, relisted}."""
    if not os.path.isfile("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz"):
        pytest.fail("Fashion-MNIST is missing: scripts/setup.sh installs dataset-fashion-mnist")
    tmp_path = tmp_path_factory.mktemp("elastic")
    out, hosts = tmp_path / "faulty", tmp_path / "hosts"
    proc = launch(out, hosts)
    # the run with no fault, beside it from the start: the test is CPU-bound on 2 cores (the
    # reference's 13 s of CPU fill the survivors' waits and the new rank's start either way),
    # and one process started late is what ends last under load (a fair share of a core is
    # small there); its numbers do not depend on what runs beside it
    straight, reference = tmp_path / "straight", None
    try:
        reference = launch_reference(straight)

        def in_epoch_2():
            """a commit in epoch 2 (the steps after it are rolled back)"""
            return epochs_done(out) >= 1 and rows_in(out / "steps.csv") > STEPS_3_RANKS
        wait_for(in_epoch_2, 600)
        # kill halfway to the next commit, so that there are steps to roll back: the committed
        # rows' wall times say how long a step takes now
        step_s = pd.read_csv(out / "steps.csv")["wall_time"].diff().tail(10).median()
        time.sleep(min(5.0, COMMIT_EVERY / 2 * step_s))
        pid, host = (out / "pids" / "rank2").read_text().split()
        killed = time.time()
        os.kill(int(pid), signal.SIGKILL)
        hosts.write_text("\n".join(h for h in HOSTS if not h.startswith(host + ":")) + "\n")

        def shrunk():
            """the job going on with 2 ranks"""
            m = runlog.read_manifest(out)
            return [e for e in m["membership"] if e["world_size"] == 2]
        shrink = wait_for(shrunk, 120)[0]
        hosts.write_text("\n".join(HOSTS) + "\n")               # the slot is back
        relisted = time.time()
        code = finish(proc)
        assert code == 0, (tmp_path / "faulty.log").read_text()[-3000:]
        assert finish(reference) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    finally:
        for job in (proc, reference):
            if job is not None and job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    return dict(out=out, straight=straight, killed=killed, shrink=shrink, relisted=relisted)


def test_killed_rank_rolls_back_goes_on_and_its_slot_rejoins(killed_and_rejoined, tmp_path):
    run = killed_and_rejoined
    out, straight = run["out"], run["straight"]
    killed, shrink, relisted = run["killed"], run["shrink"], run["relisted"]
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
    assert epochs["epoch"].tolist() == list(range(1, EPOCHS + 1))
    assert ref["epoch"].tolist() == list(range(1, EPOCHS + 1)) and set(ref["world_size"]) == {1}
    lost = ref["test_accuracy"].iloc[-1] - epochs["test_accuracy"].iloc[-1]
    assert lost <= NOISE, (epochs["test_accuracy"].tolist(), ref["test_accuracy"].tolist())
    figures = {"detect_s": shrink["unix"] - killed, "steps_rolled_back": shrink["steps_rolled_back"],
               "rejoin_s_after_relisting": rejoin["unix"] - relisted,
               "steps": len(steps), "accuracy": float(epochs["test_accuracy"].iloc[-1]),
               "accuracy_uninterrupted": float(ref["test_accuracy"].iloc[-1])}
    (tmp_path / "figures.json").write_text(json.dumps(figures))
    print("elastic figures:", json.dumps(figures))
