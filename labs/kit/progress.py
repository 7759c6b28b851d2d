"""Plain-text progress of an epoch on rank 0."""
import sys
import time


class Progress:
    """One line redrawn with \\r on a terminal; otherwise a line at every tenth of the epoch,
    so the logs of horovodrun stay short."""

    def __init__(self, enabled, total, label):
        self.enabled, self.total, self.label = enabled, total, label
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()
        self.next_line = 0

    def update(self, done, loss, force=False):
        if not self.enabled:
            return
        if not self.tty and not force and done < self.next_line:
            return
        self.next_line = done + max(1, self.total // 10)
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        width = 30
        filled = int(width * done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        text = (f"{self.label} [{bar}] {done}/{self.total} steps  loss {loss:.4f}  "
                f"{rate:.1f} steps/s  {elapsed:.0f}s")
        print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", flush=True)

    def close(self):
        if self.enabled and self.tty:
            print(flush=True)
