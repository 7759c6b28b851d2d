"""The time-to-accuracy grid: every method's steps to two targets, and its time on four links.

    python -m labs.bench.tta_grid --dry-run               # the runs it would start, and their cost
    python -m labs.bench.tta_grid --prefix /work/bin/cpu-shared   # run (resumable), then summarise
    python -m labs.bench.tta_grid --summary-only --out runs/tta    # the CSVs and the plot again
    python -m labs.bench.tta_grid --summary-only --out runs/tta-new \
        --steps-from results/tta/steps.csv --targets-from results/tta/targets.csv \
        --step-times-csv results/tta/step_times.csv [--step-times FRONT:CPU:STEPS_CSV ...]
                                  # the committed counts and cells, with the runs in runs/tta-new

Steps (labs/kit/tta.py): each method trains over loopback (labs/mnist.py on Horovod,
labs/ddp_mnist.py for DDP's own hooks and auto on DDP) with --holdout HOLDOUT and an evaluation
every EVAL_IMAGES training images (--eval-every 40 at 2 ranks, 20 at 4), at the lab's settings
(lr 0.02 x ranks, momentum 0.9, batch 64 a rank), both lab networks, 2 and 4 ranks. float32
first, for SEEDS seeds and CAP epochs: its held-out accuracy after the lab's epochs (2),
averaged over its seeds, sets the cell's targets, that minus 0.5 points ('lab') and itself
('float32'); every other method then trains until it passes the stricter one or CAP epochs
(--target-accuracy), for the seeds METHOD_SEEDS gives it. A method that never reaches a target
within CAP epochs says so. Steps do not depend on load: run them beside other work (--prefix
cpu-shared). --targets-from TARGETS_CSV gives a cell's targets where its float32 folders are
gone: its float32 runs are then not trained (unless --methods names none).

Time: steps x the method's step time on each link (a step benchmark's cells: --step-times,
bench_step and bench_ddp steps.csv files, each with the CPU it was measured on; or
--step-times-csv, a step_times.csv this grid wrote, whose cells name their source and CPU) +
start-up, evaluations and epoch ends, the least of each over the runs of the same trainer,
network and ranks (the runs share the machine: load adds to these seconds, never to the steps).
Where two methods compute the same steps, one measurement serves both (STEPS_OF: DDP's own
allreduce is float32's, bit for bit at 2 ranks; our hook's schemes on DDP are the same codecs
as on Horovod, only the buckets' layout, hence the scale blocks' boundaries, differ). Auto for
time to accuracy decides on its front's and link's cells, so each front runs its own
(auto:tta-<link>, ddp:auto:tta-<link>: results/tta/auto/step_s/, written by python -m
labs.bench.tta_auto --write-step-s); labs/bench/tta_auto.py composes their time mode by mode.

Without run folders (--steps-from STEPS_CSV: a steps.csv this grid wrote; the runs in --out
replace their rows): the tables are composed from the rows as from the runs, byte for byte;
tta.png draws the runs that have folders and names the methods without a curve; scaling*.csv
is not written (its target is one the rows do not hold).

Writes OUT/runs/<run>/ (the run folders), OUT/logs/, and OUT/targets.csv, OUT/steps.csv (each
run's reach of each target), OUT/step_times.csv, OUT/tta.csv (each front, network, link, ranks,
method and target: the time, the steps, how many seeds reached it), OUT/tables.md and
OUT/tta.png.
"""
from __future__ import annotations

import argparse
import math
import shlex
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from labs.kit import runlog, tta
from labs.kit.flags import DEFAULTS
from labs.kit.launch import horovodrun_command
from labs.kit.matrix import move_aside, run_one

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("basic", "horovod")                # labs/mnist.py --model
BENCH_MODEL = {"basic": "basic", "horovod": "lab"}   # the step benchmarks' names of them
RANKS = (2, 4)
LINKS = ("loopback", "1gbit", "100mbit", "10mbit")
HOLDOUT, EVAL_IMAGES = tta.HOLDOUT, tta.EVAL_IMAGES    # the lab job's: the same runs
LAB_EPOCHS = DEFAULTS["epochs"]              # float32's accuracy after these sets the targets
CAP = {"basic": 3, "horovod": 4}             # epochs a method may take to reach them
LOOSE_POINTS = tta.LOOSE_POINTS              # the 'lab' target: float32's - 0.5 points
SEEDS = (42, 1, 2)


@dataclass(frozen=True)
class Method:
    """One way of exchanging gradients: its key (the grid's name), the trainer that runs it
    and its flags, and its row in the step benchmark (bench_step for Horovod, bench_ddp for
    DDP)."""
    key: str
    trainer: str            # "horovod" (labs/mnist.py) or "ddp" (labs/ddp_mnist.py)
    flags: tuple
    bench_row: str

    @property
    def front(self):
        return self.trainer


def _ours(key, flags, row):
    return Method(key, "horovod", tuple(flags), row)


# Every method the plugin has (registry order), at a few parameters, and Compression.auto.
OURS = [_ours("none", [], "ours:none"), _ours("fp16", ["--fp16-allreduce"], "ours:fp16"),
        _ours("bit16", ["--bit16-allreduce"], "ours:bit16:alltoall"),
        _ours("bf16", ["--bf16-allreduce"], "ours:bf16"),
        _ours("bit8", ["--bit8-allreduce"], "ours:bit8:allgather"),
        _ours("bit8:alltoall", ["--bit8-allreduce", "--route", "alltoall"], "ours:bit8:alltoall"),
        _ours("int8", ["--int8-allreduce"], "ours:int8"),
        _ours("onebit", ["--onebit-allreduce"], "ours:onebit")]
OURS += [_ours(f"topk{r:g}", ["--topk-allreduce", f"{r:g}"], f"ours:topk{r:g}")
         for r in (0.1, 0.01, 0.001)]
OURS += [_ours(f"powersgd{k}", ["--powersgd-allreduce", str(k)], f"ours:powersgd{k}")
         for k in (1, 2, 4)]
OURS += [_ours("auto", ["--auto-allreduce"], "ours:auto")]
# Compression.auto(objective="time_to_accuracy") deciding on a link's step cells (injected:
# results/tta/auto/README.md), one run per link and front: its choice depends on the link's
# cells, and those are the front's (the Horovod step benchmark's or the DDP one's).
# `python -m labs.bench.tta_auto --write-step-s` writes the files from a step_times.csv.
STEP_S_DIR = ROOT / "results" / "tta" / "auto" / "step_s"
AUTO_TTA = "auto:tta-"


