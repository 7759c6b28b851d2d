"""Ask before training: the predicted step of every fixed scheme and of the planner's plan.
Or ask after: why a job took its plan, re-decided from the measurements its record keeps.

    hvd-compress-plan --model basic --nodes 2 --bandwidth 100Mbit/s --latency 1ms
    hvd-compress-plan --model lab --nodes 2 --link-fit FIT.json
    hvd-compress-plan --report runs/matrix/np2-auto/manifest.json

(`python -m hvd_compress.auto` is the same command.) The flags and units are the cost model's
(hvd-compress-costmodel); the command is a sibling of it rather than a flag of it because the
planner imports the cost model, and the cost model never imports what sits above it
(docs/architecture.md).

Where each input comes from (docs/planner.md); by default from the package's defaults/ (copies
of committed measurements, defaults/README.md), each replaceable by a flag:
- buckets: the lab net's parameter shapes (costmodel.methods.MODEL_SHAPES) fused in backward
  order up to 1 MiB of float32 by methods.groups_by_size, the function exchange/fusion.py calls;
- backward's pace: forward+backward from a step benchmark's summary (--step-results; the
  median over its rows for this model and rank count), two thirds of it backward (a
  backward pass costs about two forwards), or --compute; each bucket ready when backward has
  done the work of every tensor up to its last one, a tensor's work taken as its values times
  the output positions that use each (conv layers: the map's size), a FLOP count, not a
  measurement;
- codec costs: per scheme and route, a + b * bytes solved from the same file's compress_ms and
  decompress_ms on the two nets (a per call, b per fp32 byte), median over links
  (costmodel.affine.fit_calls_and_bytes);
- errors: each scheme's relative error per bucket (--errors), the largest per bucket and
  scheme;
- the link: --bandwidth and --latency for every collective, or per collective from a fit
  (--link-fit, the JSON the network benchmark and the lab's calibration write);
- the collectives' CPU, taken from backward where ranks share cores (--cpu-share, 0 by
  default: a core to spare): per collective a + b * bytes fitted to the per-rank medians of
  the collective CPU benchmark (--collective-cpu; by default the file of the nearest rank
  count), one size per collective but allgather's two, so b alone where only one was measured.
With --report, every input is the job's own: its plan_report() (the step benchmark's
plans/<cell>.json, or the lab's manifest.json, which holds it), read back by inputs.replay.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from pathlib import Path

from ..costmodel import affine, methods, units
from ..costmodel.model import Link
from ..registry import parse_label
from . import planner as pl
from . import inputs, records

# The default inputs ship with the package (defaults/README.md: copies of committed
# measurements), so the planning mode runs from an install; each flag takes the user's own.
DEFAULTS = Path(__file__).resolve().with_name("defaults")
STEP_RESULTS = DEFAULTS / "step_summary.csv"
ERRORS = DEFAULTS / "bucket_errors.csv"
COLLECTIVE_CPU = DEFAULTS / "collective-cpu"
# The collective CPU benchmark's cases, by the collective the planner's links name.
CPU_CASES = {"allreduce float32": "allreduce", "allreduce fp16": "allreduce_fp16",
             "allgather bit8": "allgather", "allgather bit8 chunk": "allgather",
             "alltoall bit8": "alltoall"}
# Parameter names of both lab nets, in parameter order (labs/mnist.py: Net, BasicNet).
NAMES = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
         "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
# Output positions each parameter's values are used at, per sample (28x28 input): conv1 5x5
# -> 24x24, conv2 on 12x12 -> 8x8 (Net); conv1 3x3 -> 26x26, conv2 -> 24x24 (BasicNet).
POSITIONS = {"horovod": [576, 576, 64, 64, 1, 1, 1, 1], "basic": [676, 676, 576, 576, 1, 1, 1, 1]}
BACKWARD_SHARE = 2 / 3
# The step benchmark's rows that measured each candidate.
BENCH_ROWS = {"none:allreduce": "ours:none", "fp16:allreduce": "ours:fp16",
              "bit16:alltoall": "ours:bit16:alltoall", "bit8:allgather": "ours:bit8:allgather",
              "bit8:alltoall": "ours:bit8:alltoall"}
BENCH_MODEL = {"horovod": "lab", "basic": "basic"}


def model_buckets(model):
    """[(name, values, [parameter indices])] in launch order: the optimizer's buckets."""
    shapes = methods.MODEL_SHAPES[model]
    backward = list(range(len(shapes)))[::-1]
    groups = methods.groups_by_size([methods.numel(shapes[i]) for i in backward],
                                    methods.FUSION_BYTES)
    out = []
    for g in groups:
        members = [backward[j] for j in g]
        out.append((NAMES[members[0]], sum(methods.numel(shapes[i]) for i in members), members))
    return out


