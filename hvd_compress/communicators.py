"""How compressed gradients travel between ranks, and what that costs in bytes.

Three routes, one interface (`reduce(tensors, names) -> reduced tensors`):

- `AllreduceCommunicator`: Horovod's allreduce of the compressed tensor. Right for `none`
  and Horovod's `fp16`, whose compressed form can be summed. Exactly what
  `hvd.DistributedOptimizer` does, so results are bit-identical to it.
- `AllgatherCommunicator`: the course's design for 8-bit codes. Horovod's allreduce rejects
  uint8, and a sum of float8 codes is meaningless, so every rank gathers every rank's packet,
  decodes them and reduces in float32. Each rank receives (n-1) packets: cheaper than fp32 ring
  allreduce (2(n-1)/n * g) only while n < 8 for 8-bit codes.
- `AlltoallCommunicator`: two-phase 8/16-bit reduction that scales with n. Each rank's
  gradient is cut into n chunks; alltoall hands chunk k of every rank to rank k, which decodes,
  reduces in float32 and re-encodes it; an allgather of the reduced chunks completes the
  result. Per rank 2(n-1)/n * g/4 bytes for 8-bit codes: a quarter of fp32 ring allreduce at
  every n. Each chunk carries its own scale.

Every rank ends with bit-identical results: all decode the same packets in rank order.
Each communicator counts the bytes this rank sends, as the ring / pairwise algorithms move
them, so the lab and the benchmarks never estimate what they can count.
"""
import time
from contextlib import contextmanager

import torch
import horovod.torch as hvd

from .compressors import compressor_name, packet_bytes
from .fusion import buckets_by_size, flatten

__all__ = ["make_communicator", "AllreduceCommunicator", "AllgatherCommunicator",
           "AlltoallCommunicator", "REDUCTIONS", "Stats", "start_packet_exchange"]

REDUCTIONS = ("allreduce", "allgather", "alltoall")
DEFAULT_FUSION_BYTES = 64 * 1024 * 1024
_WARMED = set()


class Stats:
    """Seconds spent compressing, communicating, decompressing, and bytes sent, since last pop."""
    FIELDS = ("compress_s", "communicate_s", "decompress_s", "bytes_sent")

    def __init__(self):
        self.reset()

    def reset(self):
        self.values = dict.fromkeys(self.FIELDS, 0)
        self.values["compress_s"] = self.values["communicate_s"] = self.values["decompress_s"] = 0.0

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


def _check_op(op):
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("compressed gradient exchange supports op=hvd.Average or hvd.Sum "
                         f"(got {op!r}); use hvd.DistributedOptimizer for Adasum")


class _Communicator:
    reduction = None

    def __init__(self, compression, op=hvd.Average, fusion_threshold_bytes=None):
        _check_op(op)
        self.compression = compression
        self.op = op
        self.fusion_threshold_bytes = (DEFAULT_FUSION_BYTES if fusion_threshold_bytes is None
                                       else int(fusion_threshold_bytes))
        self.stats = Stats()
        if hasattr(compression, "decode_packet") and compression not in _WARMED:
            # The codecs probe torch's casts once per device (about a second); do it here,
            # not inside the first timed training step.
            compression.decode_packet(compression.compress(torch.zeros(1))[0])
            _WARMED.add(compression)

    def pop_stats(self):
        return self.stats.pop()

    def describe(self):
        return f"{compressor_name(self.compression)}/{self.reduction}"

    def _tag(self, name):
        # The route is part of the name, so ranks that disagree on it never match silently.
        return None if name is None else f"hvdc.{self.describe()}.{name}"

    def _compress(self, tensor, name, memory):
        """compress(tensor), with error feedback when a ResidualMemory is given."""
        if memory is None:
            return self.compression.compress(tensor)
        compensated = memory.compensate(name, tensor)
        packet, ctx = self.compression.compress(compensated)
        memory.remember(name, compensated, self.compression.decode_packet(packet))
        return packet, (tensor.shape, tensor.dtype)

    def _sum_packets(self, rows, n):
        """Decode row r = rank r's packet, sum in float32 in rank order, average if asked."""
        total = self.compression.decode_packet(rows[0])
        scratch = torch.empty_like(total)
        for r in range(1, n):
            total.add_(self.compression.decode_packet(rows[r], out=scratch))
        return self._finish_mean(total, n)

    def _finish_mean(self, total, n):
        if self.op == hvd.Average and n > 1:
            total.div_(n)
        return total


