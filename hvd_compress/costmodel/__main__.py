"""Command line for the cost model: predict collective times, or fit alpha/beta to measurements.

    python -m hvd_compress.costmodel --nodes 8 --size 32MiB --bandwidth 10Gbit/s --latency 1ms
    python -m hvd_compress.costmodel --nodes 2 4 8 16 32 --size 100MB --bandwidth 1.25GB/s \
        --latency 50us --bits 32 8 --format csv > predicted.csv
    python -m hvd_compress.costmodel --fit runs/bench_collectives.csv
    python -m hvd_compress.costmodel --fit runs/bench.csv --nodes 8 64 --size 32MiB   # fitted link
    python -m hvd_compress.costmodel --methods basic --nodes 2 4 --bandwidth 100Mbit/s \
        --latency 50us [--schemes bit8 bf16:allgather]    # every registered scheme by default
    python -m hvd_compress.costmodel --tta results/tta/two-seeds/scaling.csv --nodes 8 16 32 64 \
        --bandwidth 10Gbit/s --latency 50us     # time to accuracy at n ranks (accuracy.py)

The compression schemes and their bit widths come from hvd_compress.registry (plugins of
$HVD_COMPRESS_SCHEMES included): a scheme registered in one file appears in --methods, and its
bits in --bits, with no edit here.

Every quantity takes an explicit unit (see units.py); output prints units, and CSV/JSON use
SI base units named in the column (time_s, bytes_per_rank in bytes).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys

from .. import registry
from . import methods, model, units

# ---------------------------------------------------------------- argument types


def _int_at_least(low: int):
    """An argparse type: a whole number >= low, with a usage error that says so."""
    def convert(text):
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
        return value
    convert.__name__ = "int"
    return convert


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def bit_widths() -> list[int]:
    """Every bit width some exchange carries (the packet exchanges: every registered packet
    scheme's), widest first."""
    return sorted({k for name in model.EXCHANGES for k in model.carried_bits(name)}, reverse=True)


def method_rows(chosen=None) -> list[tuple]:
    """(scheme, route or None) of the --methods table: the schemes named (a name, its default
    route; or name:route), else every registered scheme at its default route, registry order."""
    if not chosen:
        return [(name, None) for name in registry.schemes()]
    rows = []
    for text in chosen:
        name, route = registry.parse_label(text)
        rows.append((name, route.value if ":" in text else None))
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvd-compress-costmodel",
        description="Alpha-beta cost model: predicted time of each gradient-exchange scheme "
                    "(time = messages*alpha + bytes*beta [+ codec_bytes*gamma]), the "
                    "bit8-allgather vs fp32-ring crossover, or a fit of alpha/beta to "
                    "measurements. Formulas: docs/costmodel.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="units: sizes 32MiB 32MB 256Mbit 4kB; rates 10Gbit/s 10Gbps 1.25GB/s; "
               "times 1ms 50us 2.5s. 'Mb' and 'KB' are refused as ambiguous.",
    )
    p.add_argument("--nodes", type=_positive_int, nargs="+", metavar="N",
                   help="number of ranks n (several values allowed)")
    p.add_argument("--size", type=units.argument_type(units.parse_size),
                   help="fp32 gradient bytes per rank g, with a unit, e.g. 32MiB")
    p.add_argument("--bandwidth", type=units.argument_type(units.parse_rate),
                   help="link bandwidth 1/beta, e.g. 10Gbit/s or 1.25GB/s")
    p.add_argument("--latency", type=units.argument_type(units.parse_time),
                   help="per-message latency alpha, e.g. 1ms or 50us")
    widths = bit_widths()
    p.add_argument("--bits", type=int, nargs="+", choices=widths, default=[32, 16, 8],
                   metavar="K", help="gradient bit widths k to show (default: 32 16 8; any of "
                   f"{' '.join(map(str, widths))}: the registered schemes' widths)")
    p.add_argument("--schemes", nargs="+", metavar="SCHEME",
                   help="what to show (default: all). Predicting collectives: exchanges of "
                   + ", ".join(model.EXCHANGES) + ". With --methods: registered compression schemes, NAME or "
                   "NAME:ROUTE (" + ", ".join(registry.schemes()) + ")")
    p.add_argument("--tensors", type=_positive_int, default=1,
                   help="packets per rank that each carry a header: tensors for allgather "
                        "(one scale per tensor), fusion buckets for alltoall "
                        "(one scale per chunk); default 1")
    p.add_argument("--header-bytes", type=_nonneg_int, default=model.HEADER_BYTES,
                   help=f"header bytes per compressed packet (default {model.HEADER_BYTES})")
    p.add_argument("--servers", type=_positive_int, default=1,
                   help="parameter servers s (default 1)")
    p.add_argument("--codec-rate", type=units.argument_type(units.parse_rate),
                   help="encode/decode throughput in fp32 bytes, e.g. 2GB/s; adds "
                        "gamma = 1/rate per codec byte (default: no compute cost)")
    p.add_argument("--methods", choices=sorted(methods.MODEL_SHAPES), metavar="MODEL",
                   help="every compression method's bytes and time per step for one of the "
                        "lab's networks (horovod | basic), with --nodes, --bandwidth, --latency; "
                        "formulas in hvd_compress/costmodel/methods.py")
    p.add_argument("--tta", metavar="FILE.csv",
                   help="time to accuracy at --nodes ranks on the --bandwidth/--latency link, "
                        "from each method's steps to a target measured at two rank counts and "
                        "its compute per step (the grid's scaling.csv: labs/bench/tta_grid.py); "
                        "the model and its assumptions: hvd_compress/costmodel/accuracy.py")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.add_argument("--fit", metavar="FILE.csv",
                   help="fit alpha/beta per collective to a measurement CSV with columns "
                        "collective,n,bytes,seconds (or median_s); see fit.py")
    p.add_argument("--weighting", choices=("relative", "absolute"), default="relative",
                   help="least-squares weighting for --fit (default: relative errors)")
    p.add_argument("--per-n", action="store_true",
                   help="with --fit: fit each rank count on its own (default: one alpha/beta "
                        "per collective for all n)")
    p.add_argument("--link-rate", type=units.argument_type(units.parse_rate),
                   help="with --fit: the link's rate, e.g. 100Mbit/s; no fit may claim more "
                        "(beta is held at 1/rate and alpha refitted where it would)")
    return p


