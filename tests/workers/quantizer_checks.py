"""Run under horovodrun (tests/workers/suite.py, or alone): int8 and onebit on real ranks
(hvd_compress/compressors/int8.py, onebit.py): through several steps, every rank holds the same bits, equal BIT
FOR BIT to a one-process reference that replays every rank's encoding (int8: with that rank's
own rounding stream) and the route's reduction; bytes counted equal the cost model's formula;
the optimizer trains with each, onebit with error feedback."""
import re

import torch

import hvd_compress as hc
from hvd_compress.codecs import SCALE_BLOCK
from hvd_compress.exchange.bucketing import chunk_bounds
from hvd_compress.exchange.routes import make_communicator
from hvd_compress.costmodel.methods import bytes_per_step
from hvd_compress.exchange.memory import ResidualMemory
from hvd_compress.compressors import Int8Compressor
from hvd_compress.roles import rounding_stream
import checks

rank = world = None               # this job's rank and world size, set by run()
SEED = 7
NUMELS = (1000, 5, 777)          # not multiples of 8 or of the block; 5: one short block


def grads(step, r, numel):
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + 10 * r + numel)) * 1e-3


class Streams:
    """Every rank's int8 rounding streams (one per bucket and phase: roles.rounding_stream), as
    that rank's Int8Compressor holds them."""

    def __init__(self):
        self.gens = {r: {} for r in range(world)}

    def use(self, r, stream):
        """Rank r's generator for `stream` in place; enter the returned context to draw from it."""
        key = ("cpu", stream)
        if key not in self.gens[r]:
            self.gens[r][key] = torch.Generator().manual_seed(Int8Compressor.stream_seed(r, stream))
        Int8Compressor._generators = self.gens[r]
        return rounding_stream(stream)


def reference(comp, route, xs, streams, name):
    """The reduced tensor and each rank's message, replayed in this one process (the bucket is
    named by its one tensor's name)."""
    numel = xs[0].numel()
    if route == "allgather":
        msgs = []
        for r in range(world):
            with streams.use(r, name):
                msgs.append(comp.encode_message(xs[r].clone(), torch.zeros(comp.message_bytes(numel), dtype=torch.uint8)))
        out = torch.empty(numel)
        comp.decode_messages(torch.stack(msgs), numel, out, SCALE_BLOCK, world)
        return out, msgs
    chunks = chunk_bounds(numel, world, SCALE_BLOCK)
    bounds = [a for a, _ in chunks] + [chunks[-1][1]]
    sizes = [comp.message_bytes(b - a) for a, b in chunks]
    offsets = [sum(sizes[:k]) for k in range(world + 1)]
    msgs = []
    for r in range(world):
        with streams.use(r, name):
            msgs.append(comp.encode_chunks(xs[r].clone(), torch.zeros(sum(sizes), dtype=torch.uint8), bounds))
    reduced = []
    for k, (a, b) in enumerate(chunks):
        rows = torch.stack([m[offsets[k]:offsets[k + 1]] for m in msgs])
        with streams.use(k, name + ".reduce"):
            reduced.append(comp.reduce_encode(rows, b - a, torch.zeros(sizes[k], dtype=torch.uint8), SCALE_BLOCK, world))
    out = torch.empty(numel)
    comp.decode_chunks(torch.cat(reduced), bounds, out)
    return out, msgs


def own_decoded(comp, route, msg, numel):
    out = torch.empty(numel)
    if route == "allgather":
        return comp.decode_message(msg, numel, out)
    chunks = chunk_bounds(numel, world, SCALE_BLOCK)
    return comp.decode_chunks(msg, [a for a, _ in chunks] + [chunks[-1][1]], out)


def run(hvd):
    global rank, world
    rank, world = hvd.rank(), hvd.size()
    for comp, route, feedback in ((hc.Compression.int8, "allgather", False),
                                  (hc.Compression.int8, "alltoall", False),
                                  (hc.Compression.onebit, "allgather", True)):
        tag = f"{comp.name}.{route}"
        comm = make_communicator(comp, route)          # (its warm-up encodes: before the reseed)
        Int8Compressor.reseed(SEED)
        streams = Streams()
        memory = ResidualMemory() if feedback else None
        residual = {(r, n): torch.zeros(n) for r in range(world) for n in NUMELS}
        for step in range(3):
            for numel in NUMELS:
                name = f"t{numel}"
                mine = Int8Compressor._generators
                out = comm.reduce([grads(step, rank, numel)], [name], memory)[0]
                sent = comm.pop_stats()["bytes_sent"]
                xs = [grads(step, r, numel) + residual[(r, numel)] for r in range(world)]
                ref, msgs = reference(comp, route, xs, streams, name)
                Int8Compressor._generators = mine          # this rank's own stream goes on
                if feedback:
                    for r in range(world):
                        residual[(r, numel)] = xs[r] - own_decoded(comp, route, msgs[r], numel)
                where = f"{tag}.step{step}.n{numel}"
                checks.check(f"{where}.equals_reference_bit_for_bit", torch.equal(out, ref),
                             f"max diff {(out - ref).abs().max()}")
                checks.check(f"{where}.identical_on_all_ranks", checks.same_everywhere([out]))
                if route == "allgather":
                    formula = bytes_per_step(comp.name, [(numel,)], world, route=route)
                    checks.check(f"{where}.bytes_equal_formula", sent == formula, f"{sent} != {formula}")
                else:                                   # per rank it depends on the chunk: the mean
                    total = hvd.allreduce(torch.tensor(float(sent)), op=hvd.Sum, name=f"{where}.sent")
                    formula = bytes_per_step(comp.name, [(numel,)], world, route=route)
                    checks.check(f"{where}.bytes_equal_formula", float(total) / world == formula,
                                 f"{float(total) / world} != {formula}")
        if feedback:
            checks.check(f"{tag}.residual_is_x_minus_decoded",
                         all(torch.equal(memory.residuals[f"t{n}"], residual[(rank, n)]) for n in NUMELS))

    # the optimizer's defaults: error feedback on for onebit, off when asked, off for int8;
    # onebit refuses the two-phase route with a clear error
    def sgd():
        return torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    opt = hc.DistributedOptimizer(sgd(), compression=hc.Compression.onebit)
    checks.check("onebit.error_feedback_on_by_default", opt.core.memory is not None)
    opt = hc.DistributedOptimizer(sgd(), compression=hc.Compression.onebit, error_feedback=False)
    checks.check("onebit.error_feedback_off_when_asked", opt.core.memory is None)
    opt = hc.DistributedOptimizer(sgd(), compression=hc.Compression.int8)
    checks.check("int8.no_error_feedback_by_default", opt.core.memory is None)
    try:
        hc.DistributedOptimizer(sgd(), compression=hc.Compression.onebit, route="alltoall")
        refusal = "no error"
    except ValueError as err:
        refusal = str(err)
    checks.check("onebit.alltoall_refused_clearly", bool(re.search("onebit cannot travel by alltoall", refusal)),
                 refusal)
    checks.trains("int8", hc.Compression.int8)
    checks.trains("onebit", hc.Compression.onebit)


if __name__ == "__main__":
    checks.main(run)
