"""Which bucket schedule="overlap" cuts into chunks (exchange/sender.py chunk_plan): a pure
function of the layout, so every rank cuts alike, and one bucket at most."""
import pytest

from hvd_compress.exchange.sender import MAX_CHUNKS, MIN_CHUNK_BYTES, chunk_count, chunk_plan

pytestmark = pytest.mark.unit

# The basic net's buckets in backward order, bit8 messages: fc2 and fc1.bias, fc1.weight, the
# convolutions (the front: the next forward needs them first).
BASIC = [1_432, 1_188_480, 19_008]


def test_the_basic_nets_fc1_is_cut_and_nothing_else():
    assert chunk_plan(BASIC) == {1: MAX_CHUNKS}
    assert chunk_plan(BASIC, MAX_CHUNKS // 2) == {1: MAX_CHUNKS // 2}


def test_a_bucket_no_larger_than_a_chunk_or_with_nothing_before_it_is_not_cut():
    assert chunk_plan([10 * MIN_CHUNK_BYTES]) == {}                # nothing in front of it
    assert chunk_plan([MIN_CHUNK_BYTES, 1_000]) == {}              # one chunk's worth
    assert chunk_count(4 * MIN_CHUNK_BYTES, MIN_CHUNK_BYTES) == 2  # chunks twice the front


def test_of_two_buckets_that_would_be_cut_only_the_largest_is():
    """Two cut buckets' chunks could be handed to Horovod in different orders on different
    ranks (the sender picks among what is queued when a slot frees), each rank then waiting
    for a collective the other has not launched: one bucket is cut, the largest."""
    sizes = [40 * MIN_CHUNK_BYTES, 8 * MIN_CHUNK_BYTES, 1_000]
    assert chunk_count(sizes[0], sum(sizes[1:])) > 1 and chunk_count(sizes[1], sizes[2]) > 1
    assert chunk_plan(sizes) == {0: chunk_count(sizes[0], sum(sizes[1:]))}
