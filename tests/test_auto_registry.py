"""Compression.auto takes every registered scheme whose registry entry says it can carry a bucket
of values (registry.Scheme.carries_values), plugins included, and its error guard decides per
bucket: the one-file E2M1 example (docs/examples/e2m1_example.py, carries_values=True) is
chosen for a bucket whose measured error is under the bound and refused for one above it.
Measurements built by hand, as tests/test_planner.py builds them; nothing runs Horovod.

This holds only once auto reads its candidates from the registry instead of a list of its own
(the E2M1 file is registered after the package is imported, as a user's plugin is)."""
import importlib
import sys
from pathlib import Path

import pytest

from hvd_compress import registry
from hvd_compress.costmodel.model import Link

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


@pytest.fixture
def e2m1():
    """The example registered as a plugin is; the registry restored after."""
    saved = dict(registry.SCHEMES)
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("e2m1_example")
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("e2m1_example", None)
        registry.SCHEMES.clear()
        registry.SCHEMES.update(saved)


def test_auto_chooses_a_plugin_scheme_where_its_error_guard_allows(e2m1):
    from hvd_compress.auto import planner
    from hvd_compress.auto.settings import Auto
    settings = Auto()                          # made after the plugin registered, as a job's is
    e2m1_labels = [t for t in settings.candidates if t.startswith("e2m1:")]
    assert e2m1_labels, f"Compression.auto does not take e2m1: candidates {settings.candidates}"
    assert registry.scheme("e2m1").carries_values

    # Two buckets on a slow link with free codecs: the fewest bytes win wherever allowed.
    # E2M1's measured error is under the bound on the first, over it on the second.
    mib = 1 << 20
    buckets = [planner.Bucket("under", 4 * mib, 0.01), planner.Bucket("over", 4 * mib, 0.02)]
    link = Link.from_bandwidth(1e-3, 10e6 / 8)
    links = {c: link for c in ("allreduce", "allreduce_fp16", "allgather", "alltoall")}
    codecs = {t: planner.CodecCost() for t in settings.candidates if t != "none:allreduce"}
    bound = settings.error_bound
    errors = {(b.name, registry.parse_label(t)[0]): 0.001
              for b in buckets for t in settings.candidates}
    errors[("under", "e2m1")] = 0.8 * bound
    errors[("over", "e2m1")] = 3 * bound
    m = planner.Measurements(2, buckets, 0.02, links, codecs, errors)
    plan = planner.search(m, settings.candidates, bound)

    assert plan.schemes[0] in e2m1_labels, plan.schemes
    assert not plan.schemes[1].startswith("e2m1:"), plan.schemes
    assert all(("over", t) in plan.refused and "> bound" in plan.refused[("over", t)]
               for t in e2m1_labels)
