"""What Compression.auto measures in the running job, and how the ranks' measurements become
one planner.Measurements (docs/planner.md, "In the job").

On each rank, no collective inside (an error here is gathered, never raised past a collective
the other ranks are in):
  step_sample     one step's pace from the optimizer's times: when each bucket left (hook work
                  before it subtracted), backward's span, the wait after it, the rest (fixed);
                  under schedule="overlap" also when the next forward needed each bucket
                  (forward_needs: its pre-hooks, as backward's pace is taken from its hooks)
  pace_summary    the median of the warm-up steps, the first discarded
  time_codecs     each candidate's encode / two-phase reduce / decode on the real buckets
  measure_errors  each lossy scheme's ||decode(encode(g)) - g|| / ||g|| on the buckets
Collective, every rank in the same order:
  time_collectives  each candidate collective on two sizes, a few repetitions (more where
                    they are cheap), and larger ones (agreed from every rank's times) where
                    those two cannot tell the cost of a byte from the cost of a message
Pure:
  combine         every rank's measurements -> planner.Measurements (the slowest rank's pace
                  and codec costs; each collective's fastest rank, see below), or a ValueError
                  saying why they cannot be planned from
"""
import math
import os
import statistics
import time

import torch

from .. import registry
from ..exchange.bucketing import chunk_bounds
from ..registry import Route, parse_label
from . import planner
from .records import Host, Pace, RankMeasurements, StepSample

__all__ = ["LINK_COLLECTIVES", "LINK_SMALL_BYTES", "LINK_LARGE_BYTES", "LINK_REPS",
           "CODEC_REPS", "DISAGREE_FACTOR", "step_sample", "pace_summary", "time_codecs",
           "measure_errors", "link_sizes", "link_grow_caps", "next_link_size",
           "LINK_REPS_MAX", "LINK_REP_BUDGET_S", "more_link_reps", "carried_units",
           "fastest_repetitions",
           "LINK_RESOLVED_RATIO", "LINK_GROW_MAX_S", "time_collectives", "combine", "host",
           "cpu_share", "whole_size", "carry", "carried", "forward_needs"]

LINK_COLLECTIVES = ("allreduce", "allreduce_fp16", "allgather", "alltoall")
# Two sizes per collective (alpha and beta need two): a small message, and the job's largest
# bucket held within [64 KiB, 256 KiB]: big enough that bandwidth dominates on a fast link,
# small enough that a 10 Mbit/s link times it in ~0.2 s.
LINK_SMALL_BYTES = 4 << 10
LINK_LARGE_BYTES = (64 << 10, 256 << 10)
# Where the larger size took under LINK_RESOLVED_RATIO times the small one's time, the message's
# cost hides the byte's, so it is timed again LINK_GROW_FACTOR larger, up to the job's largest
# message and while a size takes under LINK_GROW_MAX_S.
LINK_RESOLVED_RATIO = 4.0
LINK_GROW_MAX_S = 0.05
LINK_GROW_FACTOR = 4
# Timed repetitions after one untimed (Horovod negotiates a new name once, then caches it, as
# it does for the job's own buckets): the fit takes their median.
LINK_REPS = 3
# Where a size's repetitions are cheap, more, up to LINK_REPS_MAX, as many as LINK_REP_BUDGET_S
# holds at the slowest rank's median: a small message's median of three moves with one slow
# repetition, and alpha with it, by enough to flip a plan.
LINK_REPS_MAX = 9
LINK_REP_BUDGET_S = 0.06
CODEC_REPS = 3
# In synchronous training every rank's step lasts as long as the slowest's: ranks whose median
# steps differ by more than this factor measured something else (a clock, a stalled rank).
DISAGREE_FACTOR = 3.0
# Calibration polls a collective every 50 us (not wait_for's up to 1 ms), so the poll adds
# little to what is timed.
_POLL_S = 50e-6


# ---------------------------------------------------------------- the pace (each rank)

