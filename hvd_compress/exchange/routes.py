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
import inspect

import torch

from ..codecs import SCALE_BLOCK
from ..compressors import compressor_name
from ..registry import SCHEMES, Route, load_plugins, resolve_route
from ..engine.base import AVERAGE
from ..roles import FP16Compressor, PacketCompressor, rounding_stream
from .base import Capabilities, CommunicatorBase, Exchange, Stats, launch_next_phases, wait_for
from .bucketing import DEFAULT_FUSION_BYTES, chunk_bounds
from .sender import MAX_CHUNKS, ChunkedHandle, Sender, chunk_plan

__all__ = ["make_communicator", "route_of", "AllreduceCommunicator", "AllgatherCommunicator",
           "AlltoallCommunicator", "Stats", "start_packet_exchange", "horovod_bytes_sent",
           "DEFAULT_FUSION_BYTES", "wait_for", "launch_next_phases"]

_WARMED = set()


class _Base(CommunicatorBase):

    def __init__(self, compression, op=AVERAGE, fusion_threshold_bytes=None,
                 scale_block=SCALE_BLOCK, engine=None):
        super().__init__(compression, op, engine)
        self.scale_block = scale_block
        threshold = DEFAULT_FUSION_BYTES if fusion_threshold_bytes is None else int(fusion_threshold_bytes)
        # One scale per tensor (scale_block=None, the course's packets) means one tensor per bucket.
        self.fusion_threshold_bytes = threshold if scale_block else 0

    def describe(self):
        return f"{compressor_name(self.compression)}/{self.route.value}"

    def chunk_counts(self):
        """{bucket name: chunks} of the buckets prioritise() cut (none here)."""
        return {}

    def _average(self, values, n):
        if self.op == AVERAGE and n > 1:
            values.div_(n)


