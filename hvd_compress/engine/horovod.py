"""HorovodEngine: Horovod's collectives, called exactly as the communicators called them before
the engine seam, so every result on Horovod is bit for bit what it was.

This is the one module of hvd_compress that needs Horovod (hvd_compress.DistributedOptimizer
and every communicator made without engine= import it from here): where Horovod is missing,
importing it raises HorovodMissing, which says how to get Horovod or what runs without it.
"""
from .base import AVERAGE, SUM, Engine, HorovodMissing

try:
    import horovod.torch as hvd
except ModuleNotFoundError as missing:
    if not (missing.name or "").startswith("horovod"):   # Horovod is there but broken: as is
        raise
    raise HorovodMissing() from missing

__all__ = ["HorovodEngine", "horovod_engine", "hvd"]

_OPS = {AVERAGE: hvd.Average, SUM: hvd.Sum}


class HorovodEngine(Engine):
    name = "horovod"

    def size(self):
        return hvd.size()

    def rank(self):
        return hvd.rank()

    def local_size(self):
        return hvd.local_size()

    def parse_op(self, op):
        if op in (AVERAGE, SUM):
            return op
        if op == hvd.Average:
            return AVERAGE
        if op == hvd.Sum:
            return SUM
        return None

    def allreduce_async_(self, tensor, name, op=AVERAGE):
        return hvd.allreduce_async_(tensor, name=name, op=_OPS[op], prescale_factor=1.0,
                                    postscale_factor=1.0)

    def allreduce_async(self, tensor, name, op=AVERAGE):
        return hvd.allreduce_async(tensor, name=name, op=_OPS[op])

    def allgather_async(self, tensor, name, sizes=None):
        return hvd.allgather_async(tensor, name=name)       # Horovod learns the sizes itself

    def alltoall_async(self, tensor, splits, name):
        return hvd.alltoall_async(tensor, splits=splits, name=name)

    def poll(self, handle):
        return hvd.poll(handle)

    def synchronize(self, handle):
        return hvd.synchronize(handle)

    def allgather(self, tensor, name):
        return hvd.allgather(tensor, name=name)

    def allreduce(self, tensor, name, op=SUM):
        return hvd.allreduce(tensor, name=name, op=_OPS[op])

    def barrier(self):
        hvd.barrier()

    def controller(self):
        return "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "none"

    def allgather_object(self, obj, name=None):
        return hvd.allgather_object(obj, name=name)

    def broadcast_object(self, obj, root_rank=0, name=None):
        return hvd.broadcast_object(obj, root_rank=root_rank, name=name)


_ENGINE = None


def horovod_engine():
    """The one HorovodEngine (it holds no state: Horovod's is global)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = HorovodEngine()
    return _ENGINE
