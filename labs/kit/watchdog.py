"""A step watchdog: a training job whose ranks stop making progress ends, with an error that
names the rank that stopped.

Horovod ends a job quickly when a rank dies, and Gloo gives up on a silent peer after its
receive timeout, but under MPI a rank that stops answering without dying (SIGSTOP, a wedged
process, a swapped-out host) leaves every other rank blocked in a collective forever. A
collective cannot be interrupted from Python, so a thread watches the time since the last
finished step and, past the limit, reports and ends this process; the launcher (mpirun or
horovodrun) then tears the job down. Nothing is lost that a checkpoint did not already hold.

The limit adapts to the run unless fixed (--step-timeout): for each kind of work (a training
step, an evaluation, a checkpoint) it is FACTOR times the slowest one of that kind seen so far,
at least FLOOR_S; the first of a kind (the first step pays for start-up and Horovod's first
negotiation) may take STARTUP_S. A step during which this rank's emulated link received under
CRAWL_BPS is not learnt from: the limit grows with slow steps, not with a crawling network. A wedged rank is caught within FLOOR_S of its last step on a
run whose steps are fast, while a run whose steps or evaluations are slow (4 ranks on 2 cores,
a large model) gets a limit that grows with them.

Which rank stopped: every rank's watchdog thread writes a heartbeat file each PERIOD_S (its
steps so far and the time). A stopped or dead process writes none; ranks merely blocked in a
collective still do. So the rank whose watchdog fires names the ranks whose heartbeat went
stale, or, if none did (a deadlock rather than a stop), the ranks furthest behind in steps. A
peer on this host whose heartbeat is stale and whose process is stopped (SIGSTOP) is certain:
the wait then ends at the floor, whatever the limit (the first evaluation's is start-up's).

Which link failed: on an emulated network (labs.netem: each rank has its own eth0) the
heartbeat also carries the rank's link, its state and the bytes it received over the last
RATE_WINDOW_S (link_probe, from labs.netem.launch.link_probe). Every process running, the
sentence then names a link that is down, a network that delivers nothing (every packet lost,
a partition), or one that crawls, before it looks at the step counts (over a crawling link
one rank may finish a step the other has not: a step apart is not then a deadlock).
"""
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

__all__ = ["StepWatchdog", "EXIT_CODE", "FLOOR_S", "FACTOR", "STARTUP_S", "PERIOD_S", "suspects",
           "stopped", "gloo_ceiling"]

EXIT_CODE = 75          # EX_TEMPFAIL: the job may succeed when rerun (with --resume)
FLOOR_S = 20.0          # below Gloo's receive timeout (lab: 60 s, Horovod: 30 s): the watchdog speaks first
FACTOR = 10.0           # a healthy step 10x slower than the slowest seen is not a healthy step
STARTUP_S = 300.0       # the first step / evaluation / checkpoint of a run
PERIOD_S = 1.0          # how often the thread wakes, writes its heartbeat and checks
GLOO_MARGIN_S = 5.0     # under Gloo the learnt limit stays this far below Gloo's timeout
STALE_S = 5 * PERIOD_S  # a heartbeat this old: that process is not running
RATE_WINDOW_S = 10.0    # a link's receive rate: bytes over the last this many seconds
DEAD_LINK_BPS = 1000.0  # received less than this a second: the network delivers nothing
CRAWL_BPS = 1e6 / 8     # under 1 Mbit/s: a crawl
HOST = socket.gethostname()   # a heartbeat's pid is checked only on the host that wrote it


