"""How compressed gradients travel between ranks (registry.Route), and what that costs in bytes.

Every communicator has the contract of roles.Communicator: `start(bucket)` compresses a bucket
and launches its collective without blocking (the optimizer calls it from a gradient hook
while backward runs); `finish(exchange)` waits and leaves the reduced values in the bucket.

- `AllreduceCommunicator`: Horovod's allreduce of the compressed tensor, tensor by tensor
  (Horovod's own fusion buffer fuses them). Right for `none` and Horovod's `fp16`, whose codes
  can be summed; exactly what `hvd.DistributedOptimizer` does, so results are bit-identical.
- `AllgatherCommunicator`: the course's design for 8-bit codes. Every rank gathers every
  rank's bucket message and decodes-and-sums them in one pass in float32. (n-1) messages
  per rank: cheaper than fp32 ring allreduce only while n < 32/bits * 2.
- `AlltoallCommunicator`: the two-phase route, which scales with n. Phase 1: the bucket is
  cut into n chunks (on block boundaries), alltoall hands chunk k of every rank to rank k,
  which decodes-and-sums it and re-encodes it. Phase 2: an allgather of the reduced chunks.
  2(n-1)/n of the codes per rank, like a ring allreduce of them. `progress()` launches
  phase 2 if phase 1 is done (the optimizer calls it from every gradient hook), and
  `advance()` (called by step() before any finish) waits for all phase 1s, launching each
  bucket's phase 2 the moment its phase 1 completes, whatever the buckets' order.

Every rank ends with bit-identical results: all decode the same codes in rank order. Each
communicator counts the bytes this rank sends, so the lab and the benchmarks never estimate
what they can count.
"""
import time
from contextlib import contextmanager

import torch
import horovod.torch as hvd

from .codecs import SCALE_BLOCK
from .compressors import Compression, compressor_name
from .costmodel.methods import chunk_bounds
from .fusion import Bucket
from .registry import SCHEMES, Route, resolve_route
from .roles import Communicator, PacketCompressor

__all__ = ["make_communicator", "AllreduceCommunicator", "AllgatherCommunicator",
           "AlltoallCommunicator", "Stats", "start_packet_exchange", "horovod_bytes_sent",
           "DEFAULT_FUSION_BYTES", "wait_for", "launch_next_phases"]

# Buckets of at most 1 MiB of float32 (Horovod fuses up to 64 MiB, DDP buckets 25 MiB): small
# enough that the first buckets leave while backward still computes the rest. A tensor larger
# than this travels alone.
DEFAULT_FUSION_BYTES = 1 << 20
_WARMED = set()
# How long wait_for() sleeps between polls: doubling from the first value up to the second.
POLL_SLEEP_S = (50e-6, 1e-3)


def wait_for(handle):
    """hvd.synchronize(handle), but waiting by sleeping between polls instead of spinning.

    Why: Horovod's synchronize() loops on std::this_thread::yield() until the handle is done
    (horovod/torch/mpi_ops_v2.cc, WaitAndClear). A rank that waits so keeps its core busy, and
    the core is what the other ranks' backward and Horovod's background thread (which does
    the reduction) need when there are as many processes as cores or more: 4 ranks on this
    2-core machine spent 35% of the CPU in the kernel, at ~30,000 preemptions a second each.
    Sleeping adds at most POLL_SLEEP_S[1] to a wait; a finished handle's synchronize()
    returns at once (and raises its error, if any).
    """
    sleeps = _poll_sleeps()
    while not hvd.poll(handle):
        time.sleep(next(sleeps))
    return hvd.synchronize(handle)


def _poll_sleeps():
    """The sleeps between polls: POLL_SLEEP_S[0] doubling up to POLL_SLEEP_S[1]."""
    delay, longest = POLL_SLEEP_S
    while True:
        yield delay
        delay = min(2 * delay, longest)


