"""communicators.wait_for: Horovod's synchronize() without its yield spin, on the real Horovod
(one process; the multi-process tests run every communicator's waits through it)."""
import pytest
import torch
import horovod.torch as hvd

from hvd_compress import communicators


def test_wait_for_returns_what_synchronize_would_and_releases_the_handle(monkeypatch):
    hvd.init()
    delays = []
    real_sleep = communicators.time.sleep

    def sleep(seconds):
        delays.append(seconds)
        real_sleep(seconds)
    monkeypatch.setattr(communicators.time, "sleep", sleep)
    x = torch.arange(1 << 22, dtype=torch.float32)
    for i in range(20):
        out = communicators.wait_for(hvd.allreduce_async(x, name=f"wait_for.{i}", op=hvd.Sum))
        assert torch.equal(out, x)                          # one process: the sum is x
    first, longest = communicators.POLL_SLEEP_S
    assert delays, "every allreduce was done before its first poll: nothing was waited for"
    assert delays[0] == first and max(delays) <= longest
    assert all(b in (2 * a, longest, first) for a, b in zip(delays, delays[1:]))   # doubling


def test_wait_for_raises_horovods_error_for_an_unknown_handle():
    hvd.init()
    with pytest.raises(ValueError, match="Handle 987654 was not created or has been cleared"):
        communicators.wait_for(987654)
