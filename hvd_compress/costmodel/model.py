"""The alpha-beta cost model of collectives and of hvd-compress's gradient exchanges.

A message of m bytes costs  alpha + m * beta  seconds: alpha is the per-message latency
(software + wire startup), beta = 1 / bandwidth the time per byte. A collective is a
sequence of steps; every function here returns the *coefficients* of that sum,

    time = messages * alpha  +  bytes * beta  +  codec_bytes * gamma

so the same numbers serve prediction (plug in alpha, beta) and fitting (solve for them,
see fit.py). `bytes` is the beta coefficient: the bytes that must pass one after another
through the busiest link. For the symmetric collectives that is what every rank sends (and
also receives, in parallel on a full-duplex link); for a parameter server it is what the
server receives in the push plus what it sends in the pull, two phases that cannot overlap.
`gamma` is an optional encode/decode cost in seconds per fp32 byte: 0 unless you pass it,
so the communication model stays a communication model.

Notation: n ranks; g = bytes of fp32 gradient per rank; k-bit gradients travel as
g * k / 32 bytes. Derivations, one paragraph each, are in docs/costmodel.md; the
classic reference is Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH" (IJHPCA 2005).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..registry import HEADER_BYTES, Route, schemes as registered_schemes

__all__ = [
    "Link", "Cost",
    "ring_allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast_tree",
    "tree_allreduce", "double_binary_tree_allreduce", "parameter_server",
    "compressed_allgather", "compressed_two_phase", "wire_bytes",
    "EXCHANGES", "REFERENCE", "carried_bits", "predict",
    "predict_table",
    "course_allreduce_time", "lumped_latency",
    "bandwidth_crossover", "allgather_crossover", "first_n_not_faster",
]

@dataclass(frozen=True)
class Link:
    """One network link: alpha seconds per message, beta seconds per byte."""

    alpha: float
    beta: float

    def __post_init__(self):
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"latency alpha must be finite and >= 0 s, got {self.alpha!r}")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta (s/byte) must be finite and > 0, got {self.beta!r}")

    @classmethod
    def from_bandwidth(cls, alpha: float, bytes_per_second: float) -> "Link":
        if not (bytes_per_second > 0 and math.isfinite(bytes_per_second)):
            raise ValueError(f"bandwidth must be finite and > 0 B/s, got {bytes_per_second!r}")
        return cls(alpha=alpha, beta=1.0 / bytes_per_second)

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return 1.0 / self.beta


@dataclass(frozen=True)
class Cost:
    """Coefficients of alpha, beta and gamma; add two Costs to run phases one after another."""

    messages: float
    bytes: float
    codec_bytes: float = 0.0

    def seconds(self, link: Link, gamma: float = 0.0) -> float:
        return self.messages * link.alpha + self.bytes * link.beta + self.codec_bytes * gamma

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.messages + other.messages, self.bytes + other.bytes,
                    self.codec_bytes + other.codec_bytes)


# ---------------------------------------------------------------- argument checks

def _ranks(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of ranks must be an integer >= 1, got {n!r}")
    return n


def _nbytes(x, what="message size") -> float:
    x = float(x)
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{what} must be finite and >= 0 bytes, got {x!r}")
    return x


def _bits(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 32:
        raise ValueError(f"bit width must be an integer in 1..32, got {k!r}")
    return k


def _log2_steps(n: int) -> int:
    """Depth of a binary tree over n ranks: ceil(log2 n), exactly (no float log)."""
    return (n - 1).bit_length()


# ---------------------------------------------------------------- primitive collectives

def ring_allreduce(n: int, nbytes: float) -> Cost:
    """Ring allreduce of an nbytes vector: reduce-scatter then allgather, each n-1 steps
    of nbytes/n:  2(n-1) alpha + 2(n-1)/n * nbytes * beta."""
    n, m = _ranks(n), _nbytes(nbytes)
    return Cost(2 * (n - 1), 2 * (n - 1) / n * m)


def reduce_scatter(n: int, total_bytes: float) -> Cost:
    """Ring reduce-scatter. Each rank *inputs* the whole vector (total_bytes = G) and keeps
    a reduced 1/n slice:  (n-1) alpha + (n-1)/n * G * beta."""
    n, G = _ranks(n), _nbytes(total_bytes)
    return Cost(n - 1, (n - 1) / n * G)


def allgather(n: int, per_rank_bytes: float) -> Cost:
    """Ring allgather. Each rank *contributes* per_rank_bytes; the gathered total is
    G = n * per_rank_bytes:  (n-1) alpha + (n-1)/n * G * beta = (n-1)(alpha + per_rank * beta)."""
    n, p = _ranks(n), _nbytes(per_rank_bytes)
    return Cost(n - 1, (n - 1) * p)


def alltoall(n: int, per_rank_bytes: float) -> Cost:
    """Pairwise alltoall. Each rank holds m = per_rank_bytes split in n blocks and sends
    block j to rank j (its own block stays):  (n-1) alpha + (n-1)/n * m * beta."""
    n, m = _ranks(n), _nbytes(per_rank_bytes)
    return Cost(n - 1, (n - 1) / n * m)


def broadcast_tree(n: int, nbytes: float) -> Cost:
    """Binomial-tree broadcast from one root: ceil(log2 n) (alpha + nbytes * beta)."""
    n, m = _ranks(n), _nbytes(nbytes)
    d = _log2_steps(n)
    return Cost(d, d * m)


def tree_allreduce(n: int, nbytes: float) -> Cost:
    """Binary-tree reduce to a root, then broadcast back, whole vector each step:
    2 ceil(log2 n) (alpha + nbytes * beta). Few messages, but every step moves all bytes."""
    n, m = _ranks(n), _nbytes(nbytes)
    d = _log2_steps(n)
    return Cost(2 * d, 2 * d * m)


def double_binary_tree_allreduce(n: int, nbytes: float) -> Cost:
    """Pipelined double binary tree (NCCL's tree), ideal limit:
    2 ceil(log2 n) alpha + 2 nbytes beta.

    Two complementary trees each carry half the vector, chopped into many small chunks
    that stream up (reduce) and down (broadcast). Each rank then sends and receives about
    nbytes per phase. This is a *lower bound*: it ignores the extra alpha per chunk and
    the pipeline fill, which a real implementation pays.
    """
    n, m = _ranks(n), _nbytes(nbytes)
    if n == 1:
        return Cost(0, 0.0)
    return Cost(2 * _log2_steps(n), 2 * m)


def parameter_server(n: int, nbytes: float, servers: int = 1) -> Cost:
    """n workers push nbytes to s servers (each holds 1/s of the vector); workers pull the sum.

    Each server's link carries n * nbytes / s each way and handles n messages each way;
    each worker's link carries nbytes each way in s messages. The slower side bounds:
        2 max(n, s) alpha + 2 max(n/s, 1) * nbytes * beta.
    With one server (s=1) that is 2n alpha + 2n nbytes beta: it grows linearly in n,
    the reason allreduce replaced it. Servers are separate machines from the workers.
    """
    n, m = _ranks(n), _nbytes(nbytes)
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"number of servers must be an integer >= 1, got {servers!r}")
    return Cost(2 * max(n, servers), 2 * max(n / servers, 1.0) * m)


# ---------------------------------------------------------------- hvd-compress's exchanges

def wire_bytes(g: float, bits: int) -> float:
    """Bytes of k-bit codes for g bytes of fp32 gradient: g * k / 32."""
    return _nbytes(g, "gradient size") * _bits(bits) / 32


def compressed_allgather(n: int, g: float, bits: int = 8, header_bytes: float = HEADER_BYTES,
                         tensors: int = 1) -> Cost:
    """The course design: every rank allgathers everyone's k-bit packet and decodes all n.

    Packet per rank p = g*k/32 + header_bytes*tensors, so each rank receives (n-1) p:
        (n-1) alpha + (n-1) (g k/32 + h T) beta.
    Codec work: encode own g, decode n packets -> (n+1) g fp32 bytes.
    """
    n = _ranks(n)
    p = wire_bytes(g, bits) + _nbytes(header_bytes, "header") * _count(tensors)
    return allgather(n, p) + Cost(0, 0.0, (n + 1) * g)


def compressed_two_phase(n: int, g: float, bits: int = 8, header_bytes: float = HEADER_BYTES,
                         tensors: int = 1) -> Cost:
    """Two-phase: alltoall of k-bit chunks, each rank reduces its 1/n slice, allgather of slices.

    Every phase moves n-1 packets of (g k/32)/n + h T bytes per rank:
        2(n-1) alpha + 2(n-1) (g k/(32 n) + h T) beta   ~  2(n-1)/n g k/32 beta.
    Codec work: encode g, decode g (n slices of g/n), re-encode g/n, decode g -> (3 + 1/n) g.
    """
    n = _ranks(n)
    chunk = wire_bytes(g, bits) / n + _nbytes(header_bytes, "header") * _count(tensors)
    # alltoall(n, n*chunk) and allgather(n, chunk) both move (n-1) chunks per rank.
    return alltoall(n, n * chunk) + allgather(n, chunk) + Cost(0, 0.0, (3 + 1 / n) * g)


def _count(t) -> int:
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"number of tensors must be an integer >= 1, got {t!r}")
    return t


def _allreduce_in_wire_dtype(collective):
    """fp32 (k=32) or fp16 (k=16) allreduce: Horovod sums in the dtype that travels.
    Casting to fp16 and back costs 2g of codec work."""
    def cost(n, g, bits, **_):
        codec = 0.0 if bits == 32 else 2 * g
        return collective(n, wire_bytes(g, bits)) + Cost(0, 0.0, codec)
    return cost


def _param_server(n, g, bits, servers=1, **_):
    # worker encodes g, server decodes n*g/s and re-encodes g/s, worker decodes g
    codec = 0.0 if bits == 32 else (2 + (n + 1) / servers) * g
    return parameter_server(n, wire_bytes(g, bits), servers) + Cost(0, 0.0, codec)


@dataclass(frozen=True)
class Exchange:
    """A way to average gradients across ranks (a collective algorithm), with the bit widths
    it can carry. Not a compression scheme: those are registry.SCHEMES."""

    name: str
    bits: tuple
    summary: str
    cost: object  # (n, g, bits, header_bytes=, tensors=, servers=) -> Cost


EXCHANGES = {
    s.name: s for s in [
        Exchange("allreduce_ring", (32, 16),
               "ring allreduce in the wire dtype (32: fp32, 16: Compression.fp16)",
               _allreduce_in_wire_dtype(ring_allreduce)),
        Exchange("allreduce_tree", (32, 16), "binary-tree reduce + broadcast",
               _allreduce_in_wire_dtype(tree_allreduce)),
        Exchange("allreduce_dbtree", (32, 16),
               "pipelined double binary tree, ideal lower bound",
               _allreduce_in_wire_dtype(double_binary_tree_allreduce)),
        Exchange("param_server", (32, 16, 8), "parameter server(s), push g + pull g",
               _param_server),
        Exchange("allgather", (16, 8),
               "hvd-compress course design: allgather of k-bit packets, decode all",
               lambda n, g, bits, header_bytes=HEADER_BYTES, tensors=1, **_:
               compressed_allgather(n, g, bits, header_bytes, tensors)),
        Exchange("alltoall", (16, 8),
               "hvd-compress two-phase: alltoall k-bit chunks, reduce, allgather",
               lambda n, g, bits, header_bytes=HEADER_BYTES, tensors=1, **_:
               compressed_two_phase(n, g, bits, header_bytes, tensors)),
    ]
}
REFERENCE = ("allreduce_ring", 32)  # Horovod's default: what every speed-up is measured against


def carried_bits(exchange: str) -> tuple:
    """The bit widths `exchange` carries: its own, and for the packet exchanges (allgather,
    alltoall) every registered packet scheme's that travels by that route (plugins included:
    a 4-bit scheme registered in one file is priced here without another edit)."""
    own = EXCHANGES[exchange].bits
    if exchange not in (Route.ALLGATHER.value, Route.ALLTOALL.value):
        return own
    packet = {s.bits for s in registered_schemes().values()
              if s.packet and Route(exchange) in s.routes and 1 <= s.bits <= 32}
    return tuple(sorted(set(own) | packet, reverse=True))


def predict(scheme: str, n: int, g: float, bits: int, *, header_bytes: float = HEADER_BYTES,
            tensors: int = 1, servers: int = 1) -> Cost:
    """Cost coefficients of `scheme` for n ranks, g fp32 bytes per rank, k = bits."""
    if scheme not in EXCHANGES:
        raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(EXCHANGES)}")
    s = EXCHANGES[scheme]
    if _bits(bits) not in carried_bits(scheme):
        raise ValueError(f"scheme {scheme!r} carries {carried_bits(scheme)} bits, not {bits}")
    return s.cost(_ranks(n), _nbytes(g, "gradient size"), bits,
                  header_bytes=header_bytes, tensors=tensors, servers=servers)


def predict_table(nodes, g: float, link: Link, bits=(32, 16, 8), schemes=None, *,
                  gamma: float = 0.0, header_bytes: float = HEADER_BYTES, tensors: int = 1,
                  servers: int = 1) -> list[dict]:
    """One row per (n, scheme, bits) the scheme supports; plain dicts, SI units in the keys."""
    rows = []
    for n in nodes:
        ref_scheme, ref_bits = REFERENCE
        ref = predict(ref_scheme, n, g, ref_bits).seconds(link, gamma)
        for name in schemes or EXCHANGES:
            for k in bits:
                if k not in carried_bits(name):
                    continue
                c = predict(name, n, g, k, header_bytes=header_bytes, tensors=tensors,
                            servers=servers)
                t = c.seconds(link, gamma)
                rows.append(dict(
                    n=n, scheme=name, bits=k, messages=c.messages, bytes_per_rank=c.bytes,
                    codec_bytes=c.codec_bytes, time_s=t,
                    speedup_vs_fp32_ring=(ref / t) if t > 0 else math.nan,
                ))
    return rows


# ---------------------------------------------------------------- the course's formula

def course_allreduce_time(n: int, nbytes: float, a: float, bandwidth: float) -> float:
    """The course's T = a + 2(n-1)/n * g / b: one lumped startup a for the whole allreduce.

    It equals ring_allreduce when a = lumped_latency(n, alpha) = 2(n-1) alpha and b = 1/beta.
    Both g and b must be in the same unit (bytes and bytes/s): mixing bits and bytes is
    an 8x error.
    """
    n, m = _ranks(n), _nbytes(nbytes)
    return a + 2 * (n - 1) / n * m / bandwidth


def lumped_latency(n: int, alpha: float) -> float:
    """The course's a in terms of the per-message alpha of a ring: 2(n-1) alpha."""
    return 2 * (_ranks(n) - 1) * alpha


