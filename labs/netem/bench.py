"""Time Horovod's collectives and hvd-compress's gradient exchanges; fit the alpha-beta model.

It answers: for g bytes on n ranks, how long does each way of exchanging them take, how close
is the cost model, and what does compression buy over Horovod's fp32 allreduce *measured in
the same run*?  Every point is verified (the collective's result is checked) before it is timed.

Files (rank 0 writes them; pandas reads them; OUT is the --out path, e.g. results/bench/b.csv):

  OUT               Horovod's primitives, one row per repetition:
                    collective,dtype,n,bytes,rep,seconds,...   collective = allreduce | allgather
                    | alltoall | reducescatter; bytes = each rank's *input* tensor (as
                    hvd_compress/costmodel/fit.py defines it), so this file is what
                    `python -m hvd_compress.costmodel --fit OUT` reads.
  OUT_schemes.csv   gradient exchanges end to end, one row per repetition: scheme (e.g.
                    bit8_allgather), n, bytes = fp32 gradient bytes g, seconds, and the
                    communicator's compress_s, communicate_s, decompress_s, bytes_sent.
  OUT_summary.csv   one row per point: median_s, p10_s, p90_s, the model's predicted_s, and
                    the ratios to fp32 allreduce at the same (n, bytes).
  OUT_fit.json      alpha and beta fitted by hvd_compress.costmodel.fit.
  OUT.png           measured (median, p10..p90) against the fitted model (labs/netem/plots.py).

Run (as a worker, ranks started by a launcher):
  horovodrun -np 2 --gloo python -m labs.netem.bench --out results/bench/lo2.csv
  python -m labs.netem bench -n 4 --rate 1gbit -- --out results/bench/net4.csv
Run (as a driver: n = 2 and 4, then one merged fit and plot):
  python -m labs.netem.bench --launch loopback -n 2 4 --out results/bench/loopback.csv
  python -m labs.netem.bench --launch netem --rate 1gbit -n 2 4 --out results/bench/1g.csv
Again from existing CSVs:
  python -m labs.netem.bench --analyze results/bench/1g.csv

Timing: at each size every case is first checked (its result compared with the exact one),
then warmed up, then timed in interleaved rounds (case a, b, c, a, b, c, ...) so that load
from other programs hits all cases alike.  Before every call the ranks meet at a barrier; a
repetition's time is the slowest rank's time from the barrier to the end of its call.  The
number of repetitions is chosen per case from the warm-up so that each takes about --budget
seconds, between --min-reps and --max-reps: a small message, whose median decides alpha and
is the most easily moved by a few slow repetitions, gets the most.  The fit never takes a
bandwidth above the emulated link's rate (costmodel.fit's max_bandwidth).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from hvd_compress.costmodel import units
from hvd_compress.registry import COURSE_SCHEMES, SCHEMES, Route, label, parse_label

from . import plots
from .launch import wire_counter


# allreduce_fp16: Horovod's allreduce of a float16 tensor (what --fp16-allreduce sends): its
# own fit, as Horovod sums float16 on the CPU at its own pace.
PRIMITIVES = ("allreduce", "allgather", "alltoall", "reducescatter", "allreduce_fp16")
DEFAULT_PRIMITIVES = ("allreduce", "allgather", "alltoall")
# Gradient exchanges: (compression, reduction).  "hvd_fp16" is Horovod's plain allreduce of
# an fp16 tensor (the cast is done before the clock starts): the floor for fp16 traffic.
# Every other scheme and route is the plugin's (hvd_compress.registry): one list of names,
# the course's value codecs (the other methods are compared in the lab's matrix, --methods).
HVD_FP16 = "hvd_fp16"
DEFAULT_SCHEMES = (f"{HVD_FP16}:allreduce",) + tuple(
    label(name, route) for name in COURSE_SCHEMES for route in SCHEMES[name].routes)
BITS = {HVD_FP16: 16, **{name: SCHEMES[name].bits for name in COURSE_SCHEMES}}
# Largest relative error (||out - exact|| / ||exact||) a scheme may have before the benchmark
# refuses to time it: a sanity bound that catches garbage, not an accuracy claim.
MAX_REL_ERR = {32: 1e-5, 16: 1e-2, 8: 0.25}

PRIMITIVE_COLUMNS = ["collective", "dtype", "n", "bytes", "rep", "seconds",
                     "bytes_per_rank", "wire_tx_bytes", "controller", "transport",
                     "link_rate_bps", "link_delay_s"]
SCHEME_COLUMNS = ["scheme", "compression", "reduction", "n", "bytes", "rep", "seconds",
                  "compress_s", "communicate_s", "decompress_s", "bytes_sent", "wire_tx_bytes",
                  "result_rel_err", "controller", "transport", "link_rate_bps", "link_delay_s"]


# ----------------------------------------------------------------------------------------
# Arguments (pure helpers)
# ----------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'64KiB' -> 65536; a bare number is bytes (units.parse_size: KiB/MiB/GiB or kB/MB/GB)."""
    try:
        value = int(round(units.parse_size(text, default_unit="B")))
    except units.UnitError as exc:
        raise ValueError(f"bad size {text!r}: write e.g. 1KiB, 64MiB, 4096 ({exc})") from None
    if value < 1:
        raise ValueError(f"size {text!r} is below one byte")
    return value


