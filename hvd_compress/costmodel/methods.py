"""Bytes and time per training step of every compression method, for a model given by shapes.

What one rank sends per step, counted exactly as the communicators count it (tests compare
the two), from the gradients' shapes alone (no torch here):

    method    collective           per unit (n ranks)                       unit
    none      ring allreduce       2(n-1)/n * 4 numel                        tensor
    fp16      ring allreduce       2(n-1)/n * 2 numel                        tensor
    bit8      allgather            (n-1) * (4 ceil(numel/B) + pad4(numel))   bucket
    bit16     allgather | 2-phase  2 bytes a value instead of 1              bucket
    int8      allgather | 2-phase  as bit8                                   bucket
    bf16      2-phase | allgather  2 bytes a value, no block scales          bucket
    onebit    allgather            (n-1) * (4 ceil(numel/B) + pad4(ceil(numel/8)))   bucket
    topk      allgather            (n-1) * 8 k,  k = max(1, ceil(ratio numel))       tensor
    powersgd  ring allreduce       2(n-1)/n * 4 (rows + cols) r per matrix,  4 numel per vector

Each scheme's bytes come from its registry entry (hvd_compress/registry.py: code_bytes for the
packet schemes, step_bytes for top-k and PowerSGD), so a scheme added there is counted here.

B is the scale block (256 values); pad4 rounds up to a multiple of 4 bytes; the two-phase
route sends 2(n-1)/n of the bucket's messages on average over ranks. Buckets: the tensors in
backward order (last layer first), fused up to 1 MiB of float32 (the runtime's exchange/bucketing.py).
The time of a step's exchange is the alpha-beta model's (model.py): alpha per message of
each collective, beta per byte sent.
"""
from __future__ import annotations

import math

from ..codecs.formats import SCALE_BLOCK
from ..exchange.bucketing import (DEFAULT_FUSION_BYTES, backward_buckets, chunk_bounds,
                                  groups_by_size)
from ..registry import Route, powersgd_values, scheme, schemes, topk_count
from .model import Cost, allgather, alltoall, reduce_scatter, ring_allreduce

__all__ = ["METHOD_DEFAULTS", "MODEL_SHAPES", "numel", "groups_by_size", "buckets", "chunk_bounds",
           "message_bytes",
           "powersgd_values", "bytes_per_step", "step_cost", "exchange_units", "unit_seconds",
           "exchange_seconds", "two_phase", "break_even_rate"]

FUSION_BYTES = DEFAULT_FUSION_BYTES   # the runtime's (exchange/bucketing.py), read, not copied
# The methods' default parameters (top-k's ratio, PowerSGD's rank), from the registry.
METHOD_DEFAULTS = {s.name: s.parameter for s in schemes().values() if s.parameter is not None}
# Each collective's alpha-beta coefficients for one call, bytes as fit.py defines them.
COLLECTIVE_COSTS = {"allreduce": ring_allreduce, "allgather": allgather, "alltoall": alltoall,
                    "reducescatter": reduce_scatter, "allreduce_fp16": ring_allreduce}
# The lab's two networks (labs/mnist.py), parameter shapes in order; a test checks them.
MODEL_SHAPES = {
    "horovod": [(10, 1, 5, 5), (10,), (20, 10, 5, 5), (20,), (50, 320), (50,), (10, 50), (10,)],
    "basic": [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 9216), (128,), (10, 128), (10,)],
}


def numel(shape) -> int:
    return math.prod(shape)


def buckets(numels, threshold_bytes=FUSION_BYTES):
    """Value counts of the optimizer's buckets (bucketing.backward_buckets)."""
    return backward_buckets(numels, threshold_bytes)


def message_bytes(method, count, block=SCALE_BLOCK) -> int:
    """Bytes of one bucket message of `count` values: block scales, codes, padding to 4 (the
    scheme's registry entry: what blockcodec.BlockCodec sends)."""
    return scheme(method).message_bytes(count, block)


def _parameter(method, parameter):
    return scheme(method).parameter if parameter is None else parameter


