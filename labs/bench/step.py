#!/usr/bin/env python
"""Training-step benchmark: stock `hvd.DistributedOptimizer` against ours, side by side.

    python -m labs.bench.step                     # the whole grid: 16 cells (an hour or more)
    python -m labs.bench.step --models lab --links loopback --ranks 2 --steps 5

For every (model, link, ranks) -- a cell -- one Horovod job is started (over an emulated link
from labs.netem where a rate is given, which needs root, else loopback). Inside it every
row -- stock none and fp16, ours none / fp16 / bit16 / bit8 (allgather and two-phase), and
ours:auto, the per-bucket plan the optimizer measures and chooses itself (Compression.auto,
docs/planner.md) -- trains its own copy of the model on the same synthetic MNIST-shaped batches,
in interleaved rounds, so every ratio is measured in the same run on the same machine state.

Rows beyond the grid's (--rows): `local`, the same model trained with no exchange (forward,
backward and the optimizer's update: the compute floor), and `ours:SCHEME[:ROUTE]+overlap`,
the optimizer given the model, which overlaps by default (a bucket's parameters updated as it
arrives, the next forward waiting per layer; the other rows of ours pass schedule="wait"; `ours:auto+overlap` plans on that schedule, its plan report in
plans/<cell>-overlap.json), and `ours:SCHEME[:ROUTE]+whole+overlap`, the same with no bucket
cut into chunks (prioritise=False: what the chunks buy, measured beside them). With a local row, summary.csv gives every row its bound (issue 46):
bound_ms = max(floor_ms, the local row's step; wire_ms, the row's bytes a step at the link's
rate, none over loopback) and step_over_bound.

Links: loopback; 1gbit and 100mbit; 10mbit, a cross-site link, where the basic net's float32
step takes ~4 s at 2 ranks and compression has the most to win.

Steps: each row's timed steps come in rounds, every row once a round. After --rounds rounds
more are run, up to --max-rounds, while any row's median is not yet known to --target-spread
(3%, issue 25's): a row's spread (median_ci_pct in summary.csv) is the width of the 95%
confidence interval of its median step across its rounds (distribution-free: order statistics
of the round medians), in % of the median; it shrinks as rounds are added, so running longer
can reach it. round_spread_pct, the largest minus the smallest round median, is said beside it:
it is the spread of one round, which more rounds never shrink. Defaults (STEPS): the lab net
10 steps a round, 10 to 40 rounds; the basic net 5 steps a round, 8 to 30 rounds, and at
10mbit 3 steps, 6 to 10 rounds (a step there takes 1-7 s). --steps (a row's steps in its first
--rounds rounds), --rounds and --max-rounds set every cell alike.

ours:auto: before the timed rounds its warm-up goes on until every rank has decided, a plan or
a fallback to float32 (at most --auto-warmup-max steps, its trial steps included, else the
cell fails and says so); those steps are not timed as the row's steps, but their number and
wall time, the calibration seconds the optimizer reports and the outcome ("planned" or its
"fallback: why") are in calibration.csv and on the row of summary.csv (auto_warmup_steps,
auto_warmup_s, calibration_s, auto_outcome), and its plan_report() in plans/<cell>.json. Its
timed steps include whatever re-planning the optimizer does (plan_event in steps.csv).

Writes OUT/steps.csv (one row per timed step of rank 0, with the plan it ran under for auto),
OUT/calibration.csv, OUT/plans/, OUT/summary.csv (per row: median step and its split, p10/p90,
the spreads, the plan and its predicted step, ratios to stock float32 and fp16 and to the
cell's fastest fixed row, stock or ours: vs_fastest, fastest_row; and the ratios to the
fastest row and to stock float32 taken round by round, vs_fastest_paired and
vs_stock_none_paired with their 95% intervals _lo and _hi: see paired_ratio; what the machine
and the link allow, bound_ms, and each row's step over it: see bounds; an overlapped row's
steady state, steady_ms: see summarise) and OUT/summary.png; then
`python -m labs.bench.wins_losses OUT/summary.csv` counts wins and losses. Models: `lab`, Horovod's
example network of the lab (21,840 parameters); `basic`, pytorch/examples' mnist network (1.2 M).

The statistics of rounds and the grid's arguments are labs/bench/rounds.py's, shared with
labs/bench/ddp.py.
"""
import argparse
import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

