"""The engine seam (hvd_compress/engine/): the torch.distributed engine's operations on real Gloo
ranks (2 and 4), the Horovod engine's one-process properties, and the wait's sleeps."""
import pytest

from ddprun import across_sizes, passed_checks
from hvd_compress.engine.base import (AVERAGE, POLL_SLEEP_S, SUM, UNCROWDED_LONGEST_SLEEP_S,
                                      Engine, longest_sleep)


@pytest.mark.multiprocess
@across_sizes("engine_ops")
def test_torch_engine_ops_on_gloo(request, np):
    names = passed_checks(request)
    assert "allreduce average = DDP's divide-then-sum, bit for bit" in names
    assert "alltoall: chunk k of every rank to rank k" in names
    assert "allgather of unequal first dimensions" in names
    assert "a large allgather in pieces: the rows in rank order, sizes cut back" in names
    assert "pieces and one piece give the same bits" in names
    assert "a large alltoall in pieces: chunk k of every rank to rank k" in names
    assert "a large alltoall: pieces and one piece give the same bits" in names
    assert len(names) >= 14, names


@pytest.mark.unit
def test_longest_sleep_depends_on_crowding():
    assert longest_sleep(4, 2) == POLL_SLEEP_S[1]
    assert longest_sleep(2, 2) == UNCROWDED_LONGEST_SLEEP_S


class _Countdown(Engine):
    """An engine whose one handle is done after `polls` polls: exercises Engine.wait alone."""

    def __init__(self, polls):
        self.left, self.polled = polls, 0

    def local_size(self):
        return 1

    def poll(self, handle):
        self.polled += 1
        self.left -= 1
        return self.left < 0

    def synchronize(self, handle):
        return ("result", handle)


@pytest.mark.unit
def test_wait_polls_until_done_then_synchronizes():
    eng = _Countdown(3)
    assert eng.wait(7) == ("result", 7)
    assert eng.polled == 4


@pytest.mark.unit
def test_the_horovod_engine_maps_horovods_ops():
    hvd = pytest.importorskip("horovod.torch")
    from hvd_compress.engine.horovod import horovod_engine
    eng = horovod_engine()
    assert eng is horovod_engine()
    assert eng.parse_op(hvd.Average) == AVERAGE and eng.parse_op(hvd.Sum) == SUM
    assert eng.parse_op(hvd.Adasum) is None and eng.parse_op(AVERAGE) == AVERAGE


@pytest.mark.unit
def test_the_torch_engine_needs_an_initialised_group():
    from hvd_compress.engine.distributed import TorchEngine
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchEngine()