def parse_sizes(text: str) -> list[int]:
    """'1KiB:64MiB' (x4 steps), '1KiB:64MiB:x2', '4KiB,1MiB' or a mix -> sorted sizes."""
    sizes = set()
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) == 1:
            sizes.add(parse_size(parts[0]))
            continue
        if len(parts) not in (2, 3):
            raise ValueError(f"bad size range {item!r}: write FROM:TO or FROM:TO:xFACTOR")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = float(parts[2].lstrip("x")) if len(parts) == 3 else 4.0
        if hi < lo or factor <= 1:
            raise ValueError(f"bad size range {item!r}: need FROM <= TO and a factor > 1")
        size = float(lo)
        while size <= hi * (1 + 1e-9):
            sizes.add(int(round(size)))
            size *= factor
    return sorted(sizes)


def parse_schemes(items: list[str]) -> list[tuple[str, str]]:
    """['bit8:allgather', ...] -> [('bit8', 'allgather'), ...], checked by the registry."""
    out = []
    for item in items:
        compression, _, reduction = item.partition(":")
        try:
            if not reduction:
                raise ValueError("no route")
            if compression == HVD_FP16:
                route = Route.parse(reduction)
                if route is not Route.ALLREDUCE:
                    raise ValueError(f"{HVD_FP16} is Horovod's allreduce only")
            else:
                compression, route = parse_label(item)
                if compression not in COURSE_SCHEMES:
                    raise ValueError(f"this benchmark times {', '.join(COURSE_SCHEMES)}; compare "
                                     "the other methods with python -m labs.kit.matrix --methods")
        except ValueError as exc:
            raise ValueError(f"bad scheme {item!r}: write COMPRESSION:ROUTE with compression "
                             f"in {sorted(BITS)} ({exc})") from None
        out.append((compression, route.value))
    return out


def scheme_name(compression: str, reduction: str) -> str:
    return f"{compression}_{reduction}"


def output_paths(out: Path) -> dict[str, Path]:
    """All files of one benchmark, named after OUT."""
    out = Path(out)
    stem = out.with_suffix("")
    return {"primitives": out, "schemes": Path(f"{stem}_schemes.csv"),
            "summary": Path(f"{stem}_summary.csv"), "fit": Path(f"{stem}_fit.json"),
            "ratios": Path(f"{stem}_ratios.csv"), "plot": Path(f"{stem}.png")}


