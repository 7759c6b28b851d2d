"""Plot a collectives benchmark: measured time against the fitted alpha-beta model.

One column per rank count n, two rows: Horovod's primitives (dashed: the fit of its own
collective at that n; dotted: the fit pooled over n) and the gradient-exchange schemes
(communication predicted with the link fitted to all primitives at that n; the measured time
includes compression and decompression, so the gap between a scheme's markers and its line is
the codec's cost plus the model's error). Markers are medians, bars p10..p90.

    python -m labs.netem.plots results/bench/1g_summary.csv    # -> results/bench/1g.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _title(summary, n) -> str:
    part = summary[summary["n"] == n]
    transport = part["transport"].iloc[0] if "transport" in part and len(part) else ""
    rate = part["link_rate_bps"].iloc[0] if "link_rate_bps" in part and len(part) else ""
    text = f"n = {n}"
    if transport:
        text += f", {transport}"
    try:
        if rate == rate and str(rate) != "":        # not NaN, not empty
            text += f" {float(rate) / 1e9:g} Gbit/s"
    except ValueError:
        pass
    return text


def _fit_text(f: dict) -> str:
    bw = f.get("bandwidth_bytes_per_s")
    return (f"{f['collective']}: α {f['alpha_s'] * 1e6:.0f} µs, "
            + (f"{bw * 8 / 1e9:.2f} Gbit/s" if bw else "β 0"))


def plot_bench(summary, path: Path, fits: dict | None = None) -> Path:
    """Draw `summary` (a DataFrame as written to OUT_summary.csv) into the PNG `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(summary["n"].unique())
    kinds = [k for k in ("primitive", "scheme") if (summary["kind"] == k).any()]
    size = (max(8.0, 6.2 * len(ns)), 4.6 * len(kinds) + 0.4)
    fig, axes = plt.subplots(len(kinds), len(ns), figsize=size, squeeze=False, sharex=True)
    names = list(dict.fromkeys(summary["name"]))
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}
    for row, kind in enumerate(kinds):
        for col, n in enumerate(ns):
            ax = axes[row][col]
            part = summary[(summary["kind"] == kind) & (summary["n"] == n)]
            for name, pts in part.groupby("name", sort=False):
                pts = pts.sort_values("bytes")
                c = colors[name]
                yerr = [pts["median_s"] - pts["p10_s"], pts["p90_s"] - pts["median_s"]]
                ax.errorbar(pts["bytes"], pts["median_s"], yerr=yerr, fmt="o-", ms=4, lw=0.6,
                            color=c, capsize=2, label=name)
                if "predicted_s" in pts and pts["predicted_s"].notna().any():
                    ax.plot(pts["bytes"], pts["predicted_s"], "--", color=c, lw=1.4)
                if "pooled_predicted_s" in pts and pts["pooled_predicted_s"].notna().any():
                    ax.plot(pts["bytes"], pts["pooled_predicted_s"], ":", color=c, lw=1.2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{'Horovod collectives' if kind == 'primitive' else 'gradient exchanges'}"
                         f" — {_title(summary, n)}", fontsize=10)
            if row == len(kinds) - 1:
                ax.set_xlabel("bytes per rank (input tensor; schemes: fp32 gradient)")
            if col == 0:
                ax.set_ylabel("seconds per call")
            ax.legend(fontsize=7, loc="upper left",
                      title="o median, bars p10..p90, -- model (: pooled over n)",
                      title_fontsize=7)
            if fits and kind == "primitive":
                here = [f for f in fits.get("fits", []) if f.get("n") == n]
                ax.text(0.98, 0.02, "\n".join(_fit_text(f) for f in here), fontsize=7,
                        ha="right", va="bottom", transform=ax.transAxes,
                        bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    if fits:
        parts = [_fit_text(f) for f in fits.get("fits", []) if f.get("n") is None]
        lines = ["; ".join(parts[i:i + 2]) for i in range(0, len(parts), 2)]
        fig.suptitle("alpha-beta fits pooled over n — " + "\n".join(lines), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    import json
    import pandas as pd
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary", type=Path, help="OUT_summary.csv written by labs.netem.bench")
    p.add_argument("--png", type=Path, help="default: OUT.png next to the summary")
    args = p.parse_args(argv)
    stem = str(args.summary.with_suffix(""))
    base = stem[:-len("_summary")] if stem.endswith("_summary") else stem
    fit_path = Path(base + "_fit.json")
    fits = json.loads(fit_path.read_text()) if fit_path.exists() else None
    out = plot_bench(pd.read_csv(args.summary), args.png or Path(base + ".png"), fits)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
