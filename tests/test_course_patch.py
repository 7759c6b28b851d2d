"""The course's in-tree route (patches/course-bit8-bit16.patch) in the Horovod that setup built.

tests/workers/course_route.py, on every rank: hvd.Compression.bit8/.bit16 are the plugin's
compressors; none/fp16 still allreduce, identical to a plain hvd.allreduce (several dtypes,
shapes, Average and Sum); hvd.allreduce with bit8/bit16 equals the plugin's allgather
reduction; a course-style script (only `import horovod.torch as hvd`) trains with
hvd.DistributedOptimizer(compression=hvd.Compression.bit8) and lands on the same parameters,
bit for bit, as hvd_compress.DistributedOptimizer.
"""
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from hvdrun import across_ranks, passed_checks

ROOT = Path(__file__).resolve().parents[1]
HOROVOD_VERSION = "0.28.1"
# Where scripts/setup.sh caches the sdist it patches and builds (it always downloads it).
SDIST = (Path(os.environ.get("HVD_COMPRESS_CACHE", Path.home() / ".cache" / "hvd-compress"))
         / "sdist" / f"horovod-{HOROVOD_VERSION}.tar.gz")


def series():
    return [line for line in (ROOT / "patches" / "series").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def patched_files(patch):
    """The paths (inside the sdist) a unified diff changes."""
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.MULTILINE)


@pytest.mark.unit
def test_patches_apply_in_series_order(tmp_path):
    """Each patch of patches/series applies, in that order, to the sdist setup.sh builds: a
    dry run first, then for real (the next patch sees the previous one applied), as setup.sh
    does it (patch -p1 --forward); and each changed what it says."""
    assert series() == ["build-cxx17.patch", "course-bit8-bit16.patch",
                        "gloo-post-receives-first.patch"]
    assert SDIST.is_file(), (f"{SDIST} is missing: scripts/setup.sh downloads Horovod "
                             f"{HOROVOD_VERSION}'s sdist there; run it")
    patches = [ROOT / "patches" / name for name in series()]
    wanted = {f"horovod-{HOROVOD_VERSION}/{path}" for p in patches for path in patched_files(p)}
    with tarfile.open(SDIST) as sdist:
        members = [m for m in sdist.getmembers() if m.name in wanted]
        sdist.extractall(tmp_path, members=members, filter="data")
    assert len(members) == len(wanted) == 8, sorted(wanted - {m.name for m in members})
    src = tmp_path / f"horovod-{HOROVOD_VERSION}"
    for patch in patches:
        before = {path: (src / path).read_bytes() for path in patched_files(patch)}
        for dry in (["--dry-run"], []):
            done = subprocess.run(["patch", "-p1", "--forward", "-d", str(src), *dry,
                                   "-i", str(patch)], capture_output=True, text=True)
            assert done.returncode == 0, f"{patch.name} does not apply:\n{done.stdout}{done.stderr}"
        for path, text in before.items():
            assert (src / path).read_bytes() != text, f"{patch.name} left {path} unchanged"
    # applied once, a patch is refused the second time (--forward): they really are in
    again = subprocess.run(["patch", "-p1", "--forward", "--dry-run", "-d", str(src), "-i",
                            str(patches[1])], capture_output=True, text=True)
    assert again.returncode != 0 and "previously applied" in again.stdout, again.stdout


@pytest.mark.multiprocess
@across_ranks("course_route")
def test_course_route(controller, np, request):
    names = passed_checks(request)
    assert "optimizer.bit8.equals_plugin" in names and "optimizer.bit16.equals_plugin" in names
    assert sum(n.endswith("fp16_identical") for n in names) == 24
