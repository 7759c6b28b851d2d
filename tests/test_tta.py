"""Time to accuracy (labs/kit/tta.py, labs/bench/tta_grid.py) and the trainers' held-out split:
the split, the flags that refuse a run that would evaluate on the test set, when a target is
reached, what a run's time is made of, the composition, and the grid's bookkeeping, on run
folders written here with known times."""
import math
import sys

import pandas as pd
import pytest
import torch

from labs.bench import tta_grid
from labs.kit import data as lab_data, runlog, tta
from labs.kit.data import DataError

pytestmark = pytest.mark.unit


def loaded(n=100):
    return lab_data.LoadedData(
        name="mnist", folder="/x", train_x=torch.arange(n, dtype=torch.float32).reshape(n, 1),
        train_y=torch.arange(n), test_x=torch.zeros(10, 1), test_y=torch.zeros(10, dtype=torch.long),
        files={}, split_test=None, mean=0.0, std=1.0)


def test_hold_out_sets_the_last_images_aside_and_trains_on_the_rest():
    data = lab_data.hold_out(loaded(100), 30)
    assert data.train_y.tolist() == list(range(70))
    assert data.holdout_y.tolist() == list(range(70, 100))
    assert data.holdout_x[:, 0].tolist() == [float(i) for i in range(70, 100)]
    described = data.describe()
    assert described["train_samples"] == 70 and described["holdout_samples"] == 30
    assert loaded().describe()["holdout_samples"] == 0


@pytest.mark.parametrize("count", [0, 100, 101, -1])
def test_hold_out_refuses_a_split_that_leaves_nothing(count):
    with pytest.raises(DataError, match="--holdout must be between 1 and 99"):
        lab_data.hold_out(loaded(100), count)


@pytest.mark.parametrize("argv, message", [
    (["--eval-every", "10"], "--eval-every needs --holdout K"),
    (["--target-accuracy", "0.9"], "--target-accuracy needs --holdout K"),
    (["--holdout", "100", "--target-accuracy", "1.5"], "must be a fraction in"),
    (["--holdout", "100", "--target-accuracy", "0"], "must be a fraction in"),
    (["--holdout", "0"], "--holdout must be at least 1"),
    (["--holdout", "100", "--eval-every", "0"], "--eval-every must be at least 1"),
])
def test_the_trainer_refuses_evaluations_without_a_held_out_split(argv, message, capsys):
    from labs import mnist
    with pytest.raises(SystemExit) as stop:
        mnist.parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def evals_frame(steps, accuracies, epochs=None, eval_s=0.5):
    epochs = epochs or [1] * len(steps)
    return pd.DataFrame({"epoch": epochs, "step": steps, "samples": [128 * s for s in steps],
                         "holdout_samples": 500, "holdout_loss": 1.0,
                         "holdout_accuracy": accuracies, "eval_s": eval_s,
                         "wall_time": 0.0})


def test_reach_is_the_first_evaluation_at_or_above_the_target():
    evals = evals_frame([10, 20, 30, 40, 50], [0.5, 0.79, 0.80, 0.78, 0.85],
                        epochs=[1, 1, 2, 2, 2])
    hit = tta.reach(evals, 0.80)
    assert (hit.step, hit.samples, hit.evals, hit.epoch_ends, hit.accuracy) == (30, 3840, 3, 1, 0.80)
    assert hit.reached and hit.last_step == 50
    never = tta.reach(evals, 0.9)
    assert not never.reached and never.step is None and never.accuracy == 0.85
    assert never.last_step == 50 and math.isinf(tta.compose(never, 1.0, tta.RunTimes(0, 0, 0, 0)))


def test_compose_adds_start_up_steps_evaluations_and_epoch_ends():
    hit = tta.Reach(0.8, step=300, samples=0, evals=8, epoch_ends=1, accuracy=0.8, last_step=300)
    times = tta.RunTimes(startup_s=5.0, eval_s=1.5, epoch_end_s=7.0, step_s=0.2)
    assert tta.compose(hit, 0.5, times) == pytest.approx(5.0 + 300 * 0.5 + 8 * 1.5 + 7.0)
    # in the first epoch no epoch end is counted, even where a run has none to measure (NaN)
    first = tta.Reach(0.8, 100, 0, 3, 0, 0.8, 100)
    assert tta.compose(first, 0.5, tta.RunTimes(5.0, 1.5, math.nan, 0.2)) == pytest.approx(
        5.0 + 50 + 4.5)


