"""Links that fail under the emulated network (labs.netem, one namespace per rank): a rank's
link set down, every packet lost, a link slowed to a crawl end a 2-process lab run within a
bounded time with an error naming the cause; 2% packet loss and a milder slowdown are ridden
out; after a failure the run resumes (--resume, links healthy again) with no step recorded
twice (issue 15).

Each case trains Horovod's small network on Fashion-MNIST for 2 epochs over 1 Gbit/s links,
waits until rank 0 is 50 steps into epoch 2 (so epoch 1's checkpoint exists), then injects the
fault with `python -m labs.netem fault ...`. The measured seconds from the fault to the end of
the job are printed (pytest -s); docs/reliability.md's rows come from them.
"""
import json
import os
import re
import subprocess
import sys
import time

import pandas as pd
import pytest

from conftest import ROOT

from labs.kit import runlog
from labs.kit.launch import launch_env

TRAINER = str(ROOT / "labs" / "mnist.py")
FLAGS = ["--dataset", "fashion-mnist", "--epochs", "2", "--model", "horovod", "--lr", "0.01",
         "--momentum", "0.5", "--no-progress"]
STEPS_PER_EPOCH = 469            # 60,000 images, 2 ranks, batch 64
BOUND_S = 60                     # the job ends this soon after the fault
START_TIMEOUT_S = 240


def netem_problem():
    if os.geteuid() != 0:
        return "network emulation needs root"
    done = subprocess.run([sys.executable, "-m", "labs.netem", "check"], capture_output=True,
                          text=True, timeout=60)
    return None if done.returncode == 0 else f"labs.netem check failed: {done.stdout}"


@pytest.fixture(autouse=True)
def needs_netem():
    problem = netem_problem()
    if problem:
        pytest.skip(problem)
    if not os.path.isfile("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        pytest.skip("needs Debian's dataset-fashion-mnist (scripts/test.sh installs it)")


def command(out, delay, resume=False):
    return ([sys.executable, "-m", "labs.netem", "run", "-n", "2", "--rate", "1gbit",
             "--delay", delay, "--timeout", "600", "--", sys.executable, TRAINER, "--out", str(out)]
            + FLAGS + (["--resume"] if resume else []))


def fault(*args):
    done = subprocess.run([sys.executable, "-m", "labs.netem", "fault", *map(str, args)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def steps_written(path):
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def run_with_fault(out, delay, *what):
    """Start the run, inject `what` 50 steps into epoch 2; (exit code, output, seconds from
    the fault to the job's end)."""
    proc = subprocess.Popen(command(out, delay), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=launch_env(), cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while steps_written(out / "steps_rank0.csv") < STEPS_PER_EPOCH + 50:
        assert proc.poll() is None, f"ended before the fault:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "epoch 2 not reached in time"
        time.sleep(0.2)
    fault(*what)
    faulted = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=BOUND_S + 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    return proc.returncode, output, time.monotonic() - faulted


def resume_completes(out, delay):
    """--resume with healthy links finishes the run; every step of every rank appears once."""
    done = subprocess.run(command(out, delay, resume=True), capture_output=True, text=True,
                          env=launch_env(), cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert runlog.read_manifest(out)["status"] == "complete"
    steps = pd.read_csv(out / "steps.csv")
    assert not steps.duplicated(["rank", "epoch", "batch"]).any()
    assert len(steps) == 2 * 2 * STEPS_PER_EPOCH
    epochs = pd.read_csv(out / "epochs.csv")
    assert epochs["epoch"].tolist() == [1, 2]
    return float(epochs["test_accuracy"].iloc[-1])


def said(output):
    """The watchdog's sentences (any rank's) and the run's tail, for an assertion message."""
    return "\n".join(re.findall(r"hvd-compress: rank \d+:[^\n]*", output)) + "\n...\n" + output[-3000:]


def report(case, seconds, output, accuracy=None):
    """One line for docs/reliability.md (pytest -s)."""
    print(f"\n[link fault] {case}: ended {seconds:.1f} s after the fault"
          + (f"; resumed to {100 * accuracy:.2f}%" if accuracy is not None else ""))
    cause = re.search(r"(Link down|No traffic|The network crawls)[^\n]*", output)
    if cause:
        print(f"[link fault] {case}: {cause.group(0)[:200]}")


def test_a_link_set_down_ends_the_job_naming_it_and_the_run_resumes(tmp_path):
    out = tmp_path / "down"
    code, output, seconds = run_with_fault(out, "0", "down", 1)
    assert code != 0 and seconds <= BOUND_S, (code, seconds, output[-3000:])
    assert "rank 1's network interface eth0 is down" in output, said(output)
    manifest = runlog.read_manifest(out)
    assert manifest["status"] == "failed" and "Link down" in manifest["reason"], manifest
    report("rank 1's eth0 down", seconds, output, resume_completes(out, "0"))


def test_every_packet_lost_ends_the_job_naming_it(tmp_path):
    out = tmp_path / "partition"
    code, output, seconds = run_with_fault(out, "0.1ms", "loss", 1.0)
    assert code != 0 and seconds <= BOUND_S, (code, seconds, output[-3000:])
    assert "No traffic: every link is up" in output, said(output)
    report("100% loss", seconds, output, resume_completes(out, "0.1ms"))


def test_a_link_that_crawls_ends_the_job_naming_it(tmp_path):
    out = tmp_path / "crawl"
    code, output, seconds = run_with_fault(out, "0", "rate", 1, "20kbit")
    assert code != 0 and seconds <= BOUND_S, (code, seconds, output[-3000:])
    assert "The network crawls" in output, said(output)
    report("rank 1 at 20 kbit/s", seconds, output, resume_completes(out, "0"))


@pytest.mark.parametrize("what,case", [(("loss", 0.02), "2% loss"),
                                       (("rate", 1, "10mbit"), "rank 1 at 10 Mbit/s")])
def test_mild_faults_are_ridden_out(tmp_path, what, case):
    out = tmp_path / "mild"
    delay = "0.1ms" if what[0] == "loss" else "0"
    code, output, seconds = run_with_fault(out, delay, *what)
    assert code == 0, output[-3000:]
    assert runlog.read_manifest(out)["status"] == "complete"
    steps = pd.read_csv(out / "steps.csv")
    assert len(steps) == 2 * 2 * STEPS_PER_EPOCH and not steps.duplicated(["rank", "epoch", "batch"]).any()
    if what[0] == "loss":                  # the bridge really dropped frames
        stats = json.loads(re.search(r"netem: delay bridge (\{.*\})", output).group(1))
        assert stats["dropped_loss"] > 0
    accuracy = float(pd.read_csv(out / "epochs.csv")["test_accuracy"].iloc[-1])
    report(case + " (ridden out)", seconds, output, accuracy)