def step_s_name(front, link):
    """The injected step cells' file of a front and link: <link>.json (Horovod, the first
    runs' name), ddp-<link>.json (DDP)."""
    return f"{link}.json" if front == "horovod" else f"{front}-{link}.json"


def _auto_tta_flags(front, link):
    return ("--auto-allreduce", "--auto-objective", "time_to_accuracy", "--auto-step-s",
            str(STEP_S_DIR / step_s_name(front, link)))


OURS += [_ours(f"{AUTO_TTA}{link}", _auto_tta_flags("horovod", link), "ours:auto")
         for link in LINKS]
# DDP's own hooks (labs/ddp_mnist.py): its fp16_compress_hook and powerSGD_hook at rank 1.
DDP_OWN = [Method("ddp:fp16", "ddp", ("--ddp-fp16",), "stock:fp16"),
           Method("ddp:powersgd1", "ddp", ("--ddp-powersgd", "1"), "stock:powersgd1")]
# Compression.auto for time to accuracy in our DDP hook (labs/ddp_mnist.py takes labs/mnist.py's
# --auto-* flags), deciding on DDP's step cells of the link: runs of their own, since its
# decisions, hence its steps, follow the front's cells.
DDP_AUTO = [Method(f"ddp:{AUTO_TTA}{link}", "ddp", _auto_tta_flags("ddp", link), "ours:auto")
            for link in LINKS]
TRAINED = {m.key: m for m in OURS + DDP_OWN + DDP_AUTO}
# The methods that are Compression.auto (the step's objective or time to accuracy): never "the
# best fixed method" of a cell (labs/bench/tta_auto.py).
AUTO_KEYS = frozenset(m.key for m in TRAINED.values() if "--auto-allreduce" in m.flags)
# The fronts' rows of the time table: (front, method) -> the method whose steps it takes.
# Horovod: ours, each its own. DDP: its own allreduce is float32's (the same sum and mean;
# at 2 ranks a + b in either order, bit for bit: tests/test_tta_runs.py), our hook's schemes are
# ours (the same codec and route on DDP's buckets), its own hooks their own runs. Auto for time
# to accuracy is the exception: each front's runs decided on that front's cells, so each front
# takes its own runs' steps (auto:tta-<link> on Horovod, ddp:auto:tta-<link> on DDP).
STEPS_OF = {("horovod", m.key): m.key for m in OURS}
STEPS_OF.update({("ddp", m.key): m.key for m in OURS if not m.key.startswith(AUTO_TTA)})
STEPS_OF.update({("ddp", "ddp:none"): "none", ("ddp", "ddp:fp16"): "ddp:fp16",
                 ("ddp", "ddp:powersgd1"): "ddp:powersgd1"})
STEPS_OF.update({("ddp", m.key): m.key for m in DDP_AUTO})
DDP_ROW = {"ddp:none": "stock:none", "ddp:fp16": "stock:fp16", "ddp:powersgd1": "stock:powersgd1",
           **{m.key: m.bench_row for m in DDP_AUTO}}


# The methods that train every seed, per (network, ranks); every other method trains the first
# seed only. float32 always trains every seed (its mean sets the targets). The rest are the
# methods a conclusion compares: one seed's steps move by an evaluation interval or more from
# seed to seed (float32's own spread), so a ranking between two of them needs their spread too.
METHOD_SEEDS = {
    # auto on either front: its target is read against the best fixed method seed by seed,
    # and its decisions move with the trajectory, so one seed says little.
    ("horovod", 2): {"bit8", "bit8:alltoall", "topk0.1", "powersgd1", "powersgd4",
                     "ddp:fp16", "ddp:powersgd1",
                     *(f"{front}auto:tta-{link}" for front in ("", "ddp:") for link in LINKS)},
    ("basic", 2): {"bit8", "bit8:alltoall", "topk0.1", "powersgd1", "ddp:fp16",
                   "ddp:powersgd1"},
    # The extrapolation to 8-64 ranks fits through the 2- and 4-rank cells: it needs each
    # method's spread at 4 ranks as much as at 2.
    ("horovod", 4): {"bit8", "topk0.1", "powersgd1", "ddp:fp16", "ddp:powersgd1"},
}


def seeds_of(key, model, ranks, seeds=SEEDS):
    """float32 sets the targets: every seed. The methods METHOD_SEEDS names for the cell:
    every seed. The rest: the first seed."""
    if key == "none" or key in METHOD_SEEDS.get((model, ranks), ()):
        return tuple(seeds)
    return tuple(seeds[:1])


@dataclass(frozen=True)
class Run:
    model: str
    ranks: int
    method: Method
    seed: int

    @property
    def name(self):
        return f"{self.model}-np{self.ranks}-{self.method.key.replace(':', '-')}-s{self.seed}"

    @property
    def eval_every(self):
        return tta.eval_every(self.ranks)


def grid(models=MODELS, ranks=RANKS, methods=None, seeds=SEEDS, max_seeds=None):
    """Every run, float32's first in each (model, ranks): its runs set the others' targets;
    then the other methods, seed by seed."""
    keys = methods or list(TRAINED)
    runs = []
    for model in models:
        for n in ranks:
            runs += [Run(model, n, TRAINED["none"], s) for s in seeds]
            # Seed by seed: every method's first seed before any method's second, so that a
            # grid stopped part-way has every method once before it has any twice.
            for seed in seeds:
                runs += [Run(model, n, TRAINED[key], seed) for key in keys if key != "none"
                         and seed in seeds_of(key, model, n, seeds)[:max_seeds]]
    return runs


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_command(run, run_dir, target, resume, dataset, data_dir=None, cap=None):
    """The trainer's command line: the lab's settings, the held-out split, CAP epochs (or
    `cap`), and the early stop at `target` (None: float32's runs, which set it)."""
    trainer = "mnist.py" if run.method.trainer == "horovod" else "ddp_mnist.py"
    argv = [str(ROOT / "labs" / trainer), "--dataset", dataset, "--model", run.model,
            "--epochs", str(cap or CAP[run.model]), "--seed", str(run.seed),
            "--holdout", str(HOLDOUT), "--eval-every", str(run.eval_every),
            "--out", str(run_dir), "--no-progress", *run.method.flags]
    argv += ["--data-dir", data_dir] if data_dir else []
    argv += ["--target-accuracy", f"{target:.6f}"] if target is not None else []
    argv += ["--resume"] if resume else []
    if run.method.trainer == "horovod":
        return horovodrun_command(run.ranks, [sys.executable] + argv, "gloo")
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(run.ranks),
            "--master-port", str(free_port())] + argv


