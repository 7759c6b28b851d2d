"""exchange.longest_sleep: how long wait_for may sleep between polls, from the host's crowding.
A rank with a core of its own polls often (a finished exchange is noticed sooner); ranks that
share cores keep the long sleep, so waiting does not take the cores their partners compute on."""
import pytest

from hvd_compress.exchange.base import POLL_SLEEP_S, UNCROWDED_LONGEST_SLEEP_S, longest_sleep

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("ranks,cores", [(1, 1), (2, 2), (1, 16), (4, 16)])
def test_a_rank_with_a_core_of_its_own_sleeps_at_most_the_short_cap(ranks, cores):
    assert longest_sleep(ranks, cores) == UNCROWDED_LONGEST_SLEEP_S < POLL_SLEEP_S[1]


@pytest.mark.parametrize("ranks,cores", [(3, 2), (4, 2), (2, 1), (17, 16)])
def test_ranks_that_share_cores_keep_the_long_sleep(ranks, cores):
    assert longest_sleep(ranks, cores) == POLL_SLEEP_S[1]


def test_the_first_sleep_is_shorter_than_either_cap():
    assert POLL_SLEEP_S[0] < UNCROWDED_LONGEST_SLEEP_S
