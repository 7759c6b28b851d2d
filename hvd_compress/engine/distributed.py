"""TorchEngine: torch.distributed's collectives on one ProcessGroup (Gloo on CPU, NCCL on CUDA),
the engine of hvd_compress.ddp's hook.

Average is DDP's: each rank divides its tensor by the world size, then the group sums
(torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py), so the `none` and `fp16`
allreduces equal DDP's default hook and fp16_compress_hook bit for bit. (Horovod sums first and
divides after: the two engines' float32 averages may differ in the last bit; their packet
routes, which decode and sum in the plugin's own code, agree bit for bit.)

torch.distributed matches collectives by the order they are issued, not by name: every rank
must launch the same collectives in the same order, which the communicators do (the same
buckets, the same plan, launched from the main thread). A tensor of the wrong shape or dtype
on one rank is a mismatch the group may not detect: the hook checks layouts before it
launches (hvd_compress/ddp.py).
"""
import collections
import itertools
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import AVERAGE, SUM, Engine

__all__ = ["TorchEngine"]


# With `in_pieces` set (hvd_compress.ddp decides it from the link), Gloo's allgather and
# alltoall of a large tensor go in pieces of about this many bytes, at most this many. Why: over
# a slow link a whole large gather does not move both ways alike: one direction's transfer can
# end long after the other's, the rank served last also starts its next step last, and the
# ranks drift apart; in pieces both directions move together, piece by piece. Why not always:
# each piece waits for every rank to be scheduled, which over a fast link costs more than the
# transfer (docs/ddp.md, "Gathers in pieces on a slow link", has the measurements).
GATHER_PIECE_BYTES = 64 * 1024
GATHER_MOST_PIECES = 32
TIMED_BYTES = 128 * 1024      # collectives of tensors at least this large are timed (sent_times)
TIMES_KEPT = 64               # ... the latest this many


class _Handle:
    """A collective in flight (one Work, or several: the pieces of one allgather): its future,
    and how to make its result once it is done. Polled and waited on through the future: inside
    the future's own callbacks (the hook decodes a bucket there) the future is complete while
    the Work may not yet say so."""
    __slots__ = ("future", "result")

    def __init__(self, work, result):
        if isinstance(work, list):
            self.future = torch.futures.collect_all([w.get_future() for w in work])
        else:
            self.future = work.get_future()
        self.result = result


