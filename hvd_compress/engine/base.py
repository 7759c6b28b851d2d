"""Engine: the collectives a communicator uses, and the wait that does not spin.

Every engine offers the same few operations, with the same meaning on every rank:

    size(), rank(), local_size()
    allreduce_async_(tensor, name, op)      in place; op AVERAGE or SUM
    allgather_async(tensor, name, sizes=None)
                                            every rank's tensor, rows concatenated along dim
                                            0 in rank order: the same shape everywhere, or
                                            `sizes`, every rank's first dimension, known to all
    alltoall_async(tensor, splits, name)    splits[k] elements to rank k; every rank sends the
                                            same splits (one bucket layout), so the result is
                                            (received, received splits) with n pieces of
                                            splits[rank()] each, in rank order
    poll(handle), synchronize(handle)       done yet? / its result (raises its error)
    wait(handle)                            synchronize, sleeping between polls
    allgather(tensor, name)                 blocking; the first dimensions may differ
    allreduce(tensor, name, op), barrier()  blocking, a copy reduced (the lab's totals)
    allgather_object(obj, name), broadcast_object(obj, root_rank, name)
    absent(key, timeout_s)                  the ranks that did not reach the point `key` names
                                            within timeout_s (outside the collectives; [] for
                                            an engine that cannot tell)

Names label a collective (Horovod matches them across ranks; torch.distributed matches by
order, so every rank must issue the same collectives in the same order, which the
communicators do: their plans are identical on every rank).
"""
import os
import time

__all__ = ["Engine", "AVERAGE", "SUM", "POLL_SLEEP_S", "UNCROWDED_LONGEST_SLEEP_S",
           "longest_sleep", "usable_cores", "HorovodMissing"]

AVERAGE = "average"
SUM = "sum"

# How long wait() sleeps between polls: doubling from the first value up to the second on a
# crowded host (more ranks than cores), up to UNCROWDED_LONGEST_SLEEP_S where every rank has a
# core of its own (see longest_sleep for why and for the figures).
POLL_SLEEP_S = (50e-6, 1e-3)
UNCROWDED_LONGEST_SLEEP_S = 200e-6


class HorovodMissing(ModuleNotFoundError):
    """Horovod cannot be imported, and what was asked runs on it (engine/horovod.py raises it).
    A ModuleNotFoundError, so code that already catches a missing module still does; it lives
    here, not beside the engine, so that it can be caught by name without Horovod."""

    MESSAGE = ("hvd_compress.DistributedOptimizer (and every communicator made without engine=) "
               "runs on Horovod, which this Python cannot import. Build and install it with the "
               "repository's `bash scripts/setup.sh` (Horovod 0.28.1 with the project's C++17 "
               "build patch, for PyTorch, MPI and Gloo; docs/setup.md says how and what it "
               "needs), or train on torch.distributed with the DDP hook, which needs only "
               "torch: hvd_compress.ddp (docs/ddp.md)")

    def __init__(self, message=MESSAGE):
        super().__init__(message, name="horovod")


def longest_sleep(local_ranks, cores):
    """The longest sleep between two polls, for `local_ranks` ranks on `cores` usable cores.

    A finished exchange is noticed up to one sleep late, and a rank's lateness delays the next
    step of all. Where each rank has a core, short sleeps cost no CPU another rank needs and
    keep that lateness small; where ranks share cores, each poll takes CPU from the cores the
    other ranks compute on, so crowded hosts keep POLL_SLEEP_S[1] (labs/bench/wait.py
    measures both)."""
    if local_ranks > cores:
        return POLL_SLEEP_S[1]
    return min(POLL_SLEEP_S[1], UNCROWDED_LONGEST_SLEEP_S)


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Engine:
    """The collectives of one job (module docstring); subclasses implement them."""
    name = None
    # True: collectives are paired across ranks by the order they are issued (torch.distributed),
    # so a communicator launches later phases in its exchanges' order, never in completion order
    matches_by_order = False

    # ---- who -------------------------------------------------------------------------------
    def size(self):
        raise NotImplementedError

    def rank(self):
        raise NotImplementedError

    def local_size(self):
        raise NotImplementedError

    # ---- ops -------------------------------------------------------------------------------
    def parse_op(self, op):
        """AVERAGE or SUM for `op` (this engine's own constants accepted too), None if the
        engine has no such reduction the communicators can use."""
        return op if op in (AVERAGE, SUM) else None

    # ---- asynchronous collectives ----------------------------------------------------------
    def allreduce_async_(self, tensor, name, op=AVERAGE):
        raise NotImplementedError

    def allreduce_async(self, tensor, name, op=AVERAGE):
        """As allreduce_async_, into a new tensor (`tensor` is left as it is)."""
        return self.allreduce_async_(tensor.clone(), name, op)

    def allgather_async(self, tensor, name, sizes=None):
        raise NotImplementedError

    def alltoall_async(self, tensor, splits, name):
        raise NotImplementedError

    def poll(self, handle):
        raise NotImplementedError

    def synchronize(self, handle):
        raise NotImplementedError

    def wait(self, handle):
        """synchronize(handle), but waiting by sleeping between polls instead of spinning.

        Why: Horovod's synchronize() loops on std::this_thread::yield() until the handle is
        done. A rank that waits so keeps its core busy, and the core is what the other ranks'
        backward and the engine's background threads (which do the reduction) need when there
        are as many processes as cores or more: the spinning ranks and the ranks that compute
        preempt each other in the kernel instead of progressing. Sleeping adds at most
        longest_sleep() to a wait; a finished handle's synchronize() returns at once (and
        raises its error, if any)."""
        sleeps = self.poll_sleeps()
        while not self.poll(handle):
            time.sleep(next(sleeps))
        return self.synchronize(handle)

    def poll_sleeps(self):
        """The sleeps between polls: POLL_SLEEP_S[0] doubling up to longest_sleep() here."""
        delay = POLL_SLEEP_S[0]
        longest = longest_sleep(self.local_size(), usable_cores())
        while True:
            yield delay
            delay = min(2 * delay, longest)

    # ---- blocking, small -------------------------------------------------------------------
    def allgather(self, tensor, name):
        raise NotImplementedError

    def allreduce(self, tensor, name, op=SUM):
        """A reduced copy of `tensor`, blocking (the lab's epoch totals, never gradients)."""
        return self.wait(self.allreduce_async_(tensor.clone(), name, op))

    def barrier(self):
        raise NotImplementedError

    def controller(self):
        """What carries the collectives, for a run's manifest: 'gloo', 'mpi', 'torch-nccl'..."""
        raise NotImplementedError

    def allgather_object(self, obj, name):
        raise NotImplementedError

    def broadcast_object(self, obj, root_rank=0, name=None):
        raise NotImplementedError

    def absent(self, key, timeout_s):
        """The ranks that have not reached the point named `key` after timeout_s seconds,
        checked outside the collectives, so that a rank that never comes (a job in which one
        rank registered no hook) is named instead of waited for; [] where the engine cannot
        tell (Horovod: its coordinator reports a stalled collective itself)."""
        return []

    def __repr__(self):
        return f"{type(self).__name__}(size={self.size()}, rank={self.rank()})"
