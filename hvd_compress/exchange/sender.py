"""Priority on the wire: the chunks of a large bucket wait here and go to the engine a few at a
time, so that a bucket the next forward needs first is not queued behind all of them.

Why: Horovod's background thread serves collectives first come, first served, and one
collective holds the wire until it is done. Backward produces the last layers' gradients first,
so a large late-layer bucket (the basic net's fc1: 98% of its bytes) is on the wire when the
front layers' small buckets are ready, and the next forward's first layers wait for all of it.
Cut into chunks that are handed to Horovod at most `depth` at a time, it lets a front bucket,
launched directly, in after at most `depth` chunks (P3, SysML'19; ByteScheduler, SOSP'19).

A thread of this module's own launches the next chunk when one completes (polling with
sleeps, never spinning), so the wire stays busy while the main thread computes a layer; the
main thread waits for a chunk by its ticket. Chunks are served by priority (the bucket the
forward needs first: the larger bucket index, launched later in backward), then in order.
A chunk of the two-phase route is one ticket with a next phase (`then`): the thread runs it
(decode-sum-re-encode, launch the allgather) as soon as the first phase completes, chunk after
chunk in their order (`after`: a stochastic codec's rounding stream is drawn in that order),
and the ticket is done when the last phase is.
"""
import heapq
import itertools
import threading
import time

from ..engine.base import longest_sleep, usable_cores

__all__ = ["Sender", "Ticket", "ChunkedHandle", "chunk_count", "chunk_plan", "MIN_CHUNK_BYTES",
           "DEPTH"]

# Each chunk is a collective of its own, with Horovod's negotiation round before it: chunks no
# smaller than this, and no more than MAX_CHUNKS, so that the rounds stay a small part of the
# bucket's time on the wire (docs/performance.md, "Priority on the wire").
MIN_CHUNK_BYTES = 128 << 10
MAX_CHUNKS = 8
DEPTH = 2                       # chunks handed to the engine at once: one on the wire, one next
POLL_S = 0.0005                 # between polls; longer on a crowded host (engine.base.longest_sleep)


def chunk_count(bucket_bytes, front_bytes, max_chunks=MAX_CHUNKS):
    """How many chunks a bucket of `bucket_bytes` (its message) is cut into, when the buckets
    the next forward needs before it hold `front_bytes`: chunks of about twice the front
    buckets' bytes (a front bucket then waits behind at most a chunk or two of its own size
    or so), at least MIN_CHUNK_BYTES, at most `max_chunks`; 1 (not cut) where nothing is needed
    before it or the bucket is not larger than a chunk. A pure function of the bucket layout,
    so every rank cuts alike."""
    if front_bytes <= 0 or bucket_bytes <= 0:
        return 1
    chunk = max(MIN_CHUNK_BYTES, 2 * front_bytes)
    return int(max(1, min(max_chunks, -(-bucket_bytes // chunk))))


def chunk_plan(sizes, max_chunks=MAX_CHUNKS):
    """{bucket index: chunks} for buckets of `sizes` bytes in backward order (the forward needs
    the last first): the largest bucket that chunk_count cuts, alone. One bucket at most: the
    sender picks among the chunks queued when a slot frees, and with two buckets' chunks queued
    ranks could hand Horovod different ones, each then waiting for a collective the other has
    not launched. With one, every rank launches its chunks in their order."""
    counts = {i: chunk_count(size, sum(sizes[i + 1:]), max_chunks) for i, size in enumerate(sizes)}
    cut = [i for i, count in counts.items() if count > 1]
    if not cut:
        return {}
    largest = max(cut, key=lambda i: (sizes[i], i))
    return {largest: counts[largest]}


class Ticket:
    """One queued launch: its handle once launched; done once the engine has it complete.
    `then(handle)`, if given, runs on the sender's thread once that handle is complete and
    returns the handle of the next phase; not before `after`'s own `then` has run (chunks of
    one bucket go through their middle step in order). busy_s: the seconds `then` took."""
    __slots__ = ("launch", "then", "after", "handle", "error", "done", "busy_s")

    def __init__(self, launch, then=None, after=None):
        self.launch, self.then, self.after = launch, then, after
        self.handle, self.error, self.busy_s = None, None, 0.0
        self.done = threading.Event()

    def ready_for_next_phase(self):
        """Its first phase may move on: the chunk before it has moved on (or failed)."""
        return self.after is None or self.after.then is None or self.after.done.is_set()


class ChunkedHandle:
    """The tickets of one bucket's chunks (an Exchange's handle on the chunked route)."""
    __slots__ = ("tickets",)

    def __init__(self, tickets):
        self.tickets = tickets


class Sender:
    """Launch queued collectives by priority, at most `depth` in flight on the engine."""

    def __init__(self, engine, depth=DEPTH):
        self.engine, self.depth = engine, depth
        self._queue, self._in_flight = [], []
        self._order = itertools.count()
        self._lock = threading.Condition()
        self._thread = None
        self._closed = False
        # more ranks than cores: each poll takes a core another rank computes on
        self._poll_s = max(POLL_S, longest_sleep(engine.local_size(), usable_cores()))

    def submit(self, priority, launch, then=None, after=None):
        """Queue `launch()` (returns an engine handle); larger priority first. A Ticket (see
        Ticket for `then` and `after`)."""
        ticket = Ticket(launch, then, after)
        with self._lock:
            if self._closed:
                raise RuntimeError("hvd_compress: the sender was closed")
            heapq.heappush(self._queue, (-priority, next(self._order), ticket))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hvdc-sender", daemon=True)
                self._thread.start()
            self._lock.notify()
        return ticket

    def wait(self, ticket):
        """The result of the ticket's collective (engine.wait), once it is complete."""
        ticket.done.wait()
        if ticket.error is not None:
            raise ticket.error
        return self.engine.wait(ticket.handle)

    def close(self):
        with self._lock:
            self._closed = True
            self._lock.notify()

    def _run(self):
        while True:
            with self._lock:
                while not self._closed and not self._queue and not self._in_flight:
                    self._lock.wait()
                if self._closed and not self._queue and not self._in_flight:
                    return
                still = []
                for ticket in self._in_flight:
                    try:
                        finished = self.engine.poll(ticket.handle)
                        if finished and ticket.then is not None:
                            finished = False     # its next phase, in the chunks' order
                            if ticket.ready_for_next_phase():
                                start = time.perf_counter()
                                ticket.handle = ticket.then(ticket.handle)
                                ticket.busy_s += time.perf_counter() - start
                                ticket.then = None
                    except Exception as err:     # the engine's own error, for wait() to raise
                        ticket.error, finished = err, True
                    if finished:
                        ticket.done.set()
                    else:
                        still.append(ticket)
                self._in_flight = still
                while self._queue and len(self._in_flight) < self.depth:
                    _, _, ticket = heapq.heappop(self._queue)
                    try:
                        ticket.handle = ticket.launch()
                        self._in_flight.append(ticket)
                    except Exception as err:
                        ticket.error = err
                        ticket.done.set()
            time.sleep(self._poll_s)
