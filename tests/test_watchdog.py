"""The step watchdog ends a stuck process with a clear error, and leaves a live one alone."""
import subprocess
import sys
import threading
import time

import pytest

from labs.kit.watchdog import EXIT_CODE, StepWatchdog


def test_beats_keep_it_quiet_and_silence_trips_it():
    fired = threading.Event()
    with StepWatchdog(0.4, on_timeout=lambda idle: fired.set()) as dog:
        for _ in range(8):                      # 0.8 s of steady progress
            time.sleep(0.1)
            dog.beat()
        assert not fired.is_set()
        assert fired.wait(3.0), "no beat for > 0.4 s must trip the watchdog"


def test_stuck_process_exits_with_clear_error():
    code = ("import time; from labs.kit.watchdog import StepWatchdog\n"
            "with StepWatchdog(0.5, rank=3):\n    time.sleep(30)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_CODE
    assert "rank 3: no training step finished" in proc.stderr and "--resume" in proc.stderr
    assert time.monotonic() - start < 20


def test_invalid_timeout_is_refused():
    with pytest.raises(ValueError):
        StepWatchdog(0)
