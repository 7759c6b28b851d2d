"""The shadows of Compression.auto's time-to-accuracy candidates (docs/planner.md, "Time to
accuracy"): what each lossy method would have sent this step, had it been the one training,
from the gradients the job has anyway. convergence.Progress turns the inner products into
each method's share of float32's progress per step.

A candidate is a method label:

    topk<ratio>    top-k of each tensor (methods.topk.select), its own residual: separable,
                   each rank compresses its own gradient
    onebit, int8   the scheme's codec on each bucket, block scales as the exchange's: separable
    powersgd<r>    PowerSGD's round, warm-started Q: linear in the ranks' matrices for a given
                   Q (P = mean M Q, Q' = mean M^T P), and its error feedback's mean residual
                   follows the mean gradient (e' = (g + e) - P Q'^T, averaged over ranks), so
                   its shadow is computed on the averaged gradient, alike on every rank

The shadows run at a sample of each window's steps (convergence.sampled_positions, the same
steps on every rank): at a sampled step each keeps its u_c (the candidate's decoded update,
this rank's share for a separable method); the next step's `products` sets it against the
reference gradient (the averaged one in the value mode; this rank's own when a lossy method is
in force: its received average is the method's, not float32's) and consumes it, so a step that
is neither sampled nor the one after does no shadow work at all. A separable method's share is
a per-rank product: the communicator averages every product over the ranks in one small
allreduce per window (convergence's module docstring). Pure torch, no collective.

Sampling a method with state (an error-feedback residual; PowerSGD's warm-started Q as well):
its shadow advances at the sampled steps only, i.e. it is the method run on the sampled
gradients, each taken as it is (the unsampled steps' gradients are not added in: a residual
holding k steps' gradient would send k steps' worth at once, which the method never does).
Within a calm window (the regime detector's meaning: the accumulated gradient's norm moved by
less than eta) a sampled gradient is drawn as a consecutive one is, so the residual's recursion
e' = (g + e) - C(g + e) and Q's power iteration reach the behaviour they have on every step,
in fewer updates: what a sampled shadow lacks is the young method's transient after a reset
(it lasts stride times as many steps) and the noise's correlation between consecutive steps.
Compression.auto(shadow_samples=interval) runs the shadows at every step.
"""
from __future__ import annotations

import math

import torch

from .. import registry
from ..codecs import SCALE_BLOCK
from ..methods.powersgd import initial_q, matrix_shape, orthonormal
from ..methods.topk import select
from ..registry import Route
from .convergence import parse_method

__all__ = ["method_value", "exchange_route", "Shadows"]

def method_value(text):
    """The Compression value a method label names (its communicator exchanges a lossy mode)."""
    kind, p = parse_method(text)
    if kind == "topk":
        from ..methods.topk import TopK
        return TopK(p)
    if kind == "powersgd":
        from ..methods.powersgd import PowerSGD
        return PowerSGD(p)
    return registry.scheme(kind).load()


def _codec_round(comp, x, block):
    """decode(encode(x)) by the scheme's packet codec, as its allgather route sends it."""
    message = torch.zeros(comp.message_bytes(x.numel(), block), dtype=torch.uint8)
    comp.encode_chunks(x, message, [0, x.numel()], block)
    return comp.decode_chunks(message, [0, x.numel()], torch.empty_like(x), block).float()