class AllreduceCommunicator(_Base):
    """compress -> hvd.allreduce_async_ -> decompress: Horovod's own path, tensor by tensor."""
    route = Route.ALLREDUCE
    capabilities = Capabilities(one_phase=True)
    # Horovod's own name (the parameter's), so results match hvd.DistributedOptimizer's; True:
    # the scheme and route in it (Compression.auto, where buckets change schemes).
    tagged = False

    def start(self, bucket, memory=None):
        if memory is not None:
            raise ValueError("error feedback needs a lossy packet route (bit8/bit16 with "
                             "route 'allgather' or 'alltoall'), not allreduce")
        n = self.engine.size()
        with self.stats.timing("compress_s"):
            compressed, ctx = self.compression.compress(bucket.tensor)
        restore = None
        if compressed.dtype == torch.bfloat16:    # Horovod's CPU ops have no bfloat16: sum in
            compressed, restore = compressed.float(), torch.bfloat16   # float32, cast back
        elif not compressed.is_contiguous():      # Horovod needs a dense row-major buffer
            compressed = compressed.contiguous()
        name = self._tag(bucket.name) if self.tagged else bucket.name
        handle = self.engine.allreduce_async_(compressed, name, self.op)
        self.stats.add("bytes_sent", int(2 * (n - 1) * compressed.numel()
                                         * compressed.element_size() // n))
        return Exchange(bucket, handle, (ctx, restore))

    def finish(self, exchange):
        with self.stats.timing("communicate_s"):
            output = self.engine.wait(exchange.handle)
        with self.stats.timing("decompress_s"):
            ctx, restore = exchange.ctx
            if restore is not None:
                output = output.to(restore)
            exchange.bucket.tensor = self.compression.decompress(output, ctx)


class _PacketBase(_Base):
    """The packet routes: compensate -> encode one message per destination -> remember."""
    capabilities = Capabilities(fuses=True, takes_memory=True)

    def __init__(self, compression, *args, **kwargs):
        super().__init__(compression, *args, **kwargs)
        self.device = torch.device("cpu")
        if compression not in _WARMED:
            # The codecs probe torch's casts once per device (about a second); do it here,
            # not inside the first timed training step.
            compression.decode_packet(compression.compress(torch.zeros(1))[0])
            _WARMED.add(compression)

    def _block(self, numel):
        return self.scale_block or max(numel, 1)

    def codec_path(self):
        """'native' where the C++ kernel codes this bucket's values, else 'torch' (its fallback,
        much slower; a missing kernel warns once, codecs/blocks.py)."""
        path = getattr(self.compression, "codec_path", None)
        return path(self.device) if path is not None else "torch"

    def _layout(self, bucket, pieces):
        """The bucket's message, made once: one message per piece (a, b) of the buffer (the
        pieces cover it in order), their sizes, and the pieces' bounds."""
        comp = self.compression

        def make():
            sizes = [comp.message_bytes(b - a, self._block(b - a)) for a, b in pieces]
            message = torch.zeros(sum(sizes), dtype=torch.uint8, device=bucket.device)
            return message, sizes, [a for a, _ in pieces] + [pieces[-1][1]]
        # keyed by the codec too: Compression.auto exchanges one bucket by several schemes
        return bucket.cached(("layout", self.route, comp.name, tuple(pieces)), make)

    def _encode(self, bucket, pieces, memory):
        """Encode bucket.buffer[a:b] for each (a, b) in `pieces` into one message of segments;
        with error feedback, compensate first and remember what the codes dropped."""
        comp, x = self.compression, bucket.buffer
        self.device = x.device
        message, sizes, bounds = self._layout(bucket, pieces)
        if memory is not None:
            memory.compensate(bucket.name, x, inplace=True)
        with rounding_stream(bucket.name):
            comp.encode_chunks(x, message, bounds, self.scale_block)
        if memory is not None:
            kept = bucket.scratch("kept", bucket.numel, torch.float32)
            memory.remember(bucket.name, x, comp.decode_chunks(message, bounds, kept, self.scale_block))
        return message, sizes

    def _divisor(self, n):
        return n if self.op == AVERAGE else 1


class _Prioritised(_PacketBase):
    """What both packet routes share under schedule="overlap": prioritise() chooses which bucket
    is cut into chunks (sender.chunk_plan, from the layout alone, so every rank cuts alike) and
    a Sender hands the chunks to the engine a few at a time; the buckets not cut are launched
    directly, ahead of the chunks still queued."""
    sender = None
    _chunking = {}
    max_chunks = MAX_CHUNKS

    def prioritise(self, buckets):
        """Buckets in backward order (last layer first, the forward needs the last first):
        choose the chunks and start a sender if any bucket is cut. Only with block scales (a
        chunk's own scales) and on an engine that matches collectives by name (the sender
        launches in its own thread, in an order timing decides)."""
        if self.scale_block is None or self.engine.size() == 1 or self.engine.matches_by_order:
            return
        sizes = [self.compression.message_bytes(b.numel, self._block(b.numel)) for b in buckets]
        self._chunking = {}
        for i, count in chunk_plan(sizes, self.max_chunks).items():
            count = min(count, self._most_chunks(buckets[i]))
            if count > 1:
                self._chunking[buckets[i].name] = (i, count)
        if self._chunking and self.sender is None:
            self.sender = Sender(self.engine)

    def chunk_counts(self):
        """{bucket name: chunks} of the cut prioritise() made (empty: nothing cut), for the
        planner to price."""
        return {name: count for name, (_, count) in self._chunking.items()}

    def _most_chunks(self, bucket):
        """How many chunks the bucket can be cut into (each at least a scale block)."""
        return -(-bucket.numel // self.scale_block)

    def drop(self, exchange):
        """Wait for an abandoned exchange, its result dropped (its own error too)."""
        chunked = isinstance(exchange.handle, ChunkedHandle)
        for handle in exchange.handle.tickets if chunked else [exchange.handle]:
            try:
                self.sender.wait(handle) if chunked else wait_for(handle, self.engine)
            except Exception:
                pass

    def close(self):
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self._chunking = {}


class AllgatherCommunicator(_Prioritised):
    """Gather every rank's bucket message; decode and sum all n in one pass (the course's design).

    With priorities (prioritise(), schedule="overlap"): a bucket the next forward needs late
    and that is larger than what it needs first is cut into chunks on scale-block boundaries,
    each gathered on its own through a Sender (exchange/sender.py), so the front buckets,
    launched directly, are not queued behind all of it. The codes are the same (a chunk's
    segment of the message is the message of its values), so are the bits."""
    route = Route.ALLGATHER
    capabilities = Capabilities(fuses=True, takes_memory=True, one_phase=True)

    def start(self, bucket, memory=None):
        if bucket.name in self._chunking and self.sender is not None:
            return self._start_chunked(bucket, memory, *self._chunking[bucket.name])
        with self.stats.timing("compress_s"):
            message, _ = self._encode(bucket, [(0, bucket.numel)], memory)
        handle = self.engine.allgather_async(message, self._tag(bucket.name))
        self.stats.add("bytes_sent", (self.engine.size() - 1) * message.numel())
        return Exchange(bucket, handle)

    def _start_chunked(self, bucket, memory, priority, count):
        pieces = bucket.cached(("pieces", count, self.scale_block), lambda: chunk_bounds(
            bucket.numel, count, self.scale_block))
        pieces = [(a, b) for a, b in pieces if b > a]
        with self.stats.timing("compress_s"):
            message, sizes = self._encode(bucket, pieces, memory)
        tickets, offset = [], 0
        for k, size in enumerate(sizes):
            segment = message[offset:offset + size]
            offset += size
            name = self._tag(f"{bucket.name}.c{k}of{len(sizes)}")
            tickets.append(self.sender.submit(priority, lambda segment=segment, name=name:
                                              self.engine.allgather_async(segment, name)))
        self.stats.add("bytes_sent", (self.engine.size() - 1) * message.numel())
        return Exchange(bucket, ChunkedHandle(tickets), (pieces, sizes))

    def finish(self, exchange):
        bucket, n = exchange.bucket, self.engine.size()
        if isinstance(exchange.handle, ChunkedHandle):
            return self._finish_chunked(exchange)
        with self.stats.timing("communicate_s"):
            gathered = self.engine.wait(exchange.handle)
        with self.stats.timing("decompress_s"):
            self.compression.decode_messages(gathered.view(n, -1), bucket.numel, bucket.buffer,
                                             self._block(bucket.numel), self._divisor(n))

    def _finish_chunked(self, exchange):
        bucket, n = exchange.bucket, self.engine.size()
        pieces, _ = exchange.ctx
        for ticket, (a, b) in zip(exchange.handle.tickets, pieces):
            with self.stats.timing("communicate_s"):
                gathered = self.sender.wait(ticket)
            with self.stats.timing("decompress_s"):
                self.compression.decode_messages(gathered.view(n, -1), b - a, bucket.buffer[a:b],
                                                 self._block(b - a), self._divisor(n))




class AlltoallCommunicator(_Prioritised):
    """Two-phase: alltoall of encoded chunks, decode-and-sum, re-encode, allgather.

    With priorities (prioritise(), schedule="overlap"): the bucket that is cut goes in pieces,
    each a two-phase exchange of its own through a Sender: piece k holds the k-th part of every
    rank's chunk (cut on scale-block boundaries), so each rank still reduces exactly its own
    chunk, part after part in order, with the same rounding stream, and the bits are those of
    the bucket exchanged whole. The sender's thread reduces a piece and launches its allgather
    as soon as its alltoall completes, while the main thread computes; the front buckets,
    launched directly, wait behind at most a piece or two. A piece is two collectives, each
    with Horovod's negotiation round before it: at most half the allgather route's chunks."""
    route = Route.ALLTOALL
    max_chunks = MAX_CHUNKS // 2

    def _most_chunks(self, bucket):
        """Every rank's chunk cut into as many parts, each at least a scale block."""
        chunks = bucket.cached(("chunks", self.engine.size()), lambda: self._chunks(bucket))
        return min(-(-(b - a) // self.scale_block) for a, b in chunks)

    def _chunks(self, bucket):
        # Cut on block boundaries so every chunk's scales are its own; with one scale per tensor
        # (scale_block=None) each chunk gets its own scale instead.
        return chunk_bounds(bucket.numel, self.engine.size(), self.scale_block or 1)

    def start(self, bucket, memory=None):
        if bucket.name in self._chunking and self.sender is not None:
            return self._start_chunked(bucket, memory, *self._chunking[bucket.name])
        chunks = bucket.cached(("chunks", self.engine.size()), lambda: self._chunks(bucket))
        with self.stats.timing("compress_s"):
            message, sizes = self._encode(bucket, chunks, memory)
        splits = bucket.cached(("splits", tuple(sizes)), lambda: torch.tensor(sizes, dtype=torch.int32))
        handle = self.engine.alltoall_async(message, splits, self._tag(bucket.name))
        self.stats.add("bytes_sent", message.numel() - sizes[self.engine.rank()])
        return Exchange(bucket, handle, (chunks, sizes))

    def progress(self, exchange, wait=False):
        """Phase 1 done (or wait=True): reduce this rank's chunk, launch the allgather."""
        if exchange.phase != 1 or not (wait or self.engine.poll(exchange.handle)):
            return
        bucket, (chunks, sizes) = exchange.bucket, exchange.ctx
        n, me = self.engine.size(), self.engine.rank()
        a, b = chunks[me]
        with self.stats.timing("communicate_s"):
            received, _ = self.engine.wait(exchange.handle)
        with self.stats.timing("decompress_s"):   # and re-encode: one pass, in one call
            reduced = bucket.scratch("reduced", sizes[me], torch.uint8, zero=True)
            with rounding_stream(bucket.name + ".reduce"):     # its own: phase 2s run in
                self.compression.reduce_encode(                  # the order phase 1s complete
                    received.view(n, -1), b - a, reduced, self._block(b - a), self._divisor(n))
        exchange.handle = self.engine.allgather_async(reduced, self._tag(bucket.name + ".gather"),
                                                      sizes)
        exchange.phase = 2
        self.stats.add("bytes_sent", (n - 1) * reduced.numel())

    def advance(self, exchanges):
        launch_next_phases(self, exchanges)

    def _start_chunked(self, bucket, memory, priority, count):
        """Encode the bucket once, in its own order (a stochastic codec draws as for the whole
        bucket), and queue its pieces: piece k's alltoall sends the k-th part of chunk r to
        rank r; its next phase (_reduce_piece) runs on the sender's thread. Phase 2 from the
        start: launch_next_phases and progress leave it to the sender."""
        n, me = self.engine.size(), self.engine.rank()
        parts = bucket.cached(("parts", n, count), lambda: self._parts(bucket, count))
        with self.stats.timing("compress_s"):
            message, sizes = self._encode(bucket, [part for chunk in parts for part in chunk],
                                          memory)
            offsets = [0]
            for size in sizes:
                offsets.append(offsets[-1] + size)
            segment = lambda r, k: message[offsets[r * count + k]:offsets[r * count + k + 1]]
            sends = [torch.cat([segment(r, k) for r in range(n)]) for k in range(count)]
        tickets, previous = [], None
        for k in range(count):
            row = [sizes[r * count + k] for r in range(n)]
            splits = torch.tensor(row, dtype=torch.int32)
            name = self._tag(f"{bucket.name}.c{k}of{count}")
            launch = (lambda send=sends[k], splits=splits, name=name:
                      self.engine.alltoall_async(send, splits, name))
            then = (lambda handle, k=k, row=row, name=name:
                    self._reduce_piece(bucket, parts[me][k], row, name, handle))
            previous = self.sender.submit(priority, launch, then, after=previous)
            tickets.append(previous)
        mine = sum(sizes[me * count:(me + 1) * count])
        self.stats.add("bytes_sent", message.numel() - mine + (n - 1) * mine)
        return Exchange(bucket, ChunkedHandle(tickets), (parts, sizes, count), phase=2)

    def _parts(self, bucket, count):
        """parts[r][k]: the k-th of `count` parts of rank r's chunk, on scale-block boundaries."""
        chunks = bucket.cached(("chunks", self.engine.size()), lambda: self._chunks(bucket))
        return [[(a + x, a + y) for x, y in chunk_bounds(b - a, count, self.scale_block)]
                for a, b in chunks]

    def _reduce_piece(self, bucket, part, row, name, handle):
        """On the sender's thread, piece by piece in order: this rank's part of the piece from
        every rank, decoded, summed, re-encoded (the bucket's reduce stream, drawn on where the
        previous part left it), and its allgather launched; returns that handle."""
        n, me = self.engine.size(), self.engine.rank()
        a, b = part
        received, _ = self.engine.wait(handle)
        reduced = bucket.scratch(("reduced", name), row[me], torch.uint8, zero=True)
        with rounding_stream(bucket.name + ".reduce"):
            self.compression.reduce_encode(received.view(n, -1), b - a, reduced,
                                           self._block(b - a), self._divisor(n))
        return self.engine.allgather_async(reduced, name + ".gather", row)

    def _finish_chunked(self, exchange):
        bucket, n = exchange.bucket, self.engine.size()
        parts, sizes, count = exchange.ctx
        for k, ticket in enumerate(exchange.handle.tickets):
            with self.stats.timing("communicate_s"):
                gathered = self.sender.wait(ticket)
            self.stats.add("decompress_s", ticket.busy_s)      # the middle, on the sender's thread
            with self.stats.timing("decompress_s"):
                offset = 0
                for r in range(n):
                    (a, b), size = parts[r][k], sizes[r * count + k]
                    self.compression.decode_chunks(gathered[offset:offset + size], [0, b - a],
                                                   bucket.buffer[a:b], self.scale_block)
                    offset += size

    def finish(self, exchange):
        if isinstance(exchange.handle, ChunkedHandle):
            return self._finish_chunked(exchange)
        self.progress(exchange, wait=True)
        bucket, (chunks, _) = exchange.bucket, exchange.ctx
        with self.stats.timing("communicate_s"):
            gathered = self.engine.wait(exchange.handle)
        with self.stats.timing("decompress_s"):
            _, _, bounds = self._layout(bucket, chunks)
            self.compression.decode_chunks(gathered, bounds, bucket.buffer, self.scale_block)


_ROUTES = {Route.ALLREDUCE: AllreduceCommunicator, Route.ALLGATHER: AllgatherCommunicator,
           Route.ALLTOALL: AlltoallCommunicator}


def make_communicator(compression, route=None, op=AVERAGE, fusion_threshold_bytes=None,
                      scale_block=SCALE_BLOCK, engine=None):
    """The communicator for `compression` over `route` (None: the scheme's default, see
    registry.SCHEMES). The one place where a route is chosen. A method that is not one codec of
    values (top-k, PowerSGD, Compression.auto) declares its own: `compression.communicator(op)`,
    with the fusion threshold and scale block where its factory takes them (auto's buckets); one
    whose route is None chooses a route per bucket and takes no `route`. `engine`: the
    collectives (engine/; Horovod's unless given: hvd_compress.ddp passes torch.distributed's)."""
    if callable(getattr(compression, "communicator", None)):
        return own_communicator(compression, route, op, fusion_threshold_bytes, scale_block,
                                engine)
    route = route_of(compression, route)
    check_scale_block(scale_block)
    return _ROUTES[route](compression, op=op, fusion_threshold_bytes=fusion_threshold_bytes,
                          scale_block=scale_block, engine=engine)


def own_communicator(method, route, op, fusion_threshold_bytes=None, scale_block=SCALE_BLOCK,
                     engine=None):
    """The communicator a method with a collective of its own declares, checked against the
    route asked for."""
    comm = _declared(method.communicator, op, fusion_threshold_bytes, scale_block, engine)
    if route is not None and comm.route is None:
        raise ValueError(f"{compressor_name(method)} chooses each bucket's route: pass no route")
    if route is not None and Route.parse(route) != comm.route:
        raise ValueError(f"{compressor_name(method)} travels by {comm.route.value}, "
                         f"not {route!r}")
    return comm


def route_of(compression, route=None) -> Route:
    """The route a codec takes: a registered scheme's (registry.py, plugins included) checked
    or defaulted there; a user's unregistered compressor's by what it can do."""
    name = compressor_name(compression)
    if name not in SCHEMES:
        load_plugins()
    if name in SCHEMES:
        return resolve_route(name, route)
    return route_by_capability(compression, route)


def route_by_capability(compression, route=None) -> Route:
    """An unregistered compressor: a PacketCompressor travels by allgather (or alltoall),
    anything else by Horovod's allreduce."""
    packet = isinstance(compression, type) and issubclass(compression, PacketCompressor)
    route = Route.parse(route) if route is not None else (
        Route.ALLGATHER if packet else Route.ALLREDUCE)
    if packet == (route == Route.ALLREDUCE):
        raise ValueError(f"{compressor_name(compression)} cannot travel by {route.value}: "
                         "packet compressors take 'allgather' or 'alltoall', others 'allreduce'")
    return route


def check_scale_block(scale_block):
    """scale_block: a positive number of values per scale, or None (one scale per tensor)."""
    if scale_block is not None and int(scale_block) < 1:
        raise ValueError(f"scale_block must be >= 1 values or None (one scale per tensor), "
                         f"got {scale_block!r}")


def _declared(factory, op, fusion_threshold_bytes, scale_block, engine=None):
    """A method's own communicator: factory(op), and the fusion threshold and scale block by
    name where the factory takes them (Compression.auto fuses buckets; top-k and PowerSGD
    exchange per tensor and take op alone, as docs/extending.md documents), and the engine
    where one is given (a factory that takes none cannot run on another engine)."""
    takes = inspect.signature(factory).parameters
    layout = {k: v for k, v in (("fusion_threshold_bytes", fusion_threshold_bytes),
                                ("scale_block", scale_block)) if k in takes}
    if engine is not None:
        if "engine" not in takes:
            raise ValueError(f"{factory!r} takes no engine: this method runs on Horovod only")
        layout["engine"] = engine
    return factory(op=op, **layout)


def start_packet_exchange(compression, tensor, name, op=AVERAGE):
    """Launch one tensor's packet allgather now; return a callable that finishes it.

    The hook Horovod's own DistributedOptimizer needs for the course's in-tree route
    (patches/course-bit8-bit16.patch): Horovod calls it per gradient during backward and calls
    the returned function in synchronize(). Horovod's interface, per tensor: every rank's
    `compress()` packet is decoded with `decode_packet` and summed in float32 in rank order,
    as the plugin's allgather route does with scale_block=None, bit for bit.
    """
    comm = AllgatherCommunicator(compression, op=op, scale_block=None)  # validates op, warms
    packet, (shape, dtype) = compression.compress(tensor)
    handle = comm.engine.allgather_async(packet, f"hvdc.{comm.describe()}.{name}")

    def finish():
        n = comm.engine.size()
        rows = comm.engine.wait(handle).view(n, -1)
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
    item = 2 if compression is FP16Compressor else 4
    return sum(2 * (n - 1) * numel * item // n for numel in numels)