# the statistics are rounds.py's; named here too, as the summary's columns are (noqa: F401)
from labs.bench.rounds import (TARGET_SPREAD_PCT, add_grid_arguments, another_round,  # noqa: F401
                               check_grid, median, median_ci_pct, netem_command, paired_ratio,
                               round_spread_pct, worker_command)

# The default grid's rows; known_rows() lists every row --rows takes (the registry's schemes).
ROWS = ["stock:none", "stock:fp16", "ours:none", "ours:fp16", "ours:bit16:alltoall",
        "ours:bit8:allgather", "ours:bit8:alltoall", "ours:auto"]
AUTO_ROW = "ours:auto"
LOCAL_ROW = "local"       # the same model, forward + backward + update, no exchange: the floor
OVERLAP = "+overlap"      # a row of ours with schedule="overlap" (updates as buckets arrive)
WHOLE = "+whole"          # before +overlap: no bucket cut into chunks (prioritise=False)
STOCK_ROWS = ("stock:none", "stock:fp16")     # Horovod's own optimizer and compressions
LINKS = {"loopback": None, "1gbit": "1gbit", "100mbit": "100mbit", "10mbit": "10mbit"}
SPLIT = ["forward_backward_ms", "copy_ms", "compress_ms", "communicate_ms", "decompress_ms", "overlap_ms"]
PLAN = ["plan", "plan_predicted_ms", "plan_measured_ms", "plan_event"]
STEP_COLUMNS = ["model", "link", "ranks", "row", "round", "step", "step_ms"] + SPLIT + [
    "bytes_sent"] + PLAN
CALIBRATION_COLUMNS = ["model", "link", "ranks", "row", "auto_warmup_steps", "auto_warmup_s",
                       "calibration_s", "auto_outcome", "plan"]
# (steps a round, first rounds, most rounds) per (model, link); "*" for any other.
STEPS = {("*", "*"): (5, 8, 30), ("lab", "*"): (10, 10, 40), ("basic", "10mbit"): (3, 6, 10)}
CELL = ["model", "link", "ranks"]


def known_rows():
    """Every row --rows takes: Horovod's own (stock:none, stock:fp16), each scheme the registry
    holds (plugins of $HVD_COMPRESS_SCHEMES included) at its default route and, where it has
    several, on each ('ours:bf16', 'ours:bf16:allgather'), and ours:auto."""
    from hvd_compress import registry
    rows = list(STOCK_ROWS)
    for entry in registry.schemes().values():
        rows.append(f"ours:{entry.name}")
        if len(entry.routes) > 1:
            rows += [f"ours:{entry.name}:{route.value}" for route in entry.routes]
    rows += [AUTO_ROW]
    overlapped = [r + OVERLAP for r in rows if r.startswith("ours:")]
    whole = [r.removesuffix(OVERLAP) + WHOLE + OVERLAP for r in overlapped if r != AUTO_ROW + OVERLAP]
    return rows + overlapped + whole + [LOCAL_ROW]


def is_auto(row):
    """ours:auto, waiting or overlapped (ours:auto+overlap): a row that plans itself."""
    return row.removesuffix(OVERLAP) == AUTO_ROW


def plans_name(model, link, n, row):
    """plans/<this>: the auto row's plan report in a cell (the overlapped one's "-overlap")."""
    return f"{model}-{link}-n{n}{'-overlap' if row.endswith(OVERLAP) else ''}.json"


def method_parameter(text):
    """(scheme, parameter) of a row's scheme: 'topk0.1' -> ('topk', 0.1), 'powersgd4' ->
    ('powersgd', 4) for a method that takes one (registry.Scheme.parameter, of the same type),
    ('bit8', None) for the rest; None when the text names no registered scheme."""
    from hvd_compress import registry
    known = registry.schemes()
    if text in known:
        return text, None
    for name, entry in known.items():
        if entry.parameter is None or not text.startswith(name):
            continue
        try:
            value = type(entry.parameter)(text[len(name):])
        except ValueError:
            continue
        return (name, value) if value > 0 else None
    return None


def parameter_row(row):
    """Is `row` ours:<method><parameter>[:route][+overlap] (a method at another parameter than
    its default: ours:topk0.1, ours:powersgd4)?"""
    who, _, rest = row.partition(":")
    found = method_parameter(rest.removesuffix(OVERLAP).removesuffix(WHOLE).split(":")[0])
    return who == "ours" and found is not None and found[1] is not None