# ----------------------------------------------------------------------------------------
# Worker: the timing loop, run on every rank
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One thing to time at one size: `run()` does one repetition, `check(out)` verifies it."""
    kind: str                        # "primitive" or "scheme"
    name: str                        # collective or scheme name
    run: Callable[[], object]
    check: Callable[[object], float]  # raises on a wrong result; returns ||out-exact||/||exact||
    stats: Callable[[], dict] = lambda: {}
    row: dict = dataclasses.field(default_factory=dict)   # constant columns of its rows


def primitive_cases(hvd, torch, names: list[str], nbytes: int) -> list[Case]:
    """Horovod's own collectives on `nbytes` of input per rank, with results that are easy
    to check exactly: every rank contributes its rank number (+1 for the reductions)."""
    from hvd_compress.costmodel.fit import COLLECTIVES
    n, r = hvd.size(), hvd.rank()
    cases = []
    for name in names:
        if name == "allreduce_fp16":
            elems = max(nbytes // 2, n)
            x = torch.full((elems,), float(r + 1), dtype=torch.float16)
            run = (lambda x=x: hvd.allreduce_(x, op=hvd.Average, name="bench.allreduce_fp16"))
            value = (n + 1) / 2                # exact in float16 for these n

            def check(out, value=value, elems=elems):
                if out.numel() != elems or not torch.equal(out, torch.full_like(out, value)):
                    raise AssertionError(f"result is not {value} everywhere")
                return 0.0
            dtype, in_bytes = "float16", elems * 2
        elif name in ("allreduce", "reducescatter"):
            elems = max(nbytes // 4, n)
            x = torch.full((elems,), float(r + 1), dtype=torch.float32)
            if name == "allreduce":
                # In place, averaging, as DistributedOptimizer does: no 64 MiB allocation per
                # call is timed, and after the first call every rank holds (n+1)/2, so
                # repeating the call leaves the values (and the check) unchanged.
                run = (lambda x=x: hvd.allreduce_(x, op=hvd.Average, name="bench.allreduce"))
                expect, value = elems, (n + 1) / 2
            else:
                run = (lambda x=x: hvd.reducescatter(x, op=hvd.Sum, name="bench.reducescatter"))
                expect, value = None, n * (n + 1) / 2

            def check(out, value=value, expect=expect):
                if expect is not None and out.numel() != expect:
                    raise AssertionError(f"{out.numel()} elements, expected {expect}")
                if not torch.allclose(out, torch.full_like(out, value), rtol=1e-6, atol=0):
                    raise AssertionError(f"result is not {value} everywhere")
                return 0.0
            dtype, in_bytes = "float32", elems * 4
        elif name == "allgather":
            x = torch.full((nbytes,), r % 256, dtype=torch.uint8)
            run = (lambda x=x: hvd.allgather(x, name="bench.allgather"))
            want = torch.arange(n, dtype=torch.uint8).repeat_interleave(nbytes)

            def check(out, want=want):
                if not torch.equal(out, want):
                    raise AssertionError("allgather result is not every rank's block in order")
                return 0.0
            dtype, in_bytes = "uint8", nbytes
        elif name == "alltoall":
            block = max(nbytes // n, 1)
            x = torch.full((block * n,), r % 256, dtype=torch.uint8)
            splits = torch.full((n,), block, dtype=torch.int32)
            run = (lambda x=x, splits=splits: hvd.alltoall(x, splits=splits, name="bench.alltoall"))
            want = torch.arange(n, dtype=torch.uint8).repeat_interleave(block)

            def check(out, want=want):
                out = out[0] if isinstance(out, (tuple, list)) else out
                if not torch.equal(out, want):
                    raise AssertionError("alltoall did not deliver block j of rank k to rank j")
                return 0.0
            dtype, in_bytes = "uint8", block * n
        else:
            raise ValueError(f"unknown collective {name!r}; known: {', '.join(PRIMITIVES)}")
        per_rank = COLLECTIVES[name](n, in_bytes).bytes if n > 1 else 0.0
        cases.append(Case("primitive", name, run, check,
                          row={"collective": name, "dtype": dtype, "bytes": in_bytes,
                               "bytes_per_rank": per_rank}))
    return cases


def scheme_cases(hvd, torch, schemes: list[tuple[str, str]], nbytes: int) -> list[Case]:
    """hvd-compress's communicators (and Horovod's plain fp16 allreduce) on a gradient of
    `nbytes` fp32 bytes per rank, random like a real gradient, checked against the exact
    fp32 average."""
    r = hvd.rank()
    elems = max(nbytes // 4, 1)
    gen = torch.Generator().manual_seed(1234 + r)
    grad = torch.randn(elems, generator=gen, dtype=torch.float32)
    exact = hvd.allreduce(grad, op=hvd.Average, name=f"bench.exact.{nbytes}")
    exact_norm = float(exact.norm()) or 1.0
    cases = []
    for compression, reduction in schemes:
        bits = BITS[compression]
        name = scheme_name(compression, reduction)
        if compression == "hvd_fp16":
            # In place like the fp32 reference; later calls average already-equal values.
            half = grad.half()
            run = (lambda half=half: hvd.allreduce_(half, op=hvd.Average, name="bench.hvd_fp16"))
            stats = (lambda: {})
        else:
            comm = _make_communicator(hvd, compression, reduction)
            run = (lambda comm=comm, name=name: comm.reduce([grad], names=[f"bench.{name}"])[0])
            stats = comm.pop_stats

        def check(out, bits=bits, name=name):
            out = out.float()
            if out.shape != exact.shape:
                raise AssertionError(f"{name}: shape {tuple(out.shape)} != {tuple(exact.shape)}")
            if not torch.isfinite(out).all():
                raise AssertionError(f"{name}: result has NaN or Inf")
            err = float((out - exact).norm()) / exact_norm
            if err > MAX_REL_ERR[bits]:
                raise AssertionError(f"{name}: relative error {err:.3g} > {MAX_REL_ERR[bits]} "
                                     "against the exact fp32 average")
            return err
        cases.append(Case("scheme", name, run, check, stats,
                          row={"scheme": name, "compression": compression, "reduction": reduction,
                               "bytes": elems * 4}))
    return cases


def _make_communicator(hvd, compression: str, reduction: str):
    try:
        from hvd_compress.exchange.routes import make_communicator
        from hvd_compress.compression import Compression
    except ImportError as exc:
        raise SystemExit(f"scheme {compression}:{reduction} needs hvd_compress.exchange.routes "
                         f"({exc}); pass --schemes with nothing after it to time Horovod's "
                         "collectives only")
    return make_communicator(getattr(Compression, compression), route=reduction,
                             op=hvd.Average)


STAT_KEYS = ["seconds", "compress_s", "communicate_s", "decompress_s", "bytes_sent",
             "wire_tx_bytes"]


def time_cases(hvd, torch, cases: list[Case], warmup: int, min_reps: int, max_reps: int,
               budget_s: float, wire: Callable[[], float]) -> list[list[dict]]:
    """Check every case, warm them up, then time them in interleaved rounds (a, b, c, a, b,
    c, ...), so that a change in the machine's load hits all cases alike and the ratios
    between them stay fair.  Returns, per case, one row per repetition; every rank returns
    the same rows, each value the maximum over ranks."""
    errors = []
    for case in cases:
        errors.append(case.check(case.run()))
        case.stats()                     # forget the statistics of the checked call
    case_s = [0.0] * len(cases)
    for _ in range(warmup):
        for c, case in enumerate(cases):
            hvd.barrier()
            t0 = time.perf_counter()
            case.run()
            case_s[c] = time.perf_counter() - t0
            case.stats()
    # All ranks must agree on the number of repetitions: decide from the slowest rank's warm-up.
    # Each case gets its own (about budget_s of it): a small message, whose median is the one
    # that a few slow repetitions move most (it fixes alpha), gets many, a large one few.
    slowest = hvd.allreduce(torch.tensor(case_s, dtype=torch.float64), op=hvd.Max,
                            name="bench.warmup").tolist()
    reps = [int(min(max_reps, max(min_reps, budget_s / max(t, 1e-9)))) for t in slowest]
    table = torch.full((len(cases), max(reps), len(STAT_KEYS)), math.nan, dtype=torch.float64)
    for i in range(max(reps)):
        for c, case in enumerate(cases):
            if i >= reps[c]:
                continue
            hvd.barrier()
            tx0 = wire()
            t0 = time.perf_counter()
            case.run()
            t1 = time.perf_counter()
            tx1 = wire()
            s = case.stats() or {}
            table[c, i] = torch.tensor(
                [t1 - t0, s.get("compress_s", math.nan), s.get("communicate_s", math.nan),
                 s.get("decompress_s", math.nan), s.get("bytes_sent", math.nan), tx1 - tx0],
                dtype=torch.float64)
    # A value stays NaN only where every rank had NaN (no statistics, no NIC counter).
    worst = hvd.allreduce(torch.nan_to_num(table, nan=-1.0), op=hvd.Max, name="bench.table")
    worst[worst < 0] = math.nan
    return [[{**case.row, "rep": i, "result_rel_err": errors[c],
              **{k: float(worst[c, i, j]) for j, k in enumerate(STAT_KEYS)}}
             for i in range(reps[c])] for c, case in enumerate(cases)]


def run_worker(args) -> int:
    import torch
    import horovod.torch as hvd
    from labs.kit import runlog

    torch.set_num_threads(args.threads)
    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    paths = output_paths(args.out)
    env = {"n": n, "controller": "gloo" if hvd.gloo_enabled() else "mpi",
           "transport": ("netem" if os.environ.get("HVDC_NETEM") == "1"
                         else "one-host" if hvd.local_size() == n else "multi-host"),
           "link_rate_bps": os.environ.get("HVDC_NETEM_RATE_BPS", ""),
           "link_delay_s": os.environ.get("HVDC_NETEM_DELAY_S", "")}
    wire = wire_counter()
    prim_rows, scheme_rows = [], []
    sizes = parse_sizes(args.sizes)
    schemes = parse_schemes(args.schemes)
    if rank == 0:
        print(f"bench: n={n} ({env['controller']}, {env['transport']}), {len(sizes)} sizes "
              f"{_fmt_bytes(sizes[0])}..{_fmt_bytes(sizes[-1])}, collectives "
              f"{','.join(args.collectives) or '-'}, schemes "
              f"{','.join(scheme_name(*s) for s in schemes) or '-'}", flush=True)
    for nbytes in sizes:
        cases = primitive_cases(hvd, torch, args.collectives, nbytes)
        cases += scheme_cases(hvd, torch, schemes, nbytes) if schemes else []
        results = time_cases(hvd, torch, cases, args.warmup, args.min_reps, args.max_reps,
                             args.budget, wire)
        for case, rows in zip(cases, results):
            rows = [{**row, **env} for row in rows]
            (prim_rows if case.kind == "primitive" else scheme_rows).extend(rows)
            if rank == 0:
                secs = sorted(r["seconds"] for r in rows)
                print(f"bench: n={n} {case.name:<18} {_fmt_bytes(nbytes):>9}  median "
                      f"{_fmt_s(_quantile(secs, 0.5))}  p10 {_fmt_s(_quantile(secs, 0.1))}  "
                      f"p90 {_fmt_s(_quantile(secs, 0.9))}  ({len(rows)} reps)", flush=True)
        if rank == 0:
            # Rewritten whole after every size: an interrupted run keeps what it measured.
            runlog.write_csv_rows(paths["primitives"], PRIMITIVE_COLUMNS,
                                  [_select(r, PRIMITIVE_COLUMNS) for r in prim_rows])
            if schemes:
                runlog.write_csv_rows(paths["schemes"], SCHEME_COLUMNS,
                                      [_select(r, SCHEME_COLUMNS) for r in scheme_rows])
    hvd.barrier()
    if rank == 0 and args.analyze_after:
        analyze(paths["primitives"])
    return 0


def _select(row: dict, columns: list[str]) -> dict:
    return {c: ("" if row.get(c) is None or (isinstance(row.get(c), float) and math.isnan(row[c]))
                else row[c]) for c in columns}


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:g} {unit}"
    return f"{b:g} B"


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:8.3f} ms"


# ----------------------------------------------------------------------------------------
# Analysis: summary, fit, ratios, plot (rank 0 or offline)
# ----------------------------------------------------------------------------------------

def summarize(df, keys: list[str]):
    """One row per point: reps, median, p10, p90, min, max of `seconds` and of the
    communicator's own timings when present."""
    import pandas as pd
    agg = {"reps": ("seconds", "size"), "median_s": ("seconds", "median"),
           "p10_s": ("seconds", lambda s: s.quantile(0.1)),
           "p90_s": ("seconds", lambda s: s.quantile(0.9)),
           "min_s": ("seconds", "min"), "max_s": ("seconds", "max")}
    for col in ("compress_s", "communicate_s", "decompress_s", "bytes_sent", "wire_tx_bytes",
                "bytes_per_rank", "result_rel_err"):
        if col in df.columns:
            agg[f"median_{col}" if col.endswith("_s") else col] = (col, "median")
    out = df.groupby(keys, as_index=False).agg(**agg)
    return out.sort_values(keys).reset_index(drop=True) if len(out) else pd.DataFrame()