# ---- targets ----------------------------------------------------------------------------------

def lab_accuracy(run_dir):
    """A run's held-out accuracy after the lab's epochs (tta.accuracy_after: the mean of its
    last evaluations up to that epoch's end)."""
    try:
        return tta.accuracy_after(tta.read_evals(run_dir), LAB_EPOCHS)
    except tta.RunError as err:
        raise tta.RunError(f"{run_dir}: {err}") from None


def targets(out, model, ranks, seeds=SEEDS, known=None):
    """{'lab': float32's mean - 0.5 points, 'float32': float32's mean}, None until every
    float32 seed of the cell is complete. `known` ({(model, ranks): targets}, from a
    targets.csv or the rows of a steps.csv: known_targets) gives a cell's targets where its
    float32 folders are gone; float32 runs in OUT that set other targets are an error (the known
    rows were counted against the known targets)."""
    given = (known or {}).get((model, int(ranks)))
    accuracies = []
    for seed in seeds:
        run_dir = Path(out) / "runs" / Run(model, ranks, TRAINED["none"], seed).name
        manifest = runlog.read_manifest(run_dir) or {}
        if manifest.get("status") != "complete":
            return given
        accuracies.append(lab_accuracy(run_dir))
    mean = sum(accuracies) / len(accuracies)
    own = {"lab": mean - LOOSE_POINTS, "float32": mean}
    if given is not None and any(abs(own[k] - given[k]) > 5e-7 for k in own):
        raise tta.RunError(
            f"{model} net, {ranks} ranks: float32's runs in {Path(out) / 'runs'} set the targets "
            f"{own['lab']:.6f} / {own['float32']:.6f}, the given ones are {given['lab']:.6f} / "
            f"{given['float32']:.6f}: the given rows were counted against the given targets "
            f"(move those float32 runs away, or leave out --targets-from/--steps-from)")
    return own


def read_targets(path):
    """A targets.csv (model, ranks, lab, float32) as {(model, ranks): {'lab', 'float32'}}."""
    frame = pd.read_csv(path)
    missing = {"model", "ranks", "lab", "float32"} - set(frame.columns)
    if missing:
        raise tta.RunError(f"{path}: no column {', '.join(sorted(missing))} (a targets.csv "
                           f"of this grid has model, ranks, lab, float32)")
    return {(r.model, int(r.ranks)): {"lab": float(r.lab), "float32": float(r.float32)}
            for r in frame.itertuples()}


def targets_of_rows(steps):
    """The targets the rows of a steps.csv were counted against, by cell: each target name's
    one value (two values of one name in a cell are an error: rows of different grids)."""
    out = {}
    for (model, n), cell in steps.groupby(["model", "ranks"], sort=False):
        values = {}
        for name in ("lab", "float32"):
            found = sorted(set(cell.loc[cell.target_name == name, "target"]))
            if len(found) > 1 and found[-1] - found[0] > 5e-7:
                raise tta.RunError(f"{model} net, {n} ranks: the rows' {name} target takes "
                                   f"{len(found)} values ({', '.join(f'{v:.6f}' for v in found)})"
                                   f": rows of different grids")
            if found:
                values[name] = found[0]
        if len(values) == 2:
            out[(model, int(n))] = values
    return out


def known_targets(targets_from=None, rows=None):
    """The targets of the cells whose float32 folders may be gone: a targets.csv's, else those
    the given rows were counted against; where both name a cell they must agree."""
    known = read_targets(targets_from) if targets_from else {}
    for cell, values in (targets_of_rows(rows) if rows is not None and not rows.empty
                         else {}).items():
        if cell in known and any(abs(known[cell][k] - values[k]) > 5e-7 for k in values):
            raise tta.RunError(f"{cell[0]} net, {cell[1]} ranks: {targets_from} gives the "
                               f"targets {known[cell]}, the rows were counted against {values}")
        known.setdefault(cell, values)
    return known


# ---- running -------------------------------------------------------------------------------------

def plan_run(run_dir, target):
    """'skip', 'resume' or 'fresh' for a run folder. A complete run serves any target at or
    below the one it stopped at (it passed them on the way), and any target if it ran to its
    cap without stopping; one that stopped below the stricter target now asked, or was made
    for float32's place (no target) and is asked for one, or the other way, is run again."""
    manifest = runlog.read_manifest(run_dir)
    if manifest is None:
        if run_dir.exists() and any(run_dir.iterdir()):
            move_aside(run_dir)
        return "fresh"
    asked = (manifest.get("args") or {}).get("target_accuracy")
    stopped = "reached after" in str(manifest.get("reason") or "")
    if (asked is None) != (target is None):
        serves = False
    else:
        serves = asked is None or asked >= target - 5e-7 or (
            manifest.get("status") == "complete" and not stopped)
    if not serves:
        move_aside(run_dir)
        return "fresh"
    if manifest.get("status") == "complete":
        return "skip"
    if (run_dir / "checkpoint.pt").is_file():
        return "resume"
    move_aside(run_dir)
    return "fresh"


# Relative cost of a run for the progress line: epochs x seconds an epoch (2-core EPYC, lab
# settings, evaluations included) by network; a run that stops at its target takes fewer.
EPOCH_S = {"basic": 115, "horovod": 25}


