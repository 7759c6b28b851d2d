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

from ..engine.base import AVERAGE
from ..exchange.base import Exchange, launch_next_phases
from ..registry import Route
from .tensorwise import TensorwiseCommunicator, check_device

__all__ = ["PowerSGD", "PowerSGDCommunicator", "approximate"]


class PowerSGD:
    """The method and its rank, as a value `Compression.powersgd(rank)` returns."""
    name = "powersgd"

    def __init__(self, rank=2, error_feedback=True, seed=0):
        if int(rank) < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank!r}")
        self.rank, self.error_feedback, self.seed = int(rank), bool(error_feedback), int(seed)

    def __repr__(self):
        return f"PowerSGD(rank={self.rank})"

    def communicator(self, op=AVERAGE, engine=None):
        """PowerSGD carries its own collectives (two dependent allreduces), declared here."""
        return PowerSGDCommunicator(self, op=op, engine=engine)

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


def initial_q(name, m, r, seed, device="cpu"):
    """The first Q of a tensor: Gaussian, from a generator seeded by its name, so that every rank
    starts from the same Q without a broadcast (drawn on the CPU, the same bits on every
    device, then moved to the gradient's)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(m, r, generator=gen).to(device)


def _cat(flats):
    return torch.cat(flats) if flats else None


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


class PowerSGDCommunicator(TensorwiseCommunicator):
    """Every matrix by PowerSGD's two allreduces, every vector by one plain allreduce."""
    route = Route.ALLREDUCE
    ops = (AVERAGE,)            # the method averages: P and Q are means

    def __init__(self, method, op=AVERAGE, engine=None):
        super().__init__(method, op, engine)
        self.qs = {}                 # tensor name -> warm-started Q (m x r)

    def describe(self):
        return f"powersgd{self.compression.rank}/allreduce"

    def _tag(self, name, phase):
        return f"hvdc.{self.describe()}.{name}.{phase}"

    def _count(self, tensor):
        n = self.engine.size()
        self.stats.add("bytes_sent", 2 * (n - 1) * tensor.numel() * 4 // n if n > 1 else 0)

    def _p(self, bucket, nm, memory):
        """(compensated matrix M, P = M Q) of one gradient viewed as an n x m matrix."""
        n, m = nm
        r = min(self.compression.rank, n, m)
        matrix = bucket.tensor.detach().to(torch.float32).reshape(n, m)
        if memory is not None:
            matrix = memory.compensate(bucket.name, matrix)
        q = self.qs.get(bucket.name)
        if q is None or q.shape != (m, r):
            q = self.qs[bucket.name] = initial_q(bucket.name, m, r, self.compression.seed,
                                                 matrix.device)
        elif q.device != matrix.device:            # a checkpoint's Q, loaded on the CPU
            q = self.qs[bucket.name] = q.to(matrix.device)
        return matrix, matrix @ q

    def _approximate(self, bucket, matrix, p, q, memory):
        """The gradient P Q^T, Q kept for the next step's warm start, the residual remembered."""
        self.qs[bucket.name] = q                 # warm start: identical on every rank
        approx = p @ q.t()
        if memory is not None:
            memory.remember(bucket.name, matrix, approx)
        grad = bucket.tensor
        bucket.tensor = approx.view(grad.shape).to(grad.dtype)

    def start(self, bucket, memory=None):
        """Vectors: launch their allreduce (phase 0). Matrices: compensate, P = M Q, launch P's."""
        memory = self._memory(memory)
        grad = bucket.tensor
        check_device("PowerSGD", grad)
        nm = matrix_shape(grad.shape)
        with self.stats.timing("compress_s"):
            if nm is None or 0 in nm:
                flat = grad.detach().to(torch.float32).reshape(-1).clone()
                self._count(flat)
                handle = self.engine.allreduce_async_(flat, self._tag(bucket.name, "v"), AVERAGE)
                return Exchange(bucket, handle, phase=0, memory=memory)
            matrix, p = self._p(bucket, nm, memory)
        self._count(p)
        handle = self.engine.allreduce_async_(p, self._tag(bucket.name, "p"), AVERAGE)
        return Exchange(bucket, handle, ctx=[matrix, None], phase=1, memory=memory)

    def start_group(self, buckets, memory=None):
        """Several tensors (one DDP bucket's: hvd_compress/ddp.py) in three allreduces, as
        DDP's own PowerSGD hook does, instead of one or two per tensor: every vector in one,
        every matrix's P in one, later every Q in one. Each tensor's arithmetic is the
        per-tensor path's (the collective may sum a concatenation's elements in another rank
        order at more than 2 ranks: the last bit may differ, never between ranks)."""
        memory = self._memory(memory)
        vectors, matrices = [], []             # buckets; (bucket, M, P)
        with self.stats.timing("compress_s"):
            for bucket in buckets:
                check_device("PowerSGD", bucket.tensor)
                nm = matrix_shape(bucket.tensor.shape)
                if nm is None or 0 in nm:
                    vectors.append(bucket)
                else:
                    matrices.append((bucket, *self._p(bucket, nm, memory)))
            flat_v = _cat([b.tensor.detach().to(torch.float32).reshape(-1) for b in vectors])
            flat_p = _cat([p.reshape(-1) for _, _, p in matrices])
        name = buckets[0].name if buckets else "empty"
        group = {"vectors": vectors, "matrices": matrices, "v": None}
        if flat_v is not None:
            self._count(flat_v)
            group["v"] = self.engine.allreduce_async_(flat_v, self._tag(name, "group.v"), AVERAGE)
        handle = None
        if flat_p is not None:
            self._count(flat_p)
            handle = self.engine.allreduce_async_(flat_p, self._tag(name, "group.p"), AVERAGE)
        return Exchange(buckets, handle, ctx=group, phase=1 if matrices else 0, memory=memory)

    def progress(self, step, wait=False):
        """P reduced (or wait=True): orthogonalise, Q = M^T P, launch Q's allreduce."""
        if step.phase != 1 or not (wait or self.engine.poll(step.handle)):
            return
        with self.stats.timing("communicate_s"):
            p = self.engine.wait(step.handle)
        group = isinstance(step.bucket, list)
        with self.stats.timing("compress_s"):
            if group:
                matrices, offset, qs = step.ctx["matrices"], 0, []
                for j, (bucket, matrix, own_p) in enumerate(matrices):
                    reduced = orthonormal(p[offset:offset + own_p.numel()].view(own_p.shape))
                    offset += own_p.numel()
                    matrices[j] = (bucket, matrix, reduced)
                    qs.append((matrix.t() @ reduced).reshape(-1))
                q = torch.cat(qs)
                name = f"{step.bucket[0].name}.group"
            else:
                matrix = step.ctx[0]
                step.ctx[1] = p = orthonormal(p)
                q = matrix.t() @ p
                name = step.bucket.name
        self._count(q)
        step.handle = self.engine.allreduce_async_(q, self._tag(name, "q"), AVERAGE)
        step.phase = 2

    def advance(self, steps):
        launch_next_phases(self, steps)

    def finish(self, step):
        bucket = step.bucket
        self.progress(step, wait=True)
        if isinstance(bucket, list):
            return self._finish_group(step)
        with self.stats.timing("communicate_s"):
            reduced = self.engine.wait(step.handle)
        with self.stats.timing("decompress_s"):
            grad = bucket.tensor
            if step.phase == 0:
                bucket.tensor = reduced.view(grad.shape).to(grad.dtype)
                return
            matrix, p = step.ctx
            self._approximate(bucket, matrix, p, reduced, step.memory)

    def _finish_group(self, step):
        group = step.ctx
        with self.stats.timing("communicate_s"):
            flat_v = self.engine.wait(group["v"]) if group["v"] is not None else None
            flat_q = self.engine.wait(step.handle) if group["matrices"] else None
        with self.stats.timing("decompress_s"):
            offset = 0
            for bucket in group["vectors"]:
                grad = bucket.tensor
                bucket.tensor = flat_v[offset:offset + grad.numel()].view(grad.shape).to(grad.dtype)
                offset += grad.numel()
            offset = 0
            for bucket, matrix, p in group["matrices"]:
                k = matrix.shape[1] * p.shape[1]
                q = flat_q[offset:offset + k].view(matrix.shape[1], p.shape[1]).clone()
                offset += k
                self._approximate(bucket, matrix, p, q, step.memory)

    def state_dict(self):
        """Q per tensor and the error-feedback residuals: what a checkpoint must keep."""
        return dict(super().state_dict(), qs={k: v.clone() for k, v in self.qs.items()})

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.qs = {k: v.clone() for k, v in state["qs"].items()}

    def reset_state(self):
        super().reset_state()
        self.qs = {}