def _model_scheme(compression: str, reduction: str) -> tuple[str, int]:
    """The cost model's name for a gradient exchange (hvd_compress.costmodel.SCHEMES): the
    route's own name, but for Horovod's allreduce, which the model calls allreduce_ring."""
    route = Route.parse(reduction)
    return ("allreduce_ring" if route is Route.ALLREDUCE else route.value), BITS[compression]


def link_rate_bytes(prim_raw):
    """The emulated link's rate in bytes/s from the measurements' link_rate_bps column (None
    on loopback, where no rate was set)."""
    import pandas as pd
    if "link_rate_bps" not in prim_raw:
        return None
    rates = pd.to_numeric(prim_raw["link_rate_bps"], errors="coerce").dropna()
    return float(rates.iloc[0]) / 8 if len(rates) and rates.iloc[0] > 0 else None


def fit_and_predict(prim_raw, prim, schemes):
    """Fit alpha/beta (hvd_compress.costmodel.fit) to the primitives; predict every point.

    Two fits: per (collective, n), which `predicted_s` uses, and pooled over n per collective
    (`pooled_predicted_s`), the one that extrapolates to other n. Over an emulated link no fit
    may claim a bandwidth above the link's rate. A scheme's communication is
    predicted with the link fitted to all primitives at its n (one network, one alpha and beta).
    """
    from hvd_compress import costmodel
    from hvd_compress.costmodel import fit as cmfit

    measurements = cmfit.measurements_from_rows(
        prim_raw[["collective", "n", "bytes", "seconds"]].to_dict("records"), source="primitives")
    rate = link_rate_bytes(prim_raw)
    pooled = {f.label: f for f in cmfit.fit_all(measurements, max_bandwidth=rate)}
    per_n = {f.label: f for f in cmfit.fit_all(measurements, per_n=True, max_bandwidth=rate)}
    fits = {**per_n, **pooled}

    def seconds(fit, cost):
        # alpha and beta straight from the fit: a clamped beta of 0 is no valid model.Link
        return fit.alpha * cost.messages + fit.beta * cost.bytes

    def joint(n):
        return per_n.get(f"all@n={n}") or next(f for f in per_n.values() if f.n == n)

    prim = prim.copy()
    prim["predicted_s"] = [seconds(per_n[f"{c}@n={n}"], cmfit.COLLECTIVES[c](n, b))
                           for c, n, b in zip(prim["collective"], prim["n"], prim["bytes"])]
    prim["pooled_predicted_s"] = [seconds(pooled[c], cmfit.COLLECTIVES[c](n, b))
                                  for c, n, b in zip(prim["collective"], prim["n"], prim["bytes"])]
    if schemes is not None and len(schemes):
        schemes = schemes.copy()
        model_bytes, predicted = [], []
        for comp, red, n, g in zip(schemes["compression"], schemes["reduction"],
                                   schemes["n"], schemes["bytes"]):
            name, bits = _model_scheme(comp, red)
            cost = costmodel.predict(name, int(n), float(g), bits)
            model_bytes.append(cost.bytes)
            predicted.append(seconds(joint(int(n)), cost))   # communication only (gamma = 0)
        schemes["model_bytes_per_rank"] = model_bytes
        schemes["predicted_s"] = predicted
    return prim, schemes, fits