def step_sample(step_s, backward_start, backward_end, now, launches,
                applies=None) -> StepSample | None:
    """One step's pace, times from time.perf_counter(). launches: per bucket (launch order),
    (when its start() began, how long it took), or None if it never launched. Times are from
    backward's start, taken as the step's first gradient hook (what precedes it -- the loss's
    own backward to the last layer's gradient -- counts as fixed). Hook work (the starts) is
    subtracted: the planner adds each plan's own encodes. None where the step is incomplete
    (no hook fired, a bucket not launched).

    Under schedule="overlap" `applies` ((bucket, needed at, took), in the order applied) says
    when the next forward needed each bucket: the wait is what those applies took (step()
    returned at once), and the forward's pace is `forward_needs`'."""
    if backward_start is None or backward_end is None or any(x is None for x in launches):
        return None
    order = sorted(range(len(launches)), key=lambda i: launches[i][0])
    ready, work = [0.0] * len(launches), 0.0
    for i in order:
        began, cost = launches[i]
        ready[i] = max(0.0, began - backward_start - work)
        work += cost
    span = backward_end - backward_start
    needed = ()
    if applies is None:
        wait = now - backward_end
    else:
        needed, wait = forward_needs(applies, backward_end, len(launches))
        if needed is None:
            return None
    return StepSample(step_s, max(span - work, 0.0), wait, step_s - span - wait, tuple(ready),
                      needed)


def forward_needs(applies, backward_end, count):
    """(per bucket, when the next forward first needed it, s after step() returned with the
    waits before that moment taken out; the waits in all), from the optimizer's applies
    ((bucket, needed at, took) in the order applied: a forward pre-hook's buckets share its
    moment; one before step() returned is an abandoned step's, left out). (None, wait) where a
    bucket was never applied."""
    needed = [None] * count
    waited = before = 0.0
    moment = None
    for index, at, took in applies:
        if at < backward_end:                  # an abandoned step's (its updates were dropped)
            continue
        if at != moment:                       # a later hook: every wait so far came before it
            moment, before = at, waited
        if 0 <= index < count and needed[index] is None:
            needed[index] = max(0.0, at - backward_end - before)
        waited += max(0.0, took)
    if any(x is None for x in needed):
        return None, waited
    return tuple(needed), waited


def pace_summary(samples) -> Pace:
    """The median of each quantity over the samples but the first (discarded: first-touch
    allocations, Horovod's first negotiation of each name); incomplete steps left out."""
    usable = [s for s in samples[1:] if s is not None and math.isfinite(s.step_s)]
    if not usable:
        raise ValueError(f"no complete step among the {len(samples)} measured (a step without "
                         "backward, or a bucket that never launched)")

    def median(field):
        return statistics.median(getattr(s, field) for s in usable)
    ready = tuple(statistics.median(s.ready_s[i] for s in usable)
                  for i in range(len(usable[0].ready_s)))
    # the next forward's pace, where every step measured it (schedule="overlap")
    needed = ()
    if all(len(s.needed_s) == len(s.ready_s) for s in usable):
        needed = tuple(statistics.median(s.needed_s[i] for s in usable)
                       for i in range(len(ready)))
    return Pace(median("step_s"), median("backward_s"), median("wait_s"),
                max(median("fixed_s"), 0.0), ready, len(usable), needed)


# ---------------------------------------------------------------- codecs (each rank)

def _best(fn, reps):
    """The fastest of `reps` timed calls after one untimed (caches, first-touch pages)."""
    fn()
    best = math.inf
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def time_codecs(buffers, candidates, n, block, reps=CODEC_REPS):
    """{label: {"encode"|"reduce"|"decode": [[fp32 bytes, seconds], ...]}} for each lossy
    candidate, timed on each bucket's flat float32 gradient (read, never written), with the
    calls the communicators make: Horovod's fp16 casts; a packet allgather's whole-bucket
    encode and n-message decode-and-sum; a two-phase bucket's chunked encode, the middle
    decode-sum-re-encode of one chunk from n ranks, and the decode of the gathered chunks."""
    out = {}
    for text in candidates:
        name, route = parse_label(text)
        if name == "none":
            continue
        comp = registry.scheme(name).load()
        points = {"encode": [], "reduce": [], "decode": []}
        for x in buffers:
            nbytes, numel = 4 * x.numel(), x.numel()
            if route == Route.ALLREDUCE:             # Horovod's fp16: a cast each way
                codes, ctx = comp.compress(x)
                points["encode"].append([nbytes, _best(lambda: comp.compress(x), reps)])
                points["decode"].append([nbytes, _best(lambda: comp.decompress(codes, ctx), reps)])
                continue
            out_buf = torch.empty_like(x)
            if route == Route.ALLGATHER:
                bounds = [0, numel]
                message = torch.zeros(comp.chunks_bytes(bounds, block), dtype=torch.uint8)
                points["encode"].append([nbytes, _best(
                    lambda: comp.encode_chunks(x, message, bounds, block), reps)])
                rows = message.repeat(n).view(n, -1)
                points["decode"].append([nbytes, _best(
                    lambda: comp.decode_messages(rows, numel, out_buf, block, n), reps)])
            else:                                    # two-phase
                chunks = chunk_bounds(numel, n, block)
                bounds = [a for a, _ in chunks] + [chunks[-1][1]]
                message = torch.zeros(comp.chunks_bytes(bounds, block), dtype=torch.uint8)
                points["encode"].append([nbytes, _best(
                    lambda: comp.encode_chunks(x, message, bounds, block), reps)])
                a, b = chunks[0]
                size = comp.message_bytes(b - a, block)
                rows = message[:size].repeat(n).view(n, -1)
                reduced = torch.zeros(size, dtype=torch.uint8)
                points["reduce"].append([nbytes, _best(
                    lambda: comp.reduce_encode(rows, b - a, reduced, block, n), reps)])
                points["decode"].append([nbytes, _best(
                    lambda: comp.decode_chunks(message, bounds, out_buf, block), reps)])
        out[text] = points
    return out