def run_grid(args):
    out = Path(args.out)
    known = known_targets(args.targets_from, read_steps_rows(args.steps_from))
    runs = grid(args.models, args.ranks, args.methods, args.seeds, args.max_seeds)
    # A cell whose targets are given needs no float32 runs to set them (their folders may be
    # gone, their rows kept): train them only when --methods names none.
    runs = [r for r in runs if not (r.method.key == "none" and (r.model, r.ranks) in known
                                    and "none" not in (args.methods or ()))]
    weights = [(args.cap or CAP[r.model]) * EPOCH_S[r.model] for r in runs]
    total, done, ran_weight, started = sum(weights), 0.0, 0.0, time.monotonic()
    failures = []
    for number, (run, weight) in enumerate(zip(runs, weights), 1):
        header = f"[tta {number}/{len(runs)}] {run.name}"
        run_dir = out / "runs" / run.name
        target = None
        if run.method.key != "none":
            cell = targets(out, run.model, run.ranks, args.seeds, known)
            if cell is None and not args.dry_run:
                print(f"{header}: waits for float32's runs of its cell (failed or not run; "
                      f"or give its targets: --targets-from)", flush=True)
                failures.append(run.name)
                continue
            target = round(cell["float32"], 6) if cell else 1.0   # dry run: a placeholder
        if args.dry_run:
            print(header + ": " + shlex.join(args.prefix + train_command(
                run, run_dir, target, False, args.dataset, args.data_dir, args.cap)))
            continue
        held = time.monotonic()
        while args.pause_file and Path(args.pause_file).exists():
            time.sleep(10)          # another measurement wants the machine alone
        started += time.monotonic() - held     # the estimate counts the grid's own time
        action = plan_run(run_dir, target)
        done += weight
        if action == "skip":
            print(f"{header}: complete, kept", flush=True)
            continue
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        cmd = args.prefix + train_command(run, run_dir, target, action == "resume",
                                          args.dataset, args.data_dir, args.cap)
        code, seconds = run_one(cmd, out / "logs" / f"{run.name}.log", args.timeout, echo=False)
        ran_weight += weight
        manifest = runlog.read_manifest(run_dir) or {}
        ok = code == 0 and manifest.get("status") == "complete"
        if not ok:
            failures.append(run.name)
        elapsed = time.monotonic() - started
        left = (total - done) * elapsed / max(ran_weight, 1.0)
        print(f"{header}: {'done' if ok else 'FAILED'} in {seconds:.0f} s "
              f"({manifest.get('reason') or manifest.get('status')}) "
              f"[{100 * done / total:.0f}% | {elapsed / 3600:.2f} h | ~{left / 3600:.2f} h left]",
              flush=True)
    if args.dry_run:
        print(f"{len(runs)} runs, at most {total / 3600:.1f} h of machine time "
              f"(each to its cap; a run stops at its target)")
    return failures


# ---- summaries ----------------------------------------------------------------------------------

def steps_table(out, seeds=SEEDS, known=None):
    """One row per run and target: the steps to it (and what else came before it), the run's
    accuracy after the lab's epochs, and its own times besides the link. `known`: targets of
    cells whose float32 folders are gone (targets())."""
    rows, out = [], Path(out)
    for model in MODELS:
        for n in RANKS:
            cell = targets(out, model, n, seeds, known)
            if cell is None:
                continue
            for run in grid([model], [n], seeds=seeds):
                run_dir = out / "runs" / run.name
                if (runlog.read_manifest(run_dir) or {}).get("status") != "complete":
                    continue
                evals, times = tta.read_evals(run_dir), tta.run_times(run_dir)
                try:
                    at_lab = lab_accuracy(run_dir)
                except tta.RunError:            # stopped at its target before the lab's end
                    at_lab = math.nan
                stopped_at = stopped_target(run_dir)
                for name, target in cell.items():
                    hit = tta.reach(evals, target)
                    if not hit.reached and target > stopped_at + 5e-7:
                        continue    # it stopped at a lower target: it says nothing of this one
                    rows.append(dict(model=model, ranks=n, method=run.method.key,
                                     seed=run.seed, target_name=name, target=target,
                                     reached=hit.reached, step=hit.step, samples=hit.samples,
                                     evals=hit.evals, epoch_ends=hit.epoch_ends,
                                     accuracy=hit.accuracy, last_step=hit.last_step,
                                     accuracy_after_lab_epochs=at_lab,
                                     startup_s=times.startup_s, eval_s=times.eval_s,
                                     epoch_end_s=times.epoch_end_s,
                                     loopback_step_s=times.step_s, run=run.name))
    return pd.DataFrame(rows)


# A steps.csv's columns (steps_table's rows), and the key of a run's rows in it.
STEPS_COLUMNS = ["model", "ranks", "method", "seed", "target_name", "target", "reached", "step",
                 "samples", "evals", "epoch_ends", "accuracy", "last_step",
                 "accuracy_after_lab_epochs", "startup_s", "eval_s", "epoch_end_s",
                 "loopback_step_s", "run"]
RUN_KEY = ["model", "ranks", "method", "seed"]


def read_steps_rows(paths):
    """The rows of steps.csv files written by this grid (--steps-from: runs whose folders are
    gone, the counts kept), a later file's rows of a run replacing an earlier one's; None
    without files. A file that is not such a steps.csv, or names a method the grid does not
    have, is an error naming what is wrong."""
    frames = []
    for path in paths or ():
        frame = pd.read_csv(path)
        missing = [c for c in STEPS_COLUMNS if c not in frame.columns]
        if missing:
            raise tta.RunError(f"{path}: not a tta_grid steps.csv (no {', '.join(missing)})")
        unknown = sorted(set(frame.method) - set(TRAINED))
        if unknown:
            raise tta.RunError(f"{path}: methods the grid does not have: {', '.join(unknown)}")
        frame["reached"] = frame["reached"].astype(bool)
        frames.append(frame[STEPS_COLUMNS])
    if not frames:
        return None
    return merge_steps(frames[0], *frames[1:])


def merge_steps(given, *newer):
    """`given`'s rows with each run of `newer` (by model, ranks, method and seed) in place of
    that run's rows: a run counted again replaces its old count, every other row is kept."""
    merged = given
    for frame in newer:
        if frame is None or frame.empty:
            continue
        if merged is None or merged.empty:
            merged = frame
            continue
        present = set(_run_keys(frame))
        kept = [k not in present for k in _run_keys(merged)]
        merged = pd.concat([merged[kept], frame], ignore_index=True)
    return merged if merged is not None else pd.DataFrame()


def _run_keys(frame):
    return [(str(m), int(n), str(k), int(s)) for m, n, k, s in frame[RUN_KEY].values]


def stopped_target(run_dir):
    """The target a run stopped at (--target-accuracy, reached), inf if it did not stop
    early: the curve past it was never trained, so a higher target (the cell's, after more
    float32 seeds moved its mean up) is neither reached nor missed by this run."""
    manifest = runlog.read_manifest(run_dir) or {}
    asked = (manifest.get("args") or {}).get("target_accuracy")
    if asked is None or "reached after" not in str(manifest.get("reason") or ""):
        return math.inf
    return float(asked)


def named_parameter(row):
    """A benchmark row of a method at its default parameter, named with it: ours:topk ->
    ours:topk0.01, ours:powersgd -> ours:powersgd2 (the registry's defaults), as the grid
    names its methods; every other row as it is."""
    from hvd_compress import registry
    who, _, rest = row.partition(":")
    name, _, route = rest.partition(":")
    entry = registry.SCHEMES.get(name)
    if who != "ours" or entry is None or entry.parameter is None:
        return row
    return f"ours:{name}{entry.parameter:g}" + (f":{route}" if route else "")