class StepWatchdog:
    """Call `beat()` after every step and wrap other long work in `phase(kind)`; past the
    limit without either, report and exit. timeout_s: a fixed limit, or None to adapt."""

    def __init__(self, timeout_s=None, rank=0, size=1, heartbeat_dir=None, what="training step",
                 on_timeout=None, floor_s=FLOOR_S, factor=FACTOR, startup_s=STARTUP_S,
                 period_s=PERIOD_S, clock=time.monotonic, enabled=True, link_probe=None,
                 ceiling_s=None):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s, self.rank, self.size = timeout_s, rank, size
        self.heartbeat_dir = Path(heartbeat_dir) if heartbeat_dir else None
        self.what = what
        self.on_timeout = on_timeout or self._exit
        self.floor_s, self.factor, self.startup_s, self.period_s = floor_s, factor, startup_s, period_s
        self.ceiling_s = ceiling_s       # the adaptive limit's most (gloo_ceiling: why)
        self.clock = clock
        self.enabled = enabled
        self.link_probe = link_probe     # () -> {"iface", "state", "rx_bytes"} or None
        self._received = []              # (time, rx_bytes) over the last RATE_WINDOW_S
        self.kind = "step"
        self.slowest = {}                # kind -> longest seen, seconds
        self.steps = 0
        self._last = clock()
        self.why = ""                    # why it fired (_due), once it has
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if not self.enabled:
            return self
        if self.heartbeat_dir is not None:
            self.heartbeat_dir.mkdir(parents=True, exist_ok=True)
            self._heartbeat()
        self._thread = threading.Thread(target=self._watch, name="hvdc-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        return False

    # ---- what the training loop calls ----------------------------------------------------
    def beat(self):
        """A training step finished. The first one is start-up (imports, Horovod's first
        negotiation), not a sample of how long steps take."""
        if self.steps == 0 and "step" not in self.slowest:
            self._last = self.clock()
            self.slowest["startup"] = 0.0
        else:
            self._done("step")
        self.steps += 1

    @contextmanager
    def phase(self, kind):
        """Other long work (evaluation, checkpoint): limited by the slowest of its own kind."""
        self._done(self.kind)
        self.kind = kind
        try:
            yield
        finally:
            self._done(kind)
            self.kind = "step"

    def begin(self, kind):
        """Like entering phase(kind), for work whose end is another call's (end(kind))."""
        self._done(self.kind)
        self.kind = kind

    def end(self, kind):
        self._done(kind)
        self.kind = "step"

    def limit(self):
        """Seconds the current work may take: fixed, or FACTOR x the slowest of its kind."""
        if self.timeout_s is not None:
            return self.timeout_s
        seen = self.slowest.get(self.kind) if "startup" in self.slowest else None
        limit = self.startup_s if seen is None else max(self.floor_s, self.factor * seen)
        return limit if self.ceiling_s is None else min(limit, max(self.floor_s, self.ceiling_s))

    def _done(self, kind):
        now = self.clock()
        took = now - self._last
        if not (kind == "step" and self._crawled(self._last, now)):
            self.slowest[kind] = max(self.slowest.get(kind, 0.0), took)
        self._last = now

    def _crawled(self, start, end):
        """Whether this rank's link received under CRAWL_BPS between start and end (by the
        heartbeat's samples, at least a period apart): a step that slow measured a failing
        network, not how long a step takes. Learnt from, a step that the crawl met halfway
        (11 s) would have lifted the limit to 110 s, past the crawl's 37 s steps."""
        inside = [(t, b) for t, b in list(self._received) if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < self.period_s:
            return False
        (t0, b0), (t1, b1) = inside[0], inside[-1]
        return (b1 - b0) / (t1 - t0) < CRAWL_BPS

    # ---- the thread ------------------------------------------------------------------------
    def _watch(self):
        period = min(self.period_s, (self.timeout_s or self.period_s) / 4)
        while not self._stop.wait(period):
            self._heartbeat()
            idle = self.clock() - self._last
            self.why = self._due(idle)
            if self.why:
                self.on_timeout(idle)
                return

    def _due(self, idle):
        """Why the wait ends now ('' if it goes on): past the limit; or, the limit adaptive,
        past the floor with another rank's process stopped (peer_stopped)."""
        if idle > self.limit():
            return f"limit {self.limit():.0f} s, {self._how()}"
        if self.timeout_s is None and idle > self.floor_s and self.peer_stopped():
            return (f"another rank's process is stopped: ended at the floor, {self.floor_s:g} s, "
                    f"not the limit, {self.limit():.0f} s ({self._how()})")
        return ""

    def peer_stopped(self):
        """Whether another rank's process, on this host, is stopped (SIGSTOP, a debugger) with its
        heartbeat stale: certain, so an adaptive limit's wait ends at the floor, not at a limit
        still at start-up's (the first evaluation or checkpoint of a run: STARTUP_S). Seen in
        the suite: a rank stopped at the first epoch's end left the job waiting 300 s under
        MPI and 55 s under Gloo. A fixed --step-timeout is left as the user set it."""
        return bool(self.heartbeat_dir is not None
                    and stopped(self.heartbeat_dir, self.size, exclude=self.rank))

    def heartbeat(self):
        """Write this rank's heartbeat now (the thread does it every period_s)."""
        self._heartbeat()

    def _heartbeat(self):
        if self.heartbeat_dir is None:
            return
        path = self.heartbeat_dir / f"rank{self.rank}.json"
        beat = {"rank": self.rank, "steps": self.steps, "time": time.time(),
                "pid": os.getpid(), "host": HOST}
        link = self._link()
        if link is not None:
            beat["link"] = link
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(beat))
            os.replace(tmp, path)
        except OSError:
            pass                         # a full disk must not kill a healthy run here

    def _link(self):
        """This rank's link and what it received a second over the last RATE_WINDOW_S (None
        off an emulated network, or before a window's worth of samples)."""
        if self.link_probe is None:
            return None
        try:
            link = self.link_probe()
        except OSError:
            return None
        if link is None:
            return None
        now = self.clock()
        self._received.append((now, link["rx_bytes"]))
        while now - self._received[0][0] > RATE_WINDOW_S:
            self._received.pop(0)
        t0, b0 = self._received[0]
        if now - t0 >= RATE_WINDOW_S / 2:
            link["rx_bps"] = (link["rx_bytes"] - b0) / (now - t0)
            link["window_s"] = now - t0
        return link

    def _exit(self, idle):
        culprit = suspects(self.heartbeat_dir, self.size, exclude=self.rank) if self.heartbeat_dir else ""
        sys.stderr.write(
            f"\nhvd-compress: rank {self.rank}: no {self.what} finished for {idle:.0f} s "
            f"({self.why or self._due(idle)}; doing: {self.kind}). {culprit or 'Another rank is probably dead or wedged (stopped, deadlocked, out of memory).'} "
            f"Ending this job with exit code {EXIT_CODE}; rerun with --resume to continue from "
            f"the last checkpoint.\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)

    def _how(self):
        if self.timeout_s is not None:
            return "--step-timeout"
        seen = self.slowest.get(self.kind)
        return ("first of its kind" if seen is None else
                f"{self.factor:g} x the slowest {self.kind} so far, {seen:.1f} s, at least {self.floor_s:g} s")


def suspects(heartbeat_dir, size, exclude=None, now=None, stale_s=STALE_S, deadlock=True):
    """A sentence naming the ranks that stopped: heartbeat stale or missing (process stopped or
    dead), else a link's fault, else a rank whose process has exited (its heartbeat's pid on
    this host), else (deadlock=True) the ranks furthest behind in steps; '' if
    nothing can be said. deadlock=False keeps to what was observed: in a healthy run the ranks
    are often a step apart for a moment."""
    now = time.time() if now is None else now
    beats = {}
    for r in range(size):
        try:
            beats[r] = json.loads((Path(heartbeat_dir) / f"rank{r}.json").read_text())
        except (OSError, ValueError):
            beats[r] = None
    silent = [r for r, b in beats.items() if r != exclude and (b is None or now - b["time"] > stale_s)]
    if silent:
        detail = ", ".join(f"rank {r}" + ("" if beats[r] is None else
                                          f" (silent {now - beats[r]['time']:.0f} s, "
                                          f"{beats[r]['steps']} steps done)") for r in silent)
        return (f"Stalled: {detail}: its process is not running (stopped, swapped out or dead), "
                f"while the others wait for it in a collective.")
    links = {r: b["link"] for r, b in beats.items() if b is not None and "link" in b}
    # What the links measured comes before what the step counts suggest: over a crawling or
    # silent link one rank may finish a step's last collective before the other, so a step
    # apart is what a slow network looks like too, not only a deadlock.
    cause = links_down(links) or links_traffic(links)
    if cause:
        return cause
    gone = [r for r, b in beats.items() if r != exclude and b is not None and _exited(b)]
    if gone:
        # A killed process's last heartbeat is still fresh for up to stale_s: its pid tells
        # (Gloo reports a dead peer at once, before the heartbeat ages). After the links: a
        # rank whose own watchdog ended it on a link's fault has exited too, and the link is
        # the cause.
        detail = ", ".join(f"rank {r} (process {beats[r]['pid']}, {beats[r]['steps']} steps done)"
                           for r in gone)
        return (f"Dead: {detail}: its process has exited, while the others wait for it in a "
                f"collective.")
    steps = {r: b["steps"] for r, b in beats.items() if b is not None}
    if deadlock and steps and len(set(steps.values())) > 1:
        behind = min(steps.values())
        late = [r for r, s in steps.items() if s == behind]
        return ("Every rank is running but not progressing (a deadlock?); behind the others: "
                + ", ".join(f"rank {r} ({behind} steps)" for r in late) + ".")
    return ""


def stopped(heartbeat_dir, size, exclude=None, now=None, stale_s=STALE_S):
    """The ranks whose heartbeat is stale and whose process, on this host, is stopped (state
    T or t in /proc: SIGSTOP, Ctrl-Z, a debugger): they will finish nothing until continued."""
    now = time.time() if now is None else now
    found = []
    for r in range(size):
        if r == exclude:
            continue
        try:
            beat = json.loads((Path(heartbeat_dir) / f"rank{r}.json").read_text())
        except (OSError, ValueError):
            continue
        if now - beat.get("time", now) > stale_s and _state(beat) in ("T", "t"):
            found.append(r)
    return found


def _state(beat):
    """A heartbeat's process state letter from /proc ('' where it cannot be told: another host,
    no pid written; 'X' where there is no such process)."""
    pid = beat.get("pid")
    if not isinstance(pid, int) or beat.get("host") != HOST:
        return ""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"                   # no such process


def _exited(beat):
    """Whether a heartbeat's process, on this host, has exited (False where it cannot be told:
    another host, or a heartbeat from before pids were written)."""
    return _state(beat) in ("Z", "X")   # exited: reaped, or not yet by its launcher


def links_down(links):
    """'Link down: ...' naming the ranks whose interface is not up ({rank: link}), or ''."""
    down = [r for r, link in links.items() if link.get("state") not in ("up", "unknown")]
    if not down:
        return ""
    return ("Link down: " + ", ".join(f"rank {r}'s network interface "
                                      f"{links[r].get('iface', 'eth0')} is "
                                      f"{links[r].get('state')}" for r in down)
            + "; its process runs, but its collectives cannot reach the others.")


def links_traffic(links):
    """A sentence if the links are up but deliver nothing, or crawl ({rank: link}); else ''."""
    if not links:
        return ""
    rates = {r: link["rx_bps"] for r, link in links.items() if "rx_bps" in link}
    if len(rates) < len(links):
        return ""
    window = min(link["window_s"] for link in links.values())
    if max(rates.values()) < DEAD_LINK_BPS:
        return (f"No traffic: every link is up but no rank received more than "
                f"{DEAD_LINK_BPS:.0f} bytes/s over the last {window:.0f} s (packets lost or the "
                f"network partitioned).")
    slow = [r for r, bps in rates.items() if bps < CRAWL_BPS]
    if slow:
        return (f"The network crawls: over the last {window:.0f} s "
                + ", ".join(f"rank {r} received {rates[r] * 8 / 1000:.0f} kbit/s" for r in slow)
                + " (every link is up; a step now needs far longer than the limit).")
    return ""


def gloo_ceiling(environ=os.environ):
    """The adaptive limit's most (start-up's too) under horovodrun's Gloo controller: GLOO_MARGIN_S below Gloo's
    receive timeout (HOROVOD_GLOO_TIMEOUT_SECONDS), else None. Why: a wait longer than Gloo's
    timeout fails in Gloo anyway, with "Horovod has been shut down" and no rank named; start-up's
    limit (the first evaluation's too) or one learnt from slow steps on a crowded machine
    (10 x a 7 s step) would let Gloo speak first."""
    if environ.get("HOROVOD_CONTROLLER") != "gloo" or "HOROVOD_GLOO_TIMEOUT_SECONDS" not in environ:
        return None
    return float(environ["HOROVOD_GLOO_TIMEOUT_SECONDS"]) - GLOO_MARGIN_S
