#!/usr/bin/env python
"""Issue 47's step-time targets, read from a labs.bench.ddp run (OUT/steps.csv): every cell's
ratios, each as the median of the round-by-round ratios with its 95% interval
(rounds.paired_ratio: rows take turns within a round, so a machine that slows for a while
slows both sides of a round's ratio).

    python -m labs.bench.ddp_targets results/ddp-grid

Targets (ratio <= target; 'met' when the median ratio is, and the interval says whether the
data can tell):
    bit8 vs fp16_compress_hook   <= 0.6   our bit8 hook (the faster of its two routes) against
                                          DDP's fp16_compress_hook
    bit8 vs DDP default          <= 0.4   ... against DDP's own allreduce (no hook)
    auto vs fastest value row    <= 1.05  ours:auto against the fastest of the value codecs
                                          (ours: none, fp16, bit16, bf16, bit8 both routes) and
                                          DDP's default and fp16 hook
    none vs DDP default          <= 1.05  ours:none against DDP's allreduce (issue: loopback)
    PowerSGD vs DDP's PowerSGD   <= 1.05  ours:powersgd1 against DDP's powerSGD_hook, rank 1
Writes OUT/targets.csv (one line per cell and target; issue_cell: a cell the issue sets the
target for: bit8's at the basic net's 100 Mbit/s, none's on loopback, the others everywhere)
and OUT/targets.md (those cells, a table).
Pure pandas on the CSV: nothing is run or measured here.
"""
import argparse
from pathlib import Path

import pandas as pd

from labs.bench.rounds import paired_ratio

CELL = ["model", "link", "ranks"]
VALUE_ROWS = ["stock:none", "stock:fp16", "ours:none", "ours:fp16", "ours:bit16:alltoall",
              "ours:bf16", "ours:bit8:allgather", "ours:bit8:alltoall"]
BIT8 = ["ours:bit8:allgather", "ours:bit8:alltoall"]
# (name, row or rows (the fastest of them), base row or rows (the fastest), target, the cells
# the issue sets it for: the others are reported too, with issue_cell False)
TARGETS = [("bit8 vs fp16_compress_hook", BIT8, ["stock:fp16"], 0.6,
            lambda model, link: model == "basic" and link == "100mbit"),
           ("bit8 vs DDP default", BIT8, ["stock:none"], 0.4,
            lambda model, link: model == "basic" and link == "100mbit"),
           ("auto vs fastest value row", ["ours:auto"], VALUE_ROWS, 1.05, lambda *cell: True),
           ("none vs DDP default", ["ours:none"], ["stock:none"], 1.05,
            lambda model, link: link == "loopback"),
           ("PowerSGD vs DDP's PowerSGD", ["ours:powersgd1"], ["stock:powersgd1"], 1.05,
            lambda *cell: True)]


def _fastest(medians, rows):
    present = [r for r in rows if r in medians]
    return min(present, key=medians.get) if present else None


def targets(steps):
    """One dict per (cell, target) whose rows the cell has."""
    out = []
    for cell, g in steps.groupby(CELL, sort=False):
        by_row = {row: (r.step_ms.tolist(), r["round"].tolist()) for row, r in g.groupby("row")}
        medians = g.groupby("row").step_ms.median().to_dict()
        for name, rows, bases, target, issue_cell in TARGETS:
            row, base = _fastest(medians, rows), _fastest(medians, bases)
            if row is None or base is None:
                continue
            ratio, lo, hi = paired_ratio(*by_row[row], *by_row[base])
            verdict = "met" if ratio <= target else "missed"
            if lo <= target <= hi:
                verdict += " (interval holds the target)"
            out.append(dict(zip(CELL, cell), target=name, row=row, row_ms=medians[row],
                            base=base, base_ms=medians[base], ratio=ratio, ratio_lo=lo,
                            ratio_hi=hi, goal=target, verdict=verdict,
                            issue_cell=bool(issue_cell(cell[0], cell[1]))))
    return out


def markdown(table):
    """The targets in the cells the issue sets them for, as a table."""
    table = table[table.issue_cell]
    lines = ["| model | link | ranks | target | row (ms) | against (ms) | ratio [95%] | goal | "
             "verdict |", "| --- | --- | ---: | --- | --- | --- | --- | ---: | --- |"]
    for t in table.itertuples():
        lines.append(f"| {t.model} | {t.link} | {t.ranks} | {t.target} | {t.row} "
                     f"({t.row_ms:.0f}) | {t.base} ({t.base_ms:.0f}) | {t.ratio:.2f} "
                     f"[{t.ratio_lo:.2f}, {t.ratio_hi:.2f}] | {t.goal:g} | {t.verdict} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default="results/ddp-grid")
    args = p.parse_args(argv)
    out = Path(args.out)
    table = pd.DataFrame(targets(pd.read_csv(out / "steps.csv")))
    table.to_csv(out / "targets.csv", index=False, float_format="%.4g")
    (out / "targets.md").write_text(markdown(table))
    print(markdown(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
