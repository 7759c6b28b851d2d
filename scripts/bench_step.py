#!/usr/bin/env python
"""Training-step benchmark: stock `hvd.DistributedOptimizer` against ours, side by side.

    python scripts/bench_step.py                                   # the whole grid, ~15 min
    python scripts/bench_step.py --models lab --links loopback --ranks 2 --steps 10

For every (model, link, ranks) one Horovod job is started (over an emulated link from
scripts/netem.py where a rate is given, else loopback). Inside it every row -- stock none and
fp16, ours none / fp16 / bit16 / bit8 (allgather and two-phase) -- trains its own copy of the
model on the same synthetic MNIST-shaped batches, in interleaved rounds, so every ratio to
stock float32 and stock fp16 is measured in the same run on the same machine state.

Writes OUT/steps.csv (one row per timed step and rank 0), OUT/summary.csv (median step and its
split per row, with ratios), OUT/summary.png. Models: `lab`, Horovod's example network of the
lab (21,840 parameters); `basic`, pytorch/examples' mnist network (1.2 M parameters).
"""
import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROWS = ["stock:none", "stock:fp16", "ours:none", "ours:fp16", "ours:bit16:alltoall",
        "ours:bit8:allgather", "ours:bit8:alltoall"]
LINKS = {"loopback": None, "1gbit": "1gbit", "100mbit": "100mbit"}
SPLIT = ["forward_backward_ms", "compress_ms", "communicate_ms", "decompress_ms", "overlap_ms"]


# ---- inside one Horovod job -------------------------------------------------------------------
def make_model(name):
    """The lab's two networks (labs/mnist.py --model): Horovod's example, pytorch/examples'."""
    from labs.mnist import MODELS
    return MODELS["horovod" if name == "lab" else name]()


def make_optimizer(row, model):
    import torch
    import horovod.torch as hvd
    import hvd_compress as hc
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    who, scheme, *route = row.split(":")
    if who == "stock":
        return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                        compression=getattr(hvd.Compression, scheme))
    return hc.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                   compression=getattr(hc.Compression, scheme),
                                   route=route[0] if route else None)


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
        rows[row] = (model, make_optimizer(row, model))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(args.batch_size, 1, 28, 28, generator=g),
             torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(4)]
    out = open(args.csv, "a") if rank == 0 else None
    per_round = max(1, args.steps // args.rounds)
    for rnd in range(args.rounds + 1):                  # round 0 warms every row up
        for row, (model, opt) in rows.items():
            hvd.allreduce(torch.zeros(1), name="barrier")
            for i in range(per_round if rnd else args.warmup):
                x, y = data[i % len(data)]
                t0 = time.perf_counter()
                opt.zero_grad()
                F.nll_loss(model(x), y).backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                stats = opt.pop_stats() if hasattr(opt, "pop_stats") else {}
                if rnd and out:
                    out.write(",".join(map(str, [
                        args.model, args.link, n, row, rnd, i, 1e3 * (t2 - t0),
                        1e3 * (t1 - t0 - stats.get("in_backward_s", 0.0)),
                        1e3 * stats.get("compress_s", math.nan), 1e3 * stats.get("communicate_s", math.nan),
                        1e3 * stats.get("decompress_s", math.nan), 1e3 * stats.get("overlap_s", math.nan),
                        stats.get("bytes_sent", math.nan)])) + "\n")
        if rank == 0:
            print(f"[bench_step] {args.model} {args.link} n={n}: round {rnd}/{args.rounds}", flush=True)
    if out:
        out.close()


STEP_COLUMNS = ["model", "link", "ranks", "row", "round", "step", "step_ms"] + SPLIT + ["bytes_sent"]


# ---- the driver ---------------------------------------------------------------------------------
def launch(args, model, link, n, csv):
    from labs.kit.launch import horovodrun_command, launch_env
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--link", link,
           "--rows", ",".join(args.rows), "--steps", str(args.steps), "--rounds", str(args.rounds),
           "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--csv", str(csv)]
    if LINKS[link]:
        netem = Path(__file__).with_name("netem.py")
        cmd = [sys.executable, str(netem), "run", "-n", str(n), "--rate", LINKS[link],
               "--launcher", "gloo", "--timeout", str(args.timeout), "--"] + cmd
    else:
        cmd = horovodrun_command(n, cmd, "gloo")
    subprocess.run(cmd, env=launch_env(), check=True, timeout=args.timeout + 60)