class TorchEngine(Engine):
    """The collectives of `group` (None: the default group, dist.init_process_group's)."""
    name = "torch"
    matches_by_order = True

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchEngine needs torch.distributed initialised first "
                               "(dist.init_process_group, as torchrun's scripts do)")
        self.group = group if group is not None else dist.group.WORLD
        self._size = dist.get_world_size(self.group)
        self._rank = dist.get_rank(self.group)
        self.backend = dist.get_backend(self.group)
        self.in_pieces = False           # large gathers in pieces (GATHER_PIECE_BYTES: why)
        # (bytes this rank sent, seconds) of its latest large collectives, while timed is on
        self.timed, self.sent_times = True, collections.deque(maxlen=TIMES_KEPT)


    def decide_pieces(self, below_bits_per_s):
        """Large gathers in pieces from now on if rank 0's timed large collectives ran under
        `below_bits_per_s` (a slow link), said by rank 0 so that every rank cuts alike; then
        nothing more is timed. Why: over a slow link a whole large gather ends tens of ms
        later on one rank than on another, and the ranks drift apart (docs/ddp.md)."""
        rate = None
        if self.rank() == 0 and self.sent_times:
            nbytes = sum(b for b, _ in self.sent_times)
            rate = 8 * nbytes / sum(t for _, t in self.sent_times)
        slow = rate is not None and rate < below_bits_per_s
        self.in_pieces = bool(self.broadcast_object(slow, root_rank=0, name="hvdc.pieces"))
        self.timed = False
    def size(self):
        return self._size

    def rank(self):
        return self._rank

    def local_size(self):
        """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else the whole group."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self._size))

    def _global(self, rank):
        return rank if self.group is dist.group.WORLD else dist.get_global_rank(self.group, rank)

    # ---- asynchronous ----------------------------------------------------------------------
    def allreduce_async_(self, tensor, name, op=AVERAGE):
        if op not in (AVERAGE, SUM):
            raise ValueError(f"TorchEngine reduces by {AVERAGE!r} or {SUM!r}, got {op!r}")
        if op == AVERAGE and self._size > 1:
            tensor.div_(self._size)                  # DDP's order: divide, then sum
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._time(work, tensor, 2 * (self._size - 1) / self._size)      # a ring's
        return _Handle(work, lambda: tensor)

    def allgather_async(self, tensor, name, sizes=None):
        """Rows concatenated in rank order. Equal shapes on every rank, or `sizes`: every
        rank's first dimension, known to all (the two-phase route's reduced chunks): each is
        padded to the longest, gathered, and cut back."""
        tensor = tensor.contiguous()
        rest = tuple(tensor.shape[1:])
        sizes = None if sizes is None else [int(k) for k in sizes]
        if sizes is not None and sizes[self._rank] != tensor.shape[0]:
            raise ValueError(f"allgather: this rank's tensor has {tensor.shape[0]} rows, "
                             f"sizes says {sizes[self._rank]}")
        longest = tensor.shape[0] if sizes is None else max(sizes)
        if tensor.shape[0] < longest:
            padded = torch.zeros((longest,) + rest, dtype=tensor.dtype, device=tensor.device)
            padded[:tensor.shape[0]] = tensor
            tensor = padded
        pieces = self._gather_pieces(tensor)
        if pieces > 1:
            work, gathered = self._allgather_pieces(tensor, pieces)
        else:
            out = torch.empty((self._size * longest,) + rest, dtype=tensor.dtype,
                              device=tensor.device)
            work = dist.all_gather(list(out.view((self._size,) + tuple(tensor.shape)).unbind(0)),
                                   tensor, group=self.group, async_op=True)
            self._time(work, tensor, self._size - 1)
            gathered = lambda: out                                          # noqa: E731
        if sizes is None or all(k == longest for k in sizes):
            return _Handle(work, gathered)

        def cut_back():
            rows = gathered()                 # once: in pieces it is a concatenation
            return torch.cat([rows[r * longest:r * longest + k] for r, k in enumerate(sizes)])
        return _Handle(work, cut_back)

    def _time(self, work, tensor, sent_per_byte):
        """Log a large collective (one Work, not pieces) in sent_times: the bytes this rank
        sends (the tensor's times `sent_per_byte`) and the seconds from launch to done."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self.timed or nbytes < TIMED_BYTES or self._size == 1:
            return
        start = time.perf_counter()
        work.get_future().add_done_callback(lambda _: self.sent_times.append(
            (nbytes * sent_per_byte, time.perf_counter() - start)))

    def _gather_pieces(self, tensor):
        """How many collectives an allgather of `tensor` takes: with in_pieces, on Gloo, a
        large one in pieces of about GATHER_PIECE_BYTES (why: there); else, on NCCL (which
        pipelines its own) and for a tensor of few rows, one."""
        if not self.in_pieces or self.backend != "gloo" or self._size == 1 or tensor.dim() == 0:
            return 1
        nbytes = tensor.numel() * tensor.element_size()
        return max(1, min(GATHER_MOST_PIECES, nbytes // GATHER_PIECE_BYTES, tensor.shape[0]))

    def _allgather_pieces(self, tensor, pieces):
        """(the Works, the result): `tensor` cut along its rows into `pieces` allgathers,
        launched in order (the same on every rank), the rows joined back in rank order."""
        parts = torch.tensor_split(tensor, pieces)
        outs = [[torch.empty_like(part) for _ in range(self._size)] for part in parts]
        works = [dist.all_gather(out, part, group=self.group, async_op=True)
                 for out, part in zip(outs, parts)]
        return works, lambda: torch.cat([torch.cat([out[r] for out in outs])
                                         for r in range(self._size)])

    def alltoall_async(self, tensor, splits, name):
        splits = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
        if len(splits) != self._size or sum(splits) != tensor.numel():
            raise ValueError(f"alltoall splits {splits} do not cut {tensor.numel()} elements "
                             f"among {self._size} ranks")
        mine = splits[self._rank]
        received = torch.tensor([mine] * self._size, dtype=torch.int32)
        pieces = min(self._gather_pieces(tensor), min(splits))
        if pieces > 1:
            work, out = self._alltoall_pieces(tensor.contiguous(), splits, pieces)
            return _Handle(work, lambda: (out(), received))
        out = torch.empty(self._size * mine, dtype=tensor.dtype, device=tensor.device)
        work = dist.all_to_all_single(out, tensor.contiguous(), [mine] * self._size, splits,
                                      group=self.group, async_op=True)
        self._time(work, tensor, (self._size - 1) / self._size)
        return _Handle(work, lambda: (out, received))

    def _alltoall_pieces(self, tensor, splits, pieces):
        """(the Works, the result): an alltoall in `pieces` alltoalls (on Gloo, as a large
        allgather: GATHER_PIECE_BYTES), piece c carrying the c-th part of every rank's chunk;
        each source's parts joined back in order. `splits` is the same on every rank (the
        two-phase route's chunks), so every rank cuts alike."""
        def parts(length):
            return [len(p) for p in torch.arange(length).tensor_split(pieces)]
        starts = [sum(splits[:d]) for d in range(self._size)]
        send = [parts(k) for k in splits]               # per destination, per piece
        recv = parts(splits[self._rank])                # per piece, from every source
        works, outs = [], []
        for c in range(pieces):
            at = [starts[d] + sum(send[d][:c]) for d in range(self._size)]
            inp = torch.cat([tensor[at[d]:at[d] + send[d][c]] for d in range(self._size)])
            out = torch.empty(self._size * recv[c], dtype=tensor.dtype, device=tensor.device)
            works.append(dist.all_to_all_single(out, inp, [recv[c]] * self._size,
                                                [send[d][c] for d in range(self._size)],
                                                group=self.group, async_op=True))
            outs.append(out)
        return works, lambda: torch.cat([out[r * k:(r + 1) * k] for r in range(self._size)
                                         for out, k in zip(outs, recv)])

    def poll(self, handle):
        return handle.future.done()

    def future(self, handle):
        """A torch Future completed with the collective (for a callback; its value unused)."""
        return handle.future

    def synchronize(self, handle):
        handle.future.wait()                 # raises the collective's error, if any
        return handle.result()

    def wait(self, handle):
        """synchronize(): a torch Future waits on a condition variable, without the GIL and
        without spinning (what Engine.wait's sleeps avoid in Horovod's synchronize), and
        returns as soon as the collective completes, not up to a sleep later."""
        return self.synchronize(handle)

    # ---- blocking --------------------------------------------------------------------------
    def allgather(self, tensor, name):
        """Rows of every rank's tensor in rank order; the first dimensions may differ."""
        rows = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        counts = self.synchronize(self.allgather_async(rows, name + ".rows")).tolist()
        return self.synchronize(self.allgather_async(tensor, name, sizes=counts))

    def barrier(self):
        dist.barrier(group=self.group)

    def controller(self):
        return f"torch-{self.backend}"

    def allgather_object(self, obj, name=None):
        out = [None] * self._size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, root_rank=0, name=None):
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(root_rank), group=self.group)
        return box[0]

    def absent(self, key, timeout_s):
        """Each rank sets a key of its own in the group's store (the rendezvous's, which
        every rank reaches without a collective) and waits up to timeout_s for the others';
        the ranks whose keys are missing then. Keys are numbered per process, in the order
        the ranks reach such points (the same on every rank), and by torchrun's restart, so
        that a restarted job never reads the keys of a dead attempt; [] without a store."""
        store = _store(self.group)
        if store is None or self._size == 1:
            return []
        prefix = (f"hvdc/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                  f"{next(_ARRIVALS)}/{key}")
        store.set(f"{prefix}/{self._rank}", "1")
        keys = [f"{prefix}/{r}" for r in range(self._size)]
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
            return []
        except Exception:                        # the store's timeout (DistStoreError)
            return [r for r, k in enumerate(keys) if not store.check([k])]


_ARRIVALS = itertools.count()


def _store(group):
    """The store of `group` (torch keeps it beside the group), or None."""
    try:
        world = dist.distributed_c10d._world
        found = world.pg_map.get(group)
        return found[1] if found is not None else dist.distributed_c10d._get_default_store()
    except Exception:
        return None
