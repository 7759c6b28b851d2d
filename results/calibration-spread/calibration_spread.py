"""How far Compression.auto's link calibration moves from one run to the next, and whether more
repetitions a size steady it: `calibration.time_collectives` taken again and again in one job,
with 3 repetitions a size (LINK_REPS) and with more, in turn, each fitted as the job fits it
(`calibration.fastest_repetitions`, `planner.fit_links`).

Run as the ranks, e.g. 4 over the emulated 1 Gbit/s link:
    python -m labs.netem run -n 4 --rate 1gbit --launcher gloo -- \\
        python results/calibration-spread/calibration_spread.py --out results/calibration-spread
Writes (rank 0) fits.csv: one row per calibration and collective (alpha_ms, beta_s_per_byte,
calibration_s), and fits.png: each collective's alpha by repetitions.
"""
import argparse
import csv
import os
import time

import horovod.torch as hvd

from hvd_compress.auto import calibration, planner
from hvd_compress.engine.horovod import horovod_engine

FIELDS = ["job", "calibration", "reps", "budget_s", "ranks", "collective", "alpha_ms",
          "beta_s_per_byte", "calibration_s"]


def plot(rows, path):
    """Each collective's alpha, and allgather's and alltoall's less allreduce's in the same
    calibration (what decides between a compressed route and float32), by repetitions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    def kind(r):
        return f"{r['reps']}" + (f" ({r['budget_s'] * 1e3:g} ms)" if r["budget_s"] else "")
    alpha = {(r["job"], kind(r), r["calibration"], r["collective"]): r["alpha_ms"] for r in rows}
    collectives = list(dict.fromkeys(r["collective"] for r in rows))
    reps = list(dict.fromkeys(kind(r) for r in rows))
    runs = {k: sorted({key[:3] for key in alpha if key[1] == k}) for k in reps}
    panels = [(c, lambda run, c=c: alpha[run + (c,)]) for c in collectives]
    if "allreduce" in collectives:
        panels += [(f"{c} - allreduce",
                    lambda run, c=c: alpha[run + (c,)] - alpha[run + ("allreduce",)])
                   for c in ("allgather", "alltoall") if c in collectives]
    fig, axes = plt.subplots(1, len(panels), figsize=(2.9 * len(panels), 3.4))
    for ax, (title, value) in zip(axes, panels):
        ax.boxplot([[value(run) for run in runs[k]] for k in reps], whis=(0, 100))
        ax.set_xticks(range(1, len(reps) + 1), [f"{k}\n{len(runs[k])}" for k in reps],
                      fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("repetitions a size (+: budget), calibrations", fontsize=7)
    axes[0].set_ylabel("fitted alpha (ms)")
    fig.suptitle(f"{rows[0]['ranks']} ranks: the link's alpha per calibration, whiskers min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--largest-bucket", type=int, default=87360,
                    help="bytes of the job's largest float32 bucket (default: the lab net's)")
    ap.add_argument("--calibrations", type=int, default=40, help="per repetition count")
    ap.add_argument("--reps", default="3,9,3+",
                    help="repetitions a size, comma-separated; N+: N and as many more as "
                         "calibration.LINK_REP_BUDGET_S holds (what the job does)")
    ap.add_argument("--job", type=int, default=1, help="written in each row, to pool jobs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hvd.init()
    sizes = calibration.link_sizes(args.largest_bucket)
    caps = calibration.link_grow_caps(args.largest_bucket)
    out = []
    for k in range(args.calibrations):
        for reps in args.reps.split(","):
            budget = calibration.LINK_REP_BUDGET_S if reps.endswith("+") else 0
            began = time.perf_counter()
            rows = calibration.time_collectives(horovod_engine(), sizes, reps=int(reps.rstrip("+")), caps=caps,
                                                budget_s=budget)
            took = time.perf_counter() - began
            every = hvd.allgather_object(rows, name=f"spread.{k}.{reps}")
            out += [{"job": args.job, "calibration": k, "reps": reps, "budget_s": budget,
                     "ranks": hvd.size(), "collective": c,
                     "alpha_ms": f.alpha * 1e3, "beta_s_per_byte": f.beta, "calibration_s": took}
                    for c, f in planner.fit_links(calibration.fastest_repetitions(every)).items()]
        if hvd.rank() == 0:
            print(f"calibration {k + 1}/{args.calibrations}", flush=True)
    if hvd.rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fits.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows(out)
        plot(out, os.path.join(args.out, "fits.png"))


if __name__ == "__main__":
    main()