def row_compression(row):
    """(compression, route) of a fixed row of ours: the scheme's registry entry, a method at its
    default parameter (top-k's ratio, PowerSGD's rank) or at the row's (ours:topk0.1)."""
    from hvd_compress import registry
    _, text, *route = row.removesuffix(OVERLAP).removesuffix(WHOLE).split(":")
    name, value = method_parameter(text)
    entry = registry.scheme(name)
    compression = entry.load()
    if entry.parameter is not None:
        compression = compression(entry.parameter if value is None else value)
    return compression, route[0] if route else None


def cell_steps(model, link, steps=None, rounds=None, max_rounds=None):
    """(steps a round, first rounds, most rounds) of a cell. The defaults (STEPS) go on past
    their first rounds while a row's spread is over the target; --steps N (a row's steps in
    its first rounds, at most one round a step) or --rounds R run exactly that, unless
    --max-rounds allows more."""
    per_round, first, most = STEPS.get((model, link), STEPS.get((model, "*"), STEPS[("*", "*")]))
    if steps is not None or rounds is not None:
        first = rounds if rounds is not None else min(first, steps)
        per_round = max(1, steps // first) if steps is not None else per_round
        most = first
    if max_rounds is not None:
        most = max_rounds
    return per_round, first, max(first, most)


# ---- inside one Horovod job -------------------------------------------------------------------
def make_model(name):
    """The lab's two networks (labs/mnist.py --model): Horovod's example, pytorch/examples'."""
    from labs.mnist import MODELS
    return MODELS["horovod" if name == "lab" else name]()


def make_optimizer(row, model, trial_steps=0):
    import torch
    import horovod.torch as hvd
    import hvd_compress as hc
    from labs.kit.flags import auto_compression
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    if row == LOCAL_ROW:
        return sgd
    who, scheme, *_ = row.split(":")
    if who == "stock":
        return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                        compression=getattr(hvd.Compression, scheme))
    if is_auto(row):
        compression, route = auto_compression()(trial_steps=trial_steps), None
    else:
        compression, route = row_compression(row)
    return hc.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                   compression=compression, route=route,
                                   **schedule_options(row, model))


def schedule_options(row, model):
    """The optimizer's schedule for a row of ours: +overlap the model given (overlapped, as by
    default), +whole+overlap with every bucket whole (prioritise=False: what the chunks buy,
    beside them); any other row the waiting schedule."""
    if not row.endswith(OVERLAP):
        return {"schedule": "wait"}
    return {"model": model, "prioritise": not row.endswith(WHOLE + OVERLAP)}


