"""A step watchdog: a training job whose ranks stop making progress ends, with a clear error.

Horovod ends a job quickly when a rank dies, and Gloo gives up on a silent peer after its
receive timeout, but under MPI a rank that stops answering without dying (SIGSTOP, a wedged
process, a swapped-out host) leaves every other rank blocked in a collective forever. A
collective cannot be interrupted from Python, so a thread watches the time since the last
finished step and, past the limit, reports and ends this process; the launcher (mpirun or
horovodrun) then tears the job down. Nothing is lost that a checkpoint did not already hold.
"""
import os
import sys
import threading
import time

__all__ = ["StepWatchdog", "EXIT_CODE"]

EXIT_CODE = 75          # EX_TEMPFAIL: the job may succeed when rerun (with --resume)


class StepWatchdog:
    """Call `beat()` after every step; if none comes for `timeout_s`, report and exit."""

    def __init__(self, timeout_s, rank=0, what="training step", on_timeout=None):
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.rank = rank
        self.what = what
        self.on_timeout = on_timeout or self._exit
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.timeout_s is not None:
            self._thread = threading.Thread(target=self._watch, name="hvdc-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        return False

    def beat(self):
        self._last = time.monotonic()

    def _watch(self):
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self.on_timeout(idle)
                return

    def _exit(self, idle):
        sys.stderr.write(
            f"\nhvd-compress: rank {self.rank}: no {self.what} finished for {idle:.0f} s "
            f"(limit {self.timeout_s:.0f} s). Another rank is probably dead or wedged (stopped, "
            f"deadlocked, out of memory). Ending this job with exit code {EXIT_CODE}; rerun with "
            f"--resume to continue from the last checkpoint.\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)
