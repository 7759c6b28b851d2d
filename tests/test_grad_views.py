"""Gradients as views of their bucket (no copy back, no copy in when zeroed in place), on real
ranks: the worker tests/workers/grad_views.py says what it checks (it runs in the shared job of
each configuration, tests/hvdrun.py)."""
import pytest

from hvdrun import across_ranks, passed_checks

pytestmark = pytest.mark.multiprocess


@across_ranks("grad_views")
def test_gradients_are_bucket_views(controller, np, request):
    names = passed_checks(request)
    for route in ("bit8.allgather", "bit8.alltoall", "bit16.allgather", "bit16.alltoall"):
        for what in ("grads_are_bucket_views", "zeroed_in_place_stay_views",
                     "same_bits_either_zeroing", "identical_on_all_ranks"):
            assert f"{route}.{what}" in names
    assert "float64.grad_keeps_dtype" in names