def bytes_per_step(method, shapes, n, parameter=None, route=None, block=SCALE_BLOCK) -> float:
    """Bytes one rank sends per step (the mean over ranks for the two-phase route, whose
    ranks send a little more or less by chunk)."""
    if n == 1:
        return 0
    counts = [numel(s) for s in shapes]
    if scheme(method).step_bytes is not None:  # a method's own formula (registry.py)
        return scheme(method).step_bytes([tuple(s) for s in shapes], n, _parameter(method, parameter))
    if not scheme(method).packet:              # none, fp16: an allreduce of the cast values
        item = scheme(method).bits // 8
        return sum(2 * (n - 1) * c * item // n for c in counts)
    if two_phase(method, route):
        total = sum(message_bytes(method, z - a, block) for b in buckets(counts)
                    for a, z in chunk_bounds(b, n, block))
        return 2 * (n - 1) * total / n
    return sum((n - 1) * message_bytes(method, b, block) for b in buckets(counts))


def step_cost(method, shapes, n, parameter=None, route=None, block=SCALE_BLOCK) -> Cost:
    """The alpha-beta coefficients of one step's exchange: a collective per unit of the table
    above (Horovod fuses allreduces further, so for none/fp16 the alpha term is an upper
    bound), and its bytes exactly as bytes_per_step."""
    counts = [numel(s) for s in shapes]
    nbytes = bytes_per_step(method, shapes, n, parameter, route, block)
    if method == "powersgd":                 # P, then Q, per matrix; a vector at once
        units, shape = sum(2 if len(s) >= 2 else 1 for s in shapes), ring_allreduce(n, 1.0)
    elif method == "topk":
        units, shape = len(shapes), allgather(n, 1.0)
    elif not scheme(method).packet:
        units, shape = len(shapes), ring_allreduce(n, 1.0)
    elif two_phase(method, route):
        units = len(buckets(counts))
        shape = alltoall(n, float(n)) + allgather(n, 1.0)
    else:
        units, shape = len(buckets(counts)), allgather(n, 1.0)
    return Cost(units * shape.messages, float(nbytes), 0.0)


# ---------------------------------------------------------------------------------------------
# The exchange call by call: what a calibrated link predicts for a step
# ---------------------------------------------------------------------------------------------

def exchange_units(method, shapes, n, parameter=None, route=None, block=SCALE_BLOCK):
    """The collectives of one step's exchange, unit by unit in launch order (backward order:
    a bucket, or a tensor for the per-tensor methods), each unit a list of (collective, bytes)
    with bytes as fit.py defines them (each rank's input). Their bandwidth terms add up to
    bytes_per_step (a test checks it)."""
    counts = [numel(s) for s in shapes]
    if method == "none":
        return [[("allreduce", 4 * c)] for c in counts[::-1]]
    if method == "fp16":              # a float16 allreduce: its own fit (Horovod sums in fp16)
        return [[("allreduce_fp16", 2 * c)] for c in counts[::-1]]
    if method == "topk":
        ratio = _parameter(method, parameter)
        return [[("allgather", 8 * topk_count(c, ratio))] for c in counts[::-1]]
    if method == "powersgd":
        rank = _parameter(method, parameter)
        units = []
        for s in shapes[::-1]:
            if len(s) < 2:
                units.append([("allreduce", 4 * numel(s))])
            else:
                r = min(rank, s[0], numel(s) // s[0])
                units.append([("allreduce", 4 * s[0] * r), ("allreduce", 4 * (numel(s) // s[0]) * r)])
        return units
    if not scheme(method).packet:     # a user's allreduce scheme: in its own dtype
        return [[("allreduce", scheme(method).bits // 8 * c)] for c in counts[::-1]]
    if two_phase(method, route):
        units = []
        for b in buckets(counts):
            total = sum(message_bytes(method, z - a, block) for a, z in chunk_bounds(b, n, block))
            units.append([("alltoall", total), ("allgather", total / n)])
        return units
    return [[("allgather", message_bytes(method, b, block))] for b in buckets(counts)]


def unit_seconds(unit, n, links):
    """Seconds of one unit's collectives, each on its own fitted link ({collective: Link})."""
    return sum(COLLECTIVE_COSTS[c](n, b).seconds(links[c]) for c, b in unit)


def two_phase(method, route=None):
    """Whether the exchange is the two-phase route (alltoall, then allgather of the reduced
    chunks), whose second phase leaves only when the optimizer next looks at the bucket."""
    s = scheme(method)
    if not s.packet:
        return False
    return (Route.parse(route) if route is not None else s.default_route) == Route.ALLTOALL


def exchange_seconds(units, n, links, launch_span=0.0, second_phase_after_backward=False,
                     links_after=None):
    """A step's exchange, first launch to last result, on calibrated links: the units travel
    one after another (Horovod's background thread runs collectives in order), and the last
    one cannot leave before backward has produced it, `launch_span` seconds after the first:

        T = max(launch_span, t_1 + ... + t_(k-1)) + t_k

    With `second_phase_after_backward` (the two-phase route) t_i is the first collective of
    unit i and the second ones (p_i) follow: the optimizer launches a bucket's second phase
    once its first has completed, when it next polls it, so they share the one queue with the
    firsts and the total is the same on this model's reckoning:
    T = max(S, t_1 + ... + t_(k-1)) + t_k + p_1 + ... + p_k.

    `links_after`: the link as timed on idle cores, for what is on the wire after backward
    (after `launch_span`): until then backward keeps the cores busy and `links` (timed on busy
    cores) sets the pace; a collective running across that moment does the rest of its work
    at the idle pace. Without it one link times the whole exchange, the formula above.
    (Codec time is the caller's to add.)"""
    if not units:
        return 0.0
    links_after = links if links_after is None else links_after
    if second_phase_after_backward:
        queue = [(u[:1], 0.0) for u in units[:-1]] + [(units[-1][:1], launch_span)]
        queue += [(u[1:], launch_span) for u in units]
    else:
        queue = [(u, 0.0) for u in units[:-1]] + [(units[-1], launch_span)]
    clock = 0.0
    for unit, ready in queue:
        start = max(clock, ready)
        busy, idle = unit_seconds(unit, n, links), unit_seconds(unit, n, links_after)
        if start + busy <= launch_span:
            clock = start + busy
        elif start >= launch_span:
            clock = start + idle
        else:                            # backward ends while it runs: the rest at idle pace
            clock = launch_span + (1 - (launch_span - start) / busy) * idle
    return clock


def break_even_rate(fp32, compressed, fp32_codec_s, codec_s):
    """The link rate (bit/s) below which a compressed exchange beats float32's, from the two
    exchanges' Costs measured at 1 byte/s (messages: alpha terms in seconds, bytes: their
    bytes): with T(b) = L + C + 8 W / b,

        b* = 8 (W_32 - W_k) / ((L_k + C_k) - (L_32 + C_32))

    inf when compression costs no more fixed time (it pays at every rate), 0 when it sends
    no fewer bytes (it never pays)."""
    saved_bytes = fp32.bytes - compressed.bytes
    extra_fixed = (compressed.messages + codec_s) - (fp32.messages + fp32_codec_s)
    if saved_bytes <= 0:
        return 0.0
    if extra_fixed <= 0:
        return math.inf
    return 8 * saved_bytes / extra_fixed
