"""One bucket on one candidate: its codec, wire and CPU seconds worked out from the measurements,
the unit the timeline (timeline.py) and the search (search.py) run on. Pure: no torch, no Horovod.

A collective is priced twice, at the link's pace while backward computes (`links`) and after
(`links_idle`, where one was measured); the idle pace is never taken slower than the busy one,
since noise in two measurements would otherwise break the monotonicity the search relies on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..costmodel import methods
from ..registry import label, parse_label, resolve_route
from .candidates import DEFAULT_CANDIDATES
from .measurements import Bucket, CodecCost, Measurements

__all__ = ["Option", "wire_units", "option", "plan_options"]


def wire_units(scheme: str, route, count: int, n: int):
    """The collectives of one bucket of `count` values, as (collective, bytes) with bytes as
    costmodel/fit.py defines them: costmodel.methods' own reckoning, the one its tests hold to the
    communicators' byte counts."""
    route = resolve_route(scheme, route).value
    return methods.exchange_units(scheme, [(count,)], n, route=route)[0]


def _measured_as(table, collective):
    """The key `collective` was measured under: Horovod's fp16 sum falls back to allreduce's."""
    return "allreduce" if collective == "allreduce_fp16" and collective not in table else collective


def _link(links, collective):
    collective = _measured_as(links, collective)
    if collective not in links:
        raise ValueError(f"no link measured for collective {collective!r}; have "
                         f"{', '.join(sorted(links))}")
    x = links[collective]
    return x.link() if callable(getattr(x, "link", None)) else x


def _unit_seconds(unit, n, links):
    return sum(methods.COLLECTIVE_COSTS[c](n, b).seconds(_link(links, c)) for c, b in unit)


def _unit_cpu(m, collective, nbytes):
    """Backward seconds the collective's CPU costs where it runs during backward."""
    cost = m.links_cpu.get(_measured_as(m.links_cpu, collective))
    return 0.0 if cost is None or not m.cpu_share else m.cpu_share * cost.seconds(nbytes)


@dataclass(frozen=True)
class Option:
    """One candidate for one bucket, with its costs worked out."""
    label: str
    index: int           # position in the candidate order: breaks ties
    enc: float
    mid: float
    dec: float
    phases: tuple        # ((busy s, idle s), ...): the bucket's collectives
    cpu: tuple           # per phase: backward seconds its CPU costs, run during backward
    loss: float          # bytes * measured error: what the tie-break minimises
    chunks: int = 1      # overlap: the chunks its route cuts it into (Measurements.chunks)


def option(m: Measurements, bucket: Bucket, text: str, index: int) -> Option:
    """Candidate `text` on `bucket`, `index` its place in the candidate order."""
    scheme, route = parse_label(text)
    if text == "none:allreduce" and text not in m.codecs:
        cost = CodecCost()
    elif text in m.codecs:
        cost = m.codecs[text]
    else:
        raise ValueError(f"no codec cost measured for {text}")
    count = bucket.nbytes // 4
    idle = m.links_idle or m.links
    phases, cpu = [], []
    for c, b in wire_units(scheme, route, count, m.n):
        busy = _unit_seconds([(c, b)], m.n, m.links)
        phases.append((busy, min(busy, _unit_seconds([(c, b)], m.n, idle))))
        cpu.append(_unit_cpu(m, c, b))
    err = 0.0 if scheme == "none" else m.errors.get((bucket.name, scheme), math.nan)
    chunks = m.chunks.get((bucket.name, text), 1) if m.needed_s is not None else 1
    return Option(text, index, cost.encode.seconds(bucket.nbytes),
                  cost.reduce.seconds(bucket.nbytes), cost.decode.seconds(bucket.nbytes),
                  tuple(phases), tuple(cpu), bucket.nbytes * err,
                  chunks if len(phases) == 1 else 1)


def plan_options(m, plan, candidates=None):
    """`plan` (a label per bucket) as Options, each indexed by its place in `candidates`."""
    order = {t: i for i, t in enumerate(candidates or DEFAULT_CANDIDATES)}
    return [option(m, b, label(*parse_label(t)), order.get(label(*parse_label(t)), len(order)))
            for b, t in zip(m.buckets, plan)]

