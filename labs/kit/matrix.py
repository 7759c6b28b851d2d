"""Run the course's table of trainings and summarise it in summary.csv.

    python -m labs.kit.matrix --epochs 3                     # Fashion-MNIST, 9 runs
    python -m labs.kit.matrix --only 'serial,np2-*'          # a subset
    python -m labs.kit.matrix --extras                       # + bit8 alltoall / error feedback
    python -m labs.kit.matrix --methods                      # + every other registered scheme
    python -m labs.kit.matrix --auto                         # + np2-auto, np4-auto (the plan)
    python -m labs.kit.matrix --summary-only                 # rebuild summary.csv only
    python -m labs.kit.matrix --netem-rate 1gbit             # over an emulated 1 Gbit/s net
    python -m labs.kit.matrix --netem-rate 1gbit --netem-delay 1ms   # ... with 1 ms latency

The table (labs/kit/table.py): serial (one
process), then 2 and 4 processes x {none, fp16, bit16, bit8}, every run with the same epochs,
seed and data.  Each run is labs/mnist.py in its own folder (<out>/<name>), launched with
horovodrun; its console output goes to <out>/logs/<name>.log.

Interrupted matrices resume: a run whose manifest says "complete" with the same settings is
skipped, an unfinished run with a checkpoint is continued with --resume, anything else is
moved aside (<name>.stale-<time>) and run again.  summary.csv gets one row per run.

--netem-rate RATE launches every multi-process run through the emulator (python -m labs.netem:
one network namespace per rank, each with a RATE link; needs root), into
runs/matrix-netem-<rate> by default (runs/matrix-netem-<rate>-<delay> with --netem-delay, a
one-way delay per link); the serial run has nothing to send and runs as usual.
"""
import argparse
import fnmatch
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd

from hvd_compress.auto.records import PlanReport
from hvd_compress.costmodel import methods
from labs import netem

from . import runlog, tta
from .flags import DEFAULTS
from .launch import horovodrun_command, launch_env
from .table import course_runs

TRAINER = Path(__file__).resolve().parents[1] / "mnist.py"
NETEM = [sys.executable, "-m", "labs.netem"]       # the emulator's command line
# Settings that must agree between a finished run and the matrix that wants to reuse it.
SHARED_SETTINGS = ("epochs", "dataset", "split_test", "seed", "batch_size", "lr", "momentum",
                   "model", "steps_per_epoch", "holdout")


def select(runs, only):
    """Runs whose name matches one of the comma-separated patterns in ``only``."""
    if not only:
        return runs
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(r.name, pattern) for r in runs):
            raise SystemExit(f"--only: {pattern!r} matches no run; runs are "
                             f"{', '.join(r.name for r in runs)}")
    return [r for r in runs if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]


# ---------------------------------------------------------------------------------------------
# Launching one run
# ---------------------------------------------------------------------------------------------

def trainer_args(args, run_dir):
    cmd = [str(TRAINER), "--epochs", str(args.epochs), "--dataset", args.dataset,
           "--seed", str(args.seed), "--batch-size", str(args.batch_size),
           "--lr", str(args.lr), "--momentum", str(args.momentum), "--model", args.model,
           "--out", str(run_dir)]
    if args.steps_per_epoch is not None:
        cmd += ["--steps-per-epoch", str(args.steps_per_epoch)]
    return cmd + data_flags(args)


def data_flags(args):
    """--data-dir and --split-test, where set (the trainer's, the matrix's, the job's)."""
    return ((["--data-dir", args.data_dir] if args.data_dir else [])
            + (["--split-test", str(args.split_test)] if args.split_test is not None else []))


def eval_flags(args, ranks):
    """--holdout K --eval-every N (the steps in which `ranks` processes see --eval-images
    images), where the matrix holds images out: its runs then count their steps to a target
    accuracy (labs/kit/tta.py)."""
    if not args.holdout:
        return []
    return ["--holdout", str(args.holdout),
            "--eval-every", str(tta.eval_every(ranks, args.batch_size, args.eval_images))]


def launch_command(spec, args, run_dir, resume):
    """horovodrun -np N --gloo|--mpi python labs/mnist.py ..., or with --netem-rate
    python -m labs.netem run -n N --rate RATE -- python labs/mnist.py ...; a serial run
    needs neither."""
    train = [sys.executable] + trainer_args(args, run_dir) + eval_flags(args, spec.ranks) + spec.flags
    if resume:
        train.append("--resume")
    if spec.ranks == 1:
        return train
    if args.netem_rate:
        return NETEM + ["run", "-n", str(spec.ranks),
                "--rate", args.netem_rate, "--delay", args.netem_delay or "0",
                "--launcher", args.controller,
                "--timeout", f"{args.timeout:g}", "--"] + train
    return horovodrun_command(spec.ranks, train, controller=args.controller)