def measure_errors(buffers, names, candidates, block):
    """{bucket name: {scheme: relative error}} of each lossy scheme among the candidates on
    each bucket's gradient, as the codec tests define it: ||decode(encode(g)) - g|| / ||g||
    (0 for a zero bucket; NaN where the gradient is not finite, which the guard refuses)."""
    schemes = []
    for text in candidates:
        name, route = parse_label(text)
        if name != "none" and name not in [s for s, _ in schemes]:
            schemes.append((name, route))
    out = {}
    for x, bucket in zip(buffers, names):
        row = {}
        for name, route in schemes:
            comp = registry.scheme(name).load()
            if route == Route.ALLREDUCE:
                y = comp.decompress(*comp.compress(x))
            else:
                message = torch.zeros(comp.message_bytes(x.numel(), block), dtype=torch.uint8)
                comp.encode_chunks(x, message, [0, x.numel()], block)
                y = comp.decode_chunks(message, [0, x.numel()], torch.empty_like(x), block)
            norm = float(torch.linalg.vector_norm(x))
            diff = float(torch.linalg.vector_norm(y.float() - x))
            row[name] = (0.0 if diff == 0 else math.nan) if norm == 0 else diff / norm
            if not math.isfinite(norm):
                row[name] = math.nan
        out[bucket] = row
    return out


# ---------------------------------------------------------------- the link (collective)

def link_sizes(largest_bucket_bytes):
    """The two message sizes each collective is timed at (bytes)."""
    low, high = LINK_LARGE_BYTES
    return (LINK_SMALL_BYTES, min(max(int(largest_bucket_bytes), low), high))