def stock_bytes_sent(row, model, n):
    """Bytes a rank sends a step under Horovod's own optimizer (ring allreduce of float32 or
    float16), the communicators' count (routes.horovod_bytes_sent); 0 for the local row."""
    if row == LOCAL_ROW:
        return 0
    item = 2 if row == "stock:fp16" else 4
    return sum(2 * (n - 1) * p.numel() * item // n for p in model.parameters())


def plan_fields(row, stats):
    """A step's plan columns: auto's from pop_stats() (a missing key is an error, never a
    blank), empty for a fixed row."""
    if not is_auto(row):
        return {"plan": "", "plan_predicted_ms": math.nan, "plan_measured_ms": math.nan,
                "plan_event": ""}
    from labs.kit.recorder import plan_columns      # the lab's steps.csv columns, the same
    return plan_columns(stats)


def worker(args):
    import torch
    import torch.nn.functional as F
    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    rank, n = hvd.rank(), hvd.size()
    rows = {}
    for row in args.rows.split(","):
        torch.manual_seed(0)
        model = make_model(args.model)
        rows[row] = (model, make_optimizer(row, model, args.auto_trial_steps))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(args.batch_size, 1, 28, 28, generator=g),
             torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(4)]

    def step(model, opt, i, last=False):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        if last and hasattr(opt, "flush"):
            # schedule="overlap": the round's last step waits for its own updates, so that no
            # row's exchange runs on into the other rows' turns uncounted
            opt.flush()
        t2 = time.perf_counter()
        return t0, t1, t2, opt.pop_stats() if hasattr(opt, "pop_stats") else {}

    def warm_up_auto(model, opt):
        """Steps until this rank has decided (a plan, or a fallback to float32, which the
        optimizer says in plan_event): (steps, seconds, outcome, the report). Every rank
        decides at the same step (the decision is broadcast), so no collective is added to
        the warm-up's steps: they are what the optimizer measures its fixed time on. One
        check after it says that the ranks did agree."""
        start, outcome = time.perf_counter(), ""
        for i in range(args.auto_warmup_max):
            *_, stats = step(model, opt, i)
            fields = plan_fields(AUTO_ROW, stats)
            if "fallback" in fields["plan_event"]:
                outcome = fields["plan_event"]
            if fields["plan"] or outcome:
                opt.flush()              # overlapped: its last exchange not into the next row's
                seconds = time.perf_counter() - start
                steps = torch.tensor([float(i + 1)])
                lo = hvd.allreduce(steps, op=hvd.Min, name="auto_decided.min").item()
                hi = hvd.allreduce(steps, op=hvd.Max, name="auto_decided.max").item()
                if lo != hi:
                    raise RuntimeError(f"ours:auto: the ranks decided after {lo:g} to {hi:g} "
                                       f"warm-up steps; the decision must be broadcast")
                return i + 1, seconds, outcome or "planned", opt.plan_report()
        raise RuntimeError(f"ours:auto neither planned nor fell back in {args.auto_warmup_max} "
                           f"warm-up steps (--auto-warmup-max)")

    out = open(args.csv, "a", newline="") if rank == 0 else None
    writer = csv.writer(out) if out else None
    times = {row: ([], []) for row in rows}          # rank 0's step_ms and rounds, per row
    bytes_of = {row: stock_bytes_sent(row, model, n) for row, (model, _) in rows.items()
                if row == LOCAL_ROW or row in STOCK_ROWS}
    rnd = 0
    while True:                                     # round 0 warms every row up
        for row, (model, opt) in rows.items():
            hvd.allreduce(torch.zeros(1), name="barrier")
            if rnd == 0 and is_auto(row):
                count, seconds, outcome, report = warm_up_auto(model, opt)
                if rank == 0:
                    write_calibration(args, n, row, count, seconds, outcome, report)
                continue
            # the other rows ran since this one's last step: not a step of its own (auto
            # would read the whole round into its next step and re-plan on drift not there)
            if hasattr(opt, "pause_step_clock"):     # ours (stock Horovod's has none)
                opt.pause_step_clock()
            count = args.per_round if rnd else args.warmup
            for i in range(count):
                t0, t1, t2, stats = step(model, opt, i, last=i == count - 1)
                if rnd and writer:
                    plan = plan_fields(row, stats)
                    writer.writerow([args.model, args.link, n, row, rnd, i, 1e3 * (t2 - t0),
                                     1e3 * (t1 - t0 - stats.get("in_backward_s", 0.0)),
                                     *(1e3 * stats.get(k, math.nan) for k in (
                                         "copy_s", "compress_s", "communicate_s", "decompress_s",
                                         "overlap_s")),
                                     stats.get("bytes_sent", bytes_of.get(row, math.nan)),
                                     *plan.values()])
                    times[row][0].append(1e3 * (t2 - t0))
                    times[row][1].append(rnd)
        if rank == 0:
            print(f"[bench_step] {args.model} {args.link} n={n}: round {rnd}", flush=True)
            out.flush()
        more = another_round(times, rnd, args) if rank == 0 else 0.0
        more = hvd.broadcast(torch.tensor([more]), root_rank=0, name=f"more.{rnd}").item()
        if not more:
            break
        rnd += 1
    for row in [r for r in rows if is_auto(r)] if rank == 0 else []:
        plans = Path(args.csv).parent / "plans"
        plans.mkdir(exist_ok=True)
        (plans / plans_name(args.model, args.link, n, row)).write_text(
            json.dumps(rows[row][1].plan_report().to_dict(), indent=2, default=str) + "\n")
    if out:
        out.close()


def write_calibration(args, n, row, count, seconds, outcome, report):
    """One line of calibration.csv: an auto row's warm-up until it decided, and what it
    reports."""
    calibration = report.calibration_s if report is not None else math.nan
    plan = " ".join(report.labels) if report is not None else ""
    with open(Path(args.csv).parent / "calibration.csv", "a", newline="") as stream:
        csv.writer(stream).writerow([args.model, args.link, n, row, count, seconds,
                                     calibration, outcome, plan])


