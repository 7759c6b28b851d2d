"""communicators.wait_for: Horovod's synchronize() without its yield spin, on real ranks
(tests/workers/wait_for_checks.py, in the 2-rank jobs of tests/hvdrun.py; no hvd.init() in this
process). The multi-process tests run every communicator's waits through it as well."""
import pytest

from hvdrun import across_ranks, passed_checks

pytestmark = pytest.mark.multiprocess


@across_ranks("wait_for_checks")
def test_wait_for_returns_what_synchronize_would_and_releases_the_handle(controller, np, request):
    names = passed_checks(request)
    assert all(f"wait_for.allreduce{i}.returns_the_sum" in names for i in range(20))
    for what in ("something_was_waited_for", "first_sleep_is_the_shortest",
                 "no_sleep_longer_than_longest", "sleeps_reach_the_longest", "sleeps_double"):
        assert f"wait_for.{what}" in names


@across_ranks("wait_for_checks")
def test_wait_for_raises_horovods_error_for_an_unknown_handle(controller, np, request):
    assert "wait_for.unknown_handle_raises_horovods_error" in passed_checks(request)
