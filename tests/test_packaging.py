"""The plugin as a user installs it. The sdist of this checkout holds the plugin, its kernel's
C++ sources, the planner's default inputs, its licence and metadata, not the lab kit; the wheel
pip builds from that sdist too. Installed with pip into a fresh virtualenv beside PyTorch's CPU
wheel (docs/setup.md) and run from a folder under /tmp with no checkout on the path: three
processes that start together with an empty cache compile the kernel once and all use it, bit
for bit the torch path's codes; `labs` does not import; every console command runs its main
mode and names itself in its usage line.
"""
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.build          # builds an sdist and a wheel, a virtualenv, the kernel

# What a copy of the checkout leaves out: setuptools writes build/ and *.egg-info where it builds.
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "results", "runs", "build", "dist",
                                     "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")
KERNEL_SOURCES = {f"hvd_compress/codecs/native/{f}" for f in ("blocks.cpp", "kernels.h",
                                                              "kernels_x86.h")}
PLANNER_DATA = {f"hvd_compress/auto/defaults/{f}" for f in (
    "README.md", "step_summary.csv", "bucket_errors.csv", "collective-cpu/cpu-np2.csv",
    "collective-cpu/cpu-np4.csv")}
COMMANDS = ("hvd-compress-costmodel", "hvd-compress-plan", "hvd-compress-build-kernel")
COMPILING = "compiling the native codec kernel once"

# One process of a user's job: code a few thousand values (NaN, +-Inf, 11 decades) by the
# kernel and by the torch path, sum three ranks' codes both ways, and say what it ran.
USE = r"""
import json, sys, torch
import hvd_compress
from hvd_compress.codecs import E4M3, FP16, blocks, native
g = torch.Generator().manual_seed(int(sys.argv[1]))
n = 4099
x = torch.randn(3, n, generator=g) * 10.0 ** torch.randint(-8, 3, (3, n), generator=g)
x[:, ::97] = float("nan"); x[:, 5::199] = float("inf"); x[:, 7::211] = float("-inf")
same = {}
for fmt in (E4M3, FP16):
    coded = []
    for encode in (blocks.encode, blocks.encode_reference):
        codes = torch.empty(3, n, dtype=blocks.code_dtype(fmt))
        scales = torch.empty(3, blocks.num_blocks(n))
        for r in range(3):
            encode(x[r], fmt, codes[r], scales[r])
        coded.append((codes, scales))
    sums = [blocks.decode_accumulate(*coded[0], fmt, torch.empty(n)),
            blocks.decode_accumulate_reference(*coded[0], fmt, torch.empty(n))]
    bits = lambda t: t.contiguous().view(torch.uint8)
    same[fmt.name] = (torch.equal(bits(coded[0][0]), bits(coded[1][0]))
                      and torch.equal(coded[0][1], coded[1][1])
                      and torch.equal(bits(sums[0]), bits(sums[1])))
print(json.dumps({"path": {f.name: blocks.codec_path(f) for f in (E4M3, FP16)}, "same": same,
                  "package": hvd_compress.__file__, "library": native.built(),
                  "sys_path": sys.path, "cuda": torch.version.cuda}))
"""


