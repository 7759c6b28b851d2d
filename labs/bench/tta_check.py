"""The time-to-accuracy composition checked against direct runs on an emulated link.

    python -m labs.bench.tta_check run --out runs/tta-check --prefix /work/bin/cpu-quiet
    python -m labs.bench.tta_check report --out runs/tta-check \\
        --step-times runs/tta-steps/hvd-basic-n2/steps.csv

`run` trains each method twice with the same seed and the grid's settings (the basic net, 2
ranks, --holdout and --eval-every as labs/bench/tta_grid.py): over loopback, and directly on
the emulated link (python -m labs.netem run --rate RATE), each until the stricter target (the
float32 loopback run, trained for the lab's epochs, sets both targets as the grid does) or the
cap. Each training runs under --prefix (a timing: alone on the machine).

`report` composes the loopback run's steps to each target with the step benchmark's step on
the link (labs/kit/tta.py) and sets it beside the direct run's own time to the target; it
writes OUT/check.csv: the steps of both (the same where the exchange is deterministic: at 2
ranks every route is), the composed and the direct seconds and their error, and both runs'
parts (start-up, steps, evaluations, epoch ends), so that an error says which part it is in.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import pandas as pd

from labs.kit import runlog, tta
from labs.kit.launch import horovodrun_command
from labs.kit.matrix import run_one

from . import tta_grid

METHODS = ("none", "bit8")
NETEM = [sys.executable, "-m", "labs.netem", "run"]


def train_argv(method, run_dir, seed, target, epochs, dataset):
    run = tta_grid.Run("basic", 2, tta_grid.TRAINED[method], seed)
    argv = [sys.executable, str(tta_grid.ROOT / "labs" / "mnist.py"), "--dataset", dataset,
            "--model", "basic", "--epochs", str(epochs), "--seed", str(seed),
            "--holdout", str(tta.HOLDOUT), "--eval-every", str(run.eval_every),
            "--out", str(run_dir), "--no-progress", *run.method.flags]
    return argv + (["--target-accuracy", f"{target:.6f}"] if target is not None else [])


def run_all(args):
    """float32 over loopback first (it sets the targets), then each method over loopback and
    on the link; a finished run is kept."""
    out, failed = Path(args.out), []
    cap = tta_grid.CAP["basic"]
    for method in args.methods:
        for where in ("loopback", "link"):
            run_dir = out / f"{method.replace(':', '-')}-s{args.seed}-{where}"
            if (runlog.read_manifest(run_dir) or {}).get("status") == "complete":
                print(f"{run_dir.name}: complete, kept", flush=True)
                continue
            if run_dir.exists():
                tta_grid.move_aside(run_dir)
            float32 = out / f"none-s{args.seed}-loopback"
            target = None
            if (method, where) != ("none", "loopback"):
                target = tta.targets_of(float32)["float32"]
            epochs = tta_grid.LAB_EPOCHS if (method, where) == ("none", "loopback") else cap
            train = train_argv(method, run_dir, args.seed, target, epochs, args.dataset)
            cmd = (horovodrun_command(2, train, "gloo") if where == "loopback" else
                   NETEM + ["-n", "2", "--rate", args.rate, "--launcher", "gloo",
                            "--timeout", "3000", "--"] + train)
            code, seconds = run_one(args.prefix + cmd, out / "logs" / f"{run_dir.name}.log",
                                    3600, echo=False)
            status = (runlog.read_manifest(run_dir) or {}).get("status")
            print(f"{run_dir.name}: exit {code}, {status}, {seconds:.0f} s", flush=True)
            if status != "complete":
                failed.append(run_dir.name)
    return failed


def parts(run_dir, hit, step_s=None):
    """A run's time to `hit` in its parts (its own mean step, or `step_s`)."""
    times = tta.run_times(run_dir)
    step = times.step_s if step_s is None else step_s
    return {"startup_s": times.startup_s, "steps_s": hit.step * step,
            "evals_s": hit.evals * times.eval_s,
            "epoch_ends_s": hit.epoch_ends * times.epoch_end_s if hit.epoch_ends else 0.0,
            "step_ms": 1e3 * step}


def report(args):
    out = Path(args.out)
    cells = tta_grid.bench_cells(args.step_times, "horovod", args.step_times, args.cpu)
    link = cells[(cells.model == "basic") & (cells.ranks == 2) & (cells.link == args.rate)]
    rows = []
    for seed in args.seeds:
        rows += report_seed(args, out, link, seed)
    frame = pd.DataFrame(rows)
    runlog.atomic_write_text(out / "check.csv", frame.to_csv(index=False, float_format="%.6g"))
    print(frame[["method", "seed", "target_name", "steps_loopback", "steps_direct",
                 "composed_s", "direct_s", "error", "composed_step_ms",
                 "direct_step_ms"]].to_string(index=False))
    return 0


def report_seed(args, out, link, seed):
    """check.csv's rows of one seed: each method and target (the seed's float32 sets them)."""
    rows = []
    targets = tta.targets_of(out / f"none-s{seed}-loopback")
    for method in args.methods:
        loop_dir = out / f"{method.replace(':', '-')}-s{seed}-loopback"
        link_dir = loop_dir.with_name(loop_dir.name.replace("-loopback", "-link"))
        row = link[link.row == tta_grid.TRAINED[method].bench_row]
        if row.empty:
            raise SystemExit(f"{args.step_times}: no {tta_grid.TRAINED[method].bench_row} at "
                             f"basic, {args.rate}, 2 ranks")
        step_s = float(row.step_ms.iloc[0]) / 1e3
        for name, target in targets.items():
            loop_hit = tta.reach(tta.read_evals(loop_dir), target)
            link_hit = tta.reach(tta.read_evals(link_dir), target)
            if not (loop_hit.reached and link_hit.reached):
                continue
            composed = tta.compose(loop_hit, step_s, tta.run_times(loop_dir))
            direct = tta.elapsed(link_dir, link_hit)
            mine, theirs = parts(loop_dir, loop_hit, step_s), parts(link_dir, link_hit)
            rows.append(dict(method=method, seed=seed, link=args.rate, target_name=name,
                             target=target, steps_loopback=loop_hit.step,
                             steps_direct=link_hit.step, composed_s=composed, direct_s=direct,
                             error=composed / direct - 1,
                             **{f"composed_{k}": v for k, v in mine.items()},
                             **{f"direct_{k}": v for k, v in theirs.items()},
                             step_source=args.step_times, cpu=args.cpu))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["run", "report"])
    parser.add_argument("--out", default="runs/tta-check")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seed", type=int, default=tta_grid.SEEDS[0], help="run: the seed")
    parser.add_argument("--seeds", default=None, help="report: the seeds run (default --seed)")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--prefix", default="", help="a command each training runs under")
    parser.add_argument("--step-times", default=None, metavar="STEPS_CSV",
                        help="report: a bench_step steps.csv with the link's cell")
    parser.add_argument("--cpu", default="this machine", help="report: the CPU it ran on")
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    if "none" not in args.methods:
        parser.error("--methods needs none: float32's loopback run sets the targets")
    args.methods = ["none"] + [m for m in args.methods if m != "none"]
    args.prefix = shlex.split(args.prefix)
    args.seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    if args.what == "run":
        failed = run_all(args)
        return 1 if failed else 0
    if not args.step_times:
        parser.error("report needs --step-times")
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