def summarise(steps):
    keys = ["model", "link", "ranks", "row"]
    summary = steps.groupby(keys, sort=False).agg(
        steps=("step_ms", "size"), step_ms=("step_ms", "median"),
        step_p10_ms=("step_ms", lambda s: s.quantile(0.1)), step_p90_ms=("step_ms", lambda s: s.quantile(0.9)),
        **{c: (c, "median") for c in SPLIT}, bytes_per_step=("bytes_sent", "median")).reset_index()
    # issue 12's "codec time per step": compress + decompress (hooks included), as a percentage
    # of forward+backward, medians over the row's steps
    codec = (steps.compress_ms + steps.decompress_ms).groupby(
        [steps[k] for k in keys], sort=False).median()
    summary["codec_pct_of_fwd_bwd"] = [
        100 * codec.get(tuple(k), math.nan) / fb
        for k, fb in zip(summary[keys].values, summary.forward_backward_ms)]
    for base in ("stock:none", "stock:fp16"):
        ref = summary[summary.row == base].set_index(keys[:3])["step_ms"]
        summary[f"vs_{base.replace(':', '_')}"] = [
            s / ref.get(tuple(k), math.nan) for s, k in zip(summary.step_ms, summary[keys[:3]].values)]
    return summary


def plot(summary, path):
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
            colors = ["#999" if r.startswith("stock") else "#1f77b4" for r in frame.row]
            ax.bar(range(len(frame)), frame.vs_stock_none, color=colors, yerr=spread, capsize=2)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks(range(len(frame)), [r.replace("ours:", "") for r in frame.row],
                          rotation=70, fontsize=7)
            ax.set_title(f"{model}, {link}, n={n}", fontsize=9)
        axes[i][0].set_ylabel("step / stock float32 (lower: faster)")
    fig.suptitle("Training step, stock hvd.DistributedOptimizer (grey) vs hvd_compress (blue), "
                 "median and p10-p90, same run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def replot(out):
    """Redraw summary.csv and summary.png from steps.csv (e.g. after merging runs)."""
    import pandas as pd
    summary = summarise(pd.read_csv(Path(out) / "steps.csv"))
    summary.to_csv(Path(out) / "summary.csv", index=False, float_format="%.4g")
    plot(summary, Path(out) / "summary.png")
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="lab,basic")
    p.add_argument("--links", default="loopback,100mbit,1gbit", help=f"of {list(LINKS)}")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per row (default 20)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--timeout", type=int, default=900, help="seconds per job")
    p.add_argument("--out", default="results/step")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--link", help=argparse.SUPPRESS)
    p.add_argument("--csv", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    args.rows = args.rows.split(",")
    bad = [r for r in args.rows if r not in ROWS]
    if bad or any(l not in LINKS for l in args.links.split(",")):
        p.error(f"rows must be among {ROWS}, links among {list(LINKS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv = out / "steps.csv"
    csv.write_text(",".join(STEP_COLUMNS) + "\n")
    for model in args.models.split(","):
        for link in args.links.split(","):
            for n in map(int, args.ranks.split(",")):
                print(f"[bench_step] {model} over {link}, {n} ranks", flush=True)
                launch(args, model, link, n, csv.resolve())
    summary = replot(out)
    cols = ["model", "link", "ranks", "row", "step_ms", "vs_stock_none", "vs_stock_fp16",
            "forward_backward_ms", "compress_ms", "communicate_ms", "decompress_ms",
            "codec_pct_of_fwd_bwd"]
    print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