def run(cmd, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, (f"{cmd}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n"
                                  f"{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """The sdist of a copy of this checkout (setuptools' PEP 517 hook, what `python -m build
    --sdist` calls), then the wheel that pip builds from it, as for `pip install` of the sdist."""
    tmp = tmp_path_factory.mktemp("dists")
    shutil.copytree(ROOT, tmp / "src", ignore=COPY_IGNORE)
    out = tmp / "dist"
    run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"],
        cwd=tmp / "src")
    sdist, = out.glob("*.tar.gz")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", out, sdist], cwd=tmp)
    wheel, = out.glob("*.whl")
    return sdist, wheel


def test_the_sdist_holds_the_kernel_sources_and_the_metadata(dists):
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        top = tar.getnames()[0].split("/")[0]
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    assert KERNEL_SOURCES | PLANNER_DATA <= names and "pyproject.toml" in names, sorted(names)
    assert "LICENSE" in names
    assert not [n for n in names if n.startswith(("labs", "tests", "scripts", "results"))]
    for line in ("Name: hvd-compress", "Requires-Python: >=3.11", "Requires-Dist: torch",
                 "License-Expression: Apache-2.0"):
        assert line in pkg_info, pkg_info[:800]


def test_the_wheel_is_the_plugin_with_its_kernel_sources(dists):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = {n.rsplit("/", 1)[1]: whl.read(n).decode() for n in names if ".dist-info/" in n}
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"hvd_compress"}
    assert KERNEL_SOURCES | PLANNER_DATA <= names
    assert "Requires-Python: >=3.11" in info["METADATA"]
    assert "License-Expression: Apache-2.0" in info["METADATA"]
    assert "Apache License" in info["LICENSE"] and "Version 2.0" in info["LICENSE"]
    # a CPU user's torch satisfies it: no CUDA-only version, a bound above and below
    assert "Requires-Dist: torch<3,>=2.1" in info["METADATA"], info["METADATA"][:1500]
    assert all(f"{command} = " in info["entry_points.txt"] for command in COMMANDS), info


@pytest.fixture(scope="module")
def installed(dists, tmp_path_factory):
    """A fresh virtualenv (from the base interpreter, not this checkout's venv) with PyTorch's CPU
    wheel, the version this checkout runs (where setup.sh got it: on the lab machine a wheel on
    local disk; elsewhere PyTorch's CPU index, docs/setup.md), then the wheel installed by pip,
    and the environment of a user's shell: no PYTHONPATH, an empty kernel cache, no ccache (the
    compile is a real one, so the lock is tried); the commands run from a folder under /tmp."""
    home = tmp_path_factory.mktemp("user")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HVD_COMPRESS_CACHE=str(home / "cache"), CCACHE_DISABLE="1")
    run([sys.executable, "-m", "venv", home / "venv"], cwd=home, env=env)
    pip = [home / "venv" / "bin" / "python", "-m", "pip", "install", "-q"]
    run(pip + [f"torch=={importlib.metadata.version('torch')}"], cwd=home, env=env)
    run(pip + [dists[1]], cwd=home, env=env)
    work = Path(tempfile.mkdtemp(prefix="hvdc-user-", dir="/tmp"))
    yield home, env, work
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def ranks(installed):
    """Three processes of a user's job started together on the empty cache: (stdout, stderr)
    of each. First, whichever test asks, so that the build command runs on a cache they built."""
    home, env, work = installed
    procs = [subprocess.Popen([str(home / "venv" / "bin" / "python"), "-c", USE, str(r)],
                              cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(3)]
    outs = [proc.communicate(timeout=600) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs
    return outs


@pytest.mark.slow
def test_ranks_starting_together_build_the_kernel_once_and_code_bit_exact(installed, ranks):
    home, env, _ = installed
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in ranks]
    assert sum(COMPILING in err for _, err in ranks) == 1, [err for _, err in ranks]
    kernels = home / "cache" / "kernels"
    for report in reports:
        assert report["path"] == {"e4m3fn": "native", "float16": "native"}, report
        assert report["same"] == {"e4m3fn": True, "float16": True}, report
        assert report["package"].startswith(str(home / "venv")), report["package"]
        assert report["library"].startswith(str(kernels)), report["library"]
        assert not [p for p in report["sys_path"] if p.startswith(str(ROOT))], report["sys_path"]
        assert report["cuda"] is None, report                    # PyTorch's CPU wheel
    log = (kernels / os.path.basename(os.path.dirname(reports[0]["library"])) / ".ninja_log")
    assert [line.split()[-2] for line in log.read_text().splitlines()[1:]] == [
        "blocks.o", "hvdc_blocks.so"], log.read_text()           # one compile, one link


@pytest.mark.slow
def test_the_lab_kit_is_not_installed(installed):
    home, env, work = installed
    proc = subprocess.run([str(home / "venv" / "bin" / "python"), "-c", "import labs"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "No module named 'labs'" in proc.stderr, proc.stderr


# Each command's main mode, as a user first types it, and what its output must hold.
MAIN_MODES = {
    "hvd-compress-costmodel": (["--nodes", "2", "4", "--size", "32MiB", "--bandwidth", "10Gbit/s",
                                "--latency", "1ms"], "allreduce"),
    "hvd-compress-plan": (["--model", "basic", "--nodes", "2", "--bandwidth", "100Mbit/s",
                           "--latency", "1ms"], "| **plan** |"),
    "hvd-compress-build-kernel": ([], "[native] built and checked"),
}


@pytest.mark.slow
def test_every_console_command_runs_its_main_mode(installed, ranks):
    home, env, work = installed
    assert set(MAIN_MODES) == set(COMMANDS)
    for command, (args, expected) in MAIN_MODES.items():
        proc = subprocess.run([str(home / "venv" / "bin" / command), *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and expected in proc.stdout, (command, proc.stdout,
                                                                  proc.stderr[-3000:])
        usage = subprocess.run([str(home / "venv" / "bin" / command), "--help"], cwd=work,
                               env=env, capture_output=True, text=True, timeout=120)
        assert usage.returncode == 0 and usage.stdout.startswith(f"usage: {command} "), (
            command, usage.stdout[:300], usage.stderr[-2000:])
    # the plan was priced from the package's own inputs: the codecs' costs and errors were
    # there, so the lossy schemes were weighed, not refused for want of a measurement
    plan = subprocess.run([str(home / "venv" / "bin" / "hvd-compress-plan"),
                           *MAIN_MODES["hvd-compress-plan"][0], "--format", "json"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=120)
    out = json.loads(plan.stdout)
    assert {"bit8:allgather", "fp16:allreduce"} <= set(out["fixed"]), out["fixed"]
    assert any(s.startswith("bit8") for s in out["plan"]["schemes"]), out["plan"]
    assert all(str(home / "venv") in note for note in out["notes"] if ".csv" in note), out["notes"]
