"""PowerSGD: low-rank gradients, exchanged by two small float32 allreduces.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (https://arxiv.org/abs/1905.13727); PyTorch ships it as
a DDP comm hook (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py). Per step, for
each gradient viewed as an n x m matrix M (first dimension x the rest):

    M += e                      error feedback: what the last approximation missed
    P = M Q                     Q: m x r, warm-started from the previous step
    P = mean over ranks (P)     allreduce 1: n r floats
    P = orthonormal basis of P  (QR; identical on every rank: same bits in, same bits out)
    Q = M^T P                   m x r
    Q = mean over ranks (Q)     allreduce 2: m r floats
    M~ = P Q^T                  the gradient every rank applies
    e = M - M~

r = min(rank, n, m). With r = min(n, m) the approximation is the exact mean (P spans the
mean's column space), which the tests check. Vectors (biases) go uncompressed, by allreduce.
Unlike the quantisers this is not a codec of bits: the two allreduces depend on each other, so
it is a communicator of its own (roles.Communicator), with the per-tensor state (Q, residual)
that warm start and error feedback need; `state_dict()` saves it with a checkpoint.
"""
import zlib

import torch
import horovod.torch as hvd

from .fusion import Bucket
from .memory import ResidualMemory
from .registry import Route
from .roles import Communicator

__all__ = ["PowerSGD", "PowerSGDCommunicator", "powersgd_bytes", "approximate"]


class PowerSGD:
    """The method and its rank, as a value `Compression.powersgd(rank)` returns."""
    name = "powersgd"

    def __init__(self, rank=2, error_feedback=True, seed=0):
        if int(rank) < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank!r}")
        self.rank, self.error_feedback, self.seed = int(rank), bool(error_feedback), int(seed)

    def __repr__(self):
        return f"PowerSGD(rank={self.rank})"

    def __eq__(self, other):
        return isinstance(other, PowerSGD) and (self.rank, self.error_feedback, self.seed) == \
            (other.rank, other.error_feedback, other.seed)

    def __hash__(self):
        return hash((PowerSGD, self.rank, self.error_feedback, self.seed))


def matrix_shape(shape):
    """(n, m) of the matrix a gradient of `shape` is viewed as, or None for a vector/scalar."""
    if len(shape) < 2:
        return None
    n = shape[0]
    return n, int(torch.Size(shape).numel()) // n if n else 0


def powersgd_bytes(shapes, rank, world):
    """Bytes one rank sends per step (ring allreduce: 2(N-1)/N of each tensor): (n + m) r float32
    per matrix, every value of every vector. The communicator counts the same."""
    if world == 1:
        return 0
    total = 0
    for shape in shapes:
        nm = matrix_shape(shape)
        values = torch.Size(shape).numel() if nm is None else (nm[0] + nm[1]) * min(rank, *nm)
        total += 2 * (world - 1) * 4 * values // world
    return total


def initial_q(name, m, r, seed):
    """The first Q of a tensor: Gaussian, from a generator seeded by its name, so that every rank
    starts from the same Q without a broadcast."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(m, r, generator=gen)


def orthonormal(p):
    """An orthonormal basis of p's columns (reduced QR; deterministic for the same bits)."""
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


def approximate(matrices, q):
    """One-process reference of one PowerSGD round over ranks' compensated matrices (list of
    n x m, rank order), from the shared Q (m x r): (approximation, new Q). Means are sums in
    rank order divided by the number of ranks."""
    world = len(matrices)
    p = sum(m @ q for m in matrices) / world
    p = orthonormal(p)
    q = sum(m.t() @ p for m in matrices) / world
    return p @ q.t(), q


class _Step:
    """One tensor's exchange in flight."""
    __slots__ = ("bucket", "handle", "phase", "launched", "matrix", "p", "q")

    def __init__(self, bucket, handle, phase, matrix=None, p=None):
        import time
        self.bucket, self.handle, self.phase, self.matrix, self.p = bucket, handle, phase, matrix, p
        self.q = None
        self.launched = time.perf_counter()


