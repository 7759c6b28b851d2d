"""Compression.auto(objective="time_to_accuracy") in the time-to-accuracy grid's cells, against
the best fixed method of each cell.

    python -m labs.bench.tta_grid --out runs/tta-auto --models horovod --ranks 2 \\
        --methods auto:tta-loopback,auto:tta-10mbit --seeds 42,1,2 --prefix /work/bin/cpu-shared
    python -m labs.bench.tta_auto --out runs/tta-auto --fixed results/tta/tta.csv \\
        --csv results/tta/auto/auto.csv [--shadow-s shadow_cost.csv]
    /work/bin/cpu-quiet python -m labs.bench.tta_auto --shadow-cost --csv shadow_cost.csv

--shadow-cost measures each method's shadow per step as auto runs it (at the sampled steps of
each window, convergence.sampled_positions), amortised over the window, and beside it the same
shadows at every step.
Each auto:tta-<link> run trained over loopback with that link's step cells injected
(--auto-step-s: the modes' seconds per step), so its decisions are the link's. Its time to a
target is composed as labs/kit/tta.py composes a fixed method's, the steps' part summed mode by
mode: start-up + sum over its steps of the injected step of the mode in force (the manifest's
plan_report: objective.switches) + evaluations + epoch ends. The best fixed method of the cell
(front, network, ranks, link, target) is the fastest row of the grid's tta.csv that is not auto.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from labs.kit import runlog, tta

PREFIX = "auto:tta-"


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


def table(out, fixed_csv, step_dir, shadow_s=None, targets_csv="results/tta/targets.csv"):
    targets = pd.read_csv(targets_csv)
    fixed = pd.read_csv(fixed_csv)
    fixed = fixed[~fixed["method"].astype(str).str.startswith("auto")]
    rows = []
    for run_dir in sorted((Path(out) / "runs").glob(f"*-{PREFIX.replace(':', '-')}*")):
        model, np_, rest = run_dir.name.split("-", 2)
        ranks = int(np_[2:])
        link, seed = rest[len(PREFIX):].rsplit("-s", 1)
        step_s = json.loads((Path(step_dir) / f"{link}.json").read_text())
        cell_targets = targets[(targets["model"] == model) & (targets["ranks"] == ranks)]
        runs_csv = pd.read_csv(Path(fixed_csv).with_name("steps.csv"))
        for name in ("lab", "float32"):
            target = float(cell_targets[name].iloc[0])
            hit, seconds, spent = compose_auto(run_dir, step_s, target, shadow_s)
            cell = fixed[(fixed["model"] == model) & (fixed["ranks"] == ranks) &
                         (fixed["link"] == link) & (fixed["target_name"] == name)]
            reached = cell.dropna(subset=["tta_s"])
            best = reached.loc[reached["tta_s"].idxmin()] if not reached.empty else None
            ours = reached[reached["front"] == "horovod"]
            best_h = ours.loc[ours["tta_s"].idxmin()] if not ours.empty else None
            over = None
            if best_h is not None:
                r = runs_csv[(runs_csv["model"] == model) & (runs_csv["ranks"] == ranks) &
                             (runs_csv["method"] == best_h["method"]) &
                             (runs_csv["target_name"] == name)]
                over = tta.RunTimes(r["startup_s"].mean(), r["eval_s"].mean(),
                                    r["epoch_end_s"].mean(), r["loopback_step_s"].mean())
            f32 = cell[(cell["front"] == "horovod") & (cell["method"] == "none")]
            rows.append({
                "model": model, "ranks": ranks, "link": link, "seed": int(seed),
                "target_name": name, "target": target, "reached": hit.reached,
                "steps": hit.step, "tta_s": seconds,
                "tta_like_best_s": compose_auto(run_dir, step_s, target, shadow_s, over)[1],
                "tta_like_best_no_shadows_s": compose_auto(run_dir, step_s, target, None,
                                                           over)[1],
                "best_horovod": None if best_h is None else best_h["method"],
                "best_horovod_s": math.nan if best_h is None else float(best_h["tta_s"]),
                "best_horovod_steps": math.nan if best_h is None else float(best_h["steps"]),
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
    return frame


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
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
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
    frame = pd.concat([table(o, args.fixed, args.step_s, shadow) for o in args.out],
                      ignore_index=True)
    runlog.atomic_write_text(Path(args.csv), frame.to_csv(index=False, float_format="%.4g"))
    print(frame.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
