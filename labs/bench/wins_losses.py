#!/usr/bin/env python
"""Wins and losses of a step benchmark, counted as Agarwal et al. count them ("On the utility
of gradient compression", MLSys 2022: compression beat well-tuned synchronous SGD in 6 of 200+
setups): in how many cells each fixed scheme, stock or ours, is the fastest row, and in how
many it beats stock float32; then the per-bucket plan (ours:auto) against the fastest fixed
row and against stock float32 in every cell.

    python -m labs.bench.wins_losses                            # results/step/summary.csv
    python -m labs.bench.wins_losses runs/step/summary.csv --tie-pct 1

A cell is one (model, link, ranks) of labs.bench.step's summary.csv; a row's step is
its median step (step_ms). Writes, beside the summary (or in --out-dir):
  wins_losses.csv        one line per row of the benchmark: cells where it is the fastest
                         fixed row (ties within --tie-pct count for each tied row), cells where
                         it beats stock float32; for ours:auto, cells within 5% of the fastest
                         fixed row and of stock float32 (issue 25's targets) and its ratios
  wins_losses_cells.csv  one line per cell: the fastest fixed row, stock float32, auto, its plan
                         (or its fallback), its ratios to both, how well the fastest row's
                         and auto's medians are known (median_ci_pct: a ratio inside them is
                         a tie; round_spread_pct for a summary from before it), and auto's
                         predicted step and its error against the measured median (the
                         median predicted over the timed steps: a re-planned row's mixes its
                         plans), the last plan's own error against its measured median; auto
                         against the fastest row round by round (vs_fastest_paired, its 95%
                         interval, and whether that interval says slower, tie or faster)
  wins_losses.md         both, as tables
Pure pandas on the CSV: nothing is run or measured here.
"""
import argparse
import math
import sys
from pathlib import Path

import pandas as pd

CELL = ["model", "link", "ranks"]
AUTO_ROW = "ours:auto"
STOCK = "stock:none"
TARGET = 1.05           # issue 25: auto within 5% of the fastest fixed row and of stock float32


def read_summary(path):
    """The benchmark's summary.csv, checked for what the count needs."""
    frame = pd.read_csv(path)
    missing = [c for c in CELL + ["row", "step_ms"] if c not in frame]
    if missing:
        raise ValueError(f"{path}: not a labs.bench.step summary (no {', '.join(missing)})")
    if frame.empty:
        raise ValueError(f"{path}: no rows")
    bad = frame[~(frame.step_ms > 0)]
    if len(bad):
        raise ValueError(f"{path}: rows without a positive median step: "
                         + ", ".join(f"{r.model}/{r.link}/n={r.ranks}/{r.row}"
                                     for r in bad.itertuples()))
    return frame


def per_cell(frame, tie_pct=0.0):
    """One line per cell: the fastest fixed row(s) (within tie_pct of the fastest), stock
    float32's step, auto's step, plan and ratios (NaN where the cell has no such row)."""
    lines = []
    spread = "median_ci_pct" if "median_ci_pct" in frame else "round_spread_pct"
    for key, cell in frame.groupby(CELL, sort=False):
        fixed = cell[cell.row != AUTO_ROW]
        if fixed.empty:
            raise ValueError(f"cell {key}: no fixed row to compare with")
        best = fixed.step_ms.min()
        tied = fixed[fixed.step_ms <= best * (1 + tie_pct / 100)].sort_values("step_ms")
        stock = cell[cell.row == STOCK].step_ms
        auto = cell[cell.row == AUTO_ROW]
        auto_ms = auto.step_ms.iloc[0] if len(auto) else math.nan
        stock_ms = stock.iloc[0] if len(stock) else math.nan
        lines.append(dict(zip(CELL, key), fastest_row=" ".join(tied.row),
                          fastest_ms=best, stock_none_ms=stock_ms, auto_ms=auto_ms,
                          auto_plan=_text(auto, "plan"), auto_outcome=_text(auto, "auto_outcome"),
                          auto_vs_fastest=auto_ms / best, auto_vs_stock_none=auto_ms / stock_ms,
                          fastest_spread_pct=_number(tied.iloc[:1], spread),
                          auto_spread_pct=_number(auto, spread),
                          auto_predicted_ms=_number(auto, "plan_predicted_ms"),
                          auto_prediction_error_pct=100 * (
                              _number(auto, "plan_predicted_ms") / auto_ms - 1),
                          auto_last_plan_error_pct=100 * (
                              _number(auto, "plan_last_predicted_ms")
                              / _number(auto, "plan_measured_ms") - 1),
                          **paired(auto)))
    return pd.DataFrame(lines)


PAIRED = ["vs_fastest_paired", "vs_fastest_paired_lo", "vs_fastest_paired_hi"]