def launch_next_phases(communicator, exchanges):
    """Wait until no exchange is still in phase 1, calling communicator.progress(ex) on each as
    soon as its phase 1 completes; sleeps between polls as wait_for does (the sleeps count as
    communicate_s).

    Why not finish bucket by bucket: finish(bucket 0) would wait for its phase 2 before bucket
    1's phase 2 is even launched, though bucket 1's phase 1 may have completed long before;
    the link would idle between the phases of consecutive buckets.
    """
    pending, sleeps = [ex for ex in exchanges if ex.phase == 1], _poll_sleeps()
    while pending:
        for ex in pending:
            communicator.progress(ex)
        pending = [ex for ex in pending if ex.phase == 1]
        if pending:
            with communicator.stats.timing("communicate_s"):
                time.sleep(next(sleeps))


class Stats:
    """Seconds spent compressing, waiting for communication, decompressing; bytes sent; how
    long collectives were in flight while backward still ran (overlap_s); how much of the
    work was done inside backward, in gradient hooks (in_backward_s, part of compress_s and
    decompress_s); the span of each step's exchange, first launch to last result (exchange_s,
    the optimizer's) and first launch to last launch (launch_span_s), since the last pop. The
    two-phase route's middle step (decode, sum and re-encode a chunk, one native call) counts
    as decompress_s."""
    FIELDS = ("compress_s", "communicate_s", "decompress_s", "bytes_sent", "overlap_s",
              "in_backward_s", "exchange_s", "launch_span_s")

    def __init__(self):
        self.reset()

    def reset(self):
        self.values = {f: 0.0 for f in self.FIELDS}
        self.values["bytes_sent"] = 0

    @contextmanager
    def timing(self, field):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.values[field] += time.perf_counter() - start

    def pop(self):
        out = dict(self.values)
        self.reset()
        return out


class Exchange:
    """One bucket's collective in flight: its handle, phase and launch time."""
    __slots__ = ("bucket", "handle", "phase", "launched", "ctx")

    def __init__(self, bucket, handle, ctx=None, phase=1):
        self.bucket, self.handle, self.ctx, self.phase = bucket, handle, ctx, phase
        self.launched = time.perf_counter()


class _Base(Communicator):
    fuses = True                     # one flat float32 buffer per bucket

    def __init__(self, compression, op=hvd.Average, fusion_threshold_bytes=None,
                 scale_block=SCALE_BLOCK):
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("compressed gradient exchange supports op=hvd.Average or hvd.Sum "
                             f"(got {op!r}); use hvd.DistributedOptimizer for Adasum")
        self.compression = compression
        self.op = op
        self.scale_block = scale_block
        threshold = DEFAULT_FUSION_BYTES if fusion_threshold_bytes is None else int(fusion_threshold_bytes)
        # One scale per tensor (scale_block=None, the course's packets) means one tensor per bucket.
        self.fusion_threshold_bytes = threshold if scale_block else 0
        self.stats = Stats()

    def pop_stats(self):
        return self.stats.pop()

    @property
    def reduction(self):
        """The route's name: the first version's word for it, kept for its callers."""
        return self.route.value

    def describe(self):
        return f"{compressor_name(self.compression)}/{self.route.value}"

    def _tag(self, name):
        # The route is part of the name, so ranks that disagree on it never match silently.
        return f"hvdc.{self.describe()}.{name}"

    def plan(self, names, tensors, prefix=""):
        """[(member indices, Bucket)] for these tensors, in the order given."""
        return Bucket.plan(names, tensors, self.fusion_threshold_bytes, flat=self.fuses, prefix=prefix)

    def reduce(self, tensors, names, memory=None):
        """Exchange `tensors` now (start every bucket, then finish each); reduced tensors in
        the same order, shapes and dtypes. The optimizer does the same from its hooks."""
        planned = self.plan(names, tensors)
        exchanges = []
        for group, bucket in planned:
            with self.stats.timing("compress_s"):
                for j, i in enumerate(group):
                    bucket.put(j, tensors[i])
            exchanges.append(self.start(bucket, memory))
        self.advance(exchanges)
        results = [None] * len(tensors)
        for (group, bucket), ex in zip(planned, exchanges):
            self.finish(ex)
            for j, i in enumerate(group):
                results[i] = bucket.result(j)
        return results

    def progress(self, exchange):
        """Move a multi-phase exchange on if its current phase is done; never blocks."""

    def _average(self, values, n):
        if self.op == hvd.Average and n > 1:
            values.div_(n)


