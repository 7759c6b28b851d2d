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
import os

import torch
import torch.distributed as dist

from .base import AVERAGE, SUM, Engine

__all__ = ["TorchEngine"]


class _Handle:
    """A collective in flight: its Work's future, and how to make its result once it is done.
    Polled and waited on through the future: inside the future's own callbacks (the hook
    decodes a bucket there) the future is complete while the Work may not yet say so."""
    __slots__ = ("future", "result")

    def __init__(self, work, result):
        self.future, self.result = work.get_future(), result


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
        out = torch.empty((self._size * longest,) + rest, dtype=tensor.dtype, device=tensor.device)
        work = dist.all_gather(list(out.view((self._size,) + tuple(tensor.shape)).unbind(0)),
                               tensor, group=self.group, async_op=True)
        if sizes is None or all(k == longest for k in sizes):
            return _Handle(work, lambda: out)
        return _Handle(work, lambda: torch.cat([out[r * longest:r * longest + k]
                                                for r, k in enumerate(sizes)]))

    def alltoall_async(self, tensor, splits, name):
        splits = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
        if len(splits) != self._size or sum(splits) != tensor.numel():
            raise ValueError(f"alltoall splits {splits} do not cut {tensor.numel()} elements "
                             f"among {self._size} ranks")
        mine = splits[self._rank]
        out = torch.empty(self._size * mine, dtype=tensor.dtype, device=tensor.device)
        work = dist.all_to_all_single(out, tensor.contiguous(), [mine] * self._size, splits,
                                      group=self.group, async_op=True)
        received = torch.tensor([mine] * self._size, dtype=torch.int32)
        return _Handle(work, lambda: (out, received))

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