# ---- the driver ---------------------------------------------------------------------------------
def launch(args, model, link, n, csv_path):
    from labs.kit.launch import horovodrun_command, launch_env
    per_round, first, most = cell_steps(model, link, args.steps, args.rounds, args.max_rounds)
    if per_round < 3 and any(r.endswith("+overlap") for r in args.rows):
        print(f"[bench_step] {model} {link} n={n}: {per_round} step(s) a round, so an overlapped "
              f"row has no steady_ms (3 or more needed); --steps counts a row's steps over its "
              f"first {first} rounds", file=sys.stderr, flush=True)
    cmd = worker_command("labs.bench.step", args, model, link, per_round, first, most, csv_path)
    if LINKS[link]:
        cmd = netem_command(n, LINKS[link], args.timeout, cmd)
    else:
        cmd = horovodrun_command(n, cmd, "gloo")
    subprocess.run(cmd, env=launch_env(), check=True, timeout=args.timeout + 60)


def summarise(steps, calibration=None):
    """One row per (model, link, ranks, row) from steps.csv's frame (and calibration.csv's)."""
    import pandas as pd
    keys = CELL + ["row"]
    summary = steps.groupby(keys, sort=False).agg(
        steps=("step_ms", "size"), rounds=("round", "nunique"), step_ms=("step_ms", "median"),
        step_p10_ms=("step_ms", lambda s: s.quantile(0.1)), step_p90_ms=("step_ms", lambda s: s.quantile(0.9)),
        **{c: (c, "median") for c in SPLIT if c in steps}, bytes_per_step=("bytes_sent", "median")).reset_index()
    groups = steps.groupby(keys, sort=False)
    summary["round_spread_pct"] = [round_spread_pct(g.step_ms.tolist(), g["round"].tolist())
                                   for _, g in groups]
    summary["median_ci_pct"] = [median_ci_pct(g.step_ms.tolist(), g["round"].tolist())
                                for _, g in groups]
    # the median over rounds of each round's mean step: counts each exchange once where a step's
    # exchange runs on into the next (schedule="overlap": a round's first step starts with
    # nothing pending, its last waits for its own updates), which the median of steps does not
    summary["round_mean_ms"] = [g.groupby("round").step_ms.mean().median() for _, g in groups]
    # ... and an overlapped row's steady state: the median over rounds of the mean of each
    # round's middle steps (its first and last left out), each of which starts with the step
    # before's exchange pending and leaves its own pending, as in a training run. The round
    # mean charges the round's flush (the last exchange's overlap with a next forward, lost)
    # to its few steps: a run pays it once.
    summary["steady_ms"] = [steady_ms(g) for _, g in groups]
    # issue 12's "codec time per step": compress + decompress (hooks included), as a percentage
    # of forward+backward, medians over the row's steps
    codec = (steps.compress_ms + steps.decompress_ms).groupby(
        [steps[k] for k in keys], sort=False).median()
    summary["codec_pct_of_fwd_bwd"] = [
        100 * codec.get(tuple(k), math.nan) / fb
        for k, fb in zip(summary[keys].values, summary.forward_backward_ms)]
    summary = summary.join(plan_summary(steps, keys), on=keys)
    for base in ("stock:none", "stock:fp16"):
        ref = summary[summary.row == base].set_index(CELL)["step_ms"]
        summary[f"vs_{base.replace(':', '_')}"] = [
            s / ref.get(tuple(k), math.nan) for s, k in zip(summary.step_ms, summary[CELL].values)]
    # the fastest fixed row of each cell (stock or ours, any scheme; auto is what is judged)
    fixed = summary[~summary.row.map(is_auto) & (summary.row != LOCAL_ROW)]
    fastest = fixed.loc[fixed.groupby(CELL, sort=False).step_ms.idxmin()].set_index(CELL)
    cells = [tuple(k) for k in summary[CELL].values]
    summary["fastest_row"] = [fastest.row.get(k, "") for k in cells]
    summary["vs_fastest"] = [s / fastest.step_ms.get(k, math.nan)
                             for s, k in zip(summary.step_ms, cells)]
    # the same two ratios round by round (paired_ratio), with their 95% intervals
    by_row = {key: (g.step_ms.tolist(), g["round"].tolist()) for key, g in groups}
    for name, base_of in (("vs_fastest_paired", lambda k: fastest.row.get(k, "")),
                          ("vs_stock_none_paired", lambda k: "stock:none")):
        paired = [paired_ratio(*by_row[(*k, row)], *by_row.get((*k, base_of(k)), ([], [])))
                  for k, row in zip(cells, summary.row)]
        summary[name], summary[f"{name}_lo"], summary[f"{name}_hi"] = (
            [p[i] for p in paired] for i in range(3))
    summary = summary.join(bounds(summary), on=keys)
    if calibration is not None and len(calibration):
        summary = summary.merge(calibration[keys + ["auto_warmup_steps", "auto_warmup_s",
                                                    "calibration_s", "auto_outcome"]],
                                on=keys, how="left")
    else:
        summary = summary.assign(auto_warmup_steps=math.nan, auto_warmup_s=math.nan,
                                 calibration_s=math.nan, auto_outcome="")
    return summary