# ---------------------------------------------------------------- crossovers

def bandwidth_crossover(bits: int = 8) -> float:
    """n where the bandwidth terms of k-bit allgather and fp32 ring allreduce are equal.

    (n-1) g k/32 = 2(n-1)/n g  <=>  n = 64/k: 8 for bit8, 4 for bit16. Allgather's bytes
    per rank grow like n, ring's stay below 2g, so compression by 32/k only pays for n < 64/k.
    """
    return 64 / _bits(bits)


def allgather_crossover(g: float, link: Link, bits: int = 8, header_bytes: float = HEADER_BYTES,
                        tensors: int = 1) -> float:
    """Real n* where k-bit allgather and fp32 ring allreduce take equal time (gamma = 0).

    (n-1)(alpha + p beta) = 2(n-1) alpha + 2(n-1)/n g beta, with p = g k/32 + h T; divide by
    (n-1):  p beta - alpha = 2 g beta / n  =>  n* = 2 g beta / (p beta - alpha).
    Allgather is faster for n < n*. If p beta <= alpha it is faster at every n: returns inf.
    With alpha = 0 and no header, n* = 64/k exactly.
    """
    p = wire_bytes(g, bits) + _nbytes(header_bytes, "header") * _count(tensors)
    excess = p * link.beta - link.alpha
    if excess <= 0:
        return math.inf
    return 2 * g * link.beta / excess


def first_n_not_faster(g: float, link: Link, bits: int = 8, header_bytes: float = HEADER_BYTES,
                       tensors: int = 1, gamma: float = 0.0, n_max: int = 1 << 16):
    """Smallest integer n >= 2 at which k-bit allgather is no faster than fp32 ring allreduce.

    Scans n (so it also handles gamma > 0, where the equation is no longer linear).
    Returns None if allgather stays faster up to n_max.
    """
    for n in range(2, n_max + 1):
        ours = compressed_allgather(n, g, bits, header_bytes, tensors).seconds(link, gamma)
        ring = ring_allreduce(n, g).seconds(link, gamma)
        if ours >= ring * (1 - 1e-12):  # tolerate rounding at an exact tie
            return n
    return None