class PowerSGDCommunicator(Communicator):
    """Every matrix by PowerSGD's two allreduces, every vector by one plain allreduce."""
    route = Route.ALLREDUCE
    fuses = False                   # per-tensor matrices, no flat bucket
    fusion_threshold_bytes = 0
    scale_block = None

    def __init__(self, method, op=hvd.Average):
        from .communicators import Stats
        if op != hvd.Average:
            raise ValueError("PowerSGD averages gradients (op=hvd.Average); "
                             f"got {op!r}")
        self.compression = method
        self.op = op
        self.stats = Stats()
        self.memory = ResidualMemory() if method.error_feedback else None
        self.qs = {}                 # tensor name -> warm-started Q (m x r)

    def describe(self):
        return f"powersgd{self.compression.rank}/allreduce"

    @property
    def reduction(self):
        return self.route.value

    def pop_stats(self):
        return self.stats.pop()

    def plan(self, names, tensors, prefix=""):
        return Bucket.plan(names, tensors, 0, flat=False, prefix=prefix)

    def _tag(self, name, phase):
        return f"hvdc.{self.describe()}.{name}.{phase}"

    def _count(self, tensor):
        n = hvd.size()
        self.stats.values["bytes_sent"] += 2 * (n - 1) * tensor.numel() * 4 // n if n > 1 else 0

    def start(self, bucket, memory=None):
        memory = memory if memory is not None else self.memory
        grad = bucket.tensor
        nm = matrix_shape(grad.shape)
        with self.stats.timing("compress_s"):
            if nm is None or 0 in nm:
                flat = grad.detach().to(torch.float32).reshape(-1).clone()
                self._count(flat)
                return _Step(bucket, hvd.allreduce_async_(flat, name=self._tag(bucket.name, "v"),
                                                          op=hvd.Average), 0, matrix=flat)
            n, m = nm
            r = min(self.compression.rank, n, m)
            matrix = grad.detach().to(torch.float32).reshape(n, m)
            if memory is not None:
                matrix = memory.compensate(bucket.name, matrix)
            q = self.qs.get(bucket.name)
            if q is None or q.shape != (m, r):
                q = self.qs[bucket.name] = initial_q(bucket.name, m, r, self.compression.seed)
            p = matrix @ q
        self._count(p)
        handle = hvd.allreduce_async_(p, name=self._tag(bucket.name, "p"), op=hvd.Average)
        return _Step(bucket, handle, 1, matrix=matrix, p=p)

    def progress(self, step, wait=False):
        """P reduced (or wait=True): orthogonalise, Q = M^T P, launch Q's allreduce."""
        if step.phase != 1 or not (wait or hvd.poll(step.handle)):
            return
        with self.stats.timing("communicate_s"):
            p = hvd.synchronize(step.handle)
        with self.stats.timing("compress_s"):
            step.p = orthonormal(p)
            q = step.matrix.t() @ step.p
        self._count(q)
        step.handle = hvd.allreduce_async_(q, name=self._tag(step.bucket.name, "q"), op=hvd.Average)
        step.phase, step.q = 2, q

    def finish(self, step, memory=None):
        memory = memory if memory is not None else self.memory
        bucket = step.bucket
        self.progress(step, wait=True)
        with self.stats.timing("communicate_s"):
            reduced = hvd.synchronize(step.handle)
        with self.stats.timing("decompress_s"):
            grad = bucket.tensor
            if step.phase == 0:
                bucket.tensor = reduced.view(grad.shape).to(grad.dtype)
                return
            self.qs[bucket.name] = reduced           # warm start: identical on every rank
            approx = step.p @ reduced.t()
            if memory is not None:
                memory.remember(bucket.name, step.matrix, approx)
            bucket.tensor = approx.view(grad.shape).to(grad.dtype)

    def reduce(self, tensors, names, memory=None):
        """Exchange `tensors` now; the reduced tensors in the same order."""
        planned = self.plan(names, tensors)
        steps = []
        for (group, bucket) in planned:
            bucket.put(0, tensors[group[0]])
            steps.append(self.start(bucket, memory))
        results = []
        for step in steps:
            self.finish(step, memory)
            results.append(step.bucket.tensor)
        return results

    def state_dict(self):
        """Q per tensor and the error-feedback residuals: what a checkpoint must keep."""
        return {"qs": {k: v.clone() for k, v in self.qs.items()},
                "residuals": self.memory.state_dict() if self.memory is not None else {}}

    def load_state_dict(self, state):
        self.qs = {k: v.clone() for k, v in state["qs"].items()}
        if self.memory is not None:
            self.memory.load_state_dict(state["residuals"])
