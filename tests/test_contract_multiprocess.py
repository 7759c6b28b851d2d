"""The contract on 2 real ranks (tests/workers/contract_checks.py: the one-file examples of
docs/extending.md, E5M2 and the sub-byte E2M1, among them), and a compressor written in one
file (docs/examples/e5m2_example.py) trained by the lab, labs/mnist.py, on 2 ranks."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from hvdrun import across_ranks, passed_checks
from hvd_compress.costmodel import methods
from labs.kit.launch import horovodrun_command, launch_env

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


@across_ranks("contract_checks")
def test_contract_on_two_ranks(controller, np, request):
    names = passed_checks(request)
    for name in ("one_file.trains.loss_falls", "e5m2.alltoall.bytes_are_the_cost_models",
                 "e2m1.trains.loss_falls", "e2m1.trains.identical_on_all_ranks",
                 "e2m1.allgather.equals_the_formats_reference",
                 "e2m1.alltoall.equals_the_formats_reference",
                 "e2m1.allgather.bytes_are_the_cost_models",
                 "e2m1.alltoall.bytes_are_the_cost_models",
                 "bf16.alltoall.tensor1.equals_float32_sum", "hook_error.step_raises_the_real_error",
                 "wrap_twice.only_the_new_hooks_fire", "close.same_bits_without_hooks"):
        assert name in names


def test_a_one_file_compressor_in_a_lab_run(tmp_path, mnist_dir):
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "docs" / "examples"),
                                                      env.get("PYTHONPATH")]))
    env["HVD_COMPRESS_SCHEMES"] = "e5m2_example"
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "labs" / "mnist.py"), "--e5m2-allreduce", "--out", str(out),
           "--data-dir", str(mnist_dir), "--split-test", "9000", "--epochs", "1",
           "--max-steps", "4", "--model", "horovod", "--no-progress"]
    done = subprocess.run(horovodrun_command(2, cmd, controller="gloo", cached_build_check=True), env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["compression"] == "e5m2" and manifest["config"] == "np2-e5m2-small", \
        done.stdout[-2000:] + done.stderr[-2000:]
    assert manifest["reduction"] == "allgather" and manifest["codec_path"] == "torch"
    steps = pd.read_csv(out / "steps_rank0.csv")
    assert len(steps) == 4
    # one byte a value and a scale per 256, as bit8 (e5m2 is registered in the ranks only)
    expected = methods.bytes_per_step("bit8", methods.MODEL_SHAPES["horovod"], 2)
    assert (steps["bytes_sent"] == expected).all()