def write_run(folder, start=1000.0, resumed=False):
    """A run folder of 2 epochs of 4 steps of 0.25 s each (rank 0; rank 1's rows are other
    times that must not count), evaluations of 0.5 s after steps 2, 4, 6, 8, an epoch end of
    3 s between steps 4 and 5 besides its evaluation, and a start-up of 6 s."""
    folder.mkdir(parents=True)
    runlog.write_manifest(folder, {"status": "complete", "process_start_unix": start,
                                   "resumes": [1] if resumed else []})
    t, steps, evals = start + 6.0, [], []
    for step in range(1, 9):
        t += 0.25
        steps.append({"rank": 0, "epoch": 1 + (step > 4), "step": step, "step_s": 0.25,
                      "wall_time": t, "samples": 64})
        steps.append({"rank": 1, "epoch": 1 + (step > 4), "step": step, "step_s": 9.0,
                      "wall_time": t, "samples": 64})
        if step % 2 == 0:
            t += 0.5
            evals.append({"epoch": 1 + (step > 4), "step": step, "samples": 128 * step,
                          "holdout_samples": 10, "holdout_loss": 1.0,
                          "holdout_accuracy": step / 10, "eval_s": 0.5, "wall_time": t})
        if step == 4:
            t += 3.0
    pd.DataFrame(steps).to_csv(folder / "steps.csv", index=False)
    pd.DataFrame(evals).to_csv(folder / "evals.csv", index=False)
    return folder


def test_run_times_split_a_run_into_start_up_evaluations_and_epoch_ends(tmp_path):
    times = tta.run_times(write_run(tmp_path / "run"))
    assert times.startup_s == pytest.approx(6.0)
    assert times.eval_s == pytest.approx(0.5)
    assert times.epoch_end_s == pytest.approx(3.0)
    assert times.step_s == pytest.approx(0.25)


def test_a_resumed_run_has_no_start_up_and_its_stop_is_no_epoch_end(tmp_path):
    """Resumed at epoch 2 a day later: the process started after the first steps, and the gap
    before epoch 2 is the stop; neither may enter a composed time (the grid takes the least
    start-up over its runs: a negative one would carry every run of the cell)."""
    run = write_run(tmp_path / "run")
    steps = pd.read_csv(run / "steps.csv")
    steps.loc[steps.epoch == 2, "wall_time"] += 86400.0
    steps.to_csv(run / "steps.csv", index=False)
    runlog.write_manifest(run, {"status": "complete", "process_start_unix": 1000.0 + 86400.0,
                                "resumes": [{"from_epoch": 2}]})
    times = tta.run_times(run)
    assert math.isnan(times.startup_s) and math.isnan(times.epoch_end_s)
    assert times.eval_s == pytest.approx(0.5) and times.step_s == pytest.approx(0.25)


def test_the_composition_of_a_run_with_its_own_step_is_its_own_time(tmp_path):
    """The measure's identity: a run's steps and overheads composed with its own step time give
    back its own elapsed time to each target, in either epoch."""
    run = write_run(tmp_path / "run")
    times, evals = tta.run_times(run), tta.read_evals(run)
    for target in (0.2, 0.6, 0.8):
        hit = tta.reach(evals, target)
        assert tta.compose(hit, 0.25, times) == pytest.approx(tta.elapsed(run, hit))
    curve = tta.accuracy_curve(evals, 0.25, times)
    assert curve.seconds.tolist() == pytest.approx(
        [tta.elapsed(run, tta.reach(evals, a)) for a in evals.holdout_accuracy])


def test_a_resumed_run_has_no_time_to_a_target(tmp_path):
    run = write_run(tmp_path / "run", resumed=True)
    with pytest.raises(tta.RunError, match="was resumed"):
        tta.elapsed(run, tta.reach(tta.read_evals(run), 0.2))