def netem_problem():
    """Why this machine cannot emulate a network (labs.netem check), or None if it can."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "--netem-rate needs root (network namespaces and tc); run as root or drop it"
    done = subprocess.run(NETEM + ["check"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return f"--netem-rate: this machine cannot emulate a network: {done.stdout.strip()}"
    return None


def child_env():
    env = launch_env()
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_one(cmd, log_path, timeout, echo):
    """Run ``cmd``, teeing its output to ``log_path``; SIGTERM then SIGKILL after ``timeout``.

    Returns (exit code, or None on timeout; seconds).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=child_env(),
                                start_new_session=True)

        def pump():                     # a thread, so the main one can watch the clock
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if echo:
                    print("    " + line, end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            code = None
        except KeyboardInterrupt:
            stop(proc)
            raise
        finally:
            reader.join(timeout=10)
    return code, time.monotonic() - start


def stop(proc, grace=30):
    """Stop the process group we started: SIGTERM lets the trainer record 'interrupted'."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------------------------------------
# Deciding what to do with an existing run folder
# ---------------------------------------------------------------------------------------------

def settings_mismatch(manifest, args):
    """Names of the settings in which an existing run differs from this matrix."""
    done = manifest.get("args", {})
    wanted = {k: getattr(args, k) for k in SHARED_SETTINGS}
    mismatch = [k for k in SHARED_SETTINGS if done.get(k) != wanted[k]]
    every = tta.eval_every(manifest.get("world_size", 1), args.batch_size, args.eval_images)
    if done.get("eval_every") != (every if args.holdout else None):
        mismatch.append("eval_every")
    if manifest.get("world_size", 1) > 1:
        if network_rate(manifest) != netem_rate_bps(args):
            mismatch.append("netem rate")
        if (network_delay(manifest) or 0.0) != netem_delay_s(args):
            mismatch.append("netem delay")
    return mismatch


def netem_rate_bps(args):
    """The emulated link rate of this matrix in bit/s, None on loopback."""
    return netem.parse_rate(args.netem_rate) if args.netem_rate else None


def netem_delay_s(args):
    """The emulated one-way delay of this matrix in seconds (0 on loopback)."""
    if not (args.netem_rate and args.netem_delay):
        return 0.0
    return netem.parse_duration(args.netem_delay)


def network_rate(manifest):
    """The emulated link rate a run was made on (bit/s), None on loopback."""
    return (manifest.get("network") or {}).get("rate_bps")


def network_delay(manifest):
    """The emulated one-way delay a run was made on (s), None on loopback."""
    return (manifest.get("network") or {}).get("delay_s")


def plan(spec, args, run_dir):
    """'skip', 'resume' or 'fresh' for one run (moving a stale folder aside for 'fresh')."""
    manifest = runlog.read_manifest(run_dir)
    if manifest is None:
        if run_dir.exists() and any(run_dir.iterdir()):
            move_aside(run_dir)
        return "fresh"
    mismatch = settings_mismatch(manifest, args)
    if mismatch:
        raise SystemExit(
            f"{run_dir} was made with other settings ({', '.join(mismatch)} differ); "
            f"choose another --out or delete that folder")
    if manifest.get("status") == "complete":
        return "skip"
    if (run_dir / "checkpoint.pt").is_file() and manifest.get("world_size") == spec.ranks:
        return "resume"
    move_aside(run_dir)
    return "fresh"


def move_aside(run_dir):
    target = run_dir.with_name(f"{run_dir.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(target)
    print(f"    moved the unfinished folder aside: {target}")


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------

STEP_PARTS = ["step", "forward_backward", "compress", "communicate", "decompress", "update"]


def _seconds_between(start, end):
    if start is None or end is None:
        return math.nan
    return float(end) - float(start)


def summarize_run(name, run_dir):
    """One summary row from a run folder (NaN where the run has no numbers yet)."""
    manifest = runlog.read_manifest(run_dir) or {}
    row = {"run": name, "config": manifest.get("config"),
           "ranks": manifest.get("world_size"), "compression": manifest.get("compression"),
           "reduction": manifest.get("reduction"),
           "error_feedback": manifest.get("error_feedback"),
           "controller": manifest.get("controller"),
           "netem_rate_bps": network_rate(manifest),
           "netem_delay_s": network_delay(manifest),
           "dataset": (manifest.get("data") or {}).get("name"),
           "train_samples": (manifest.get("data") or {}).get("train_samples"),
           "status": manifest.get("status", "missing"),
           "epochs": math.nan, "train_time_s": math.nan,
           "wall_time_s": _seconds_between(manifest.get("start_unix"), manifest.get("end_unix")),
           "final_test_accuracy": math.nan, "final_test_loss": math.nan,
           "samples_per_s": math.nan, "steps_per_epoch": math.nan}
    row.update({f"{part}_ms": math.nan for part in STEP_PARTS})
    row.update(exchange_ms=math.nan, launch_span_ms=math.nan, slowest_launch_span_ms=math.nan,
               bytes_per_step=math.nan, wire_bytes_per_step=math.nan)
    row.update(NO_PLAN)
    epochs_csv, steps_csv = run_dir / "epochs.csv", run_dir / "steps.csv"
    if epochs_csv.is_file():
        epochs = pd.read_csv(epochs_csv)
        if len(epochs):
            row.update(epochs=len(epochs), train_time_s=epochs["epoch_s"].sum(),
                       final_test_accuracy=epochs["test_accuracy"].iloc[-1],
                       final_test_loss=epochs["test_loss"].iloc[-1],
                       samples_per_s=epochs["train_samples_per_s"].mean(),
                       steps_per_epoch=epochs["steps"].iloc[-1])
            if ("wire_tx_bytes" in epochs and epochs["wire_tx_bytes"].notna().all()
                    and row["ranks"]):
                # every rank's NIC over the epochs, per rank and step (NaN off netem)
                row["wire_bytes_per_step"] = (epochs["wire_tx_bytes"].sum()
                                              / (epochs["steps"].sum() * row["ranks"]))
    if steps_csv.is_file():
        steps = pd.read_csv(steps_csv)
        if len(steps):
            for part in STEP_PARTS:
                row[f"{part}_ms"] = 1000 * steps[f"{part}_s"].mean()
            row["bytes_per_step"] = steps["bytes_sent"].mean()
            for part in ("copy", "exchange", "launch_span"):
                if f"{part}_s" in steps:
                    row[f"{part}_ms"] = 1000 * steps[f"{part}_s"].mean()
            if "launch_span_s" in steps:     # the rank whose backward launches last
                row["slowest_launch_span_ms"] = 1000 * steps.groupby("rank")[
                    "launch_span_s"].mean().max()
            if "plan" in steps:
                row.update(plan_summary(steps))
    if manifest.get("plan_report"):     # what deciding cost: calibrations, rank 0's seconds
        row["plan_calibration_s"] = PlanReport.from_dict(manifest["plan_report"]).calibration_s
    row["method_parameter"] = manifest.get("method_parameter")
    args = manifest.get("args") or {}
    row.update(model=args.get("model", "horovod"), lr=args.get("lr"),
               momentum=args.get("momentum"), batch_size=args.get("batch_size"),
               steps_per_epoch_limit=args.get("steps_per_epoch"))
    row["bytes_formula"] = formula_bytes(manifest)
    row["run_dir"] = os.path.relpath(run_dir, start=run_dir.parent)
    return row


NO_PLAN = {"plan": "", "plan_predicted_ms": math.nan, "plan_measured_ms": math.nan,
           "plan_replans": math.nan, "plan_fallbacks": math.nan, "plan_fallback": "",
           "plan_calibration_s": math.nan}


def plan_summary(steps):
    """An --auto-allreduce run's plan, from rank 0's steps (every rank applies the same one):
    the last plan, its predicted step and the measured median the optimizer reported with it,
    how many steps' events say it re-planned or fell back, and the last fallback's words
    (a run that never planned trained on float32 and says why there)."""
    rank0 = steps[steps["rank"] == 0]
    planned = rank0[rank0["plan"].astype("string").fillna("") != ""]
    events = rank0["plan_event"].astype("string").fillna("")
    fallbacks = events[events.str.contains("fallback", regex=False)]
    counts = {"plan_replans": int(events.str.contains("replanned", regex=False).sum()),
              "plan_fallbacks": len(fallbacks),
              "plan_fallback": str(fallbacks.iloc[-1]) if len(fallbacks) else ""}
    if planned.empty:
        return dict(NO_PLAN, **counts)
    last = planned.iloc[-1]
    return {"plan": last["plan"], "plan_predicted_ms": float(last["plan_predicted_ms"]),
            "plan_measured_ms": float(last["plan_measured_ms"]), **counts}


def formula_bytes(manifest):
    """The cost model's bytes per step for the run (hvd_compress.costmodel.methods), to set
    beside the bytes its communicator counted; NaN where the manifest cannot say."""
    shapes, ranks = manifest.get("parameter_shapes"), manifest.get("world_size")
    block = (manifest.get("args") or {}).get("scale_block")
    # no formula for Horovod's own optimizer, Adasum, one scale per tensor (no fusion), or a
    # plan (its buckets' schemes are in the manifest's plan_report)
    if manifest.get("compression") == "auto":
        return math.nan
    if not shapes or not ranks or manifest.get("optimizer", manifest.get("route")) != "plugin" or not block:
        return math.nan
    return methods.bytes_per_step(manifest["compression"], [tuple(s) for s in shapes], ranks,
                                  manifest.get("method_parameter"), manifest.get("reduction"), block)


def read_summary(path, error=SystemExit):
    """A matrix's summary.csv; `error` (its message says what to do) when there is none."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: no summary.csv; run the matrix first (python -m labs.kit.matrix)")
    frame = pd.read_csv(path)
    if frame.empty:
        raise error(f"{path}: the summary has no runs")
    return frame


def write_summary(out):
    """summary.csv over every run folder of the table present in ``out`` (not only the ones
    this invocation ran: ``--only`` re-runs one row without dropping the others)."""
    rows = [summarize_run(spec.name, out / spec.name)
            for spec in course_runs(extras=True, methods=True, auto=True)
            if (out / spec.name).exists()]
    frame = pd.DataFrame(rows)
    runlog.atomic_write_text(out / "summary.csv", frame.to_csv(index=False))
    return frame


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    parser.add_argument("--dataset", default="fashion-mnist", choices=["mnist", "fashion-mnist"])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--split-test", type=int, default=None)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"],
                        help="base learning rate (the trainer scales it by the world size)")
    parser.add_argument("--momentum", type=float, default=DEFAULTS["momentum"])
    parser.add_argument("--model", choices=["basic", "horovod"], default=DEFAULTS["model"],
                        help="the trainer's network (default: basic, pytorch/examples')")
    parser.add_argument("--holdout", type=int, default=None, metavar="K",
                        help="hold the training set's last K images out and score them every "
                             "--eval-images images (the trainer's --holdout, --eval-every): the "
                             "report's time to accuracy counts steps on them")
    parser.add_argument("--eval-images", type=int, default=tta.EVAL_IMAGES, metavar="M",
                        help="with --holdout: training images between two evaluations, all "
                             f"processes together (default {tta.EVAL_IMAGES})")
    parser.add_argument("--steps-per-epoch", type=int, default=None, metavar="N",
                        help="a timing table: every run trains N steps a rank in each epoch "
                             "(its accuracy then says little); the network table of "
                             "run_lab.sh uses it")
    parser.add_argument("--out", default=None,
                        help="default runs/matrix (runs/matrix-netem-<RATE> with --netem-rate), "
                             "in the current folder")
    parser.add_argument("--only", default=None,
                        help="comma-separated run names or patterns, e.g. 'serial,np2-*'")
    parser.add_argument("--extras", action="store_true",
                        help="add bit8 alltoall and bit8 error-feedback rows (2 and 4 ranks)")
    parser.add_argument("--methods", action="store_true",
                        help="add every other registered scheme (int8, onebit, bf16, topk 0.01, "
                             "powersgd rank 2 and any plugin's: registry.other_schemes) at 2 "
                             "and 4 processes; the report compares them in a table of their own")
    parser.add_argument("--auto", action="store_true",
                        help="add the per-bucket plan (--auto-allreduce) at 2 and 4 processes; "
                             "the report sets its plan beside its predicted and measured step")
    parser.add_argument("--controller", choices=["gloo", "mpi"], default="gloo")
    parser.add_argument("--netem-rate", default=None, metavar="RATE",
                        help="run the multi-process rows over an emulated network of RATE "
                             "per rank (e.g. 100mbit, 1gbit) through labs.netem; needs "
                             "root; default --out runs/matrix-netem-<RATE>")
    parser.add_argument("--netem-delay", default=None, metavar="DELAY",
                        help="with --netem-rate: one-way delay per link, e.g. 0.5ms "
                             "(labs.netem --delay); default --out "
                             "runs/matrix-netem-<RATE>-<DELAY>")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds allowed per run before it is stopped (default 3600)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the runs' output")
    parser.add_argument("--prefix", default="", metavar="COMMAND",
                        help="a command each run is started under (a lock that gives a timing "
                             "run the machine alone: each run waits for it, alone)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--summary-only", action="store_true",
                        help="rebuild summary.csv from the existing run folders")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if args.steps_per_epoch is not None and args.steps_per_epoch < 1:
        parser.error(f"--steps-per-epoch must be at least 1, got {args.steps_per_epoch}")
    if args.holdout is not None and args.holdout < 1 or args.eval_images < 1:
        parser.error("--holdout and --eval-images must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.netem_delay and not args.netem_rate:
        parser.error("--netem-delay needs --netem-rate (e.g. --netem-rate 1gbit)")
    args.prefix = shlex.split(args.prefix)
    if args.netem_rate:
        try:
            netem_rate_bps(args)
        except netem.NetemError as err:
            parser.error(f"--netem-rate: {err}")
        try:
            netem_delay_s(args)
        except netem.NetemError as err:
            parser.error(f"--netem-delay: {err}")
    if args.out is None:
        name = f"matrix-netem-{args.netem_rate.lower()}" if args.netem_rate else "matrix"
        if args.netem_delay and netem_delay_s(args) > 0:
            name += f"-{args.netem_delay.lower()}"
        args.out = str(Path("runs") / name)
    return args


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out).resolve()
    runs = select(course_runs(args.extras, args.methods, args.auto), args.only)
    if args.summary_only:
        print(write_summary(out).to_string(index=False))
        return 0
    if args.netem_rate and not args.dry_run and any(spec.ranks > 1 for spec in runs):
        problem = netem_problem()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if not args.dry_run:                      # a dry run prints and writes nothing
        out.mkdir(parents=True, exist_ok=True)
        runlog.atomic_write_json(out / "matrix.json", {
            "settings": {k: v for k, v in vars(args).items() if k not in ("dry_run", "quiet")},
            "runs": [spec.name for spec in runs], "updated": runlog.now_iso()})

    failures, started = [], time.monotonic()
    for number, spec in enumerate(runs, 1):
        header = f"[{number}/{len(runs)}] {spec.name}"
        if args.dry_run:
            print(header + ": " + shlex.join(args.prefix + launch_command(spec, args,
                                                                          out / spec.name, False)))
            continue
        if not execute(spec, args, out, header,
                       f"matrix time so far {(time.monotonic() - started) / 60:.1f} min"):
            failures.append(spec.name)
    if args.dry_run:
        return 0
    return finish(out, failures)


