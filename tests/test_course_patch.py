"""The course's in-tree route (patches/course-bit8-bit16.patch) in the Horovod that setup built.

tests/workers/course_route.py, on every rank: hvd.Compression.bit8/.bit16 are the plugin's
compressors; none/fp16 still allreduce, identical to a plain hvd.allreduce (several dtypes,
shapes, Average and Sum); hvd.allreduce with bit8/bit16 equals the plugin's allgather
reduction; a course-style script (only `import horovod.torch as hvd`) trains with
hvd.DistributedOptimizer(compression=hvd.Compression.bit8) and lands on the same parameters,
bit for bit, as hvd_compress.DistributedOptimizer.
"""
from pathlib import Path

import pytest

from hvdrun import across_ranks, passed_checks

ROOT = Path(__file__).resolve().parents[1]


def test_patches_apply_in_series_order():
    series = [l for l in (ROOT / "patches" / "series").read_text().splitlines() if l and not l.startswith("#")]
    assert series == ["build-cxx17.patch", "course-bit8-bit16.patch",
                      "gloo-post-receives-first.patch"]
    for name in series:
        text = (ROOT / "patches" / name).read_text()
        assert "\n--- a/" in text and "\n+++ b/" in text


@pytest.mark.multiprocess
@across_ranks("course_route")
def test_course_route(controller, np, request):
    names = passed_checks(request)
    assert "optimizer.bit8.equals_plugin" in names and "optimizer.bit16.equals_plugin" in names
    assert sum(n.endswith("fp16_identical") for n in names) == 24
