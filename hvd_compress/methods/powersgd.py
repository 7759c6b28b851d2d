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

Three options run torch's powerSGD_hook's variant (docs/ddp.md; their defaults are this
method as it always was): `start_iter` N (each tensor's first N exchanges are a plain average,
no error feedback: the hook's start_powerSGD_iter), `min_compression_rate` (a matrix whose
factors are not that many times smaller than it goes uncompressed) and `init="ddp"` (the first
Q drawn as the hook draws it, so that both start from the same factors).
Unlike the quantisers this is not a codec of bits: the two allreduces depend on each other, so
it is a communicator of its own (roles.Communicator), with the per-tensor state (Q, residual)
that warm start and error feedback need; `state_dict()` saves it with a checkpoint.
"""
import zlib

import torch

from ..engine.base import AVERAGE
from ..exchange.base import Capabilities, Exchange, launch_next_phases
from ..registry import Route
from .tensorwise import TensorwiseCommunicator, check_device

__all__ = ["PowerSGD", "PowerSGDCommunicator", "approximate"]

# How the first Q of a tensor is drawn: "name", from a generator seeded by the tensor's name
# (initial_q); "ddp", as torch's powerSGD_hook draws it (DDPDraws).
INITS = ("name", "ddp")


class PowerSGD:
    """The method and its rank, as a value `Compression.powersgd(rank)` returns."""
    name = "powersgd"

    def __init__(self, rank=2, error_feedback=True, seed=0, start_iter=0,
                 min_compression_rate=0.0, init="name"):
        if int(rank) < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank!r}")
        if int(start_iter) < 0:
            raise ValueError(f"PowerSGD start_iter must be >= 0, got {start_iter!r}")
        if not float(min_compression_rate) >= 0:           # NaN too
            raise ValueError("PowerSGD min_compression_rate must be >= 0, got "
                             f"{min_compression_rate!r}")
        if init not in INITS:
            raise ValueError(f"PowerSGD init must be one of {INITS}, got {init!r}")
        self.rank, self.error_feedback, self.seed = int(rank), bool(error_feedback), int(seed)
        self.start_iter, self.init = int(start_iter), init
        self.min_compression_rate = float(min_compression_rate)

    def _key(self):
        return (self.rank, self.error_feedback, self.seed, self.start_iter,
                self.min_compression_rate, self.init)

    def __repr__(self):
        extra = "".join(f", {k}={v!r}" for k, v, default in (
            ("start_iter", self.start_iter, 0), ("min_compression_rate",
                                                 self.min_compression_rate, 0.0),
            ("init", self.init, "name")) if v != default)
        return f"PowerSGD(rank={self.rank}{extra})"

    def compresses(self, n, m):
        """Whether an n x m matrix is worth its factors: (n + m) r * min_compression_rate <
        n m, as torch's hook decides (rate 0, the default: every matrix)."""
        r = min(self.rank, n, m)
        return (n + m) * r * self.min_compression_rate < n * m

    def communicator(self, op=AVERAGE, engine=None):
        """PowerSGD carries its own collectives (two dependent allreduces), declared here."""
        return PowerSGDCommunicator(self, op=op, engine=engine)

    def __eq__(self, other):
        return isinstance(other, PowerSGD) and self._key() == other._key()

    def __hash__(self):
        return hash((PowerSGD, *self._key()))


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