def bench_cells(steps_csv, front, source, cpu):
    """Step times from a step benchmark's steps.csv (bench_step or bench_ddp: rank 0's timed
    steps, in rounds): per (model, link, ranks, row) the median over rounds of each round's
    mean step. A sum of steps is what a run's time is, so a mean; a round's, so that one slow
    round cannot carry it."""
    steps = pd.read_csv(steps_csv)
    steps["row"] = steps["row"].map(named_parameter)
    means = steps.groupby(["model", "link", "ranks", "row", "round"]).step_ms.mean()
    cells = means.groupby(level=[0, 1, 2, 3]).median().rename("step_ms").reset_index()
    rounds = means.groupby(level=[0, 1, 2, 3]).size().rename("rounds").reset_index()
    cells = cells.merge(rounds, on=["model", "link", "ranks", "row"])
    return cells.assign(front=front, source=str(source), cpu=cpu)


# A step_times.csv's columns (bench_cells' order): the cell, its time, its source and CPU.
CELL_COLUMNS = ["model", "link", "ranks", "row", "step_ms", "rounds", "front", "source", "cpu"]


def read_cells_csv(path):
    """The cells of a step_times.csv this grid wrote (--step-times-csv): each keeps the source
    file and CPU it names (the step benchmarks' folders need not be here)."""
    frame = pd.read_csv(path)
    missing = [c for c in CELL_COLUMNS if c not in frame.columns]
    if missing:
        raise tta.RunError(f"{path}: not a tta_grid step_times.csv (no {', '.join(missing)}; "
                           f"a step benchmark's steps.csv goes to --step-times FRONT:CPU:PATH)")
    return frame[CELL_COLUMNS]


def read_step_times(specs, csvs=()):
    """--step-times-csv PATH ... then --step-times FRONT:CPU:PATH ...: every cell of every
    file; a later file's cell replaces an earlier one's (the newer measurement of the same
    row), so a step benchmark's new cells replace those of a step_times.csv. A step
    benchmark's file replaces every earlier cell of each (front, network, ranks) it measured,
    the rows it did not measure included: the rows a time table compares side by side come
    from one run on one CPU, never some from another machine."""
    frames = [read_cells_csv(path) for path in csvs or ()]
    group = ["front", "model", "ranks"]
    for spec in specs:
        front, cpu, path = spec.split(":", 2)
        new = bench_cells(path, front, path, cpu)
        measured = set(map(tuple, new[group].values))
        frames = [f[[tuple(k) not in measured for k in f[group].values]] for f in frames]
        frames.append(new)
    if not frames:
        return pd.DataFrame(columns=CELL_COLUMNS)
    cells = pd.concat(frames, ignore_index=True)
    return cells.drop_duplicates(["front", "model", "link", "ranks", "row"], keep="last")


def front_methods(front):
    """The time table's methods of a front, with their benchmark rows."""
    rows = {m.key: m.bench_row for m in OURS if (front, m.key) in STEPS_OF}
    if front == "ddp":
        rows.update(DDP_ROW)
    return rows


def tta_table(steps, cells):
    """The time to each target of every (front, network, link, ranks, method) that has both its
    steps and its step time, over its seeds' runs (each composed with its own start-up,
    evaluations and epoch ends): the median (a seed that never reached the target counts as
    never, so the median is a time where most seeds reached it), the fastest and slowest
    seed, how many reached it; the steps likewise. A median, not a mean: on three seeds one
    slow seed (PowerSGD's steps differ by 2x from seed to seed) would carry a mean. An
    auto:tta-<link> method has a row on its link only (its decisions were that link's); its
    step there is the auto row's cell (tta_auto composes it mode by mode)."""
    rows = []
    for front in ("horovod", "ddp"):
        for method, bench_row in front_methods(front).items():
            trained = steps[steps["method"] == STEPS_OF[(front, method)]]
            own = auto_link(method)
            for (model, n, name), runs in trained.groupby(["model", "ranks", "target_name"]):
                for link in LINKS:
                    if own is not None and link != own:
                        continue        # it decided for its own link's cells, not this one's
                    cell = cells[(cells.front == front) & (cells.model == BENCH_MODEL[model])
                                 & (cells.link == link) & (cells.ranks == n)
                                 & (cells.row == bench_row)]
                    if cell.empty:
                        continue
                    step_s = float(cell.step_ms.iloc[0]) / 1e3
                    seconds = [tta.compose(_reach(r), step_s, _times(r))
                               for r in runs.itertuples()]
                    counts = [float(r.step) if r.reached else math.inf
                              for r in runs.itertuples()]
                    reached = [s for s in seconds if math.isfinite(s)]
                    rows.append(dict(
                        front=front, model=model, link=link, ranks=n, method=method,
                        target_name=name, target=runs["target"].iloc[0],
                        seeds=len(runs), reached=len(reached),
                        steps=_finite(statistics.median(counts)),
                        steps_min=_finite(min(counts)), steps_max=_finite(max(counts)),
                        step_ms=1e3 * step_s, tta_s=statistics.median(seconds),
                        tta_min_s=min(seconds), tta_max_s=max(seconds),
                        steps_from=STEPS_OF[(front, method)],
                        step_source=cell.source.iloc[0], cpu=cell.cpu.iloc[0]))
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    keys = ["front", "model", "link", "ranks", "target_name"]
    best = table.groupby(keys).tta_s.transform("min")
    none = table[table.method.isin(["none", "ddp:none"])].groupby(keys).tta_s.min()
    table["vs_best"] = table.tta_s / best
    table["vs_float32"] = [t / none.get(tuple(k), math.nan)
                           for t, k in zip(table.tta_s, table[keys].values)]
    return table


def auto_link(key):
    """The link an auto-for-time-to-accuracy method decided for (its injected cells'), None for
    every other method."""
    return key.rsplit(AUTO_TTA, 1)[1] if AUTO_TTA in key else None


def _finite(value):
    return value if math.isfinite(value) else math.nan


def _reach(row):
    return tta.Reach(row.target, None if not row.reached else int(row.step),
                     None if not row.reached else int(row.samples), int(row.evals),
                     int(row.epoch_ends), row.accuracy, int(row.last_step))


def _times(row):
    return tta.RunTimes(row.startup_s, row.eval_s, row.epoch_end_s, row.loopback_step_s)


