"""scripts/check_fsdp_cuda.py, the FSDP2 front's device check (NCCL, CUDA tensors), as far as a
machine without a GPU can run it: its checks on the CPU with Gloo, with Horovod unimportable
(a lent GPU machine has none), and its message where there is no device."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the script as a lent machine runs it, with Horovod unimportable
WITHOUT_HOROVOD = ("import runpy, sys; sys.modules['horovod'] = None; "
                   "sys.argv = ['check_fsdp_cuda'] + sys.argv[1:]; "
                   "runpy.run_module('scripts.check_fsdp_cuda', run_name='__main__')")


@pytest.mark.multiprocess
def test_check_fsdp_cuda_runs_its_checks_on_the_cpu_without_horovod(tmp_path):
    report_path = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-c", WITHOUT_HOROVOD, "--device", "cpu",
                           "--out", str(report_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["backend"] == "gloo" and not report["horovod_loaded"]
    for label in ("none", "fp16", "bit16", "bf16", "bit8", "int8", "bit8+ef"):
        assert report["fsdp"][label]["ok"], (label, report["fsdp"][label])
        assert report["fsdp"][label]["finite"], label
    assert "bit for bit" in report["fsdp"]["none"]["compared"]
    for label in ("fp16", "bit16", "bf16", "bit8", "int8", "bit8+ef"):
        assert report["codecs"][label]["ok"], (label, report["codecs"][label])


@pytest.mark.interpreter
def test_check_fsdp_cuda_says_when_there_is_no_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run")
    done = subprocess.run([sys.executable, "-m", "scripts.check_fsdp_cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