# ---------------------------------------------------------------- formatting helpers


def _markdown(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    """A Markdown table: readable in a terminal, pastes into a report, splits on '|'."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    rule = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2))
                          for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _jsonable(x):
    """JSON has no inf/nan: write null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def _ratio(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}x"


def _compact(text: str) -> str:
    """'10 Gbit/s' -> '10Gbit/s', a form the CLI accepts back."""
    return text.replace(" ", "")


# ---------------------------------------------------------------- prediction


def crossovers(args, link: model.Link, gamma: float) -> list[dict]:
    """k-bit allgather vs fp32 ring allreduce, for each compressed k asked for."""
    out = []
    for k in sorted({b for b in args.bits if b < 32}):
        out.append(dict(
            bits=k,
            bandwidth_only_n=model.bandwidth_crossover(k),
            equal_time_n=model.allgather_crossover(args.size, link, k, args.header_bytes,
                                                   args.tensors),
            first_n_not_faster=model.first_n_not_faster(args.size, link, k, args.header_bytes,
                                                        args.tensors, gamma),
            gamma_s_per_byte=gamma,
        ))
    return out


def _crossover_lines(cross: list[dict], gamma: float) -> list[str]:
    lines = ["crossover: k-bit allgather (course design) vs fp32 ring allreduce"]
    for c in cross:
        k, n_bw, n_eq, first = (c["bits"], c["bandwidth_only_n"], c["equal_time_n"],
                                c["first_n_not_faster"])
        pad = " " * len(f"  bit{k}: ")
        lines.append(f"  bit{k}: bandwidth alone: bytes/rank (n-1)*g*{k}/32 = 2(n-1)/n*g at "
                     f"n = 64/{k} = {n_bw:g}, so allgather wins only for n < {n_bw:g}")
        if math.isinf(n_eq):
            eq = "allgather is faster at every n"
        elif n_eq <= 2:
            eq = f"allgather is not faster at any n >= 2 (n* = {n_eq:.2f})"
        else:
            eq = f"equal time at n* = {n_eq:.2f}"
        lines.append(f"{pad}with latency (n-1 vs 2(n-1) messages) and headers: {eq}"
                     + (", before codec cost" if gamma > 0 else ""))
        verdict = (f"allgather is slower or equal from n = {first}" if first is not None
                   else "allgather stays faster up to n = 65536")
        lines.append(f"{pad}=> {verdict}" + (", counting codec cost" if gamma > 0 else ""))
    return lines


def predict_command(args, link: model.Link, link_source: str) -> str:
    gamma = 1.0 / args.codec_rate if args.codec_rate else 0.0
    rows = model.predict_table(args.nodes, args.size, link, args.bits, args.schemes,
                               gamma=gamma, header_bytes=args.header_bytes,
                               tensors=args.tensors, servers=args.servers)
    cross = crossovers(args, link, gamma)
    inputs = dict(size_bytes=args.size, alpha_s=link.alpha, beta_s_per_byte=link.beta,
                  bandwidth_bytes_per_s=link.bandwidth, gamma_s_per_byte=gamma,
                  header_bytes=args.header_bytes, tensors=args.tensors, servers=args.servers,
                  link_source=link_source)

    if args.format == "json":
        return json.dumps(_jsonable(dict(inputs=inputs, rows=rows, crossovers=cross)), indent=2)
    if args.format == "csv":
        for line in _crossover_lines(cross, gamma):  # stdout stays pure CSV
            print("# " + line.strip(), file=sys.stderr)
        return _csv(rows)

    head = (f"alpha-beta model ({link_source}): alpha = {units.format_time(link.alpha)} per "
            f"message, bandwidth = {units.format_rate(link.bandwidth)} "
            f"(beta = {units.format_time(link.beta)}/B)\ng = {units.format_size(args.size)} "
            f"of fp32 gradient per rank in {args.tensors} tensor(s), "
            f"{args.header_bytes} B header per compressed packet, {args.servers} server(s), "
            + (f"codec {units.format_rate(args.codec_rate)} "
               f"(gamma = {units.format_time(gamma)}/B)" if gamma else "no codec cost"))
    header = ["n", "scheme", "bits", "messages", "bytes/rank", "time", "vs fp32 ring"]
    cells = [[str(r["n"]), r["scheme"], str(r["bits"]), f"{r['messages']:g}",
              units.format_size(r["bytes_per_rank"]), units.format_time(r["time_s"]),
              _ratio(r["speedup_vs_fp32_ring"])] for r in rows]
    if gamma:  # show how much of each time is encode/decode rather than the network
        header.insert(6, "of which codec")
        for c, r in zip(cells, rows):
            c.insert(6, units.format_time(r["codec_bytes"] * gamma))
    table = _markdown(header, cells, right=set(range(len(header))) - {1})
    notes = ("messages = alpha coefficient (steps); bytes/rank = beta coefficient: bytes each "
             "rank sends (and receives),\nfor param_server the server's push + pull; "
             "vs fp32 ring = time(allreduce_ring, 32) / time (> 1 is faster).")
    return "\n".join([head, "", table, "", notes, "", *_crossover_lines(cross, gamma)])


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue().rstrip("\n")


# ---------------------------------------------------------------- methods


def methods_command(args, link: model.Link) -> str:
    """One row per (n, method) for a lab network: bytes one rank sends per step and the
    predicted exchange time, each also as a ratio to float32 allreduce."""
    shapes = methods.MODEL_SHAPES[args.methods]
    rows = []
    for n in args.nodes:
        ref = methods.step_cost("none", shapes, n)
        for name, route in method_rows(args.schemes):
            cost = methods.step_cost(name, shapes, n, route=route)
            t, t_ref = cost.seconds(link), ref.seconds(link)
            parameter = registry.scheme(name).parameter
            rows.append(dict(model=args.methods, n=n, method=name, parameter=parameter,
                             route=registry.resolve_route(name, route).value,
                             messages=cost.messages, bytes_per_rank=cost.bytes, time_s=t,
                             bytes_vs_fp32=cost.bytes / ref.bytes if ref.bytes else math.nan,
                             time_vs_fp32=t / t_ref if t_ref else math.nan))
    if args.format == "json":
        return json.dumps(_jsonable(rows), indent=2)
    if args.format == "csv":
        return _csv(rows)
    header = ["n", "method", "route", "messages", "bytes/rank/step", "time", "bytes vs fp32",
              "time vs fp32"]
    body = [[str(r["n"]), r["method"] + (f" {r['parameter']:g}" if r["parameter"] else ""),
             r["route"], f"{r['messages']:g}", f"{r['bytes_per_rank']:,.0f}",
             units.format_time(r["time_s"]), _ratio(r["bytes_vs_fp32"]), _ratio(r["time_vs_fp32"])]
            for r in rows]
    head = (f"{args.methods} network ({sum(methods.numel(s) for s in shapes):,} parameters), "
            f"alpha = {units.format_time(link.alpha)}, bandwidth = "
            f"{units.format_rate(link.bandwidth)}; codec time not included")
    return head + "\n" + _markdown(header, body, {0, 3, 4, 5, 6, 7})


# ---------------------------------------------------------------- time to accuracy

TTA_COLUMNS = ("model", "method", "scheme", "parameter", "route", "target", "batch_per_rank",
               "ranks1", "steps1", "ranks2", "steps2", "compute_s", "overhead_s")


def read_scaling(path) -> list[dict]:
    """The rows of a scaling CSV (TTA_COLUMNS; numbers as floats, empty as None)."""
    with open(path, newline="", encoding="utf-8") as stream:
        reader = csv.DictReader(stream)
        missing = [c for c in TTA_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise SystemExit(f"error: --tta {path}: no column {', '.join(missing)}")
        rows = []
        for row in reader:
            for key in ("target", "batch_per_rank", "ranks1", "steps1", "ranks2", "steps2",
                        "compute_s", "overhead_s", "parameter"):
                text = row[key].strip()
                row[key] = float(text) if text else None
            row["route"] = row["route"].strip() or None
            rows.append(row)
    return rows


def tta_command(args, link: model.Link) -> str:
    """Each method's predicted time to its target at every n of --nodes (accuracy.py), and its
    ratio to float32's at the same n."""
    from . import accuracy
    rows = []
    for item in read_scaling(args.tta):
        if item["steps1"] is None or item["steps2"] is None or item["compute_s"] is None:
            continue                       # never reached at a rank count: no curve
        b = item["batch_per_rank"]
        curve = accuracy.StepsCurve.fit(item["ranks1"] * b, item["steps1"],
                                        item["ranks2"] * b, item["steps2"])
        parameter = item["parameter"]
        if parameter is not None and registry.scheme(item["scheme"]).parameter is not None:
            parameter = type(registry.scheme(item["scheme"]).parameter)(parameter)
        for n in args.nodes:
            step = accuracy.step_seconds(item["scheme"], methods.MODEL_SHAPES[item["model"]], n,
                                         link, item["compute_s"], parameter, item["route"])
            rows.append(dict(model=item["model"], method=item["method"], target=item["target"],
                             n=n, steps=curve.steps(n * b), step_s=step,
                             tta_s=accuracy.time_to_accuracy(curve, b, n, step,
                                                             item["overhead_s"] or 0.0),
                             s_min=curve.s_min, e_min=curve.e_min))
    if not rows:
        raise SystemExit(f"error: --tta {args.tta}: no method with steps at both rank counts")
    base = {(r["model"], r["n"]): r["tta_s"] for r in rows if r["method"] == "none"}
    for r in rows:
        r["vs_float32"] = r["tta_s"] / base.get((r["model"], r["n"]), math.nan)
    if args.format == "json":
        return json.dumps(_jsonable(rows), indent=2)
    if args.format == "csv":
        return _csv(rows)
    header = ["model", "n", "method", "steps", "step", "time to target", "vs fp32"]
    body = [[r["model"], str(r["n"]), r["method"], f"{r['steps']:,.0f}",
             units.format_time(r["step_s"]), units.format_time(r["tta_s"]),
             _ratio(r["vs_float32"])] for r in rows]
    head = (f"time to accuracy at n ranks, alpha = {units.format_time(link.alpha)}, bandwidth = "
            f"{units.format_rate(link.bandwidth)}: steps S(B) = S_min + E_min / B through each "
            f"method's two measured rank counts, step = its compute + the exchange not hidden "
            f"behind backward (hvd_compress/costmodel/accuracy.py)")
    return head + "\n" + _markdown(header, body, {1, 3, 4, 5, 6})


# ---------------------------------------------------------------- fitting


def fit_command(args):
    from . import fit as fitting  # imports NumPy; prediction alone does not need it
    try:
        fits = fitting.fit_all(fitting.read_measurements(args.fit), args.weighting, args.per_n,
                               args.link_rate)
    except (OSError, UnicodeDecodeError, csv.Error, fitting.FitError) as e:
        raise SystemExit(f"error: --fit: {e}") from None

    summary = [dict(collective=f.collective, n=f.n, points=len(f.points), rows=f.rows,
                    excluded_n1_rows=f.excluded_n1, alpha_s=f.alpha, beta_s_per_byte=f.beta,
                    bandwidth_bytes_per_s=f.bandwidth, r2=f.r2,
                    max_abs_rel_residual=f.max_abs_rel_residual, clamped=f.clamped,
                    weighting=f.weighting) for f in fits]
    residuals = [dict(fit=f.label, collective=p.collective, n=p.n, bytes=p.bytes,
                      reps=p.reps, measured_s=p.measured_s, predicted_s=p.predicted_s,
                      rel_residual=p.rel_residual) for f in fits for p in f.points]
    if args.format == "json":
        text = json.dumps(_jsonable(dict(source=args.fit, fits=summary, residuals=residuals)),
                          indent=2)
    elif args.format == "csv":
        text = _csv(summary)
    else:
        text = _fit_table(args, fits)
    return text, fits[-1]


def _fit_table(args, fits) -> str:
    out = [f"fit of t = c_a(n)*alpha + c_b(n, bytes)*beta to {args.fit} "
           f"({fits[0].weighting} least squares on per-point medians)", ""]
    out.append(_markdown(
        ["collective", "points", "rows", "alpha", "beta", "bandwidth", "R^2", "worst rel resid"],
        [[f.label, str(len(f.points)), str(f.rows), units.format_time(f.alpha),
          units.format_time(f.beta) + "/B", units.format_rate(f.bandwidth),
          f"{f.r2:.4f}", f"{100 * f.max_abs_rel_residual:.1f}%"] for f in fits],
        right={1, 2, 3, 4, 5, 6, 7}))
    for f in fits:
        if f.clamped == "bandwidth":
            out.append(f"note: {f.label}: the bandwidth fitted above --link-rate and was held at it")
        elif f.clamped:
            out.append(f"note: {f.label}: {f.clamped} fitted below 0 and was held at 0")
        if f.excluded_n1 and (f.collective != "all" or len(fits) == 1):
            out.append(f"note: {f.collective}: {f.excluded_n1} row(s) at n = 1 left out "
                       "(no communication)")
    out += ["", "residuals (measured - predicted) / measured, per point:", ""]
    out.append(_markdown(
        ["fit", "collective", "n", "bytes", "reps", "measured", "predicted", "rel resid"],
        [[f.label, p.collective, str(p.n), units.format_size(p.bytes), str(p.reps),
          units.format_time(p.measured_s), units.format_time(p.predicted_s),
          f"{100 * p.rel_residual:+.1f}%"] for f in fits for p in f.points],
        right={2, 3, 4, 5, 6, 7}))
    best = fits[-1]
    if best.beta > 0:
        out += ["", f"predict with the '{best.label}' fit: --latency "
                    f"{_compact(units.format_time(best.alpha, 6))} --bandwidth "
                    f"{_compact(units.format_rate(best.bandwidth, 6))}"]
    return "\n".join(out)


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    predicting = args.nodes is not None or args.size is not None
    if args.size is not None and args.size <= 0:
        parser.error("--size must be greater than 0 bytes")
    if args.tta:
        missing = [f"--{k}" for k in ("nodes", "bandwidth", "latency") if getattr(args, k) is None]
        if missing:
            parser.error(f"--tta needs {', '.join(missing)}")
        print(tta_command(args, model.Link.from_bandwidth(args.latency, args.bandwidth)))
        return 0
    if args.methods:
        try:
            method_rows(args.schemes)
        except ValueError as err:
            parser.error(f"--schemes with --methods: {err}")
        missing = [f"--{k}" for k in ("nodes", "bandwidth", "latency") if getattr(args, k) is None]
        if missing:
            parser.error(f"--methods needs {', '.join(missing)}")
        print(methods_command(args, model.Link.from_bandwidth(args.latency, args.bandwidth)))
        return 0
    known = list(model.EXCHANGES)
    wrong = [s for s in args.schemes or () if s not in known]
    if wrong:
        parser.error(f"--schemes {' '.join(wrong)}: predicting collectives, the schemes are the "
                     f"exchanges {', '.join(known)} (compression schemes go with --methods)")
    chosen = args.schemes or list(model.EXCHANGES)
    if not any(k in model.carried_bits(s) for s in chosen for k in args.bits):
        parser.error("none of the chosen schemes carries the chosen bit widths ("
                     + "; ".join(f"{s}: {', '.join(map(str, model.carried_bits(s)))}"
                                 for s in chosen) + ")")

    if args.fit is None:
        if args.link_rate is not None:
            parser.error("--link-rate bounds a fit: give it with --fit FILE.csv")
        missing = [f"--{k}" for k in ("nodes", "size", "bandwidth", "latency")
                   if getattr(args, k) is None]
        if missing:
            parser.error(f"missing {', '.join(missing)} (or give --fit FILE.csv)")
        link = model.Link.from_bandwidth(args.latency, args.bandwidth)
        print(predict_command(args, link, "given"))
        return 0

    if predicting and (args.nodes is None or args.size is None):
        parser.error("to predict with the fitted link, give both --nodes and --size")
    if predicting and args.format == "csv":
        parser.error("--format csv holds one table: run --fit and the prediction separately")
    text, joint = fit_command(args)
    if not predicting:
        print(text)
        return 0
    alpha = args.latency if args.latency is not None else joint.alpha
    beta = 1.0 / args.bandwidth if args.bandwidth is not None else joint.beta
    if beta <= 0:
        parser.error("the fit held beta at 0; give --bandwidth explicitly")
    predicted = predict_command(args, model.Link(alpha, beta), f"fitted: '{joint.collective}'")
    if args.format == "json":
        print(json.dumps(dict(fit=json.loads(text), prediction=json.loads(predicted)), indent=2))
    else:
        print(text + "\n\n" + predicted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