class AllreduceCommunicator(_Communicator):
    """compress -> hvd.allreduce_async_ -> decompress: Horovod's own path, tensor by tensor.

    Horovod fuses these allreduces in its own fusion buffer, so no bucketing here.
    """
    reduction = "allreduce"

    def reduce(self, tensors, names, memory=None):
        if memory is not None:
            raise ValueError("error feedback needs a lossy packet route (bit8/bit16 with "
                             "reduction 'allgather' or 'alltoall'), not allreduce")
        n = hvd.size()
        pending = []
        for tensor, name in zip(tensors, names):
            with self.stats.timing("compress_s"):
                compressed, ctx = self.compression.compress(tensor)
            restore = None
            if compressed.dtype == torch.bfloat16:  # Horovod's CPU ops have no bfloat16: sum in
                compressed, restore = compressed.float(), torch.bfloat16   # float32, cast back
            elif not compressed.is_contiguous():    # Horovod needs a dense row-major buffer
                compressed = compressed.contiguous()
            handle = hvd.allreduce_async_(compressed, name=name, op=self.op,
                                          prescale_factor=1.0, postscale_factor=1.0)
            self.stats.values["bytes_sent"] += int(
                2 * (n - 1) * compressed.numel() * compressed.element_size() // n)
            pending.append((handle, ctx, restore))
        results = []
        for handle, ctx, restore in pending:
            with self.stats.timing("communicate_s"):
                output = hvd.synchronize(handle)
            with self.stats.timing("decompress_s"):
                if restore is not None:
                    output = output.to(restore)
                results.append(self.compression.decompress(output, ctx))
        return results


class AllgatherCommunicator(_Communicator):
    """Gather every rank's packets, decode them all, reduce in float32 (the course's design).

    Tensors are bucketed up to `fusion_threshold_bytes` of float32: a bucket's packets (one per
    tensor, each with its own scale) are concatenated and travel in one allgather.
    """
    reduction = "allgather"

    def reduce(self, tensors, names, memory=None):
        launched = [(bucket, self.start([tensors[i] for i in bucket], [names[i] for i in bucket], memory))
                    for bucket in buckets_by_size(tensors, self.fusion_threshold_bytes)]
        results = [None] * len(tensors)
        for bucket, handle in launched:
            for i, reduced in zip(bucket, self.finish(handle)):
                results[i] = reduced
        return results

    def start(self, tensors, names, memory=None):
        """Compress `tensors` and launch one allgather carrying all their packets."""
        with self.stats.timing("compress_s"):
            packed = [self._compress(t, name, memory) for t, name in zip(tensors, names)]
            message = torch.cat([p for p, _ in packed]) if len(packed) > 1 else packed[0][0]
        handle = hvd.allgather_async(message, name=self._tag(names[0]))
        self.stats.values["bytes_sent"] += (hvd.size() - 1) * message.numel()
        return handle, [(p.numel(), ctx) for p, ctx in packed]

    def finish(self, started):
        """Wait for the allgather, decode every rank's packets, reduce: one tensor per input."""
        handle, layout = started
        n = hvd.size()
        with self.stats.timing("communicate_s"):
            gathered = hvd.synchronize(handle)
        results, offset = [], 0
        with self.stats.timing("decompress_s"):
            per_rank = gathered.view(n, -1)
            for size, (shape, dtype) in layout:
                results.append(self._sum_packets(per_rank[:, offset:offset + size], n).view(shape).to(dtype))
                offset += size
        return results


def start_packet_exchange(compression, tensor, name, op=hvd.Average):
    """Launch one tensor's allgather exchange now; return a callable that finishes it.

    The hook Horovod's own DistributedOptimizer needs for the course's in-tree route
    (patches/course-bit8-bit16.patch): Horovod calls it per gradient during backward and
    calls the returned function in synchronize().
    """
    comm = AllgatherCommunicator(compression, op=op, fusion_threshold_bytes=0)
    started = comm.start([tensor], [name])
    return lambda: comm.finish(started)[0]


def _chunk_bounds(numel, n):
    """n contiguous chunks covering range(numel), sizes differing by at most one."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for k in range(n):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class AlltoallCommunicator(_Communicator):
    """Two-phase reduction: alltoall of encoded chunks, reduce, allgather of reduced chunks.

    Every tensor is cut into n chunks (sizes differ by at most one), each encoded with its own
    scale, so a small-magnitude tensor never shares a scale with a large one. Rank k receives
    chunk k of every tensor of a bucket from every rank in one alltoall, reduces each in float32
    and re-encodes it; one allgather per bucket brings every reduced chunk to every rank.
    """
    reduction = "alltoall"

    def reduce(self, tensors, names, memory=None):
        n, me = hvd.size(), hvd.rank()
        phase1 = []
        for bucket in buckets_by_size(tensors, self.fusion_threshold_bytes):
            with self.stats.timing("compress_s"):
                flats = [flatten([tensors[i]]) for i in bucket]
                if memory is not None:
                    flats = [memory.compensate(names[i], f) for i, f in zip(bucket, flats)]
                bounds = [_chunk_bounds(f.numel(), n) for f in flats]
                # packets[k][j]: chunk k of tensor j, destined for rank k
                packets = [[self.compression.compress(f[b[k][0]:b[k][1]])[0]
                            for f, b in zip(flats, bounds)] for k in range(n)]
                if memory is not None:
                    self._remember(memory, [names[i] for i in bucket], flats, bounds, packets)
                segments = [torch.cat(row) for row in packets]
                splits = torch.tensor([seg.numel() for seg in segments], dtype=torch.int32)
                message = torch.cat(segments)
            handle = hvd.alltoall_async(message, splits=splits, name=self._tag(names[bucket[0]]))
            self.stats.values["bytes_sent"] += message.numel() - segments[me].numel()
            phase1.append((bucket, bounds, handle))

        phase2 = []
        for bucket, bounds, handle in phase1:
            with self.stats.timing("communicate_s"):
                received, _ = hvd.synchronize(handle)
            with self.stats.timing("decompress_s"):
                per_rank = received.view(n, -1)
                reduced_chunks, offset = [], 0
                for b in bounds:
                    size = packet_bytes(self.compression, b[me][1] - b[me][0])
                    reduced_chunks.append(self._sum_packets(per_rank[:, offset:offset + size], n))
                    offset += size
            with self.stats.timing("compress_s"):
                reduced = torch.cat([self.compression.compress(c)[0] for c in reduced_chunks])
            handle = hvd.allgather_async(reduced, name=self._tag(f"{names[bucket[0]]}.gather"))
            self.stats.values["bytes_sent"] += (n - 1) * reduced.numel()
            phase2.append((bucket, bounds, handle))

        results = [None] * len(tensors)
        for bucket, bounds, handle in phase2:
            with self.stats.timing("communicate_s"):
                gathered = hvd.synchronize(handle)
            with self.stats.timing("decompress_s"):
                flats = [torch.empty(b[-1][1], dtype=torch.float32, device=gathered.device)
                         for b in bounds]
                offset = 0
                for r in range(n):                       # rank r's reduced chunks, tensor by tensor
                    for f, b in zip(flats, bounds):
                        size = packet_bytes(self.compression, b[r][1] - b[r][0])
                        self.compression.decode_packet(gathered[offset:offset + size],
                                                       out=f[b[r][0]:b[r][1]])
                        offset += size
                for i, f in zip(bucket, flats):
                    results[i] = f.view(tensors[i].shape).to(tensors[i].dtype)
        return results

    def _remember(self, memory, names, flats, bounds, packets):
        """Error feedback: each tensor's residual from the chunks this rank encoded."""
        for j, (name, f, b) in enumerate(zip(names, flats, bounds)):
            kept = torch.empty_like(f)
            for k in range(len(packets)):
                self.compression.decode_packet(packets[k][j], out=kept[b[k][0]:b[k][1]])
            memory.remember(name, f, kept)


def make_communicator(compression, reduction=None, op=hvd.Average, fusion_threshold_bytes=None):
    """The communicator for `compression` over `reduction` (None: the compressor's default)."""
    if reduction is None:
        reduction = getattr(compression, "default_reduction", "allreduce")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction != "allreduce" and not hasattr(compression, "decode_packet"):
        raise ValueError(f"reduction={reduction!r} needs a packet compressor (Compression.bit8 or "
                         f".bit16); {compressor_name(compression)} travels by allreduce")
    if reduction == "allreduce" and hasattr(compression, "decode_packet"):
        raise ValueError(f"{compressor_name(compression)} packets cannot be summed by allreduce "
                         "(a sum of float8 codes is meaningless): use 'allgather' or 'alltoall'")
    cls = {"allreduce": AllreduceCommunicator, "allgather": AllgatherCommunicator,
           "alltoall": AlltoallCommunicator}[reduction]
    return cls(compression, op=op, fusion_threshold_bytes=fusion_threshold_bytes)