def link_rate(link):
    """The cell's link in bits a second (netem's reading of its rate), None for loopback (no
    emulated link: its wire time is not counted)."""
    from labs.netem.links import parse_rate
    return parse_rate(LINKS[link]) if LINKS.get(link) else None


def steady_ms(row_steps):
    """The median over rounds of each round's middle steps' mean (rounds of 3 steps or more;
    NaN where none has them): summarise's steady_ms."""
    means = []
    for _, rnd in row_steps.groupby("round"):
        order = rnd.sort_values("step").step_ms.tolist()
        if len(order) >= 3:
            means.append(sum(order[1:-1]) / (len(order) - 2))
    return median(means) if means else math.nan


def bounds(summary):
    """Per row, what the machine and the link allow (issue 46): floor_ms, the local row's median
    step in the cell (forward, backward and the update, no exchange); wire_ms, the row's bytes
    a step at the cell's link rate (none over loopback); bound_ms = max(floor, wire) and
    step_over_bound, the row's median step over it, round_mean_over_bound its round_mean_ms
    over it and steady_over_bound its steady_ms (the one to read for an overlapped row; the
    round mean is the same plus the round's flush shared out; NaN without a local row)."""
    import pandas as pd
    keys = CELL + ["row"]
    floor = summary[summary.row == LOCAL_ROW].set_index(CELL)["step_ms"]
    rows = []
    for _, r in summary.iterrows():
        cell = tuple(r[k] for k in CELL)
        rate = link_rate(r.link)
        wire = 8e3 * r.bytes_per_step / rate if rate and r.bytes_per_step == r.bytes_per_step \
            else 0.0
        low = floor.get(cell, math.nan)
        bound = max(low, wire) if low == low else math.nan
        rows.append(dict(zip(keys, (*cell, r.row)), floor_ms=low, wire_ms=wire, bound_ms=bound,
                         step_over_bound=r.step_ms / bound if bound == bound else math.nan,
                         round_mean_over_bound=r.round_mean_ms / bound if bound == bound
                         else math.nan,
                         steady_over_bound=r.steady_ms / bound if bound == bound else math.nan))
    return pd.DataFrame(rows).set_index(keys)


def plan_summary(steps, keys):
    """Per row: the plan of its last timed step, the median predicted step over its timed steps
    (a re-planned row's mixes its plans, as its median step does), the last plan's own
    prediction and the optimizer's measured median since that plan was applied, and the
    re-plans and fallbacks among its events (empty and NaN for fixed rows, and for a steps.csv
    from before the plan columns)."""
    import pandas as pd
    rows = []
    for key, g in steps.groupby(keys, sort=False):
        plan = g["plan"].astype("string").fillna("") if "plan" in g else pd.Series([""] * len(g))
        events = (g["plan_event"].astype("string").fillna("") if "plan_event" in g
                  else pd.Series([""] * len(g)))
        planned = plan != ""
        rows.append(dict(zip(keys, key), plan=plan[planned].iloc[-1] if planned.any() else "",
                         plan_predicted_ms=g["plan_predicted_ms"][planned.values].median()
                         if planned.any() else math.nan,
                         plan_last_predicted_ms=g["plan_predicted_ms"][planned.values].iloc[-1]
                         if planned.any() else math.nan,
                         plan_measured_ms=g["plan_measured_ms"][planned.values].iloc[-1]
                         if planned.any() else math.nan,
                         plan_replans=int(events.str.contains("replanned",
                                                              regex=False).sum()),
                         plan_fallbacks=int(events.str.contains("fallback", regex=False).sum())))
    return pd.DataFrame(rows).set_index(keys)