class Shadows:
    """Every candidate's shadow on this rank: residuals, PowerSGD's Q, and last step's u_c."""

    def __init__(self, methods, scale_block=SCALE_BLOCK):
        self.methods = tuple(methods)
        self.kinds = {m: parse_method(m) for m in self.methods}
        self.scale_block = int(scale_block)
        self._codecs = {m: registry.scheme(k).load() for m, (k, _) in self.kinds.items()
                        if k in ("onebit", "int8")}
        self.reset()

    def reset(self, method=None):
        """Forget every shadow (None) or one method's (its residual and Q: a method that takes
        over starts from the trajectory in force, with nothing of its own unsent)."""
        if method is None:
            self.residual = {m: {} for m in self.methods}
            self.qs = {m: {} for m in self.methods}
            self.sent = None                 # last step's {method: [u per bucket]}
            self.reference = None            # last step's reference gradient, per bucket
            return
        self.residual[method] = {}
        self.qs[method] = {}

    def pending(self):
        """Whether the last shadowed step's updates wait for this step's products."""
        return self.sent is not None and self.reference is not None

    def products(self, reference):
        """(<h_t, h_t+1>, {method: <u_c,t, h_t+1>}) of the last shadowed step's updates with
        this step's reference gradient h_t+1 (a list of flat float32 per bucket), which they
        are then forgotten for; None when no shadowed step waits (the first step, a step after
        an unsampled one)."""
        if not self.pending():
            return None
        sent, before = self.sent, self.reference
        self.sent = self.reference = None
        if len(before) != len(reference):
            return None
        exact = sum(float(torch.dot(a, b)) for a, b in zip(before, reference))
        made = {m: sum(float(torch.dot(u, b)) for u, b in zip(us, reference))
                for m, us in sent.items()}
        return exact, made

    def observe(self, sampled, local, reference, buckets, skip=()):
        """One step of the job: the products of the last shadowed step (None if none waits),
        then, if this step is `sampled`, its shadows (step()); a step with neither does
        nothing."""
        if not sampled and not self.pending():
            return None
        products = self.products(reference)
        if sampled:
            self.step(local, reference, buckets, skip)
        return products

    def step(self, local, reference, buckets, skip=()):
        """This step's shadows: each candidate compresses (its gradient + its residual), keeps
        what it sent for the next step's products. `local` and `reference` are per bucket flat
        float32; `buckets` the buckets (their members' names, numels and shapes); the methods
        in `skip` are not shadowed this step (nor measured at the next). The next call to
        products() reads what it kept."""
        sent = {}
        for m, (kind, p) in self.kinds.items():
            if m in skip:
                continue
            source = reference if kind == "powersgd" else local
            sent[m] = [self._one(m, kind, p, i, x, b) for i, (x, b) in
                       enumerate(zip(source, buckets))]
        self.sent = sent
        self.reference = [r.clone() for r in reference]

    def _one(self, m, kind, p, i, x, bucket):
        residual = self.residual[m]
        e = residual.get(i)
        x = x + e if e is not None and e.shape == x.shape else x.clone()
        if kind in ("onebit", "int8"):
            u = _codec_round(self._codecs[m], x, self.scale_block)
        else:
            u = torch.empty_like(x)
            for j, (off, k, shape) in enumerate(zip(bucket.offsets, bucket.numels,
                                                    bucket.shapes)):
                part = x[off:off + k]
                out = u[off:off + k]
                if kind == "topk":
                    out.zero_()
                    idx = select(part, max(1, math.ceil(p * k)))
                    out[idx] = part[idx]
                else:
                    out.copy_(self._powersgd(m, p, (i, j), part, shape))
        residual[i] = x - u
        return u

    def _powersgd(self, m, rank, key, part, shape):
        nm = matrix_shape(shape)
        if nm is None or 0 in nm:
            return part                        # vectors go whole, as the method sends them
        n, k = nm
        r = min(rank, n, k)
        q = self.qs[m].get(key)
        if q is None or q.shape != (k, r):
            q = initial_q(str(key), k, r, 0, part.device)
        matrix = part.reshape(n, k)
        pm = orthonormal(matrix @ q)
        q = matrix.t() @ pm
        self.qs[m][key] = q
        return (pm @ q.t()).reshape(-1)


def exchange_route(text):
    """The route a lossy mode's bucket takes: the packet allgather for the codecs (their
    registered route), the method's own for top-k and PowerSGD (None)."""
    kind, _ = parse_method(text)
    return Route.ALLGATHER if kind in ("onebit", "int8") else None