def unloaded_times(steps):
    """Each run's start-up, evaluation and epoch end replaced by the least of them over the
    runs of its trainer, network and ranks. The grid's runs share the machine (their steps do
    not depend on load, their seconds do): another job's load only ever adds to these, and
    they are the trainer's, not the method's (imports, the launcher's rendezvous, the data; a
    forward pass over the held-out split; the test set and the checkpoint), so the least over
    many runs is the nearest to the machine alone, where the step cells were measured."""
    if steps.empty:
        return steps
    trainer = steps["method"].map(lambda key: TRAINED[key].trainer)
    least = steps.groupby([steps["model"], steps["ranks"], trainer])
    steps = steps.copy()
    for column in ("startup_s", "eval_s", "epoch_end_s"):
        steps[column] = least[column].transform("min")
    return steps


def plot(out, steps, cells, path):
    """Held-out accuracy against time on each link, one line per method (its first seed's
    run with a folder in OUT/runs), a panel per (network, ranks) and link, the two targets as
    dashed lines. Returns (drawn, the methods that have rows and a step cell but no curve):
    none of their runs has a folder here (their rows came from --steps-from). With no curve at
    all nothing is drawn (a plot of dashed lines would replace a drawn one)."""
    cells_here = [(m, n) for m in MODELS for n in RANKS
                  if not steps[(steps.model == m) & (steps.ranks == n)].empty]
    methods = list(front_methods("horovod")) + list(DDP_ROW)
    lines, no_curve = [], set()
    for i, (model, n) in enumerate(cells_here):
        for j, link in enumerate(LINKS):
            for k, method in enumerate(methods):
                front = "ddp" if method.startswith("ddp:") else "horovod"
                runs = steps[(steps.model == model) & (steps.ranks == n)
                             & (steps.method == STEPS_OF[(front, method)])
                             & (steps.target_name == "lab")]
                cell = cells[(cells.front == front) & (cells.model == BENCH_MODEL[model])
                             & (cells.link == link) & (cells.ranks == n)
                             & (cells.row == front_methods(front)[method])]
                if runs.empty or cell.empty:
                    continue
                here = runs[[(Path(out) / "runs" / str(r) / "evals.csv").is_file()
                             for r in runs.run]]
                if here.empty:
                    no_curve.add(f"{model}-np{n}:{method}")
                    continue
                first = here.sort_values("seed").iloc[0]
                curve = tta.accuracy_curve(tta.read_evals(Path(out) / "runs" / first.run),
                                           float(cell.step_ms.iloc[0]) / 1e3, _times(first))
                lines.append((i, j, k, method, curve))
    if not lines:
        return False, sorted(no_curve)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(cells_here), len(LINKS), figsize=(4.2 * len(LINKS),
                             3.4 * len(cells_here)), squeeze=False)
    colours = plt.get_cmap("tab20")
    for i, j, k, method, curve in lines:
        axes[i][j].plot(curve.seconds, 100 * curve.holdout_accuracy, lw=1,
                        color=colours(k % 20), label=method)
    for i, (model, n) in enumerate(cells_here):
        cell_targets = steps[(steps.model == model) & (steps.ranks == n)].groupby(
            "target_name").target.first()
        for j, link in enumerate(LINKS):
            ax = axes[i][j]
            for name, target in cell_targets.items():
                ax.axhline(100 * target, ls="--", lw=0.7, color="k")
            low = 100 * cell_targets.min() - 6
            ax.set_ylim(low, 100 * cell_targets.max() + 2)
            ax.set_xscale("log")
            ax.set_title(f"{model} net, {n} ranks, {link}", fontsize=9)
            ax.set_xlabel("seconds (composed)", fontsize=8)
            if j == 0:
                ax.set_ylabel("held-out accuracy, %")
    if axes[0][-1].get_legend_handles_labels()[0]:     # its panel may have no curve
        axes[0][-1].legend(fontsize=6, ncol=2, loc="lower right")
    cpus = "; ".join(f"{front} step cells: {', '.join(sorted(set(group.cpu)))}"
                     for front, group in cells.groupby("front", sort=False))
    fig.suptitle("Held-out accuracy against time to it on each link (steps over loopback x "
                 "the link's step time, + start-up and evaluations); dashed: the targets\n"
                 f"{cpus}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True, sorted(no_curve)


# The cost model's name of each method of ours: (scheme, parameter, route) (registry names).
SCHEME_OF = {"none": ("none", None, None), "fp16": ("fp16", None, None),
             "bit16": ("bit16", None, None), "bf16": ("bf16", None, None),
             "bit8": ("bit8", None, None), "bit8:alltoall": ("bit8", None, "alltoall"),
             "int8": ("int8", None, None), "onebit": ("onebit", None, None),
             **{f"topk{r:g}": ("topk", r, None) for r in (0.1, 0.01, 0.001)},
             **{f"powersgd{k}": ("powersgd", k, None) for k in (1, 2, 4)}}


def scaling_table(out, steps, cells, seeds=SEEDS, known=None):
    """The cost model's input for time to accuracy at n ranks (python -m hvd_compress.costmodel
    --tta): per network and method of ours, the steps to one target at 2 and at 4 ranks (the
    lower of the two cells' 'lab' targets, which the runs of both reached on the way to their
    own; the mean over the seeds run), its compute per step (its step over loopback at 2 ranks,
    a core a rank: the exchange there is nearly free) and its start-up and evaluations; and
    how many seeds each mean is over, their fewest and most steps (the cost model reads the
    means; the range says how far a fit through them can be read)."""
    rows, out = [], Path(out)
    for model in MODELS:
        cell_targets = [targets(out, model, n, seeds, known) for n in RANKS]
        if None in cell_targets:
            continue
        target = min(t["lab"] for t in cell_targets)
        for key, (scheme, parameter, route) in SCHEME_OF.items():
            measured, spread = [], []
            for n in RANKS:
                reached = []
                for seed in seeds_of(key, model, n, seeds):
                    run_dir = out / "runs" / Run(model, n, TRAINED[key], seed).name
                    if (runlog.read_manifest(run_dir) or {}).get("status") == "complete":
                        reached.append(tta.reach(tta.read_evals(run_dir), target))
                ok = reached and all(r.reached for r in reached)
                measured.append(sum(r.step for r in reached) / len(reached) if ok else None)
                spread.append((len(reached), min(r.step for r in reached) if ok else None,
                               max(r.step for r in reached) if ok else None))
            cell = cells[(cells.front == "horovod") & (cells.model == BENCH_MODEL[model])
                         & (cells.link == "loopback") & (cells.ranks == 2)
                         & (cells.row == TRAINED[key].bench_row)]
            own = steps[(steps.model == model) & (steps.ranks == 2) & (steps.method == key)
                        & (steps.target_name == "lab")]
            rows.append(dict(model=model, method=key, scheme=scheme, parameter=parameter,
                             route=route, target=target, batch_per_rank=64,
                             ranks1=RANKS[0], steps1=measured[0], ranks2=RANKS[1],
                             steps2=measured[1],
                             seeds1=spread[0][0], steps1_min=spread[0][1],
                             steps1_max=spread[0][2], seeds2=spread[1][0],
                             steps2_min=spread[1][1], steps2_max=spread[1][2],
                             compute_s=float(cell.step_ms.iloc[0]) / 1e3 if len(cell) else None,
                             overhead_s=float((own.startup_s + own.evals * own.eval_s).median())
                             if len(own) else None))
    return pd.DataFrame(rows)


# The seeds' extremes paired for the fit at n ranks (the cost model through scaling-<name>.csv):
# the fewest steps at 4 ranks after the most at 2 scale best, the other way worst; the truth of
# a fit through the means lies between the two only as far as the seeds sample the spread.
SPREAD_PAIRS = {"best": ("steps1_max", "steps2_min"), "worst": ("steps1_min", "steps2_max")}


def _fmt_steps(rows):
    """'720' or '560, 720, 840' (its seeds' in SEEDS order), 'never' where one did not reach
    it."""
    return ", ".join("never" if not r.reached else f"{int(r.step)}"
                     for r in rows.sort_values("seed", key=lambda s: s.map(SEEDS.index))
                     .itertuples())


def _fmt_median(rows):
    """The median steps over the seeds and their range: '720 [560-840]', '720' for one seed;
    a seed that never reached it counts as never."""
    counts = [float(r.step) if r.reached else math.inf for r in rows.itertuples()]
    if not counts:
        return "—"
    median = statistics.median(counts)
    text = "never" if not math.isfinite(median) else f"{median:.0f}"
    if len(counts) > 1:
        text += " [" + "-".join("never" if not math.isfinite(c) else f"{c:.0f}"
                                for c in (min(counts), max(counts))) + "]"
    return text


def _fmt_s(value):
    return "never" if not math.isfinite(value) else f"{value:,.0f}"


def tables(steps, table):
    """The README's tables, from the summaries: per network and ranks, each method's steps to
    each target (the median over its seeds, their range, each seed's), the targets; then per
    front, network and ranks, each method's median time to the two targets on each link
    (x float32's; the fastest of the column in bold)."""
    lines = []
    for (model, n), cell in steps.groupby(["model", "ranks"], sort=False):
        lines += [f"### Steps to each target over loopback, {model} net, {n} ranks", "",
                  "| method | seeds | lab: median [range] | float32: median [range] | "
                  f"each seed ({', '.join(map(str, SEEDS))}): lab / float32 |",
                  "|---|---|---|---|---|"]
        for key in TRAINED:
            here = cell[cell.method == key]
            if here.empty:
                continue
            lab, strict = (here[here.target_name == t] for t in ("lab", "float32"))
            seeds = ", ".join(str(s) for s in SEEDS if s in set(here.seed))
            lines.append(f"| {key} | {seeds} | {_fmt_median(lab)} | {_fmt_median(strict)} | "
                         f"{_fmt_steps(lab) or '—'} / {_fmt_steps(strict) or '—'} |")
        lines.append("")
    lines += ["Targets (held-out accuracy): " + "; ".join(
        f"{m} net, {n} ranks: lab {100 * g[g.target_name == 'lab'].target.iloc[0]:.2f}%, "
        f"float32 {100 * g[g.target_name == 'float32'].target.iloc[0]:.2f}%"
        for (m, n), g in steps.groupby(["model", "ranks"], sort=False)) + "."]
    if table.empty:
        return "\n".join(lines)
    for front in ("horovod", "ddp"):
        for (model, n), rows in table[table.front == front].groupby(["model", "ranks"],
                                                                    sort=False):
            links = [link for link in LINKS if link in set(rows.link)]
            lines += ["", f"### {front}, {model} net, {n} ranks: seconds to the lab / float32 "
                          f"target, median over the seeds (x float32's)", "",
                      "| method | " + " | ".join(links) + " |", "|---" * (len(links) + 1) + "|"]
            for method in (m for m in front_methods(front) if m in set(rows.method)):
                cols = []
                for link in links:
                    parts = []
                    for name in ("lab", "float32"):
                        cell = rows[(rows.link == link) & (rows.target_name == name)]
                        mine = cell[cell.method == method]
                        if mine.empty:
                            parts.append("—")
                            continue
                        r = mine.iloc[0]
                        text = _fmt_s(r.tta_s) + ("" if not math.isfinite(r.tta_s)
                                                  else f" (x{r.vs_float32:.2f})")
                        parts.append(f"**{text}**" if r.tta_s == cell.tta_s.min() else text)
                    cols.append(" / ".join(parts))
                lines.append(f"| {method} | " + " | ".join(cols) + " |")
            lines += ["", f"### {front}, {model} net, {n} ranks: seconds to the float32 target, "
                          f"median [fastest-slowest seed] (seeds reached / run)", "",
                      "| method | " + " | ".join(links) + " |", "|---" * (len(links) + 1) + "|"]
            strict = rows[rows.target_name == "float32"]
            for method in (m for m in front_methods(front) if m in set(strict.method)):
                cols = []
                for link in links:
                    mine = strict[(strict.method == method) & (strict.link == link)]
                    if mine.empty:
                        cols.append("—")
                        continue
                    r = mine.iloc[0]
                    spread = "" if r.seeds == 1 else \
                        f" [{_fmt_s(r.tta_min_s)}-{_fmt_s(r.tta_max_s)}]"
                    cols.append(f"{_fmt_s(r.tta_s)}{spread} ({r.reached}/{r.seeds})")
                lines.append(f"| {method} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def summarise(out, step_time_specs, seeds=SEEDS, steps_from=(), targets_from=None,
              step_times_csv=()):
    """The grid's CSVs, tables and plot from the runs in OUT/runs, and from the rows of
    `steps_from` (steps.csv files: runs whose folders are gone; a run in OUT replaces its
    rows) with the cells' targets from `targets_from` or those rows; the step cells from
    `step_times_csv` (step_times.csv files) and then `step_time_specs` (step benchmarks'
    steps.csv). The fit's input (scaling*.csv) reaches a target the rows do not hold, so it is
    written only where every row's run has its folder here."""
    out = Path(out)
    given = read_steps_rows(steps_from)
    known = known_targets(targets_from, given)
    steps = merge_steps(given, steps_table(out, seeds, known))
    targets_rows = [dict(model=m, ranks=n, **t) for m in MODELS for n in RANKS
                    if (t := targets(out, m, n, seeds, known)) is not None]
    runlog.atomic_write_text(out / "targets.csv", pd.DataFrame(targets_rows).to_csv(index=False))
    runlog.atomic_write_text(out / "steps.csv", steps.to_csv(index=False))
    cells = read_step_times(step_time_specs, step_times_csv)
    runlog.atomic_write_text(out / "step_times.csv", cells.to_csv(index=False))
    composed = unloaded_times(steps)
    table = tta_table(composed, cells) if not steps.empty else pd.DataFrame()
    runlog.atomic_write_text(out / "tta.csv", table.to_csv(index=False, float_format="%.6g"))
    if not steps.empty:
        runlog.atomic_write_text(out / "tables.md", tables(steps, table) + "\n")
    if not steps.empty and not cells.empty:
        drawn, no_curve = plot(out, composed, cells, out / "tta.png")
        if not drawn:
            print(f"tta.png not drawn: no run of steps.csv has a folder in {out / 'runs'}"
                  + (" (the one there is left as it was)" if (out / "tta.png").exists()
                     else ""))
        elif no_curve:
            print(f"tta.png: no curve for {len(no_curve)} method(s), no run folder in "
                  f"{out / 'runs'} (rows from --steps-from): {', '.join(no_curve)}")
        gone = sorted({r for r in steps.run if not (out / "runs" / str(r)).is_dir()})
        if gone:
            print(f"scaling.csv not written: {len(gone)} run(s) of steps.csv have no folder in "
                  f"{out / 'runs'}, and the fit's target (the lower of the two cells' lab "
                  f"targets) is one their rows do not hold")
            return steps, table
        scaling = scaling_table(out, composed, cells, seeds, known)
        runlog.atomic_write_text(out / "scaling.csv",
                                 scaling.to_csv(index=False, float_format="%.6g"))
        for name, pair in SPREAD_PAIRS.items() if not scaling.empty else ():
            runlog.atomic_write_text(out / f"scaling-{name}.csv", scaling.assign(
                steps1=scaling[pair[0]], steps2=scaling[pair[1]]).to_csv(
                    index=False, float_format="%.6g"))
    return steps, table


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/tta")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated, of {', '.join(TRAINED)} (default: all)")
    parser.add_argument("--dataset", default="fashion-mnist", choices=["mnist", "fashion-mnist"])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--prefix", default="",
                        help="a command each training runs under (e.g. a CPU lock's wrapper)")
    parser.add_argument("--step-times", nargs="*", default=[], metavar="FRONT:CPU:STEPS_CSV",
                        help="step benchmark steps.csv files (front horovod or ddp, the CPU "
                             "they were measured on); later ones replace earlier cells")
    parser.add_argument("--step-times-csv", nargs="*", default=[], metavar="STEP_TIMES_CSV",
                        help="step_times.csv files this grid wrote (their cells, each with its "
                             "source and CPU); --step-times' cells replace theirs")
    parser.add_argument("--steps-from", action="append", default=[], metavar="STEPS_CSV",
                        help="a steps.csv this grid wrote: the rows of runs whose folders are "
                             "gone, merged with the runs in --out (a run there replaces its "
                             "rows); again for another (later files replace earlier rows)")
    parser.add_argument("--targets-from", default=None, metavar="TARGETS_CSV",
                        help="a targets.csv this grid wrote: the targets of cells whose float32 "
                             "folders are gone (default: those --steps-from's rows were counted "
                             "against); their float32 runs are not trained unless --methods "
                             "names none")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                        help="float32's seeds (the others take the first)")
    parser.add_argument("--max-seeds", type=int, default=None, metavar="K",
                        help="train the methods besides float32 on at most their first K "
                             "seeds (a first pass over every method before their other seeds)")
    parser.add_argument("--cap", type=int, default=None, metavar="EPOCHS",
                        help=f"epochs a run may take (default by network: {CAP})")
    parser.add_argument("--pause-file", default=None, metavar="PATH",
                        help="while PATH exists, wait before starting the next run (a timing "
                             "measurement that needs the machine alone holds it)")
    parser.add_argument("--timeout", type=float, default=3 * 3600)
    parser.add_argument("--summary-only", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    args.ranks = [int(n) for n in args.ranks.split(",")]
    args.methods = args.methods.split(",") if args.methods else None
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if args.cap is not None and args.cap < LAB_EPOCHS:
        parser.error(f"--cap must be at least the lab's {LAB_EPOCHS} epochs: float32's accuracy "
                     f"after them sets the targets")
    bad = [m for m in args.models if m not in MODELS] + [
        m for m in (args.methods or []) if m not in TRAINED]
    if bad:
        parser.error(f"unknown: {', '.join(bad)}")
    args.prefix = shlex.split(args.prefix)
    if not args.summary_only:
        missing = sorted({flag for key in (args.methods or TRAINED)
                          for flag in _auto_step_s(TRAINED[key]) if not Path(flag).is_file()})
        if missing and args.dry_run:
            print(f"note: no injected step cells {', '.join(missing)} yet (python -m "
                  f"labs.bench.tta_auto --write-step-s)", file=sys.stderr)
        elif missing:
            parser.error(f"no injected step cells {', '.join(missing)}: write them with python "
                         f"-m labs.bench.tta_auto --write-step-s --cells STEP_TIMES_CSV "
                         f"--front horovod|ddp (docs/time-to-accuracy.md)")
    return args


def _auto_step_s(method):
    """The --auto-step-s file a method's runs read ((), or one path)."""
    flags = list(method.flags)
    return (flags[flags.index("--auto-step-s") + 1],) if "--auto-step-s" in flags else ()


def main(argv=None):
    args = parse_args(argv)
    failures = [] if args.summary_only else run_grid(args)
    if args.dry_run:
        return 0
    steps, table = summarise(args.out, args.step_times, args.seeds, args.steps_from,
                             args.targets_from, args.step_times_csv)
    print(f"summary: {Path(args.out) / 'tta.csv'} ({len(table)} rows), "
          f"{Path(args.out) / 'steps.csv'} ({len(steps)} rows)")
    if failures:
        print(f"{len(failures)} run(s) failed or waited: {', '.join(failures)}; run the same "
              f"command again to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