def paired(auto):
    """Auto against the fastest fixed row round by round (rounds.paired_ratio): the median
    ratio, its 95% interval, and what the interval says: "slower" (all of it above 1),
    "faster" (all below), "tie" (it holds 1); NaN and "" for a summary from before it."""
    lo, hi = _number(auto, PAIRED[1]), _number(auto, PAIRED[2])
    verdict = ("slower" if lo > 1 else "faster" if hi < 1 else "tie"
               if math.isfinite(lo) and math.isfinite(hi) else "")
    return {f"auto_{c}": _number(auto, c) for c in PAIRED} | {"auto_paired_verdict": verdict}


def _text(rows, column):
    """The first row's text in `column`, "" where there is none."""
    if not len(rows) or column not in rows:
        return ""
    value = rows[column].iloc[0]
    return value if isinstance(value, str) else ""


def _number(rows, column):
    return float(rows[column].iloc[0]) if len(rows) and column in rows else math.nan


def counts(frame, cells):
    """One line per row of the benchmark: in how many cells it is (one of) the fastest fixed
    row(s), in how many it beats stock float32, of how many cells it ran in; for auto, how
    many cells it is at least as fast as the fastest fixed row, within 5% of it and of stock
    float32, with its median and largest ratio to the fastest, and in how many cells the
    round-by-round ratio's interval says it is slower than the fastest row, tied, or faster."""
    winners = [set(w.split()) for w in cells.fastest_row]
    stock = cells.set_index(CELL).stock_none_ms
    lines = []
    for row in dict.fromkeys(frame.row):
        mine = frame[frame.row == row].set_index(CELL).step_ms
        beats = sum(ms < stock.get(k, math.nan) for k, ms in mine.items())
        line = {"row": row, "cells": len(mine), "beats_stock_none_in": int(beats)}
        if row == AUTO_ROW:
            judged = cells.dropna(subset=["auto_ms"])
            line.update(fastest_in=int((judged.auto_vs_fastest <= 1).sum()),
                        within_5pct_of_fastest_in=int((judged.auto_vs_fastest <= TARGET).sum()),
                        within_5pct_of_stock_none_in=int(
                            (judged.auto_vs_stock_none <= TARGET).sum()),
                        median_vs_fastest=judged.auto_vs_fastest.median(),
                        worst_vs_fastest=judged.auto_vs_fastest.max(),
                        paired_slower_in=int((judged.auto_paired_verdict == "slower").sum()),
                        paired_tie_in=int((judged.auto_paired_verdict == "tie").sum()),
                        paired_faster_in=int((judged.auto_paired_verdict == "faster").sum()))
        else:
            line["fastest_in"] = sum(row in w for w in winners)
        lines.append(line)
    columns = ["row", "cells", "fastest_in", "beats_stock_none_in", "within_5pct_of_fastest_in",
               "within_5pct_of_stock_none_in", "median_vs_fastest", "worst_vs_fastest",
               "paired_slower_in", "paired_tie_in", "paired_faster_in"]
    return pd.DataFrame(lines).reindex(columns=columns)


def markdown(table, cells, tie_pct):
    def fmt(v):
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.3g}"
        return str(v)

    def md(frame):
        head = "| " + " | ".join(frame.columns) + " |"
        rule = "|" + "---|" * len(frame.columns)
        return "\n".join([head, rule] + ["| " + " | ".join(fmt(v) for v in r) + " |"
                                         for r in frame.itertuples(index=False)])
    tie = f" (rows within {tie_pct:g}% of the fastest count as tied)" if tie_pct else ""
    return (f"# Wins and losses ({len(cells)} cells{tie})\n\n"
            f"In how many cells each row is the fastest fixed row, and beats stock float32:\n\n"
            f"{md(table)}\n\nPer cell: the fastest fixed row, auto's plan and ratios:\n\n"
            f"{md(cells)}\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary", nargs="?", default="results/step/summary.csv")
    p.add_argument("--out-dir", default=None, help="default: the summary's folder")
    p.add_argument("--tie-pct", type=float, default=0.0,
                   help="rows within this %% of a cell's fastest count as fastest too (default 0)")
    args = p.parse_args(argv)
    if not (args.tie_pct >= 0 and math.isfinite(args.tie_pct)):
        p.error(f"--tie-pct must be a number >= 0, got {args.tie_pct}")
    try:
        frame = read_summary(args.summary)
        cells = per_cell(frame, args.tie_pct)
    except (OSError, ValueError) as err:
        print(f"wins_losses: {err}", file=sys.stderr)
        return 1
    table = counts(frame, cells)
    out = Path(args.out_dir or Path(args.summary).parent)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "wins_losses.csv", index=False, float_format="%.4g")
    cells.to_csv(out / "wins_losses_cells.csv", index=False, float_format="%.4g")
    text = markdown(table, cells, args.tie_pct)
    (out / "wins_losses.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
