"""Time to accuracy: how soon a training reaches the accuracy it needs, on any link.

In synchronous data-parallel training every rank applies the same averaged gradient at every
step, so the steps a run needs to reach an accuracy are a property of its method (the scheme,
its error feedback, the ranks, the seed), not of the link: a slower link makes each step
longer, never more steps. So a run's time to a target on a link is

    time = start-up + steps x step(link) + evaluations x eval + epoch ends x epoch_end

with the steps (and how many evaluations and epoch ends come before the target) counted once,
over loopback, from the run's evaluations of a held-out split (the trainers' --holdout K
--eval-every N: evals.csv), and step(link) the step time of that method on that link (a step
benchmark's cell). Start-up (process start to the first step: imports, the launcher's
rendezvous, the data), an evaluation and an epoch's end (the test set, the checkpoint) are
what the run spends besides its steps; they do not depend on the link.

    reach(evals, target)          when a run first reached `target` (Reach)
    run_times(run_dir)            what its time is made of, besides the link (RunTimes)
    compose(reach, step_s, times) the time to the target on a link of step time step_s
    elapsed(run_dir, reach)       the run's own time to the target (a direct run on that link)
    accuracy_curve(...)           each evaluation's accuracy against its composed time
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

from labs.kit import runlog

# The lab's held-out split and how often it is scored (the lab job's table and the grid,
# labs/bench/tta_grid.py): 2,000 images, evaluated after every 5,120 training images (every 40
# steps at 2 ranks of 64, 20 at 4, 80 serially), about 11 times an epoch: a step count known to
# a tenth of an epoch, at the price of a forward pass over 2,000 images each time (the same
# for every method, so it moves no ranking).
HOLDOUT = 2000
EVAL_IMAGES = 5120

__all__ = ["HOLDOUT", "EVAL_IMAGES", "LOOSE_POINTS", "eval_every", "Reach", "RunTimes",
           "RunError", "Composed", "read_evals", "read_steps", "reach", "run_times", "compose",
           "elapsed", "accuracy_curve", "accuracy_after", "targets_of", "compose_runs",
           "LAST_EVALS"]


def eval_every(ranks, batch_size=64, images=EVAL_IMAGES):
    """--eval-every for `ranks` processes: the steps in which they train on `images` images."""
    return max(1, images // (batch_size * ranks))


class RunError(RuntimeError):
    """A run folder lacks what the measure needs (the message says what)."""


@dataclass(frozen=True)
class Reach:
    """When a run first reached `target` on its held-out split: the first evaluation whose
    accuracy is at least the target (step None: none did, up to `last_step`)."""
    target: float
    step: Optional[int]         # training steps done at that evaluation
    samples: Optional[int]      # training images seen then, all ranks
    evals: int                  # evaluations up to and including that one
    epoch_ends: int             # epoch ends (test set, checkpoint) before it
    accuracy: float             # its accuracy; without a reach, the best the run saw
    last_step: int              # the last evaluated step: how far a "never" looked

    @property
    def reached(self):
        return self.step is not None


@dataclass(frozen=True)
class RunTimes:
    """What a run spends besides its steps, in seconds (rank 0): start-up, one evaluation of
    the held-out split (median), one epoch's end (median; NaN in a run of one epoch), and its
    own mean step for reference."""
    startup_s: float
    eval_s: float
    epoch_end_s: float
    step_s: float


def read_evals(run_dir) -> pd.DataFrame:
    path = Path(run_dir) / "evals.csv"
    if not path.is_file():
        raise RunError(f"{run_dir}: no evals.csv (run the trainer with --holdout K "
                       f"--eval-every N)")
    frame = pd.read_csv(path)
    if frame.empty:
        raise RunError(f"{path}: no evaluation yet")
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def read_steps(run_dir) -> pd.DataFrame:
    """Rank 0's steps (steps.csv, or steps_rank0.csv of a run still going)."""
    run_dir = Path(run_dir)
    path = run_dir / "steps.csv"
    if not path.is_file():
        path = run_dir / "steps_rank0.csv"
    if not path.is_file():
        raise RunError(f"{run_dir}: no steps.csv")
    frame = pd.read_csv(path)
    return frame[frame["rank"] == 0].sort_values("step", kind="stable").reset_index(drop=True)


def reach(evals: pd.DataFrame, target: float) -> Reach:
    """The first evaluation at or above `target`; its counts of evaluations and epoch ends."""
    hit = evals[evals["holdout_accuracy"] >= target]
    last = int(evals["step"].iloc[-1])
    if hit.empty:
        return Reach(target, None, None, len(evals), int(evals["epoch"].iloc[-1]) - 1,
                     float(evals["holdout_accuracy"].max()), last)
    first = hit.iloc[0]
    return Reach(target, int(first["step"]), int(first["samples"]),
                 int((evals["step"] <= first["step"]).sum()), int(first["epoch"]) - 1,
                 float(first["holdout_accuracy"]), last)