def add_ratios(prim, schemes):
    """Each scheme's time and bytes per rank over fp32 allreduce's at the same (n, bytes)."""
    if schemes is None or not len(schemes):
        return schemes
    ref = prim[prim["collective"] == "allreduce"][["n", "bytes", "median_s", "bytes_per_rank"]
                                                 + (["wire_tx_bytes"] if "wire_tx_bytes" in prim
                                                    else [])]
    ref = ref.rename(columns={"median_s": "fp32_allreduce_s",
                              "bytes_per_rank": "fp32_allreduce_bytes_per_rank",
                              "wire_tx_bytes": "fp32_allreduce_wire_tx_bytes"})
    out = schemes.merge(ref, on=["n", "bytes"], how="left")
    out["time_ratio"] = out["median_s"] / out["fp32_allreduce_s"]
    sent = out["bytes_sent"] if "bytes_sent" in out else out["model_bytes_per_rank"]
    sent = sent.fillna(out["model_bytes_per_rank"])
    out["bytes_ratio"] = sent / out["fp32_allreduce_bytes_per_rank"]
    if "wire_tx_bytes" in out and "fp32_allreduce_wire_tx_bytes" in out:
        out["wire_ratio"] = out["wire_tx_bytes"] / out["fp32_allreduce_wire_tx_bytes"]
    return out


