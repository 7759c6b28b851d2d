"""Plots of a run matrix, PNG files next to the report.

    python -m labs.kit.plots                                   # runs/matrix -> runs/*.png
    python -m labs.kit.plots --summary runs/x/summary.csv --out-dir runs/x


accuracy.png   test accuracy after each epoch, one line per configuration
loss.png       training loss per step (rank 0, moving average), x axis in epochs so that
               configurations with different steps per epoch line up
step_time.png  mean step time split into forward+backward, compress, communicate,
               decompress and update (stacked bars), and bytes sent per step
methods.png    accuracy against bytes per step of every parallel run (with --methods)
network.png    the network table (--network-summary, --calibration): each parallel row's step
               time on the emulated link and over loopback, and its exchange measured beside
               the prediction (labs/kit/network.py)
tta.png        with the network table and a table that held images out (--holdout): each
               parallel row's held-out accuracy against its time on the link (labs/kit/tta.py)
"""
import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from . import network, tta  # noqa: E402
from .matrix import read_summary  # noqa: E402

PARTS = [("forward_backward_ms", "forward+backward"), ("compress_ms", "compress"),
         ("communicate_ms", "communicate"), ("decompress_ms", "decompress"),
         ("update_ms", "update")]


def load(summary_path):
    summary_path = Path(summary_path)
    summary = read_summary(summary_path)
    runs = {}
    for row in summary.itertuples():
        folder = summary_path.parent / row.run_dir
        epochs = folder / "epochs.csv"
        steps = folder / "steps.csv"
        if not epochs.is_file() or not steps.is_file():
            raise SystemExit(f"{folder}: epochs.csv or steps.csv is missing")
        runs[row.run] = (pd.read_csv(epochs), pd.read_csv(steps))
    return summary, runs


def style(run):
    """Same colour for a compression, solid for 2 processes, dashed for 4."""
    colours = {"none": "tab:blue", "fp16": "tab:green", "bit16": "tab:orange",
               "bit8": "tab:red", "auto": "tab:cyan"}
    parts = run.split("-")
    colour = colours.get(parts[1] if len(parts) > 1 else "", "black")
    if run == "serial":
        return {"color": "black", "linestyle": ":"}
    if len(parts) > 2:                    # extras such as bit8-alltoall, bit8-ef
        colour = {"alltoall": "tab:purple", "ef": "tab:brown"}.get(parts[2], colour)
    return {"color": colour, "linestyle": "-" if parts[0] == "np2" else "--"}


