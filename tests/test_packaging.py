"""The plugin as a user installs it (issue 45). The sdist of this checkout holds the plugin, its
kernel's C++ sources and its metadata, not the lab kit; the wheel pip builds from that sdist
too. Installed with pip into a fresh virtualenv and run with no checkout on the path: three
processes that start together with an empty cache compile the kernel once and all use it, bit
for bit the torch path's codes; `labs` does not import; the console commands answer --help.
"""
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from conftest import ROOT

pytestmark = pytest.mark.build          # builds an sdist and a wheel, a virtualenv, the kernel

# What a copy of the checkout leaves out: setuptools writes build/ and *.egg-info where it builds.
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "results", "runs", "build", "dist",
                                     "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")
KERNEL_SOURCES = {f"hvd_compress/codecs/native/{f}" for f in ("blocks.cpp", "kernels.h",
                                                              "kernels_x86.h")}
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
                  "sys_path": sys.path}))
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
    assert KERNEL_SOURCES <= names and "pyproject.toml" in names, sorted(names)
    assert not [n for n in names if n.startswith(("labs", "tests", "scripts", "results"))]
    for line in ("Name: hvd-compress", "Requires-Python: >=3.11", "Requires-Dist: torch"):
        assert line in pkg_info, pkg_info[:800]


def test_the_wheel_is_the_plugin_with_its_kernel_sources(dists):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = {n.rsplit("/", 1)[1]: whl.read(n).decode() for n in names if ".dist-info/" in n}
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"hvd_compress"}
    assert KERNEL_SOURCES <= names
    assert "Requires-Python: >=3.11" in info["METADATA"]
    assert all(f"{command} = " in info["entry_points.txt"] for command in COMMANDS), info


@pytest.fixture(scope="module")
def installed(dists, tmp_path_factory):
    """A fresh virtualenv (from the base interpreter, not this checkout's venv) with the wheel
    installed by pip, torch the version this checkout runs (where setup.sh got it: on the lab
    machine a wheel on local disk), and the environment of a user's shell: no PYTHONPATH, an
    empty kernel cache, no ccache (the compile is a real one, so the lock is tried)."""
    home = tmp_path_factory.mktemp("user")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HVD_COMPRESS_CACHE=str(home / "cache"), CCACHE_DISABLE="1")
    run([sys.executable, "-m", "venv", home / "venv"], cwd=home, env=env)
    run([home / "venv" / "bin" / "python", "-m", "pip", "install", "-q", dists[1],
         f"torch=={importlib.metadata.version('torch')}"], cwd=home, env=env)
    return home, env


@pytest.mark.slow
def test_ranks_starting_together_build_the_kernel_once_and_code_bit_exact(installed):
    home, env = installed
    ranks = [subprocess.Popen([str(home / "venv" / "bin" / "python"), "-c", USE, str(r)], cwd=home,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(3)]
    outs = [rank.communicate(timeout=600) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outs
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sum(COMPILING in err for _, err in outs) == 1, [err for _, err in outs]
    kernels = home / "cache" / "kernels"
    for report in reports:
        assert report["path"] == {"e4m3fn": "native", "float16": "native"}, report
        assert report["same"] == {"e4m3fn": True, "float16": True}, report
        assert report["package"].startswith(str(home / "venv")), report["package"]
        assert report["library"].startswith(str(kernels)), report["library"]
        assert not [p for p in report["sys_path"] if p.startswith(str(ROOT))], report["sys_path"]
    log = (kernels / os.path.basename(os.path.dirname(reports[0]["library"])) / ".ninja_log")
    assert [line.split()[-2] for line in log.read_text().splitlines()[1:]] == [
        "blocks.o", "hvdc_blocks.so"], log.read_text()           # one compile, one link


@pytest.mark.slow
def test_the_lab_kit_is_not_installed(installed):
    home, env = installed
    proc = subprocess.run([str(home / "venv" / "bin" / "python"), "-c", "import labs"], cwd=home,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "No module named 'labs'" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_console_commands_answer_help(installed):
    home, env = installed
    helps = [subprocess.Popen([str(home / "venv" / "bin" / command), "--help"], cwd=home, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in COMMANDS]
    for command, proc in zip(COMMANDS, helps):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.startswith("usage:"), (command, out, err)