def analyze(out_path: Path, quiet: bool = False) -> dict:
    """Summary CSV, fit JSON, ratios and plot from OUT (and OUT_schemes.csv if present)."""
    import pandas as pd
    from labs.kit import runlog

    paths = output_paths(out_path)
    prim_raw = pd.read_csv(paths["primitives"])
    schemes_raw = pd.read_csv(paths["schemes"]) if paths["schemes"].exists() else None
    prim = summarize(prim_raw, ["collective", "dtype", "n", "bytes"])
    schemes = (summarize(schemes_raw, ["scheme", "compression", "reduction", "n", "bytes"])
               if schemes_raw is not None and len(schemes_raw) else None)
    prim, schemes, fits = fit_and_predict(prim_raw, prim, schemes)
    schemes = add_ratios(prim, schemes)

    prim.insert(0, "kind", "primitive")
    prim.insert(1, "name", prim["collective"] + "_" + prim["dtype"].map(
        {"float32": "fp32", "float16": "fp16", "uint8": "u8"}).fillna(prim["dtype"]))
    frames = [prim]
    if schemes is not None:
        schemes.insert(0, "kind", "scheme")
        schemes.insert(1, "name", schemes["scheme"])
        frames.append(schemes)
    summary = pd.concat(frames, ignore_index=True, sort=False)
    summary["rel_err"] = (summary["median_s"] - summary["predicted_s"]) / summary["median_s"]
    summary["pooled_rel_err"] = ((summary["median_s"] - summary["pooled_predicted_s"])
                                 / summary["median_s"])
    if "median_communicate_s" in summary:
        summary["comm_rel_err"] = ((summary["median_communicate_s"] - summary["predicted_s"])
                                   / summary["median_communicate_s"])
    for col in ("link_rate_bps", "link_delay_s", "transport", "controller"):
        if col in prim_raw:
            summary[col] = prim_raw[col].iloc[0]
    runlog.atomic_write_text(paths["summary"], summary.to_csv(index=False))

    fit_json = {"source": str(paths["primitives"]),
                "fits": [{"collective": f.collective, "n": f.n, "alpha_s": f.alpha,
                          "beta_s_per_byte": f.beta,
                          # JSON has no inf/nan: null where beta was clamped to 0 or R^2 undefined
                          "bandwidth_bytes_per_s": _finite_or_none(f.bandwidth),
                          "r2": _finite_or_none(f.r2), "points": len(f.points),
                          "clamped": f.clamped}
                         for f in fits.values()],
                "schemes_predicted_with": "all@n (all primitives at the scheme's n)"}
    runlog.atomic_write_json(paths["fit"], fit_json)
    ratios = report_ratios(summary)
    if len(ratios):
        runlog.atomic_write_text(paths["ratios"], ratios.to_csv(index=False))
    plots.plot_bench(summary, paths["plot"], fits=fit_json)
    if not quiet:
        print(format_report(summary, fit_json, ratios))
        print(f"\nwrote {paths['summary']}, {paths['fit']}, {paths['plot']}"
              + (f", {paths['ratios']}" if len(ratios) else ""))
    return {"summary": summary, "fits": fit_json, "ratios": ratios, "paths": paths}


