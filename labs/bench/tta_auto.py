"""Compression.auto(objective="time_to_accuracy") in the time-to-accuracy grid's cells, against
the best fixed method of each cell.

    python -m labs.bench.tta_auto --write-step-s --cells results/tta/step_times.csv \
        --front horovod|ddp --model lab --ranks 2 [--dir results/tta/auto/step_s]
    python -m labs.bench.tta_grid --out runs/tta-auto --models horovod --ranks 2 \
        --methods auto:tta-loopback,ddp:auto:tta-10mbit --seeds 42,1,2 \
        --targets-from results/tta/targets.csv --prefix /work/bin/cpu-shared
    python -m labs.bench.tta_auto --out runs/tta-auto --fixed results/tta/tta.csv \
        --csv results/tta/auto/auto.csv [--shadow-s shadow_cost.csv]
    /work/bin/cpu-quiet python -m labs.bench.tta_auto --shadow-cost --csv shadow_cost.csv

--write-step-s writes the injected step cells of every link, <link>.json for Horovod and
ddp-<link>.json for DDP (tta_grid.step_s_name), from a step_times.csv (or a step benchmark's
steps.csv of that front): "value" the fastest of the value plan's candidates' cells on the link
(hvd_compress.auto.candidates.DEFAULT_CANDIDATES: none, fp16, bit16 and bit8 by route), each of
convergence.DEFAULT_METHODS its own cell; a method without a cell is an error naming it, and
nothing is written.
--shadow-cost measures each method's shadow per step as auto runs it (at the sampled steps of
each window, convergence.sampled_positions), amortised over the window, and beside it the same
shadows at every step.
Each auto:tta-<link> run (ddp:auto:tta-<link> on DDP) trained over loopback with that link's
step cells injected (--auto-step-s: the modes' seconds per step), so its decisions are the
link's. Its time to a target is composed as labs/kit/tta.py composes a fixed method's, the
steps' part summed mode by mode: start-up + sum over its steps of the injected step of the mode
in force (the manifest's plan_report: objective.switches) + evaluations + epoch ends. The best
fixed method of the cell (network, ranks, link, target) is the fastest row of the grid's
tta.csv that is not auto, of both fronts (best_fixed), of the run's own front (best_front,
whose start-up, evaluations and epoch ends, as tta.csv composed them, give tta_like_best_s),
and of Horovod's (best_horovod).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from labs.bench import tta_grid
from labs.kit import runlog, tta


def modes_by_step(switches, steps):
    """The mode in force at each step 1..steps ("value" first; a switch at step s applies from
    step s + 1)."""
    out, mode, pending = [], "value", sorted((int(s[0]), s[2]) for s in switches)
    for step in range(1, steps + 1):
        while pending and pending[0][0] < step:
            mode = pending.pop(0)[1]
        out.append(mode)
    return out


def shadow_cost(model="horovod", methods=None, windows=3, warm=1, interval=None,
                samples=None):
    """Seconds per step of the shadows of `methods` (default: every default method) on
    `model`'s real gradients, in its auto buckets, amortised over a window: each step runs
    Shadows.observe as TimeToAccuracy does (its shadows at the window's sampled steps, their
    products at the step after, nothing at the others), and a window's cost is its steps'
    total over `interval`; the median of `windows` windows after `warm` untimed ones.
    samples == interval: the shadows at every step (the cost before sampling)."""
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    from hvd_compress.auto.convergence import (DEFAULT_METHODS, INTERVAL, SHADOW_SAMPLES,
                                               sampled_positions)
    from hvd_compress.auto.shadow import Shadows
    from hvd_compress.exchange.bucketing import DEFAULT_FUSION_BYTES
    from hvd_compress.exchange.fusion import Bucket
    from labs import mnist

    interval = INTERVAL if interval is None else interval
    at = sampled_positions(interval, SHADOW_SAMPLES if samples is None else samples)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = mnist.MODELS[model]()
    names, params = zip(*[(n, p) for n, p in net.named_parameters()][::-1])   # backward order
    buckets = [b for _, b in Bucket.plan(list(names), list(params), DEFAULT_FUSION_BYTES)]
    shadows = Shadows(methods or DEFAULT_METHODS)
    per_window = []
    for _ in range(warm + windows):
        spent = 0.0
        for position in range(interval):
            x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
            net.zero_grad()
            F.nll_loss(net(x), y).backward()
            grads = dict(net.named_parameters())
            flat = [torch.cat([grads[n].grad.reshape(-1) for n in b.names]) for b in buckets]
            began = time.perf_counter()
            shadows.observe(position in at, flat, flat, buckets)
            spent += time.perf_counter() - began
        per_window.append(spent / interval)
    return statistics.median(per_window[warm:])


def shadowed_by_step(windows, methods, steps):
    """The methods shadowed at each step 1..steps: all of them but those a window retired (its
    "retired" list applies from the step after it to the next window's end)."""
    out, retired = [], set()
    ends = sorted((int(w["step"]), set(w.get("retired", ()))) for w in windows)
    for step in range(1, steps + 1):
        while ends and ends[0][0] < step:
            retired = ends.pop(0)[1]
        out.append([m for m in methods if m not in retired])
    return out


def compose_auto(run_dir, step_s, target, shadow_s=None, times=None):
    """(Reach, seconds to the target or NaN, the steps spent in each mode up to it).
    shadow_s: {method: seconds its shadow adds to a step}, summed over the methods shadowed at
    each step."""
    manifest = runlog.read_manifest(run_dir) or {}
    objective = (manifest.get("plan_report") or {}).get("objective") or {}
    hit = tta.reach(tta.read_evals(run_dir), target)
    steps = hit.step if hit.reached else hit.last_step
    modes = modes_by_step(objective.get("switches", []), steps)
    shadow_s = shadow_s or {}
    shadows = sum(sum(shadow_s.get(m, 0.0) for m in ms) for ms in shadowed_by_step(
        objective.get("windows", []), list(shadow_s), steps)) / max(steps, 1)
    spent = {}
    for m in modes:
        spent[m] = spent.get(m, 0) + 1
    if not hit.reached:
        return hit, math.nan, spent
    times = times or tta.run_times(run_dir)
    mean_step = sum(step_s[m] for m in modes) / len(modes) + shadows
    return hit, tta.compose(hit, mean_step, times), spent


def auto_runs(out):
    """The auto-for-time-to-accuracy runs in OUT/runs: (folder, model, ranks, method, link,
    seed), both fronts' (auto:tta-<link> on Horovod, ddp:auto:tta-<link> on DDP)."""
    by_name = {key.replace(":", "-"): tta_grid.TRAINED[key] for key in tta_grid.AUTO_KEYS
               if tta_grid.AUTO_TTA in key}
    found = []
    for run_dir in sorted((Path(out) / "runs").glob("*-np*-*-s*")):
        model, np_, rest = run_dir.name.split("-", 2)
        name, _, seed = rest.rpartition("-s")
        method = by_name.get(name)
        if method is None or not seed.isdigit():
            continue
        link = method.key.rsplit(tta_grid.AUTO_TTA, 1)[1]
        found.append((run_dir, model, int(np_[2:]), method, link, int(seed)))
    return found


def _best(rows):
    return rows.loc[rows["tta_s"].idxmin()] if not rows.empty else None


def table(out, fixed_csv, step_dir, shadow_s=None, targets_csv=None):
    """A row per auto run and target: its time composed mode by mode, against the cell's best
    fixed method of every row of the grid's tta.csv but auto's (both fronts: best_fixed), the
    best of its own front (best_front; its start-up, evaluations and epoch ends compose
    tta_like_best_s) and the best Horovod row (best_horovod, as the first runs were read).
    targets_csv: default the targets.csv beside fixed_csv."""
    fixed_csv = Path(fixed_csv)
    targets = pd.read_csv(targets_csv or fixed_csv.with_name("targets.csv"))
    fixed = pd.read_csv(fixed_csv)
    fixed = fixed[~fixed["method"].isin(tta_grid.AUTO_KEYS)]
    # the start-up, evaluations and epoch ends tta.csv composed its rows with: the least over
    # the runs of a trainer, network and ranks (tta_grid.unloaded_times), not a run's own
    runs_csv = tta_grid.unloaded_times(pd.read_csv(fixed_csv.with_name("steps.csv")))
    rows = []
    for run_dir, model, ranks, method, link, seed in auto_runs(out):
        front = method.front
        step_s = json.loads((Path(step_dir) / tta_grid.step_s_name(front, link)).read_text())
        cell_targets = targets[(targets["model"] == model) & (targets["ranks"] == ranks)]
        if cell_targets.empty:
            raise tta.RunError(f"{run_dir}: no targets of {model} net, {ranks} ranks in "
                               f"{targets_csv or fixed_csv.with_name('targets.csv')}")
        for name in ("lab", "float32"):
            target = float(cell_targets[name].iloc[0])
            hit, seconds, spent = compose_auto(run_dir, step_s, target, shadow_s)
            cell = fixed[(fixed["model"] == model) & (fixed["ranks"] == ranks) &
                         (fixed["link"] == link) & (fixed["target_name"] == name)]
            reached = cell.dropna(subset=["tta_s"])
            best = _best(reached)
            best_h = _best(reached[reached["front"] == "horovod"])
            best_f = _best(reached[reached["front"] == front])
            over = None
            if best_f is not None:
                # the runs whose steps that row takes (DDP's allreduce: float32's, ...)
                trained = tta_grid.STEPS_OF.get((front, best_f["method"]), best_f["method"])
                r = runs_csv[(runs_csv["model"] == model) & (runs_csv["ranks"] == ranks) &
                             (runs_csv["method"] == trained) &
                             (runs_csv["target_name"] == name)]
                over = tta.RunTimes(r["startup_s"].min(), r["eval_s"].min(),
                                    r["epoch_end_s"].min(), r["loopback_step_s"].mean())
            f32 = cell[(cell["front"] == front) &
                       (cell["method"] == ("none" if front == "horovod" else "ddp:none"))]
            rows.append({
                "front": front, "method": method.key,
                "model": model, "ranks": ranks, "link": link, "seed": seed,
                "target_name": name, "target": target, "reached": hit.reached,
                "steps": hit.step, "tta_s": seconds,
                "tta_like_best_s": compose_auto(run_dir, step_s, target, shadow_s, over)[1],
                "tta_like_best_no_shadows_s": compose_auto(run_dir, step_s, target, None,
                                                           over)[1],
                "best_horovod": None if best_h is None else best_h["method"],
                "best_horovod_s": math.nan if best_h is None else float(best_h["tta_s"]),
                "best_horovod_steps": math.nan if best_h is None else float(best_h["steps"]),
                "best_front": None if best_f is None else best_f["method"],
                "best_front_s": math.nan if best_f is None else float(best_f["tta_s"]),
                "best_front_steps": math.nan if best_f is None else float(best_f["steps"]),
                "modes": " ".join(f"{m}:{k}" for m, k in spent.items()),
                "best_fixed": None if best is None else f"{best['front']}:{best['method']}",
                "best_fixed_s": math.nan if best is None else float(best["tta_s"]),
                "best_fixed_steps": math.nan if best is None else float(best["steps"]),
                "float32_s": float(f32["tta_s"].iloc[0]) if not f32.empty else math.nan,
                "float32_reached": bool(f32["reached"].iloc[0] > 0) if not f32.empty else None})
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame["vs_best"] = frame["tta_s"] / frame["best_fixed_s"]
        frame["vs_best_horovod"] = frame["tta_like_best_s"] / frame["best_horovod_s"]
        frame["vs_best_horovod_no_shadows"] = (frame["tta_like_best_no_shadows_s"] /
                                               frame["best_horovod_s"])
        frame["vs_best_front"] = frame["tta_like_best_s"] / frame["best_front_s"]
        frame["vs_best_front_no_shadows"] = (frame["tta_like_best_no_shadows_s"] /
                                             frame["best_front_s"])
    return frame


# ---- the injected step cells: step_s/<link>.json from a step_times.csv ----------------------

def value_rows(front):
    """The bench rows of the value plan's candidates (hvd_compress.auto.candidates'
    DEFAULT_CANDIDATES, scheme:route): ours:<scheme>:<route>, and ours:<scheme> for a row at
    the scheme's default route (ours:none, ours:fp16)."""
    from hvd_compress.auto.candidates import DEFAULT_CANDIDATES
    rows = []
    for label in DEFAULT_CANDIDATES:
        scheme, _, route = label.partition(":")
        rows += [f"ours:{scheme}:{route}", f"ours:{scheme}"]
    return list(dict.fromkeys(rows))


def step_s_of(cells, front, model, ranks, link, methods=None):
    """{'value': s, '<method>': s, ...} for one front, network, ranks and link, in seconds
    (rounded to the microsecond, as the first files were): 'value' the fastest of the value
    plan's candidates' cells there (value_rows), each method (default: convergence's
    DEFAULT_METHODS) its own cell (the grid's bench row of it). Also returns the value's row.
    A method without a cell, or no value row at all, raises a KeyError naming them."""
    from hvd_compress.auto.convergence import DEFAULT_METHODS
    here = cells[(cells["front"] == front) & (cells["model"] == model) &
                 (cells["ranks"] == int(ranks)) & (cells["link"] == link)]
    ms = dict(zip(here["row"], here["step_ms"].astype(float)))
    values = {row: ms[row] for row in value_rows(front) if row in ms}
    want = {m: tta_grid.TRAINED[m].bench_row for m in (methods or DEFAULT_METHODS)}
    missing = [row for row in want.values() if row not in ms]
    if not values:
        missing.insert(0, "one of " + "/".join(value_rows(front)))
    if missing:
        raise KeyError(f"{front}, {model}, {ranks} ranks, {link}: no step cell for "
                       f"{', '.join(missing)}", missing)
    fastest = min(values, key=values.get)
    out = {"value": round(values[fastest] / 1e3, 6)}
    out.update({m: round(ms[row] / 1e3, 6) for m, row in want.items()})
    return out, fastest


def read_cells(paths, front):
    """Step cells from step_times.csv files (the grid's), or a step benchmark's steps.csv (its
    rows are `front`'s); a later file's cell replaces an earlier one's."""
    frames = []
    for path in paths:
        columns = pd.read_csv(path, nrows=0).columns
        if "round" in columns:               # a step benchmark's own output
            frames.append(tta_grid.read_step_times([f"{front}:?:{path}"]))
        else:
            frames.append(tta_grid.read_step_times([], [path]))
    cells = pd.concat(frames, ignore_index=True)
    return cells.drop_duplicates(["front", "model", "link", "ranks", "row"], keep="last")


def write_step_s(cells, front, model, ranks, folder, links=tta_grid.LINKS):
    """Every link's file (step_s_name: <link>.json for Horovod, ddp-<link>.json for DDP) in
    `folder`; nothing is written if any link lacks a cell (one KeyError naming them all)."""
    model = tta_grid.BENCH_MODEL.get(model, model)
    made, errors, rows = {}, [], []
    for link in links:
        try:
            made[link] = step_s_of(cells, front, model, ranks, link)
        except KeyError as err:
            errors.append(err.args[0])
            rows += [r for r in err.args[1] if r.startswith("ours:") and r not in rows]
    if errors:
        bench = "labs.bench.step" if front == "horovod" else "labs.bench.ddp"
        raise KeyError("; ".join(errors) + f". Measure them (python -m {bench} --models "
                       f"{model} --ranks {ranks} --rows {','.join(rows) or '...'}) or pass "
                       f"a --cells file that has them; nothing was written")
    paths = []
    for link, (values, fastest) in made.items():
        path = Path(folder) / tta_grid.step_s_name(front, link)
        runlog.atomic_write_text(path, json.dumps(values, indent=1))
        paths.append((path, fastest))
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", action="append", help="the grid's out folder (its runs/); "
                        "again for another")
    parser.add_argument("--shadow-s", default=None, metavar="CSV",
                        help="each method's shadow seconds a step (--shadow-cost's CSV)")
    parser.add_argument("--shadow-cost", action="store_true",
                        help="measure the shadows' seconds per step (amortised over a window) "
                        "and exit")
    parser.add_argument("--fixed", default="results/tta/tta.csv",
                        help="the grid's tta.csv whose fixed methods auto is held against")
    parser.add_argument("--step-s", default="results/tta/auto/step_s",
                        help="the folder of the links' injected step times (<link>.json)")
    parser.add_argument("--targets", default=None, metavar="TARGETS_CSV",
                        help="the cells' targets (default: the targets.csv beside --fixed)")
    parser.add_argument("--csv")
    parser.add_argument("--write-step-s", action="store_true",
                        help="write the injected step cells (--dir/<link>.json, ddp-<link>.json "
                             "for --front ddp) from --cells and exit")
    parser.add_argument("--cells", action="append", default=[], metavar="CSV",
                        help="--write-step-s: a step_times.csv of the grid, or a step "
                             "benchmark's steps.csv (of --front); again for another, later "
                             "cells replacing earlier")
    parser.add_argument("--front", choices=("horovod", "ddp"), default="horovod")
    parser.add_argument("--model", default="lab", help="--write-step-s: the network (the step "
                        "benchmark's name, lab or basic, or the grid's, horovod or basic)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--links", default=",".join(tta_grid.LINKS))
    parser.add_argument("--dir", default=str(tta_grid.STEP_S_DIR),
                        help="--write-step-s: the folder of the files")
    args = parser.parse_args(argv)
    if args.write_step_s:
        if not args.cells:
            parser.error("--write-step-s needs --cells STEP_TIMES_CSV")
        try:
            written = write_step_s(read_cells(args.cells, args.front), args.front, args.model,
                                   args.ranks, args.dir, args.links.split(","))
        except (KeyError, tta.RunError) as err:
            print(f"error: {err.args[0]}", file=sys.stderr)
            return 1
        for path, fastest in written:
            print(f"{path}: value = {fastest}")
        return 0
    if args.shadow_cost:
        from hvd_compress.auto.convergence import DEFAULT_METHODS, INTERVAL
        # shadow_ms: a step's share of the sampled shadows (what auto pays, for compose_auto);
        # every_step_ms: the same shadows run at every step (the cost before sampling)
        rows = []
        for m in (*DEFAULT_METHODS, None):             # None: every method at once
            methods = None if m is None else (m,)
            rows.append({"method": m or "all", "shadow_ms": 1e3 * shadow_cost(methods=methods),
                         "every_step_ms": 1e3 * shadow_cost(methods=methods, windows=1,
                                                            samples=INTERVAL)})
        frame = pd.DataFrame(rows)
        print(frame.to_string(index=False))
        if args.csv:
            runlog.atomic_write_text(Path(args.csv), frame.to_csv(index=False,
                                                                  float_format="%.4g"))
        return 0
    shadow = None
    if args.shadow_s:
        costs = pd.read_csv(args.shadow_s)
        shadow = {r.method: r.shadow_ms / 1e3 for r in costs.itertuples() if r.method != "all"}
    if not args.out or not args.csv:
        parser.error("--out and --csv are needed (or --shadow-cost)")
    frame = pd.concat([table(o, args.fixed, args.step_s, shadow, args.targets)
                       for o in args.out], ignore_index=True)
    runlog.atomic_write_text(Path(args.csv), frame.to_csv(index=False, float_format="%.4g"))
    print(frame.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