def plot(summary, path, title=None):
    """One panel per (model, link, ranks), a row per model: each row's median step as a ratio
    to stock float32 in the same run, with its p10-p90 spread (these machines are noisy)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(summary.model))
    cells = list(dict.fromkeys(zip(summary.link, summary.ranks)))
    fig, axes = plt.subplots(len(models), len(cells), figsize=(2.6 * len(cells), 3.6 * len(models)),
                             sharey=True, squeeze=False)
    for i, model in enumerate(models):
        for j, (link, n) in enumerate(cells):
            ax = axes[i][j]
            frame = summary[(summary.model == model) & (summary.link == link) & (summary.ranks == n)]
            base = frame.step_ms / frame.vs_stock_none
            spread = [(frame.step_ms - frame.step_p10_ms) / base, (frame.step_p90_ms - frame.step_ms) / base]
            colors = ["#999" if r.startswith("stock") else "#ff7f0e" if is_auto(r)
                      else "#2ca02c" if r == LOCAL_ROW else "#1f77b4" for r in frame.row]
            ax.bar(range(len(frame)), frame.vs_stock_none, color=colors, yerr=spread, capsize=2)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks(range(len(frame)), [r.replace("ours:", "") for r in frame.row],
                          rotation=70, fontsize=7)
            ax.set_title(f"{model}, {link}, n={n}", fontsize=9)
        axes[i][0].set_ylabel("step / stock float32 (lower: faster)")
    fig.suptitle(title or "Training step, stock hvd.DistributedOptimizer (grey) vs hvd_compress "
                 "(blue; auto: orange), median and p10-p90, same run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def replot(out, title=None):
    """Redraw summary.csv and summary.png from steps.csv and calibration.csv (e.g. after
    merging runs)."""
    import pandas as pd
    out = Path(out)
    calibration = out / "calibration.csv"
    summary = summarise(pd.read_csv(out / "steps.csv"),
                        pd.read_csv(calibration) if calibration.is_file() else None)
    summary.to_csv(out / "summary.csv", index=False, float_format="%.4g")
    plot(summary, out / "summary.png", title)
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grid_arguments(p, ROWS, "results/step", LINKS, rows_help=(
        "comma-separated rows (default: the grid's); any of stock:none, stock:fp16, ours:auto "
        "and ours:SCHEME[:ROUTE] for every registered scheme, plugins included; a method at "
        "another parameter than its default: ours:topk0.1, ours:powersgd4"))
    args = p.parse_args(argv)
    if args.worker:
        return args
    known = known_rows()
    check_grid(p, args, LINKS, lambda r: r in known or parameter_row(r), known)
    if any(is_auto(r) for r in args.rows):
        from labs.kit.flags import auto_compression
        try:
            auto_compression()
        except RuntimeError as err:
            p.error(f"{AUTO_ROW}: {err} (or leave the row out: --rows)")
    return args


def run_cells(args, launch_cell, tag="bench_step"):
    """Every (model, link, ranks) cell of args, one job each by launch_cell(args, model, link,
    n, steps_csv), rank 0's steps appended to OUT/steps.csv (labs/bench/ddp.py shares this)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "steps.csv"
    csv_path.write_text(",".join(STEP_COLUMNS) + "\n")
    (out / "calibration.csv").write_text(",".join(CALIBRATION_COLUMNS) + "\n")
    for model in args.models:
        for link in args.links:
            for n in args.ranks:
                print(f"[{tag}] {model} over {link}, {n} ranks", flush=True)
                launch_cell(args, model, link, n, csv_path.resolve())
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    out = run_cells(args, launch)
    summary = replot(out)
    cols = ["model", "link", "ranks", "row", "step_ms", "median_ci_pct", "round_spread_pct",
            "rounds", "vs_stock_none",
            "vs_fastest", "forward_backward_ms", "communicate_ms", "codec_pct_of_fwd_bwd",
            "bytes_per_step", "wire_ms", "bound_ms", "step_over_bound", "round_mean_ms",
            "round_mean_over_bound", "steady_ms", "steady_over_bound", "plan", "plan_predicted_ms"]
    print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    over = summary[~(summary.median_ci_pct <= args.target_spread)]
    print(f"[bench_step] rows whose median is known to worse than {args.target_spread:g}% "
          f"(median_ci_pct): {len(over)} of {len(summary)}"
          + (f" (largest {over.median_ci_pct.max():.1f}%: {over.loc[over.median_ci_pct.idxmax(), 'row']})"
             if len(over) and over.median_ci_pct.notna().any() else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