def link_grow_caps(largest_bucket_bytes):
    """{collective: the largest message (bytes as time_collectives takes them) the job's plans
    send through it}: the float32 bucket by allreduce, its 16-bit form by the others (fp16's
    vector, bit16's allgather part or alltoall send buffer)."""
    largest = int(largest_bucket_bytes)
    return {c: largest if c == "allreduce" else largest // 2 for c in LINK_COLLECTIVES}


def next_link_size(size, small_s, large_s, cap):
    """The next size to time a collective at, or None: grow (x LINK_GROW_FACTOR, at most `cap`)
    while the largest size so far (`size`, taking `large_s`) is not LINK_RESOLVED_RATIO times as
    slow as the small one (`small_s`), took under LINK_GROW_MAX_S, and is below `cap`. Pure: every
    rank passes the same agreed times and gets the same answer."""
    if size >= cap or not large_s < LINK_GROW_MAX_S or large_s >= LINK_RESOLVED_RATIO * small_s:
        return None
    return min(size * LINK_GROW_FACTOR, int(cap))


def more_link_reps(reps, slowest_median_s, budget_s=LINK_REP_BUDGET_S):
    """How many repetitions to add to a size's `reps`: as many as `budget_s` holds at the
    slowest rank's median time, within LINK_REPS_MAX in all. Pure: every rank that passes the
    same agreed time gets the same answer."""
    if not (budget_s > 0 and slowest_median_s > 0 and math.isfinite(slowest_median_s)):
        return 0
    return max(0, min(LINK_REPS_MAX - reps, int(budget_s / slowest_median_s)))


def time_collectives(engine, sizes, reps=LINK_REPS, collectives=LINK_COLLECTIVES, caps=None,
                     budget_s=LINK_REP_BUDGET_S):
    """[(collective, n, bytes, seconds, cpu seconds)] for each collective and size, `reps`
    timed repetitions after one untimed, and at the sizes given, with `reps` >= 2, as many more
    as `budget_s` holds (more_link_reps) at the slowest rank's median of the first ones, every
    rank in the same order (a collective: call it on every rank); cpu: what this process's
    other threads spent meanwhile. bytes as costmodel.fit defines them: allreduce a float32
    vector of that many bytes, allreduce_fp16 a float16 one, allgather each rank's part,
    alltoall each rank's send buffer (equal splits). With `caps` ({collective: bytes},
    link_grow_caps), a collective whose two sizes did not resolve a byte's cost is timed at
    larger ones (next_link_size), decided on the fastest rank's medians, gathered: the same
    sizes on every rank."""
    n = engine.size()
    rows = []
    for collective in collectives:
        sizes_here = list(sizes)
        medians = []
        while sizes_here:
            size = whole_size(sizes_here.pop(0), n)
            if collective == "allreduce":
                tensor = torch.zeros(size // 4, dtype=torch.float32)
                launch = lambda t, name: engine.allreduce_async(t, name)  # noqa: E731
            elif collective == "allreduce_fp16":
                tensor = torch.zeros(size // 2, dtype=torch.float16)
                launch = lambda t, name: engine.allreduce_async(t, name)  # noqa: E731
            elif collective == "allgather":
                tensor = torch.zeros(size, dtype=torch.uint8)
                launch = lambda t, name: engine.allgather_async(t, name)  # noqa: E731
            elif collective == "alltoall":
                tensor = torch.zeros(size, dtype=torch.uint8)
                splits = torch.full((n,), size // n, dtype=torch.int32)
                launch = lambda t, name: engine.alltoall_async(t, splits, name)  # noqa: E731
            else:
                raise ValueError(f"cannot time collective {collective!r}")
            name = f"hvdc.auto.link.{collective}.{size}"
            times, cpus, total, rep = [], [], reps, 0
            # each call carries this rank's median so far to every rank (carry): after the
            # last of the first `reps`, every rank reads the same times and adds as many
            # repetitions, with no collective of its own between them
            # (the two sizes asked for only: a grown one is large, its bytes' cost far above
            # the message's, and costs the most to repeat)
            carries = budget_s > 0 and reps >= 2 and size >= 4 * n and len(medians) < len(sizes)
            while rep <= total:
                if carries and rep <= reps:        # read once, after call `reps`
                    carry(collective, tensor, engine.rank(), n,
                           statistics.median(times) if times else 0.0)
                began, cpu, mine = time.perf_counter(), time.process_time(), time.thread_time()
                handle = launch(tensor, name)
                while not engine.poll(handle):
                    time.sleep(_POLL_S)
                output = engine.synchronize(handle)
                if rep:
                    times.append(time.perf_counter() - began)
                    # the CPU of every thread but this one (which polls): Horovod's, the
                    # transport's -- what the collective takes from backward's cores
                    cpus.append(max(0.0, (time.process_time() - cpu) - (time.thread_time() - mine)))
                if carries and rep == reps:
                    total += more_link_reps(reps, max(carried(collective, output, n)), budget_s)
                rep += 1
            rows += [(collective, n, size, t, c) for t, c in zip(times, cpus)]
            medians.append(statistics.median(times))
            if sizes_here or caps is None or collective not in caps or len(medians) < 2:
                continue
            every = engine.allgather(torch.tensor([[medians[0], medians[-1]]], dtype=torch.float64),
                                     f"hvdc.auto.link.grow.{collective}.{size}")
            small_s, large_s = every.min(dim=0).values.tolist()
            grown = next_link_size(size, small_s, large_s, caps[collective])
            if grown is not None and whole_size(grown, n) > size:
                sizes_here.append(grown)
    return rows


# A rank's median so far, as each collective carries it exactly to every rank: whole units
# of CARRY_UNIT_S below CARRY_MOST, as int32 bytes in an allgather's part and in every alltoall
# chunk, in a float32 or float16 allreduce's slot per rank (the others 0: the sum is exact;
# Horovod averages, so n times the slot is read back). float16 holds integers exactly only
# below 2048: 50 us units there, 102 ms, past any budget.
CARRY_UNIT_S = {"allreduce": 1e-6, "allreduce_fp16": 50e-6, "allgather": 1e-6, "alltoall": 1e-6}
CARRY_MOST = {"allreduce": 1 << 24, "allreduce_fp16": 2047, "allgather": (1 << 31) - 1,
              "alltoall": (1 << 31) - 1}


def carried_units(collective, seconds):
    """`seconds` in the whole units `collective` carries (what every rank reads back)."""
    return min(round(seconds / CARRY_UNIT_S[collective]), CARRY_MOST[collective])


def carry(collective, tensor, rank, n, seconds):
    """Write `seconds` where `collective` takes it to every rank (read by carried)."""
    units = carried_units(collective, seconds)
    if collective in ("allreduce", "allreduce_fp16"):
        tensor[rank] = float(units)
    else:                       # allgather: this rank's part; alltoall: each rank's chunk of it
        chunk = tensor.numel() // (1 if collective == "allgather" else n)
        tensor.view(-1, chunk)[:, :4] = torch.tensor([units], dtype=torch.int32).view(torch.uint8)


def carried(collective, output, n):
    """Every rank's seconds as `collective`'s output brought them (the same on every rank)."""
    if collective in ("allreduce", "allreduce_fp16"):
        units = [round(float(v) * n) for v in output[:n]]
    else:
        if collective == "alltoall":
            output = output[0]                       # (received, the splits received)
        units = output.view(n, -1)[:, :4].contiguous().view(torch.int32).flatten().tolist()
    return [u * CARRY_UNIT_S[collective] for u in units]


def whole_size(size, n):
    """`size` bytes rounded down to whole float32 values split equally over n ranks."""
    return max(n, size // (4 * n) * 4 * n)


# ---------------------------------------------------------------- every rank's -> one

def _finite(value, what):
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} is {value!r}, not a finite time >= 0")
    return float(value)


def job_step_s(steps):
    """The job's step from the ranks' own times of it (their mean). In synchronous training the
    ranks' steps end together, so on average they last as long; one rank's step differs from
    another's by when that rank ran again after the exchange ended, which adds to one step and
    takes as much from the next. The slowest rank's time of each step (or the largest of the
    ranks' medians) keeps only the additions: where ranks share cores and one waits for a
    core, it reads the steps long and re-plans on drift that is not there."""
    steps = list(steps)
    return math.fsum(steps) / len(steps)


def combine(ranks, link_rows, n):
    """One planner.Measurements from every rank's measurements (`ranks`: per rank, its
    records.RankMeasurements: buckets, pace, codecs, errors) and timed collectives (`link_rows`:
    per rank, its rows). Per quantity the slowest rank's: its pace sets the timeline, its
    codecs the hooks' cost. Per collective repetition the fastest rank's: every rank times the
    same collective, and those that arrived earlier add their wait for the last to it.
    Raises ValueError where they cannot be planned from: ranks with other buckets, times that
    are not finite, ranks whose steps differ by more than DISAGREE_FACTOR, a link that does not
    fit."""
    layouts = {tuple(tuple(b) for b in r.buckets) for r in ranks}
    if len(layouts) != 1:
        raise ValueError("ranks' buckets differ: " + "; ".join(
            f"rank {i}: {[list(b) for b in r.buckets]}" for i, r in enumerate(ranks)))
    layout = ranks[0].buckets
    steps = [_finite(r.pace.step_s, f"rank {i}'s median step")
             for i, r in enumerate(ranks)]
    if min(steps) <= 0 or max(steps) > DISAGREE_FACTOR * min(steps):
        raise ValueError(f"ranks disagree: median steps {', '.join(f'{s:.4g}' for s in steps)} s "
                         f"differ by more than {DISAGREE_FACTOR:g}x")
    pace = {k: max(_finite(getattr(r.pace, k), f"rank {i}'s {k}") for i, r in enumerate(ranks))
            for k in ("backward_s", "fixed_s")}
    ready, last = [], 0.0
    for j in range(len(layout)):
        # launch order: a bucket leaves no sooner than the one before it
        last = max(last, max(_finite(r.pace.ready_s[j], f"rank {i}'s ready time")
                             for i, r in enumerate(ranks)))
        ready.append(last)
    buckets = [planner.Bucket(name, int(nbytes), t) for (name, nbytes), t in zip(layout, ready)]
    backward = max(pace["backward_s"], ready[-1] if ready else 0.0)
    # schedule="overlap" (every rank measured the next forward): the slowest rank's need of
    # each bucket, as its ready times; else the waiting schedule is priced
    needed = None
    if all(len(r.pace.needed_s) == len(layout) for r in ranks):
        needed = tuple(max(_finite(r.pace.needed_s[j], f"rank {i}'s forward need")
                           for i, r in enumerate(ranks)) for j in range(len(layout)))

    links = planner.fit_links(fastest_repetitions(link_rows))

    codecs = {}
    for text in sorted({t for r in ranks for t in r.codecs}):
        parts = {}
        for op in ("encode", "reduce", "decode"):
            worst = {}
            for i, r in enumerate(ranks):
                for nbytes, seconds in r.codecs.get(text, {}).get(op, ()):
                    worst[nbytes] = max(worst.get(nbytes, 0.0),
                                        _finite(seconds, f"rank {i}'s {text} {op}"))
            if worst:
                parts[op] = planner.fit_affine(sorted(worst.items()))
        codecs[text] = planner.CodecCost(**parts)
    errors = {}
    for r in ranks:
        for bucket, row in r.errors.items():
            for scheme_name, err in row.items():
                key = (bucket, scheme_name)
                err = float(err) if err is not None else math.nan
                old = errors.get(key, -math.inf)
                errors[key] = math.nan if math.isnan(err) or math.isnan(old) else max(old, err)
    # overlap's chunks are cut from the layout alone, alike on every rank: rank 0's
    chunks = {(b, t): int(c) for t, row in ranks[0].chunks.items() for b, c in row.items()
              if int(c) > 1} if needed is not None else {}
    return planner.Measurements(n, tuple(buckets), backward, links, codecs, errors,
                                fixed_s=pace["fixed_s"], links_cpu=_links_cpu(link_rows),
                                cpu_share=cpu_share([r.host for r in ranks]), needed_s=needed,
                                chunks=chunks)


def fastest_repetitions(link_rows):
    """[(collective, n, bytes, seconds)], each repetition's fastest rank's time, from every
    rank's time_collectives rows (`link_rows`: per rank, its rows): every rank times the same
    collective, and those that arrived earlier add their wait for the last one to it. Raises
    ValueError on a time that is not finite."""
    fastest = {}
    for rows in link_rows:
        seen = {}
        for collective, size_n, nbytes, seconds, *_ in rows:
            key = (collective, size_n, nbytes, seen.setdefault((collective, nbytes), 0))
            seen[(collective, nbytes)] += 1
            seconds = _finite(seconds, f"a timed {collective}")
            fastest[key] = min(fastest.get(key, math.inf), seconds)
    return [(c, size_n, b, s) for (c, size_n, b, _), s in sorted(fastest.items())]


def host():
    """This rank's machine as cpu_share counts it: the kernel's boot id (ranks in network
    namespaces of one machine, each a host of its own to Horovod, share it), the cores it may
    run on, its compute threads."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        machine = os.uname().nodename
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Host(machine, int(cores or 1), torch.get_num_threads())


def cpu_share(hosts):
    """The backward seconds a collective's CPU second costs while backward computes: on a
    machine whose ranks' compute threads fill its cores (threads >= cores), every thread gets
    cores/threads of a core, so work added to one rank's process delays its backward by
    threads/cores of itself (4 ranks of one thread on 2 cores: 2); where a core is left free,
    Horovod's thread runs there (0). The most crowded machine's; 0 where a rank did not say."""
    if not hosts or any(not isinstance(h, Host) for h in hosts):
        return 0.0
    machines = {}
    for h in hosts:
        threads, cores = machines.get(h.machine, (0, h.cores))
        machines[h.machine] = (threads + h.threads, min(cores, h.cores))
    return max((t / c if t >= c else 0.0) for t, c in machines.values())


def _links_cpu(link_rows):
    """{collective: Affine} the CPU seconds per call, on each size the median of each rank's
    repetitions, then of the ranks; {} where no row has a CPU time."""
    per = {}
    for rows in link_rows:
        mine = {}
        for row in rows:
            if len(row) > 4:
                mine.setdefault((row[0], row[2]), []).append(_finite(row[4], f"a {row[0]}'s CPU"))
        for key, values in mine.items():
            per.setdefault(key, []).append(statistics.median(values))
    out = {}
    for collective in sorted({c for c, _ in per}):
        points = sorted((b, statistics.median(v)) for (c, b), v in per.items() if c == collective)
        out[collective] = planner.fit_affine(points)
    return out