def test_a_run_without_evaluations_says_how_to_get_them(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(tta.RunError, match="--holdout K --eval-every N"):
        tta.read_evals(tmp_path / "run")


def test_bench_cells_take_the_median_of_the_rounds_means(tmp_path):
    rows = [("basic", "100mbit", 2, "ours:bit8:allgather", rnd, step, ms)
            for rnd, values in ((1, [10, 10, 40]), (2, [20, 20, 20]), (3, [30, 30, 30]))
            for step, ms in enumerate(values)]
    pd.DataFrame(rows, columns=["model", "link", "ranks", "row", "round", "step", "step_ms"]
                 ).to_csv(tmp_path / "steps.csv", index=False)
    cells = tta_grid.bench_cells(tmp_path / "steps.csv", "horovod", "x", "cpu")
    # round means 20, 20, 30: median 20 (the median of the steps would be 20, the mean 23.3)
    assert cells.step_ms.tolist() == [20.0] and cells.rounds.tolist() == [3]


def test_every_row_of_the_time_table_has_a_trained_method_and_a_bench_row():
    for front in ("horovod", "ddp"):
        for method, row in tta_grid.front_methods(front).items():
            assert tta_grid.STEPS_OF[(front, method)] in tta_grid.TRAINED, (front, method)
            assert row.startswith(("ours:", "stock:")), row


def test_float32_is_run_first_in_every_cell_and_on_every_seed():
    runs = tta_grid.grid()
    for model in tta_grid.MODELS:
        for n in tta_grid.RANKS:
            cell = [r for r in runs if (r.model, r.ranks) == (model, n)]
            firsts = cell[:len(tta_grid.SEEDS)]
            assert [r.method.key for r in firsts] == ["none"] * len(tta_grid.SEEDS)
            assert {r.seed for r in firsts} == set(tta_grid.SEEDS)
    assert len({r.name for r in runs}) == len(runs)
    # every run evaluates after the same number of training images at 2 and 4 ranks
    assert {r.eval_every * 64 * r.ranks for r in runs} == {tta_grid.EVAL_IMAGES}


def finished_float32(out, model, ranks, accuracies):
    for seed, accuracy in zip(tta_grid.SEEDS, accuracies):
        run = tta_grid.Run(model, ranks, tta_grid.TRAINED["none"], seed)
        folder = out / "runs" / run.name
        folder.mkdir(parents=True)
        runlog.write_manifest(folder, {"status": "complete", "args": {}})
        evals_frame([10, 20], [0.5, accuracy], epochs=[1, tta_grid.LAB_EPOCHS]).to_csv(
            folder / "evals.csv", index=False)


def test_targets_wait_for_every_float32_seed_then_take_their_mean(tmp_path):
    assert tta_grid.targets(tmp_path, "basic", 2) is None
    finished_float32(tmp_path, "basic", 2, [0.88, 0.89, 0.90])
    cell = tta_grid.targets(tmp_path, "basic", 2)
    # each seed's accuracy after the lab's epochs: the mean of its last evaluations (0.5, a)
    assert cell["float32"] == pytest.approx((0.5 + 0.89) / 2)
    assert cell["lab"] == pytest.approx(cell["float32"] - 0.005)


def test_a_run_serves_the_targets_it_passed_and_is_run_again_for_a_higher_one(tmp_path, capsys):
    stopped, capped, float32 = tmp_path / "stopped", tmp_path / "capped", tmp_path / "float32"
    for folder, target, reason in ((stopped, 0.88, "--target-accuracy 0.88 reached after 9 steps"),
                                   (capped, 0.88, None), (float32, None, None)):
        folder.mkdir()
        runlog.write_manifest(folder, {"status": "complete", "reason": reason,
                                       "args": {"target_accuracy": target}})
    assert tta_grid.plan_run(stopped, 0.88) == "skip"
    assert tta_grid.plan_run(stopped, 0.87) == "skip"          # passed on the way to 0.88
    assert tta_grid.plan_run(capped, 0.95) == "skip"           # never stopped: its whole curve
    assert tta_grid.plan_run(float32, None) == "skip"
    assert tta_grid.plan_run(stopped, 0.89) == "fresh"         # stopped before 0.89
    assert not stopped.exists() and "moved the unfinished folder aside" in capsys.readouterr().out
    assert tta_grid.plan_run(float32, 0.9) == "fresh"          # float32's place, not a method's


def test_other_seeds_come_after_every_methods_first_and_only_for_the_methods_named():
    runs = tta_grid.grid(["horovod"], [2])
    first, *rest = tta_grid.SEEDS
    lossy = [r for r in runs if r.method.key != "none"]
    firsts = [r for r in lossy if r.seed == first]
    assert lossy[:len(firsts)] == firsts and len(firsts) == len(tta_grid.TRAINED) - 1
    again = {r.method.key for r in lossy if r.seed != first}
    assert again == tta_grid.METHOD_SEEDS[("horovod", 2)]
    assert all({r.seed for r in lossy if r.method.key == key} == set(tta_grid.SEEDS)
               for key in again)
    # --max-seeds 1: the first pass, every method once
    assert [r for r in tta_grid.grid(["horovod"], [2], max_seeds=1)
            if r.method.key != "none"] == firsts
    # a cell METHOD_SEEDS does not name: one seed for every method but float32
    assert {r.seed for r in tta_grid.grid(["basic"], [4]) if r.method.key != "none"} == {first}


def test_a_run_stopped_below_a_target_says_nothing_of_it(tmp_path):
    """More float32 seeds can move a cell's targets above the one a method's run stopped at:
    that run neither reached nor missed the new target (its curve stops there), so steps.csv
    has no row for it; a run that ran to its cap does say 'never'."""
    def run(key, seed, target, reason, keep):
        folder = write_run(tmp_path / "runs" / tta_grid.Run("basic", 2, tta_grid.TRAINED[key],
                                                            seed).name)
        runlog.write_manifest(folder, {"status": "complete", "process_start_unix": 1000.0,
                                       "reason": reason, "args": {"target_accuracy": target}})
        evals = pd.read_csv(folder / "evals.csv")
        evals[evals.step <= keep].to_csv(folder / "evals.csv", index=False)

    for seed in tta_grid.SEEDS:      # float32: 0.2, 0.4, 0.6, 0.8 -> targets 0.595 and 0.6
        run("none", seed, None, None, 8)
    run("bit8", 42, 0.35, "--target-accuracy 0.35 reached after 4 steps (epoch 1)", 4)
    run("int8", 42, 0.9, None, 4)                     # ran to its cap at 0.4: never either
    run("fp16", 42, 0.75, "--target-accuracy 0.75 reached after 8 steps (epoch 2)", 8)
    steps = tta_grid.steps_table(tmp_path)
    rows = {(r.method, r.target_name): r.reached for r in steps.itertuples()}
    assert tta_grid.targets(tmp_path, "basic", 2)["lab"] == pytest.approx(0.595)
    assert ("bit8", "lab") not in rows and ("bit8", "float32") not in rows
    assert rows[("fp16", "lab")] and rows[("fp16", "float32")]
    assert rows[("int8", "lab")] == rows[("int8", "float32")] == False  # noqa: E712
    assert rows[("none", "float32")]


def test_a_runs_accuracy_after_its_epochs_is_the_mean_of_its_last_evaluations():
    evals = evals_frame([10, 20, 30, 40, 50], [0.5, 0.80, 0.70, 0.90, 0.99], epochs=[1, 1, 1, 2, 2])
    assert tta.accuracy_after(evals) == pytest.approx((0.70 + 0.90 + 0.99) / 3)
    assert tta.accuracy_after(evals, 1) == pytest.approx((0.5 + 0.8 + 0.7) / 3)
    with pytest.raises(tta.RunError, match="no evaluation in epoch 3"):
        tta.accuracy_after(evals, 3)


@pytest.mark.parametrize("text, parsed", [("topk0.1", ("topk", 0.1)),
                                          ("powersgd4", ("powersgd", 4)),
                                          ("bit8", ("bit8", None)), ("topk", ("topk", None)),
                                          ("topkx", None), ("powersgd0", None), ("nope", None)])
def test_bench_rows_name_a_method_at_a_parameter(text, parsed):
    from labs.bench import step
    assert step.method_parameter(text) == parsed


def lab_table(base, runs, link_ms=None, holdout=True):
    """A loopback table of parallel runs {name: (compression, held-out accuracies of 4
    evaluations, 2 an epoch)}, 0.2 s a step over loopback; with link_ms, a network table beside
    it (its step per run in ms, 100 Mbit/s)."""
    rows = []
    for name, (compression, accuracies) in runs.items():
        folder = base / "loop" / name
        write_run(folder)
        frame = pd.read_csv(folder / "evals.csv")
        frame["holdout_accuracy"] = accuracies
        if holdout:
            frame.to_csv(folder / "evals.csv", index=False)
        else:
            (folder / "evals.csv").unlink()
        manifest = runlog.read_manifest(folder)
        runlog.write_manifest(folder, dict(manifest, data={"holdout_samples": 2000},
                                           args={"eval_every": 40, "batch_size": 64},
                                           world_size=2))
        rows.append(dict(run=name, ranks=2, compression=compression, reduction="allgather",
                         error_feedback=False, status="complete", epochs=2, run_dir=name,
                         train_time_s=10.0, final_test_accuracy=0.88, step_ms=200.0,
                         forward_backward_ms=150.0, compress_ms=1.0, communicate_ms=40.0,
                         decompress_ms=1.0, update_ms=8.0, bytes_per_step=1000.0,
                         netem_rate_bps=math.nan))
    pd.DataFrame(rows).to_csv(base / "loop" / "summary.csv", index=False)
    if link_ms is None:
        return base / "loop" / "summary.csv", None
    (base / "net").mkdir(parents=True)
    net = pd.DataFrame(rows).assign(netem_rate_bps=1e8, step_ms=[link_ms[r["run"]] for r in rows])
    net.to_csv(base / "net" / "summary.csv", index=False)
    return base / "loop" / "summary.csv", base / "net" / "summary.csv"


def test_the_report_says_when_each_scheme_reaches_its_targets_on_the_link(tmp_path):
    from labs.kit import report
    loop, net = lab_table(tmp_path, {"np2-none": ("none", [0.80, 0.86, 0.87, 0.89]),
                                     "np2-bit8": ("bit8", [0.80, 0.870, 0.86, 0.87])},
                          link_ms={"np2-none": 500.0, "np2-bit8": 250.0})
    text = report.tta_section(loop, report.load_summary(loop), net)
    # targets: float32's last three 0.86, 0.87, 0.89: 0.8733 (float32), 0.8683 (lab); float32
    # reaches the lab target at step 6 and the other at step 8, bit8 the lab target at step 4
    # and never the other
    assert "2 processes float32 87.33%; 2 processes lab 86.83%" in text
    none_lab = 6.0 + 6 * 0.5 + 3 * 0.5 + 3.0
    bit8_lab = 6.0 + 4 * 0.25 + 2 * 0.5
    assert f"float32 {none_lab:.0f} s; bit8 {bit8_lab:.0f} s (x{bit8_lab / none_lab:.2f}: pays)" in text
    assert "bit8 — s (never reached it: does not pay)" in text
    assert "| not within 2 epochs |" in text and "(tta.png)" in text
    assert "nan" not in text.lower()


def test_the_report_says_why_there_is_no_time_to_accuracy(tmp_path):
    from labs.kit import report
    loop, net = lab_table(tmp_path, {"np2-none": ("none", [0.8, 0.8, 0.8, 0.8])},
                          link_ms={"np2-none": 500.0}, holdout=False)
    assert report.tta_section(loop, report.load_summary(loop), net).startswith(
        "Not measured in this table")
    loop2, _ = lab_table(tmp_path / "b", {"np2-none": ("none", [0.8, 0.8, 0.8, 0.8])})
    assert "no network table (--no-network)" in report.tta_section(
        loop2, report.load_summary(loop2), None, "--no-network")


def test_a_bench_row_at_a_methods_default_is_named_with_its_parameter():
    assert tta_grid.named_parameter("ours:topk") == "ours:topk0.01"
    assert tta_grid.named_parameter("ours:powersgd") == "ours:powersgd2"
    for kept in ("ours:powersgd1", "ours:bit8:alltoall", "stock:powersgd1", "ours:auto", "local"):
        assert tta_grid.named_parameter(kept) == kept


def test_the_lab_jobs_table_holds_images_out_and_evaluates_by_images_seen():
    from labs.kit import job, matrix, table
    args, extra = job.parse_args(["--prefix", "/bin/env X=1"])
    loop = job.table_args(args, extra)
    assert loop.holdout == tta.HOLDOUT and loop.prefix == ["/bin/env", "X=1"]
    by_name = {run.name: run for run in table.course_runs()}
    for name, every in (("serial", 80), ("np2-none", 40), ("np4-bit8", 20)):
        cmd = matrix.launch_command(by_name[name], loop, "/tmp/x", False)
        assert cmd[cmd.index("--eval-every") + 1] == str(every), name
    network = job.network_args(args, loop)
    assert network.holdout is None and network.prefix == ["/bin/env", "X=1"]
    assert "--holdout" not in matrix.launch_command(by_name["np2-none"], network, "/tmp/x", False)
    assert job.table_args(job.parse_args(["--holdout", "0"])[0], []).holdout is None


@pytest.mark.interpreter
def test_a_calibration_in_a_wrapper_keeps_its_cores_busy_inside_it():
    from labs.kit import job
    assert job.main(["--busy", "1", "--", sys.executable, "-c", "pass"]) == 0
    assert job.main(["--busy", "0", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_the_time_table_takes_the_median_over_seeds_a_never_counting_as_never():
    def row(seed, step):
        return dict(model="basic", ranks=2, method="bit8", seed=seed, target_name="lab",
                    target=0.8, reached=step is not None, step=step or math.nan,
                    samples=128 * (step or 0), evals=3, epoch_ends=0, accuracy=0.8,
                    last_step=900, startup_s=10.0, eval_s=1.0, epoch_end_s=math.nan,
                    loopback_step_s=0.1)
    cells = pd.DataFrame([dict(front="horovod", model="basic", link="loopback", ranks=2,
                               row="ours:bit8:allgather", step_ms=100.0, rounds=1,
                               source="x", cpu="cpu")])
    steps = pd.DataFrame([row(42, 400), row(1, 800), row(2, None)])
    (r,) = tta_grid.tta_table(steps, cells).itertuples()
    # seconds: 10 + steps x 0.1 + 3 evaluations of 1 s; the median of 53, 93 and never is 93
    assert (r.seeds, r.reached, r.steps, r.steps_min) == (3, 2, 800, 400)
    assert math.isnan(r.steps_max) and r.tta_s == pytest.approx(93.0)
    assert r.tta_min_s == pytest.approx(53.0) and math.isinf(r.tta_max_s)
    two_nevers = tta_grid.tta_table(pd.DataFrame([row(42, 400), row(1, None), row(2, None)]),
                                    cells)
    assert math.isinf(two_nevers.tta_s.iloc[0]) and math.isnan(two_nevers.steps.iloc[0])


def test_the_composition_takes_the_least_loaded_start_up_of_the_trainers_runs():
    steps = pd.DataFrame([
        dict(model="basic", ranks=2, method="none", startup_s=9.0, eval_s=0.5, epoch_end_s=2.0),
        dict(model="basic", ranks=2, method="bit8", startup_s=20.0, eval_s=0.3, epoch_end_s=4.0),
        dict(model="basic", ranks=2, method="ddp:fp16", startup_s=30.0, eval_s=0.9,
             epoch_end_s=math.nan),
        dict(model="basic", ranks=4, method="bit8", startup_s=40.0, eval_s=0.8, epoch_end_s=5.0)])
    least = tta_grid.unloaded_times(steps)
    assert list(least.startup_s) == [9.0, 9.0, 30.0, 40.0]   # DDP's launcher, 4 ranks: their own
    assert list(least.eval_s) == [0.3, 0.3, 0.9, 0.8]
    assert list(least.epoch_end_s[:2]) == [2.0, 2.0] and math.isnan(least.epoch_end_s[2])
    assert list(steps.startup_s) == [9.0, 20.0, 30.0, 40.0]    # steps.csv keeps each run's own


def test_the_summary_of_a_grid_with_one_rank_count_writes_no_fit(tmp_path):
    """Targets at 2 ranks only: the tables, but no scaling.csv rows (and no crash)."""
    for seed in tta_grid.SEEDS:
        write_run(tmp_path / "runs" / tta_grid.Run("basic", 2, tta_grid.TRAINED["none"],
                                                   seed).name)
    pd.DataFrame([dict(model="basic", link="loopback", ranks=2, row="ours:none", round=1,
                       step_ms=30.0)]).to_csv(tmp_path / "bench.csv", index=False)
    steps, table = tta_grid.summarise(tmp_path, [f"horovod:cpu:{tmp_path / 'bench.csv'}"])
    assert set(steps.method) == {"none"} and set(table.link) == {"loopback"}
    assert (tmp_path / "tables.md").is_file() and (tmp_path / "tta.png").is_file()
    assert (tmp_path / "scaling.csv").read_text().strip() == ""     # no network at both