def _finite_or_none(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def report_ratios(summary):
    """Scheme vs fp32 allreduce, per (n, bytes): time ratio and bytes-per-rank ratio."""
    import pandas as pd
    if "time_ratio" not in summary:
        return pd.DataFrame()
    cols = ["n", "bytes", "name", "median_s", "fp32_allreduce_s", "time_ratio", "bytes_ratio"]
    cols += [c for c in ("wire_ratio",) if c in summary]
    return summary[summary["kind"] == "scheme"][cols].reset_index(drop=True)


def format_report(summary, fit_json, ratios) -> str:
    """The text printed at the end: fitted links, model error, and the ratio tables."""
    lines = ["", "alpha-beta fits (hvd_compress.costmodel.fit, relative least squares):"]
    for f in fit_json["fits"]:
        bw = f["bandwidth_bytes_per_s"]
        label = f["collective"] + ("" if f.get("n") is None else f"@n={f['n']}")
        lines.append(f"  {label:<14} alpha {f['alpha_s'] * 1e6:9.1f} us   "
                     + (f"bandwidth {bw * 8 / 1e9:8.3f} Gbit/s" if bw else "bandwidth   (beta fitted 0)")
                     + (f"   R^2 {f['r2']:.4f}" if f["r2"] is not None else "")
                     + (f"   (bandwidth held at the link rate)" if f["clamped"] == "bandwidth"
                        else f"   ({f['clamped']} held at 0)" if f["clamped"] else ""))
    big = summary[(summary["bytes"] >= 2**20) & (summary["kind"] == "primitive")]
    for col, what in (("rel_err", "fitted per (collective, n)"),
                      ("pooled_rel_err", "fitted per collective, pooled over n")):
        if len(big) and col in big:
            worst = big[col].abs().max()
            within = (big[col].abs() <= 0.25).mean()
            lines.append(f"  primitives >= 1 MiB, {what}: |measured - model| / measured <= 25% "
                         f"at {100 * within:.0f}% of points (worst {100 * worst:.1f}%)")
    if len(ratios):
        lines += ["", "vs fp32 allreduce measured in the same run (time ratio t, bytes per "
                      "rank ratio b; < 1 = better):"]
        for n, part in ratios.groupby("n"):
            sizes = sorted(part["bytes"].unique())
            head = f"  n={n:<3} {'scheme':<18}" + "".join(f"{_fmt_bytes(s):>18}" for s in sizes)
            lines.append(head)
            for name, rows in part.groupby("name", sort=False):
                cells = []
                for s in sizes:
                    r = rows[rows["bytes"] == s]
                    cells.append("" if not len(r) else
                                 f"t {r['time_ratio'].iloc[0]:5.2f} b {r['bytes_ratio'].iloc[0]:4.2f}")
                lines.append(f"        {name:<18}" + "".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Driver: launch the workers for each n, merge, analyze
# ----------------------------------------------------------------------------------------

def worker_args(args, out: Path) -> list[str]:
    """Command line of one worker run (the driver's timing options passed through)."""
    return ["--out", str(out), "--sizes", args.sizes, "--collectives", *args.collectives,
            "--schemes", *args.schemes, "--warmup", str(args.warmup),
            "--min-reps", str(args.min_reps), "--max-reps", str(args.max_reps),
            "--budget", str(args.budget), "--threads", str(args.threads), "--no-analyze"]


def launch_command(args, n: int, out: Path) -> list[str]:
    me = [sys.executable, "-m", "labs.netem.bench"] + worker_args(args, out)
    if args.launch == "loopback":
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        mode = (["--gloo"] if args.controller == "gloo" else
                ["--mpi", "--mpi-args=--allow-run-as-root --oversubscribe --bind-to none"])
        return [horovodrun, "-np", str(n), "-H", f"localhost:{n}", *mode] + me
    netem = [sys.executable, "-m", "labs.netem", "run", "-n", str(n),
             "--launcher", args.controller, "--timeout", str(args.timeout)]
    if args.rate:
        netem += ["--rate", args.rate]
    if args.delay:
        netem += ["--delay", args.delay]
    return netem + ["--"] + me


def run_driver(args) -> int:
    from labs.kit import runlog

    paths = output_paths(args.out)
    parts = []
    for n in args.n:
        part = paths["primitives"].with_name(f"{paths['primitives'].stem}_n{n}.csv")
        cmd = launch_command(args, n, part)
        print(f"bench: launching n={n}: {shlex.join(cmd)}", flush=True)
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}"
                                    f"{os.environ.get('PATH', '')}")
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout + 30)
        except subprocess.TimeoutExpired:
            rc = 124
        except KeyboardInterrupt:
            rc = 130
        finally:
            if proc.poll() is None:          # stop the launcher; netem tears down on SIGTERM
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        if rc != 0:
            print(f"bench: n={n} failed with exit code {rc}", file=sys.stderr)
            return rc
        parts.append(part)
    runlog.merge_csvs(parts, paths["primitives"])
    scheme_parts = [output_paths(p)["schemes"] for p in parts]
    if all(p.exists() for p in scheme_parts) and scheme_parts:
        runlog.merge_csvs(scheme_parts, paths["schemes"])
    for part in parts:                       # the merged files say everything the parts did
        part.unlink()
        output_paths(part)["schemes"].unlink(missing_ok=True)
    analyze(paths["primitives"])
    return 0


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Details: docs/netem.md")
    p.add_argument("--out", type=Path, default=Path("results/bench/bench.csv"),
                   help="primitives CSV; the other files are named after it")
    p.add_argument("--sizes", default="1KiB:64MiB",
                   help="sizes: FROM:TO[:xFACTOR] (default factor 4) and/or a comma list")
    p.add_argument("--collectives", nargs="*", default=list(DEFAULT_PRIMITIVES),
                   choices=PRIMITIVES, help="Horovod collectives to time")
    p.add_argument("--schemes", nargs="*", default=list(DEFAULT_SCHEMES),
                   help="gradient exchanges COMPRESSION:REDUCTION (empty: none); "
                        f"default {' '.join(DEFAULT_SCHEMES)}")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=50)
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds of timed repetitions per point (within min/max reps)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-analyze", dest="analyze_after", action="store_false",
                   help="worker: only write the raw CSVs")
    p.add_argument("--analyze", type=Path, metavar="OUT",
                   help="only summarize, fit and plot existing CSVs")
    p.add_argument("--launch", choices=["loopback", "netem"],
                   help="driver: start the ranks for each -n (horovodrun or labs.netem)")
    p.add_argument("-n", type=int, nargs="+", default=[2, 4], help="driver: rank counts")
    p.add_argument("--controller", choices=["gloo", "mpi"], default="gloo",
                   help="driver: Horovod controller / launcher")
    p.add_argument("--rate", help="driver with netem: per-rank link rate, e.g. 1gbit")
    p.add_argument("--delay", help="driver with netem: one-way delay, e.g. 0.1ms")
    p.add_argument("--timeout", type=float, default=1800, help="driver: seconds per n")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parse_sizes(args.sizes)
        parse_schemes(args.schemes)
    except ValueError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    if args.min_reps < 1 or args.max_reps < args.min_reps or args.warmup < 0:
        print("bench: error: need 1 <= --min-reps <= --max-reps and --warmup >= 0",
              file=sys.stderr)
        return 2
    if args.analyze:
        analyze(args.analyze)
        return 0
    if args.launch:
        return run_driver(args)
    if "HOROVOD_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        print("bench: not started by a launcher; use horovodrun, python -m labs.netem bench, "
              "or --launch loopback|netem", file=sys.stderr)
        return 2
    return run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