class AllreduceCommunicator(_Base):
    """compress -> hvd.allreduce_async_ -> decompress: Horovod's own path, tensor by tensor."""
    route = Route.ALLREDUCE
    fuses = False

    def start(self, bucket, memory=None):
        if memory is not None:
            raise ValueError("error feedback needs a lossy packet route (bit8/bit16 with "
                             "route 'allgather' or 'alltoall'), not allreduce")
        n = hvd.size()
        with self.stats.timing("compress_s"):
            compressed, ctx = self.compression.compress(bucket.tensor)
        restore = None
        if compressed.dtype == torch.bfloat16:    # Horovod's CPU ops have no bfloat16: sum in
            compressed, restore = compressed.float(), torch.bfloat16   # float32, cast back
        elif not compressed.is_contiguous():      # Horovod needs a dense row-major buffer
            compressed = compressed.contiguous()
        handle = hvd.allreduce_async_(compressed, name=bucket.name, op=self.op,
                                      prescale_factor=1.0, postscale_factor=1.0)
        self.stats.values["bytes_sent"] += int(2 * (n - 1) * compressed.numel()
                                               * compressed.element_size() // n)
        return Exchange(bucket, handle, (ctx, restore))

    def finish(self, exchange):
        with self.stats.timing("communicate_s"):
            output = wait_for(exchange.handle)
        with self.stats.timing("decompress_s"):
            ctx, restore = exchange.ctx
            if restore is not None:
                output = output.to(restore)
            exchange.bucket.tensor = self.compression.decompress(output, ctx)


class _PacketBase(_Base):
    """The packet routes: compensate -> encode one message per destination -> remember."""

    def __init__(self, compression, *args, **kwargs):
        super().__init__(compression, *args, **kwargs)
        if compression not in _WARMED:
            # The codecs probe torch's casts once per device (about a second); do it here,
            # not inside the first timed training step.
            compression.decode_packet(compression.compress(torch.zeros(1))[0])
            _WARMED.add(compression)

    def _block(self, numel):
        return self.scale_block or max(numel, 1)

    def _layout(self, bucket, pieces):
        """The bucket's message, made once: one message per piece (a, b) of the buffer (the
        pieces cover it in order), their sizes, and the pieces' bounds."""
        comp = self.compression

        def make():
            sizes = [comp.message_bytes(b - a, self._block(b - a)) for a, b in pieces]
            message = torch.zeros(sum(sizes), dtype=torch.uint8, device=bucket.device)
            return message, sizes, [a for a, _ in pieces] + [pieces[-1][1]]
        return bucket.cached(("layout", self.route, tuple(pieces)), make)

    def _encode(self, bucket, pieces, memory):
        """Encode bucket.buffer[a:b] for each (a, b) in `pieces` into one message of segments;
        with error feedback, compensate first and remember what the codes dropped."""
        comp, x = self.compression, bucket.buffer
        message, sizes, bounds = self._layout(bucket, pieces)
        if memory is not None:
            memory.compensate(bucket.name, x, inplace=True)
        comp.encode_chunks(x, message, bounds, self.scale_block)
        if memory is not None:
            kept = bucket.scratch("kept", bucket.numel, torch.float32)
            memory.remember(bucket.name, x, comp.decode_chunks(message, bounds, kept, self.scale_block))
        return message, sizes

    def _divisor(self, n):
        return n if self.op == hvd.Average else 1


class AllgatherCommunicator(_PacketBase):
    """Gather every rank's bucket message; decode and sum all n in one pass (the course's design)."""
    route = Route.ALLGATHER

    def start(self, bucket, memory=None):
        with self.stats.timing("compress_s"):
            message, _ = self._encode(bucket, [(0, bucket.numel)], memory)
        handle = hvd.allgather_async(message, name=self._tag(bucket.name))
        self.stats.values["bytes_sent"] += (hvd.size() - 1) * message.numel()
        return Exchange(bucket, handle)

    def finish(self, exchange):
        bucket, n = exchange.bucket, hvd.size()
        with self.stats.timing("communicate_s"):
            gathered = wait_for(exchange.handle)
        with self.stats.timing("decompress_s"):
            self.compression.decode_messages(gathered.view(n, -1), bucket.numel, bucket.buffer,
                                             self._block(bucket.numel), self._divisor(n))


_chunk_bounds = chunk_bounds        # the cost model's, so formula and code cut alike


class AlltoallCommunicator(_PacketBase):
    """Two-phase: alltoall of encoded chunks, decode-and-sum, re-encode, allgather."""
    route = Route.ALLTOALL

    def _chunks(self, bucket):
        # Cut on block boundaries so every chunk's scales are its own; with one scale per tensor
        # (scale_block=None) each chunk gets its own scale instead.
        return _chunk_bounds(bucket.numel, hvd.size(), self.scale_block or 1)

    def start(self, bucket, memory=None):
        chunks = bucket.cached(("chunks", hvd.size()), lambda: self._chunks(bucket))
        with self.stats.timing("compress_s"):
            message, sizes = self._encode(bucket, chunks, memory)
        splits = bucket.cached(("splits", tuple(sizes)), lambda: torch.tensor(sizes, dtype=torch.int32))
        handle = hvd.alltoall_async(message, splits=splits, name=self._tag(bucket.name))
        self.stats.values["bytes_sent"] += message.numel() - sizes[hvd.rank()]
        return Exchange(bucket, handle, (chunks, sizes))

    def progress(self, exchange, wait=False):
        """Phase 1 done (or wait=True): reduce this rank's chunk, launch the allgather."""
        if exchange.phase != 1 or not (wait or hvd.poll(exchange.handle)):
            return
        bucket, (chunks, sizes) = exchange.bucket, exchange.ctx
        n, me = hvd.size(), hvd.rank()
        a, b = chunks[me]
        with self.stats.timing("communicate_s"):
            received, _ = wait_for(exchange.handle)
        with self.stats.timing("decompress_s"):   # and re-encode: one pass, in one call
            reduced = bucket.scratch("reduced", sizes[me], torch.uint8, zero=True)
            self.compression.reduce_encode(received.view(n, -1), b - a, reduced, self._block(b - a),
                                           self._divisor(n))
        exchange.handle = hvd.allgather_async(reduced, name=self._tag(bucket.name + ".gather"))
        exchange.phase = 2
        self.stats.values["bytes_sent"] += (n - 1) * reduced.numel()

    def advance(self, exchanges):
        launch_next_phases(self, exchanges)

    def finish(self, exchange):
        self.progress(exchange, wait=True)
        bucket, (chunks, _) = exchange.bucket, exchange.ctx
        with self.stats.timing("communicate_s"):
            gathered = wait_for(exchange.handle)
        with self.stats.timing("decompress_s"):
            _, _, bounds = self._layout(bucket, chunks)
            self.compression.decode_chunks(gathered, bounds, bucket.buffer, self.scale_block)


_ROUTES = {Route.ALLREDUCE: AllreduceCommunicator, Route.ALLGATHER: AllgatherCommunicator,
           Route.ALLTOALL: AlltoallCommunicator}


def make_communicator(compression, route=None, op=hvd.Average, fusion_threshold_bytes=None,
                      scale_block=SCALE_BLOCK, *, reduction=None):
    """The communicator for `compression` over `route` (None: the scheme's default, see
    registry.SCHEMES). The one place where a route is chosen. `reduction=` is the old name of
    `route=`, still accepted."""
    if reduction is not None:
        if route is not None and Route.parse(route) != Route.parse(reduction):
            raise ValueError(f"route={route!r} and reduction={reduction!r} disagree; pass route= only")
        route = reduction
    from .powersgd import PowerSGD, PowerSGDCommunicator
    if isinstance(compression, PowerSGD):        # low rank: two dependent allreduces per matrix
        if route is not None and Route.parse(route) != Route.ALLREDUCE:
            raise ValueError(f"PowerSGD travels by allreduce, not {route!r}")
        return PowerSGDCommunicator(compression, op=op)
    from .topk import TopK, TopKCommunicator
    if isinstance(compression, TopK):            # sparse pairs: summed after an allgather
        if route is not None and Route.parse(route) != Route.ALLGATHER:
            raise ValueError(f"top-k travels by allgather, not {route!r}")
        return TopKCommunicator(compression, op=op)
    name = compressor_name(compression)
    packet = isinstance(compression, type) and issubclass(compression, PacketCompressor)
    if name in SCHEMES:
        route = resolve_route(name, route)
    else:                                        # a user's compressor: by what it can do
        route = Route.parse(route) if route is not None else (
            Route.ALLGATHER if packet else Route.ALLREDUCE)
        if packet == (route == Route.ALLREDUCE):
            raise ValueError(f"{name} cannot travel by {route.value}: packet compressors take "
                             "'allgather' or 'alltoall', others 'allreduce'")
    if scale_block is not None and int(scale_block) < 1:
        raise ValueError(f"scale_block must be >= 1 values or None (one scale per tensor), "
                         f"got {scale_block!r}")
    return _ROUTES[route](compression, op=op, fusion_threshold_bytes=fusion_threshold_bytes,
                          scale_block=scale_block)


def start_packet_exchange(compression, tensor, name, op=hvd.Average):
    """Launch one tensor's packet allgather now; return a callable that finishes it.

    The hook Horovod's own DistributedOptimizer needs for the course's in-tree route
    (patches/course-bit8-bit16.patch): Horovod calls it per gradient during backward and calls
    the returned function in synchronize(). Horovod's interface, per tensor: every rank's
    `compress()` packet is decoded with `decode_packet` and summed in float32 in rank order,
    as the plugin's allgather route does with scale_block=None, bit for bit.
    """
    comm = AllgatherCommunicator(compression, op=op, scale_block=None)  # validates op, warms
    packet, (shape, dtype) = compression.compress(tensor)
    handle = hvd.allgather_async(packet, name=f"hvdc.{comm.describe()}.{name}")

    def finish():
        n = hvd.size()
        rows = wait_for(handle).view(n, -1)
        total = compression.decode_packet(rows[0])
        scratch = torch.empty_like(total)
        for r in range(1, n):
            total.add_(compression.decode_packet(rows[r], out=scratch))
        comm._average(total, n)
        return total.view(shape).to(dtype)
    return finish


def horovod_bytes_sent(compression, numels, n):
    """Bytes one rank sends per step under Horovod's own `hvd.DistributedOptimizer` (stock, or
    the course's patched route), counted as the communicators count theirs: (n-1) packets per
    gradient by allgather for 8/16-bit packet compressors, 2(n-1)/n of each tensor by ring
    allreduce otherwise; 0 at n = 1 (Horovod skips the exchange)."""
    if n == 1:
        return 0
    if isinstance(compression, type) and issubclass(compression, PacketCompressor):
        return sum((n - 1) * compression.packet_bytes(numel) for numel in numels)
    item = 2 if compression is Compression.fp16 else 4
    return sum(2 * (n - 1) * numel * item // n for numel in numels)