def plot_accuracy(runs, path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, (epochs, _) in runs.items():
        ax.plot(epochs["epoch"], 100 * epochs["test_accuracy"], marker="o", label=run,
                **style(run))
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy per epoch")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss(runs, path, window=20):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, (_, steps) in runs.items():
        rank0 = steps[steps["rank"] == 0].sort_values("step")
        per_epoch = rank0.groupby("epoch")["batch"].transform("max") + 1
        x = rank0["epoch"] - 1 + (rank0["batch"] + 1) / per_epoch
        smooth = rank0["loss"].rolling(window, min_periods=1).mean()
        ax.plot(x, smooth, label=run, linewidth=1.2, **style(run))
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"training loss (rank 0, mean of {window} steps)")
    ax.set_title("Training loss per step")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_step_time(summary, path):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.8),
                                 gridspec_kw={"width_ratios": [3, 2]})
    names = list(summary["run"])
    bottom = [0.0] * len(names)
    colours = ["tab:gray", "tab:orange", "tab:blue", "tab:green", "tab:purple"]
    for (column, label), colour in zip(PARTS, colours):
        values = summary[column].fillna(0).tolist()
        ax.bar(names, values, bottom=bottom, label=label, color=colour)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title("Where a step's time goes")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    bx.bar(names, summary["bytes_per_step"].fillna(0) / 1024, color="tab:red")
    bx.set_ylabel("KiB sent per rank per step")
    bx.set_title("Gradient bytes on the wire")
    bx.tick_params(axis="x", rotation=45)
    bx.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_methods(summary, path):
    """Accuracy against bytes per step (log scale), one point per run: which methods sit on
    the frontier (fewest bytes for their accuracy). None when the matrix ran no --methods."""
    from hvd_compress.registry import other_schemes
    if not summary["compression"].isin(other_schemes()).any():
        return None
    rows = summary[summary["ranks"] > 1]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ranks, marker in ((2, "o"), (4, "s")):
        part = rows[rows["ranks"] == ranks]
        ax.scatter(part["bytes_per_step"], 100 * part["final_test_accuracy"], marker=marker,
                   label=f"{ranks} processes")
        for row in part.itertuples():
            ax.annotate(row.run.split("-", 1)[1], (row.bytes_per_step, 100 * row.final_test_accuracy),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per rank per step (log scale)")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("Accuracy against bytes: up and to the left is better")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_network(net_summary_path, calibration, loop_summary, path):
    """Step time per parallel row on the link and over loopback; measured and predicted
    exchange per row."""
    from . import runlog
    net_summary_path = Path(net_summary_path)
    net = read_summary(net_summary_path)
    net = net[net["ranks"] > 1]
    manifests = {row.run: runlog.read_manifest(net_summary_path.parent / row.run_dir)
                 for row in net.itertuples()}
    preds = {p.run: p for p in network.predictions(net, manifests, loop_summary,
                                                   *network.load_calibration(calibration))}
    loop = loop_summary.set_index("run")
    names = list(net["run"])
    x = range(len(names))
    rate = network.rate_text(net["netem_rate_bps"].iloc[0])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.4
    ax.bar([i - width / 2 for i in x], net["step_ms"], width, label=f"{rate} link",
           color="tab:red")
    ax.bar([i + width / 2 for i in x], [loop.loc[n, "step_ms"] if n in loop.index else 0
                                        for n in names], width, label="loopback",
           color="tab:gray")
    ax.set_xticks(list(x), names, rotation=45, ha="right")
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title("Step time: where compression pays")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    predicted = [n for n in names if n in preds]    # an auto row predicts its own step
    px = range(len(predicted))
    bx.bar([i - width / 2 for i in px], [preds[n].measured_ms for n in predicted], width,
           label="measured", color="tab:blue")
    bx.bar([i + width / 2 for i in px], [preds[n].predicted_ms for n in predicted], width,
           label="predicted (alpha-beta + decode)", color="tab:orange")
    bx.set_xticks(list(px), predicted, rotation=45, ha="right")
    bx.set_ylabel("exchange per step (ms)")
    bx.set_title(f"Exchange on the {rate} link: measured and predicted")
    bx.legend(fontsize=8)
    bx.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tta(summary_path, summary, network_summary, path):
    """Each parallel row's held-out accuracy against the time it reaches it at on the network
    table's link (labs/kit/tta.py: its steps over loopback x its step on the link, with its
    start-up, evaluations and epoch ends), a panel per number of processes, float32's targets
    dashed. False (nothing drawn) where the table's runs held no images out."""
    base = Path(summary_path).parent
    net = read_summary(network_summary)
    step_s = {row.run: row.step_ms / 1e3 for row in net.itertuples() if row.ranks > 1}
    rows = [row for row in summary.itertuples() if row.ranks > 1 and row.run in step_s]
    if not rows or not all((base / r.run_dir / "evals.csv").is_file() for r in rows):
        return False
    counts = sorted({int(r.ranks) for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(max(7.5, 6 * len(counts)), 4.4),
                             squeeze=False)
    for ax, n in zip(axes[0], counts):
        fp32 = next((r for r in rows if r.ranks == n and r.compression == "none"), None)
        for row in (r for r in rows if r.ranks == n):
            folder = base / row.run_dir
            curve = tta.accuracy_curve(tta.read_evals(folder), step_s[row.run],
                                       tta.run_times(folder))
            ax.plot(curve.seconds, 100 * curve.holdout_accuracy, label=row.run, **style(row.run))
        if fp32 is not None:
            for target in tta.targets_of(base / fp32.run_dir).values():
                ax.axhline(100 * target, color="grey", lw=0.8, ls="--")
            top = 100 * tta.targets_of(base / fp32.run_dir)["float32"]
            ax.set_ylim(top - 8, top + 2)
        ax.set_xlabel("seconds on the link (steps over loopback x the link's step, + start-up "
                      "and evaluations)", fontsize=8)
        ax.set_ylabel("held-out accuracy (%)")
        ax.set_title(f"{n} processes, {network.rate_text(net['netem_rate_bps'].iloc[0])} link")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Time to accuracy (dashed: float32's accuracy after the table's epochs, and "
                 "that minus 0.5 points)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", default="runs/matrix/summary.csv")
    parser.add_argument("--out-dir", default="runs",
                        help="where the PNGs go: the report's folder (default: runs, next to runs/report.md)")
    parser.add_argument("--network-summary", default=None,
                        help="the network table's summary.csv: adds network.png")
    parser.add_argument("--calibration", default=None, help="its link's calibration fit")
    args = parser.parse_args(argv)
    if args.network_summary and not args.calibration:
        parser.error("--network-summary needs --calibration")
    summary, runs = load(args.summary)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_accuracy(runs, out / "accuracy.png")
    plot_loss(runs, out / "loss.png")
    plot_step_time(summary, out / "step_time.png")
    names = ["accuracy.png", "loss.png", "step_time.png"]
    if plot_methods(summary, out / "methods.png"):
        names.append("methods.png")
    if args.network_summary:
        plot_network(args.network_summary, args.calibration, summary, out / "network.png")
        names.append("network.png")
        if plot_tta(args.summary, summary, args.network_summary, out / "tta.png"):
            names.append("tta.png")
    for name in names:
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
