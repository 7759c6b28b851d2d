"""The candidates a bucket may take: their fixed order, which breaks every tie, and the accuracy
guard, which refuses a lossy scheme where its measured error on the bucket is too large
(docs/planner.md, "The accuracy guard"). Pure: no torch, no Horovod.
"""
from __future__ import annotations

import math

from ..registry import label, parse_label
from .measurements import Measurements

__all__ = ["DEFAULT_CANDIDATES", "ERROR_BOUND", "candidates_for"]

# The candidates, in the fixed order that breaks every tie: least lossy first.
# int8 is left out: it sends exactly bit8's bytes (so it never moves less), its stochastic
# rounding costs more codec time, and its error is relative to each block's largest value,
# not to each value (a value 100x below its block's max keeps ~1 significant bit where E4M3
# keeps 4). It can be passed in `candidates` where a measurement says otherwise.
DEFAULT_CANDIDATES = ("none:allreduce", "fp16:allreduce", "bit16:alltoall", "bit16:allgather",
                      "bit8:allgather", "bit8:alltoall")
# Accuracy guard: a bucket takes a lossy scheme only where that scheme's measured relative
# error on the bucket's gradients (||decode(encode(g)) - g|| / ||g||, as the codec tests define
# it) is at most this: E4M3's worst rounding of a value in its normal range, 2**-4
# (docs/codecs.md). Above it some of the bucket's values fell below the format's normal range
# after scaling (flushed or coarsely rounded): the scale does not fit the bucket.
ERROR_BOUND = 2.0 ** -4


def candidates_for(m: Measurements, candidates=DEFAULT_CANDIDATES, bound=ERROR_BOUND):
    """Per bucket, the candidates it may take, in the given order, and why the others may not:
    ([[label, ...] per bucket], {(bucket, label): reason}). none is always allowed."""
    allowed, refused = [], {}
    for bucket in m.buckets:
        ok = []
        for text in candidates:
            scheme, route = parse_label(text)
            text = label(scheme, route)
            err = m.errors.get((bucket.name, scheme))
            if scheme != "none" and text not in m.codecs:
                refused[(bucket.name, text)] = "codec cost not measured"
            elif scheme != "none" and err is None:
                refused[(bucket.name, text)] = "error not measured"
            elif scheme != "none" and not (math.isfinite(err) and err <= bound):
                refused[(bucket.name, text)] = f"error {err:.3g} > bound {bound:.3g}"
            else:
                ok.append(text)
        if "none:allreduce" not in ok:
            ok.insert(0, "none:allreduce")
        allowed.append(ok)
    return allowed, refused