def execute(spec, args, out, header, note=""):
    """Run (or resume, or skip) one row of the table; True when it is complete."""
    run_dir = out / spec.name
    action = plan(spec, args, run_dir)
    if action == "skip":
        print(f"{header}: already complete, skipped", flush=True)
        return True
    cmd = args.prefix + launch_command(spec, args, run_dir, resume=action == "resume")
    print(f"{header}: {'resuming' if action == 'resume' else 'starting'} "
          f"({spec.ranks} process{'es' if spec.ranks > 1 else ''}; "
          f"{note + '; ' if note else ''}log {out / 'logs' / spec.name}.log)", flush=True)
    code, seconds = run_one(cmd, out / "logs" / f"{spec.name}.log", args.timeout,
                            echo=not args.quiet)
    manifest = runlog.read_manifest(run_dir) or {}
    if code == 0 and manifest.get("status") == "complete":
        row = summarize_run(spec.name, run_dir)
        print(f"{header}: done in {seconds:.0f} s, test accuracy "
              f"{row['final_test_accuracy']:.4f}", flush=True)
        return True
    why = "timed out" if code is None else f"exit code {code}"
    print(f"{header}: FAILED ({why}, status {manifest.get('status')}); "
          f"see {out / 'logs' / spec.name}.log", flush=True)
    return False


def finish(out, failures):
    """Write summary.csv, print it; 1 (and what to do) if runs failed."""
    frame = write_summary(out)
    columns = ["run", "status", "epochs", "train_time_s", "final_test_accuracy", "step_ms",
               "communicate_ms", "bytes_per_step"]
    print(f"\nsummary: {out / 'summary.csv'}")
    print(frame[[c for c in columns if c in frame]].to_string(index=False))
    if failures:
        print(f"\n{len(failures)} run(s) failed: {', '.join(failures)}; run the same command "
              f"again to retry them (finished runs are kept)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