class DDPDraws:
    """The first Q's as torch's powerSGD_hook draws them, so that our hook and DDP's can start
    from the same factors (init="ddp"): per group of tensors (one DDP bucket), one seed from
    numpy's RandomState(seed).randint(1_000_000_000), then a Gaussian m x r per matrix from
    torch's generator under that seed, the matrices taken shape by shape (in the order each
    shape first appears, the hook's grouping) and each Q's columns orthonormalised. Relies on
    the hook's behaviour in torch 2.x (tests/ddp_workers/powersgd_ddp.py checks it); numpy, which
    torch's hook needs too, is imported only here."""

    def __init__(self, seed):
        try:
            import numpy
        except ImportError as err:          # torch's own PowerSGD hook needs it as well
            raise ImportError("PowerSGD init='ddp' draws with numpy, as torch's powerSGD_hook "
                              "does: pip install numpy") from err
        self.rng = numpy.random.RandomState(seed)

    def draw(self, nms, rank, device="cpu"):
        """Q's (m x min(rank, n, m)) for the matrices of shapes `nms` ((n, m) each, in the
        group's order), in that order."""
        gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        order = {}
        for j, nm in enumerate(nms):
            order.setdefault(tuple(nm), []).append(j)
        qs = [None] * len(nms)
        for members in order.values():
            for j in members:
                n, m = nms[j]
                q = torch.randn(m, min(rank, n, m), generator=gen)
                qs[j] = orthonormal(q).to(device)
        return qs


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
    capabilities = Capabilities(own_memory=True, per_tensor=True, groups=True)
    ops = (AVERAGE,)            # the method averages: P and Q are means

    def __init__(self, method, op=AVERAGE, engine=None):
        super().__init__(method, op, engine)
        self.qs = {}                 # tensor name -> warm-started Q (m x r)
        self.counts = {}             # tensor name -> exchanges started (for start_iter)
        self._draws = None           # init="ddp": DDPDraws, made at the first draw

    def _compressed(self, name, shape):
        """(n, m) if this tensor goes by P and Q this time, else None (a vector, a matrix not
        worth its factors, or a tensor still in its start_iter plain exchanges). Counts it."""
        method = self.compression
        count = self.counts.get(name, 0)
        if method.start_iter:
            self.counts[name] = count + 1
        nm = matrix_shape(shape)
        if nm is None or 0 in nm or count < method.start_iter or not method.compresses(*nm):
            return None
        return nm

    def _draw_missing(self, named_nms, device):
        """init="ddp": the first Q's of a group of matrices ((name, (n, m)) each) at once, as
        torch's hook draws a bucket's; "name" draws each in _p."""
        if self.compression.init != "ddp":
            return
        r = self.compression.rank
        if all(name in self.qs and self.qs[name].shape == (m, min(r, n, m))
               for name, (n, m) in named_nms):
            return
        if self._draws is None:
            self._draws = DDPDraws(self.compression.seed)
        drawn = self._draws.draw([nm for _, nm in named_nms], r, device)
        for (name, (n, m)), q in zip(named_nms, drawn):
            if name not in self.qs or self.qs[name].shape != q.shape:
                self.qs[name] = q

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
        nm = self._compressed(bucket.name, grad.shape)
        with self.stats.timing("compress_s"):
            if nm is None:
                flat = grad.detach().to(torch.float32).reshape(-1).clone()
                self._count(flat)
                handle = self.engine.allreduce_async_(flat, self._tag(bucket.name, "v"), AVERAGE)
                return Exchange(bucket, handle, phase=0, memory=memory)
            self._draw_missing([(bucket.name, nm)], grad.device)
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
            shaped = []                         # (bucket, (n, m)) of the matrices
            for bucket in buckets:
                check_device("PowerSGD", bucket.tensor)
                nm = self._compressed(bucket.name, bucket.tensor.shape)
                if nm is None:
                    vectors.append(bucket)
                else:
                    shaped.append((bucket, nm))
            if shaped:
                self._draw_missing([(b.name, nm) for b, nm in shaped], shaped[0][0].tensor.device)
            for bucket, nm in shaped:
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
        """Q per tensor, the error-feedback residuals and, with start_iter, each tensor's count
        of exchanges (a run resumed in its plain steps keeps to the same step): what a
        checkpoint must keep."""
        state = dict(super().state_dict(), qs={k: v.clone() for k, v in self.qs.items()})
        if self.compression.start_iter:
            state["counts"] = dict(self.counts)
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.qs = {k: v.clone() for k, v in state["qs"].items()}
        self.counts = dict(state.get("counts", {}))

    def reset_state(self):
        super().reset_state()
        self.qs, self.counts = {}, {}