def ready_times(model, backward_s):
    """When each bucket is ready: the FLOP share of backward done by its last tensor."""
    shapes = methods.MODEL_SHAPES[model]
    work = [methods.numel(s) * k for s, k in zip(shapes, POSITIONS[model])]
    total, done, out = sum(work), 0.0, []
    for _, _, members in model_buckets(model):
        done += sum(work[i] for i in members)
        out.append(backward_s * done / total)
    return out


def _rows(path, model, n):
    if not Path(path).is_file():
        raise SystemExit(
            f"error: no step benchmark at {path}: the plan prices codecs and backward's pace from "
            "one; pass --step-results SUMMARY.csv (a step benchmark's summary), or --report "
            "PLAN.json to explain a job's plan")
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == BENCH_MODEL.get(model, model)]
    have = sorted({int(r["ranks"]) for r in rows})
    if not have:
        raise SystemExit(f"error: {path} has no rows for model {model!r}")
    ranks = min(have, key=lambda k: (abs(k - n), k))
    return [r for r in rows if int(r["ranks"]) == ranks], ranks


def _median(values):
    values = [v for v in values if math.isfinite(v)]
    return statistics.median(values) if values else math.nan


def _num(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def pace_and_codecs(path, model, n):
    """(forward+backward s, other s, {label: CodecCost}, ranks used) from a step benchmark."""
    rows, ranks = _rows(path, model, n)
    fwd_bwd = _median(_num(r["forward_backward_ms"]) for r in rows) / 1e3
    other = _median(
        _num(r["step_ms"]) - _num(r["forward_backward_ms"]) - _num(r["compress_ms"])
        - _num(r["communicate_ms"]) - _num(r["decompress_ms"])
        for r in rows if r["row"].startswith("ours")) / 1e3
    codecs = {}
    for text, row in BENCH_ROWS.items():
        points = {}
        for m in ("horovod", "basic"):
            sel, _ = _rows(path, m, ranks)
            sel = [r for r in sel if r["row"] == row]
            if not sel:
                continue
            calls = (len(methods.MODEL_SHAPES[m]) if parse_label(text)[1].value == "allreduce"
                     else len(model_buckets(m)))
            nbytes = 4 * sum(methods.numel(s) for s in methods.MODEL_SHAPES[m])
            points[m] = (calls, nbytes, _median(_num(r["compress_ms"]) for r in sel) / 1e3,
                         _median(_num(r["decompress_ms"]) for r in sel) / 1e3)
        if len(points) == 2:
            (c1, x1, enc1, dec1), (c2, x2, enc2, dec2) = points["horovod"], points["basic"]
            codecs[text] = pl.CodecCost(affine.fit_calls_and_bytes((c1, x1, enc1), (c2, x2, enc2)),
                                        affine.fit_calls_and_bytes((c1, x1, dec1), (c2, x2, dec2)))
    return fwd_bwd, max(other, 0.0), codecs, ranks


def bucket_errors(path, model):
    """{(bucket, scheme): the largest measured relative error} for this model."""
    if not Path(path).exists():
        return {}
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["model"] == model:
                key = (r["bucket"], r["scheme"])
                out[key] = max(out.get(key, 0.0), _num(r["rel_error"]))
    return out


def collective_cpu(path, n):
    """{collective: Affine} from the collective CPU benchmark's CSV (`path`, or the file of the
    nearest rank count in COLLECTIVE_CPU): per (collective, bytes) the median over
    ranks of each rank's median CPU; a + b * bytes through those points (b alone from one)."""
    if path is None:
        have = {int(f.stem.removeprefix("cpu-np")): f for f in COLLECTIVE_CPU.glob("cpu-np*.csv")
                if f.stem.removeprefix("cpu-np").isdigit()}
        if not have:
            raise SystemExit(f"error: --cpu-share: no {COLLECTIVE_CPU}/cpu-np<N>.csv; "
                             "give --collective-cpu CPU.csv")
        path = have[min(have, key=lambda k: (abs(k - n), k))]
    points = {}
    try:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                key = CPU_CASES.get(r["collective"])
                cpu, nbytes = _num(r["cpu_ms"]) / 1e3, _num(r["input_bytes"])
                if key and math.isfinite(cpu) and cpu >= 0 and nbytes > 0:
                    points.setdefault(key, {}).setdefault(nbytes, []).append(cpu)
    except (OSError, KeyError) as e:
        raise SystemExit(f"error: --collective-cpu {path}: {e!r}") from None
    if not points:
        raise SystemExit(f"error: --collective-cpu {path}: no collective's CPU in it")
    out = {}
    for key, by_size in points.items():
        sizes = [(b, statistics.median(v)) for b, v in sorted(by_size.items())]
        out[key] = (affine.fit_affine(sizes) if len(sizes) > 1
                    else affine.Affine(0.0, sizes[0][1] / sizes[0][0]))
    return out, path


def links_from_fit(path, n):
    """{collective: Link} from a fit JSON ({"fits": [{collective, n, alpha_s, beta_s_per_byte}]}):
    the fit at n ranks where there is one, else the one pooled over n."""
    try:
        fits = json.loads(Path(path).read_text())["fits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: --link-fit {path}: {e}") from None
    out = {}
    for want_n in (None, n):              # pooled first, then the exact n overrides it
        for f in fits:
            if f.get("n") == want_n and f.get("collective") != "all" and f.get("beta_s_per_byte"):
                out[f["collective"]] = Link(float(f["alpha_s"]), float(f["beta_s_per_byte"]))
    if "allreduce" not in out:
        raise SystemExit(f"error: --link-fit {path}: no allreduce fit for n = {n}")
    return out


def build(args):
    """The Measurements for this model, link and rank count, and notes on where they came from."""
    fwd_bwd, other, codecs, ranks = pace_and_codecs(args.step_results, args.model, args.nodes)
    if args.compute is not None:
        fwd_bwd = args.compute
    backward = fwd_bwd * BACKWARD_SHARE
    names = model_buckets(args.model)
    ready = ready_times(args.model, backward)
    buckets = [pl.Bucket(name, 4 * count, t) for (name, count, _), t in zip(names, ready)]
    if args.link_fit:
        links, link_text = links_from_fit(args.link_fit, args.nodes), f"fitted ({args.link_fit})"
    else:
        l = Link.from_bandwidth(args.latency, args.bandwidth)
        links = {c: l for c in ("allreduce", "allgather", "alltoall")}
        link_text = (f"{units.format_rate(args.bandwidth)}, alpha {units.format_time(args.latency)}"
                     " per message, every collective")
    errors = bucket_errors(args.errors, args.model)
    cpu, cpu_text = {}, "collectives' CPU: not counted (--cpu-share 0)"
    if args.cpu_share:
        cpu, where = collective_cpu(args.collective_cpu, args.nodes)
        cpu_text = (f"collectives' CPU: {args.cpu_share:g} x a + b*bytes per collective from "
                    f"{where}, where a collective runs during backward")
    m = pl.Measurements(args.nodes, buckets, backward, links, codecs, errors,
                        fixed_s=fwd_bwd - backward + other, links_cpu=cpu,
                        cpu_share=args.cpu_share)
    notes = [f"link: {link_text}",
             f"compute: forward+backward {units.format_time(fwd_bwd)}"
             + (" (--compute)" if args.compute is not None else
                f" ({args.step_results}, {ranks} ranks)")
             + f", backward {BACKWARD_SHARE:.2f} of it; update and the rest "
               f"{units.format_time(other)}",
             f"codec costs: {args.step_results} ({ranks} ranks), a + b*bytes per scheme",
             cpu_text,
             f"errors: {args.errors}" if errors else
             f"errors: none measured ({args.errors} missing): every lossy scheme refused"]
    return m, notes


def build_parser():
    p = argparse.ArgumentParser(prog="hvd-compress-plan",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", metavar="PLAN.json",
                   help="re-decide a job's plan from its plan_report() (plans/<cell>.json, or a "
                        "lab run's manifest.json) instead of asking before training")
    p.add_argument("--model", choices=["lab", "horovod", "basic"],
                   help="a lab network: lab (= horovod, 21,840 parameters) or basic (1.2 M)")
    p.add_argument("--nodes", type=int, metavar="N", help="ranks n (>= 1)")
    p.add_argument("--bandwidth", type=units.argument_type(units.parse_rate),
                   help="link rate, e.g. 100Mbit/s")
    p.add_argument("--latency", type=units.argument_type(units.parse_time),
                   help="alpha per message, e.g. 1ms")
    p.add_argument("--link-fit", metavar="FIT.json",
                   help="per-collective alpha and beta fitted at this n (bench_fit.json form) "
                        "instead of --bandwidth/--latency")
    p.add_argument("--compute", type=units.argument_type(units.parse_time),
                   help="forward+backward per step (default: from --step-results)")
    p.add_argument("--step-results", default=str(STEP_RESULTS), metavar="SUMMARY.csv")
    p.add_argument("--errors", default=str(ERRORS), metavar="ERRORS.csv")
    p.add_argument("--cpu-share", type=float, default=0.0, metavar="S",
                   help="backward seconds one second of a collective's CPU costs: the ranks' "
                        "compute threads per core where they fill every core (4 ranks of one "
                        "thread on 2 cores: 2); default 0, a core to spare")
    p.add_argument("--collective-cpu", metavar="CPU.csv",
                   help="each collective's CPU per call (the collective CPU benchmark's CSV; "
                        "default: the package's cpu-np<N>.csv, the nearest N)")
    p.add_argument("--margin", type=float,
                   help=f"tie margin (default {pl.TIE_MARGIN}; with --report, the job's)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report:
        given = [f for f in ("model", "nodes", "bandwidth", "latency", "link_fit", "compute")
                 if getattr(args, f) is not None] + (["cpu_share"] if args.cpu_share else [])
        if given:
            parser.error("--report re-decides from the job's own measurements; it takes no "
                         + ", ".join("--" + f.replace("_", "-") for f in given))
        return explain(args.report, args.format, args.margin)
    if args.model is None or args.nodes is None:
        parser.error("give --model and --nodes (or --report PLAN.json)")
    args.model = "horovod" if args.model == "lab" else args.model
    args.margin = pl.TIE_MARGIN if args.margin is None else args.margin
    if args.nodes < 1:
        parser.error("--nodes must be >= 1")
    if not (math.isfinite(args.cpu_share) and args.cpu_share >= 0):
        parser.error(f"--cpu-share must be finite and >= 0, got {args.cpu_share!r}")
    if not args.link_fit and (args.bandwidth is None or args.latency is None):
        parser.error("give --bandwidth and --latency, or --link-fit FIT.json")
    try:
        m, notes = build(args)
        plan = pl.search(m, margin=args.margin)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    rows = fixed_steps(m, pl.DEFAULT_CANDIDATES)
    timeline = pl.predict(m, plan.schemes)
    if args.format == "json":
        print(json.dumps({"model": args.model, "n": args.nodes, "notes": notes,
                          "fixed": {t: s for t, s in rows}, "plan": plan.as_dict(),
                          "buckets": [dict(name=b.name, bytes=b.nbytes, ready_s=b.ready_s,
                                           scheme=s, leaves_s=lv, done_s=d)
                                      for b, s, lv, d in zip(m.buckets, plan.schemes,
                                                             timeline.leaves_s, timeline.done_s)]},
                         indent=2))
        return 0
    print(f"{args.model} net, n = {args.nodes}")
    for note in notes:
        print("  " + note)
    print_tables(m, plan, timeline, rows, args.margin)
    return 0


def fixed_steps(m, candidates):
    """[(label, predicted step)] of each candidate on every bucket, float32 and the schemes
    whose codec cost was measured (the others cannot be predicted)."""
    return [(t, pl.predict(m, pl.fixed_plan(m, t)).step_s) for t in candidates
            if t == "none:allreduce" or t in m.codecs]


def print_tables(m, plan, timeline, fixed, margin):
    """Every fixed plan's predicted step beside the plan's, and the plan's timeline per bucket."""
    base = dict(fixed).get("none:allreduce", math.nan)
    print()
    print("| scheme | predicted step | vs none |")
    print("|---|---:|---:|")
    for t, s in fixed:
        print(f"| {t} | {s * 1e3:.2f} ms | {s / base:.3f}x |")
    print(f"| **plan** | {plan.predicted_s * 1e3:.2f} ms | {plan.predicted_s / base:.3f}x |")
    print()
    if m.needed_s is None:
        print("| bucket | fp32 bytes | ready | scheme | leaves | exchange done |")
        print("|---|---:|---:|---|---:|---:|")
        for b, s, lv, d in zip(m.buckets, plan.schemes, timeline.leaves_s, timeline.done_s):
            print(f"| {b.name} | {b.nbytes:,} | {b.ready_s * 1e3:.2f} ms | {s} | {lv * 1e3:.2f} ms "
                  f"| {d * 1e3:.2f} ms |")
    else:               # schedule="overlap": when the next forward needs and applies each
        print("| bucket | fp32 bytes | ready | scheme | leaves | exchange done "
              "| next forward needs it (after step()) | applied |")
        print("|---|---:|---:|---|---:|---:|---:|---:|")
        for b, s, lv, d, nd, ap in zip(m.buckets, plan.schemes, timeline.leaves_s,
                                       timeline.done_s, m.needed_s, timeline.applied_s):
            print(f"| {b.name} | {b.nbytes:,} | {b.ready_s * 1e3:.2f} ms | {s} | {lv * 1e3:.2f} ms "
                  f"| {d * 1e3:.2f} ms | {nd * 1e3:.2f} ms | {ap * 1e3:.2f} ms |")
    print(f"\nbackward ends {timeline.backward_end_s * 1e3:.2f} ms (encodes included); "
          f"fastest allowed plan {plan.fastest_s * 1e3:.2f} ms; tie margin {margin * 100:g}%; "
          f"search {'exact' if plan.exact else 'not proven optimal (docs/planner.md, The search)'}")
    for (b, t), why in sorted(plan.refused.items()):
        print(f"refused: {b} {t}: {why}")


def read_report(path):
    """The records.PlanReport in PLAN.json: the report itself, or a lab manifest holding it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --report {path}: {e}") from None
    report = data.get("plan_report", data) if isinstance(data, dict) else None
    try:
        return records.PlanReport.from_dict(report)
    except ValueError as e:
        raise SystemExit(f"error: --report {path}: {e}") from None


def explain(path, fmt="table", margin=None):
    """--report: the job's plan beside the plan re-decided from its record (with `margin`, what
    another tie margin would have taken), every fixed plan's predicted step on the same inputs,
    and the plan's timeline."""
    report = read_report(path)
    try:
        m, busy, plan = inputs.replay(report, margin)
    except ValueError as e:
        raise SystemExit(f"error: --report {path}: {e}") from None
    labels = report.labels
    fixed = fixed_steps(m, report.settings.get("candidates", pl.DEFAULT_CANDIDATES))
    timeline = pl.predict(m, plan.schemes)
    trial = report.trial
    job_margin = report.settings.get("margin", pl.TIE_MARGIN)
    same = list(plan.schemes) == labels
    rival = trial is not None and trial.chosen not in (None, "plan")   # trial.Contender("plan")
    measured = report.measurements
    out = {"report": str(path), "n": m.n, "schedule": m.schedule, "busy_factor": busy,
           "measured_on": None if measured.measured_on is None else list(measured.measured_on),
           "measured_step_s": measured.measured_step_s,
           "job": {"plan": labels, "predicted_s": report.predicted_s,
                   "measured_s": report.measured_s,
                   "chosen_by": f"trial: {trial.reason}" if rival else "the search"},
           "replayed": dict(plan.as_dict(), same_as_job=same),
           "fixed": {t: v for t, v in fixed},
           "links": {c: {"alpha_s": f.alpha, "beta_s_per_byte": f.beta}
                     for c, f in sorted(m.links.items())},
           "buckets": [dict(name=b.name, bytes=b.nbytes, ready_s=b.ready_s, scheme=s,
                            leaves_s=lv, done_s=d)
                       for b, s, lv, d in zip(m.buckets, plan.schemes, timeline.leaves_s,
                                              timeline.done_s)]}
    if fmt == "json":
        print(json.dumps(out, indent=2))
        return 0
    ms = 1e3
    print(f"{path}: n = {m.n}, {len(m.buckets)} buckets, priced on schedule={m.schedule!r}")
    print(f"  pace: backward {m.backward_s * ms:.2f} ms, the rest of the step "
          f"{m.fixed_s * ms:.2f} ms (measured on {' '.join(measured.measured_on or [])}, "
          f"step {measured.measured_step_s * ms:.2f} ms)")
    print(f"  links as the step runs them: timed alone, x {busy:.3f} (the busy factor that "
          "predicts that step); bytes as costmodel.fit counts them")
    for c, f in sorted(m.links.items()):
        print(f"    {c}: alpha {f.alpha * ms:.3f} ms, {1 / f.beta / 1e6:.2f} MB/s")
    predicted, measured_s = report.predicted_s, report.measured_s
    shift = trial.fixed_shift_s if trial is not None else 0.0
    print(f"  the job's plan: {' '.join(labels)}, predicted {predicted * ms:.2f} ms"
          + (f" (the trial's shift of the fixed time, {shift * ms:+.2f} ms, included)"
             if shift else "") + f", measured {measured_s * ms:.2f} ms")
    print(f"  re-decided:     {' '.join(plan.schemes)}, predicted {plan.predicted_s * ms:.2f} ms"
          + ("" if same else "  (not the job's: "
             + (f"--margin {margin:g}, the job's {job_margin:g})" if margin is not None
                else f"its trial adopted a rival: {trial.reason})" if rival
                else "decided by another version of the planner?)")))
    print_tables(m, plan, timeline, fixed, job_margin if margin is None else margin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