def run_times(run_dir) -> RunTimes:
    """Start-up: the rank 0 process's start (the manifest's process_start_unix) to its first
    step's start. An epoch's end: the last step of an epoch to the next epoch's first step,
    less the evaluations of the held-out split in between (what is left is the epochs' totals,
    the test set and the checkpoint). A resumed run has no start-up (NaN): process_start_unix is
    the last process's, its first steps an earlier one's; and the gap before an epoch it resumed
    at is the time it lay stopped, not an epoch's end, so it is left out."""
    manifest = runlog.read_manifest(Path(run_dir)) or {}
    started = manifest.get("process_start_unix")
    if started is None:
        raise RunError(f"{run_dir}: the manifest has no process_start_unix (a run recorded "
                       f"before time to accuracy was measured)")
    resumes = manifest.get("resumes") or []
    resumed_at = {r.get("from_epoch") for r in resumes if isinstance(r, dict)}
    steps, evals = read_steps(run_dir), read_evals(run_dir)
    first_start = steps["wall_time"].iloc[0] - steps["step_s"].iloc[0]
    ends = []
    for epoch, rows in steps.groupby("epoch"):
        after = steps[steps["epoch"] > epoch]
        if after.empty or after["epoch"].iloc[0] in resumed_at:
            continue
        last, nxt = rows.iloc[-1], after.iloc[0]
        gap = (nxt["wall_time"] - nxt["step_s"]) - last["wall_time"]
        ends.append(gap - evals.loc[evals["step"] == last["step"], "eval_s"].sum())
    return RunTimes(startup_s=math.nan if resumes else float(first_start - started),
                    eval_s=float(evals["eval_s"].median()),
                    epoch_end_s=float(pd.Series(ends).median()) if ends else math.nan,
                    step_s=float(steps["step_s"].mean()))


def compose(hit: Reach, step_s: float, times: RunTimes) -> float:
    """The time to hit.target on a link whose step takes step_s seconds (math.inf when the
    run never reached it): start-up, the steps, and the evaluations and epoch ends before."""
    if not hit.reached:
        return math.inf
    epoch_ends = hit.epoch_ends * times.epoch_end_s if hit.epoch_ends else 0.0
    return times.startup_s + hit.step * step_s + hit.evals * times.eval_s + epoch_ends


def elapsed(run_dir, hit: Reach) -> float:
    """A run's own time to hit.target: its rank 0 process's start to the end of the
    evaluation that reached it (math.inf if none did). Only a run that was not resumed has
    one time: a resumed run is refused."""
    manifest = runlog.read_manifest(Path(run_dir)) or {}
    if manifest.get("resumes"):
        raise RunError(f"{run_dir} was resumed: its time to a target is not one run's")
    if not hit.reached:
        return math.inf
    evals = read_evals(run_dir)
    done = evals.loc[evals["step"] == hit.step, "wall_time"].iloc[0]
    return float(done - manifest["process_start_unix"])


def accuracy_curve(evals: pd.DataFrame, step_s: float, times: RunTimes) -> pd.DataFrame:
    """Each evaluation's accuracy against the time it would be reached at on a link of step
    time step_s: the same composition as compose(), evaluation by evaluation."""
    count = pd.Series(range(1, len(evals) + 1), index=evals.index)
    ends = (evals["epoch"] - 1) * (0.0 if math.isnan(times.epoch_end_s) else times.epoch_end_s)
    seconds = times.startup_s + evals["step"] * step_s + count * times.eval_s + ends
    return pd.DataFrame({"step": evals["step"], "seconds": seconds,
                         "holdout_accuracy": evals["holdout_accuracy"]})


# ---- the lab's table: each scheme's time to its targets on the network table's link ---------

LOOSE_POINTS = 0.005            # the 'lab' target: float32's accuracy minus 0.5 points
# A run's accuracy "after its epochs": the mean of its last evaluations of them. At the lab's
# constant learning rate the held-out accuracy moves by about a point from one evaluation to
# the next, so one evaluation is as much the luck of that step as the run's level.
LAST_EVALS = 3


def accuracy_after(evals: pd.DataFrame, epoch: Optional[int] = None) -> float:
    """The held-out accuracy after `epoch` (default: the run's last): the mean of the last
    LAST_EVALS evaluations up to that epoch's end."""
    upto = evals if epoch is None else evals[evals["epoch"] <= epoch]
    if upto.empty or (epoch is not None and upto["epoch"].iloc[-1] != epoch):
        raise RunError(f"no evaluation in epoch {epoch}")
    return float(upto["holdout_accuracy"].iloc[-LAST_EVALS:].mean())


def targets_of(float32_run) -> dict:
    """The targets a float32 run sets: its held-out accuracy after its last epoch ('float32')
    and that minus 0.5 points ('lab')."""
    accuracy = accuracy_after(read_evals(float32_run))
    return {"lab": accuracy - LOOSE_POINTS, "float32": accuracy}


@dataclass(frozen=True)
class Composed:
    """One run's time to one target on a link: the reach counted over loopback, the link's
    step, the composed seconds; and the run's own seconds over loopback (measured)."""
    run: str
    ranks: int
    compression: str
    target_name: str
    target: float
    reach: Reach
    step_s: float
    seconds: float
    loopback_s: float


def compose_runs(loop_dirs: dict, link_step_s: dict, float32_of) -> list:
    """Composed rows for every run of `loop_dirs` ({run: (folder, ranks, compression)}) that has
    a step on the link (`link_step_s`, {run: seconds}) and a float32 run at its ranks
    (`float32_of(ranks)`: a run name): each target that float32 run sets."""
    rows = []
    for run, (folder, ranks, compression) in loop_dirs.items():
        base = float32_of(ranks)
        if run not in link_step_s or base not in loop_dirs:
            continue
        evals, times = read_evals(folder), run_times(folder)
        for name, target in targets_of(loop_dirs[base][0]).items():
            hit = reach(evals, target)
            rows.append(Composed(run, ranks, compression, name, target, hit, link_step_s[run],
                                 compose(hit, link_step_s[run], times), elapsed(folder, hit)))
    return rows
