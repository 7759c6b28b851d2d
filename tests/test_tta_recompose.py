"""The time-to-accuracy grid recomposed without its run folders (labs/bench/tta_grid.py
--steps-from, --targets-from, --step-times-csv), auto for time to accuracy on the DDP front
(ddp:auto:tta-<link>) in the grid and in labs/bench/tta_auto.py, and the injected step cells
written from a step_times.csv (tta_auto --write-step-s). Run folders are written here with
known evaluations; the committed results/tta files are read as they are."""
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from hvd_compress.auto import convergence
from labs.bench import tta_auto, tta_grid
from labs.kit import runlog, tta

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "tta"

# float32's three seeds: after the lab's 2 epochs 0.70, 0.72, 0.68 (the mean of each run's
# last three evaluations), so the cell's targets are 0.70 (float32) and 0.695 (lab)
FLOAT32 = {42: [0.5, 0.6, 0.7, 0.8], 1: [0.5, 0.62, 0.72, 0.82], 2: [0.5, 0.58, 0.68, 0.78]}


def write_run(out, key, seed, accuracies, start=1000.0, startup=6.0, model="basic", ranks=2,
              plan_report=None):
    """A complete run folder of 2 epochs of 4 steps of 0.25 s (rank 0), evaluations of 0.5 s
    after steps 2, 4, 6, 8 with the given accuracies, an epoch end of 3 s after step 4."""
    run = tta_grid.Run(model, ranks, tta_grid.TRAINED[key], seed)
    folder = Path(out) / "runs" / run.name
    folder.mkdir(parents=True)
    manifest = {"status": "complete", "process_start_unix": start, "args": {}}
    if plan_report is not None:
        manifest["plan_report"] = plan_report
    runlog.write_manifest(folder, manifest)
    t, steps, evals = start + startup, [], []
    for step in range(1, 9):
        t += 0.25
        epoch = 1 + (step > 4)
        steps.append({"rank": 0, "epoch": epoch, "step": step, "step_s": 0.25, "wall_time": t,
                      "samples": 64})
        if step % 2 == 0:
            t += 0.5
            evals.append({"epoch": epoch, "step": step, "samples": 128 * step,
                          "holdout_samples": 10, "holdout_loss": 1.0,
                          "holdout_accuracy": accuracies[step // 2 - 1], "eval_s": 0.5,
                          "wall_time": t})
        if step == 4:
            t += 3.0
    pd.DataFrame(steps).to_csv(folder / "steps.csv", index=False)
    pd.DataFrame(evals).to_csv(folder / "evals.csv", index=False)
    return folder


def bench_csv(path, rows, links=("loopback", "10mbit"), model="basic"):
    """A step benchmark's steps.csv: each row's step (ms) on each link, two rounds."""
    frame = pd.DataFrame([dict(model=model, link=link, ranks=2, row=row, round=rnd, step=0,
                               step_ms=ms * (1 + 3 * (link == "10mbit")) + rnd)
                          for link in links for row, ms in rows.items() for rnd in (1, 2)])
    frame.to_csv(path, index=False)
    return path


def grid_out(out):
    """A grid's out folder: float32 x3, bit8 and int8 (Horovod), DDP's fp16 hook, all seed 42;
    and the step cells of both fronts."""
    for seed, accuracies in FLOAT32.items():
        write_run(out, "none", seed, accuracies, startup=6.0 + seed % 3)
    write_run(out, "bit8", 42, [0.6, 0.7, 0.75, 0.8], startup=9.0)
    write_run(out, "int8", 42, [0.5, 0.5, 0.5, 0.5])                 # never
    write_run(out, "ddp:fp16", 42, [0.5, 0.6, 0.69, 0.71], startup=4.0)
    hvd = bench_csv(out / "hvd.csv", {"ours:none": 30.0, "ours:bit8:allgather": 20.0,
                                      "ours:int8": 22.0})
    ddp = bench_csv(out / "ddp.csv", {"stock:none": 25.0, "stock:fp16": 18.0,
                                      "ours:bit8:allgather": 21.0})
    return [f"horovod:cpu A:{hvd}", f"ddp:cpu B:{ddp}"]


SUMMARY_FILES = ("tta.csv", "steps.csv", "targets.csv", "step_times.csv", "tables.md")


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """The summary of a grid with its run folders (OUT a; read only by the tests)."""
    a = tmp_path_factory.mktemp("grid") / "a"
    specs = grid_out(a)
    tta_grid.summarise(a, specs)
    return a


@pytest.mark.parametrize("with_targets", [True, False])
def test_the_committed_counts_recompose_the_same_tables_without_the_run_folders(
        composed, tmp_path, capsys, with_targets):
    """The summary of a grid, then the same summary from its steps.csv, targets.csv (or the
    targets its rows were counted against) and step_times.csv alone, in a folder with no runs:
    every table the same, byte for byte; the plot drawn without curves, saying so."""
    b = tmp_path / "b"
    capsys.readouterr()
    tta_grid.summarise(b, [], steps_from=[composed / "steps.csv"],
                       targets_from=composed / "targets.csv" if with_targets else None,
                       step_times_csv=[composed / "step_times.csv"])
    for name in SUMMARY_FILES:
        assert (b / name).read_bytes() == (composed / name).read_bytes(), name
    said = capsys.readouterr().out
    assert "tta.png not drawn: no run of steps.csv has a folder" in said
    assert "scaling.csv not written" in said
    assert not (b / "tta.png").exists() and not (b / "scaling.csv").exists()
    assert (composed / "scaling.csv").is_file()      # with its folders the fit is written
    assert (composed / "tta.png").is_file()


def test_a_run_in_out_replaces_its_rows_and_a_new_run_adds_its_own(composed, tmp_path, capsys):
    """bit8's seed 42 run again in OUT (it now reaches both targets at step 8) replaces the
    file's bit8 rows; fp16 (a run the file does not have) adds its rows; every other row is the
    file's. The plot draws the runs that have folders and names the others."""
    b = tmp_path / "b"
    write_run(b, "bit8", 42, [0.6, 0.65, 0.69, 0.71], startup=9.0)
    write_run(b, "fp16", 42, [0.7, 0.7, 0.7, 0.7], startup=9.0)
    capsys.readouterr()
    steps, table = tta_grid.summarise(b, [], steps_from=[composed / "steps.csv"],
                                      step_times_csv=[composed / "step_times.csv"])
    old = pd.read_csv(composed / "steps.csv")
    assert old[old.method == "bit8"].step.tolist() == [4, 4]
    assert steps[steps.method == "bit8"].step.tolist() == [8, 8]
    assert steps[steps.method == "fp16"].step.tolist() == [2, 2]
    assert len(steps) == len(old) + 2
    rest = steps[~steps.method.isin(["bit8", "fp16"])].reset_index(drop=True)
    pd.testing.assert_frame_equal(rest, old[old.method != "bit8"].reset_index(drop=True),
                                  check_dtype=False)
    assert set(table[(table.method == "bit8") & (table.front == "horovod")].steps) == {8}
    said = capsys.readouterr().out
    assert "tta.png: no curve for" in said and (b / "tta.png").is_file()
    assert "basic-np2:none" in said and "basic-np2:ddp:fp16" in said
    assert "basic-np2:bit8" not in said and "basic-np2:fp16" not in said


def test_float32_runs_that_set_other_targets_than_the_given_ones_are_refused(composed, tmp_path):
    b = tmp_path / "b"
    for seed, accuracies in FLOAT32.items():
        write_run(b, "none", seed, [a + 0.01 for a in accuracies])
    with pytest.raises(tta.RunError, match="the given rows were counted against"):
        tta_grid.summarise(b, [], steps_from=[composed / "steps.csv"],
                           targets_from=composed / "targets.csv")


def test_rows_that_are_not_the_grids_are_refused_by_name(composed, tmp_path):
    rows = pd.read_csv(composed / "steps.csv")
    rows.drop(columns=["evals"]).to_csv(tmp_path / "short.csv", index=False)
    with pytest.raises(tta.RunError, match="not a tta_grid steps.csv \\(no evals\\)"):
        tta_grid.read_steps_rows([tmp_path / "short.csv"])
    rows.assign(method="bit9").to_csv(tmp_path / "odd.csv", index=False)
    with pytest.raises(tta.RunError, match="methods the grid does not have: bit9"):
        tta_grid.read_steps_rows([tmp_path / "odd.csv"])
    rows.assign(target=rows.target + (rows.seed == 1) * 0.01).to_csv(tmp_path / "mixed.csv",
                                                                       index=False)
    with pytest.raises(tta.RunError, match="rows of different grids"):
        tta_grid.known_targets(None, tta_grid.read_steps_rows([tmp_path / "mixed.csv"]))
    pd.read_csv(composed / "targets.csv").assign(lab=0.5).to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(tta.RunError, match="the rows were counted against"):
        tta_grid.known_targets(tmp_path / "t.csv", rows)


def test_a_step_benchmarks_cells_replace_those_of_a_step_times_csv(composed, tmp_path):
    newer = bench_csv(tmp_path / "new.csv", {"ours:bit8:allgather": 10.0}, links=("loopback",))
    cells = tta_grid.read_step_times([f"horovod:cpu C:{newer}"], [composed / "step_times.csv"])
    mine = cells[(cells.front == "horovod") & (cells.row == "ours:bit8:allgather")]
    # the benchmark's file replaces its (front, network, ranks) whole: no cell of another CPU
    # is left beside its own, the links and rows it did not measure included
    assert dict(zip(mine.link, mine.step_ms)) == {"loopback": 11.5}
    group = cells[(cells.front == "horovod") & (cells.model == mine.model.iloc[0])
                  & (cells.ranks == mine.ranks.iloc[0])]
    assert set(group.cpu) == {"cpu C"}
    with pytest.raises(tta.RunError, match="not a tta_grid step_times.csv"):
        tta_grid.read_step_times([], [composed / "hvd.csv"])


def test_the_grid_trains_no_float32_where_the_targets_are_given(composed, tmp_path, capsys):
    """--targets-from: the methods' runs stop at the file's target, float32 is not run again
    unless --methods names it."""
    def dry(*extra):
        capsys.readouterr()
        args = tta_grid.parse_args(["--dry-run", "--out", str(tmp_path / "c"),
                                    "--models", "basic", "--ranks", "2", *extra])
        assert tta_grid.run_grid(args) == []
        return [line for line in capsys.readouterr().out.splitlines() if "[tta " in line]
    given = ["--targets-from", str(composed / "targets.csv")]
    lines = dry("--methods", "int8", *given)
    assert len(lines) == 1 and "basic-np2-int8-s42" in lines[0]
    assert "--target-accuracy 0.700000" in lines[0]
    assert len(dry("--methods", "none,int8", *given)) == 4
    assert len(dry("--methods", "int8")) == 4          # no targets given: float32 first


def test_the_committed_tta_csv_is_recomposed_from_the_committed_counts_and_cells(tmp_path):
    """results/tta/tta.csv from results/tta/steps.csv, targets.csv and step_times.csv alone
    (its run folders are not committed)."""
    tta_grid.summarise(tmp_path, [], steps_from=[RESULTS / "steps.csv"],
                       targets_from=RESULTS / "targets.csv",
                       step_times_csv=[RESULTS / "step_times.csv"])
    for name in ("tta.csv", "steps.csv", "targets.csv", "step_times.csv"):
        assert (tmp_path / name).read_bytes() == (RESULTS / name).read_bytes(), name


# ---- auto for time to accuracy on the DDP front --------------------------------------------

def steps_rows(key, step, model="horovod"):
    return [dict(model=model, ranks=2, method=key, seed=42, target_name=name, target=0.8,
                 reached=True, step=step, samples=128 * step, evals=3, epoch_ends=0,
                 accuracy=0.8, last_step=900, startup_s=10.0, eval_s=1.0,
                 epoch_end_s=math.nan, loopback_step_s=0.1) for name in ("lab", "float32")]


def test_each_fronts_auto_takes_its_own_runs_steps_on_its_own_front_and_link_only():
    """auto:tta-10mbit's rows are Horovod's, ddp:auto:tta-10mbit's DDP's, each with its own
    runs' steps, on 10 Mbit/s only (they decided on its cells)."""
    steps = pd.DataFrame(steps_rows("auto:tta-10mbit", 400) + steps_rows("ddp:auto:tta-10mbit",
                                                                         600))
    cells = pd.DataFrame([dict(front=front, model="lab", link=link, ranks=2, row="ours:auto",
                               step_ms=100.0, rounds=1, source="x", cpu="cpu")
                          for front in ("horovod", "ddp") for link in tta_grid.LINKS])
    table = tta_grid.tta_table(steps, cells)
    assert set(table.link) == {"10mbit"}
    got = {(r.front, r.method, r.steps_from, r.steps) for r in table.itertuples()}
    assert got == {("horovod", "auto:tta-10mbit", "auto:tta-10mbit", 400),
                   ("ddp", "ddp:auto:tta-10mbit", "ddp:auto:tta-10mbit", 600)}
    assert {"ddp:auto:tta-10mbit", "auto:tta-10mbit", "auto"} <= tta_grid.AUTO_KEYS
    assert "ddp:fp16" not in tta_grid.AUTO_KEYS


def test_the_ddp_auto_runs_train_on_ddp_with_the_ddp_cells_of_their_link(tmp_path):
    from labs import ddp_mnist
    run = tta_grid.Run("horovod", 2, tta_grid.TRAINED["ddp:auto:tta-10mbit"], 42)
    assert run.name == "horovod-np2-ddp-auto-tta-10mbit-s42"
    cmd = tta_grid.train_command(run, tmp_path / run.name, 0.8, False, "fashion-mnist")
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"]
    script = next(i for i, part in enumerate(cmd) if part.endswith("ddp_mnist.py"))
    argv = cmd[script + 1:]
    at = argv.index("--auto-step-s") + 1
    assert argv[at] == str(tta_grid.STEP_S_DIR / "ddp-10mbit.json")
    # the trainer reads the file as it parses its flags: a file of the same form here
    argv[at] = str(tmp_path / "ddp-10mbit.json")
    (tmp_path / "ddp-10mbit.json").write_text(json.dumps({"value": 0.05, "powersgd4": 0.04}))
    args = ddp_mnist.parse_args(argv)
    assert (args.compression, args.auto_objective) == ("auto", "time_to_accuracy")
    assert args.auto_step_s == argv[at] and args.target_accuracy == 0.8
    horovod = tta_grid.TRAINED["auto:tta-10mbit"].flags
    assert horovod[-1] == str(tta_grid.STEP_S_DIR / "10mbit.json")


def test_a_ddp_auto_run_is_held_against_every_fixed_row_and_its_own_fronts_best(tmp_path):
    """tta_auto's table: a ddp:auto:tta-10mbit run (value for 4 steps, then powersgd4), its
    time against the fastest fixed row of both fronts (an auto row, either front's, is never
    'fixed'), the fastest DDP row, the fastest Horovod row; DDP's float32 is DDP's allreduce."""
    fixed = tmp_path / "grid"
    fixed.mkdir()
    pd.DataFrame([dict(model="horovod", ranks=2, lab=0.695, float32=0.70)]).to_csv(
        fixed / "targets.csv", index=False)
    rows = []
    for front, method, seconds in (("horovod", "none", 50.0), ("horovod", "bit8", 40.0),
                                   ("horovod", "auto:tta-10mbit", 1.0), ("ddp", "auto", 2.0),
                                   ("ddp", "ddp:auto:tta-10mbit", 3.0), ("ddp", "ddp:none", 45.0),
                                   ("ddp", "ddp:fp16", 35.0)):
        for name in ("lab", "float32"):
            rows.append(dict(front=front, model="horovod", link="10mbit", ranks=2,
                             method=method, target_name=name, tta_s=seconds, steps=8,
                             reached=1))
    pd.DataFrame(rows).to_csv(fixed / "tta.csv", index=False)
    # two DDP runs: tta.csv composed its rows with the least of their start-ups (5 s), not the
    # mean, and so must auto's time with the best row's overheads be
    pd.DataFrame([dict(model="horovod", ranks=2, method=method, seed=seed, target_name=name,
                       startup_s=startup, eval_s=0.5, epoch_end_s=3.0, loopback_step_s=0.25)
                  for method, seed, startup in (("ddp:fp16", 42, 5.0), ("ddp:fp16", 1, 9.0),
                                                ("bit8", 42, 1.0))
                  for name in ("lab", "float32")]).to_csv(fixed / "steps.csv", index=False)
    step_dir = tmp_path / "step_s"
    step_dir.mkdir()
    (step_dir / "ddp-10mbit.json").write_text(json.dumps({"value": 1.0, "powersgd4": 0.5}))
    (step_dir / "10mbit.json").write_text(json.dumps({"value": 9.0, "powersgd4": 9.0}))
    report = {"objective": {"switches": [[4, "value", "powersgd4", "pays"]], "windows": []}}
    write_run(tmp_path / "out", "ddp:auto:tta-10mbit", 42, [0.6, 0.7, 0.75, 0.8],
              model="horovod", plan_report=report)
    frame = tta_auto.table(tmp_path / "out", fixed / "tta.csv", step_dir)
    assert len(frame) == 2
    row = next(frame[frame.target_name == "float32"].itertuples())
    assert (row.front, row.method, row.link, row.seed, row.steps) == (
        "ddp", "ddp:auto:tta-10mbit", "10mbit", 42, 4)
    assert row.modes == "value:4"
    assert (row.best_fixed, row.best_fixed_s) == ("ddp:ddp:fp16", 35.0)
    assert (row.best_front, row.best_front_s) == ("ddp:fp16", 35.0)
    assert (row.best_horovod, row.best_horovod_s) == ("bit8", 40.0)
    assert row.float32_s == 45.0
    # with the best DDP row's start-up, evaluations and epoch ends: 5 + 4 x 1.0 + 2 x 0.5
    assert row.tta_like_best_no_shadows_s == pytest.approx(10.0)
    assert row.vs_best_front_no_shadows == pytest.approx(10.0 / 35.0)


# ---- the injected step cells ------------------------------------------------------------------

def test_the_committed_horovod_step_s_files_are_regenerated_from_the_measured_cells(tmp_path):
    cells = tta_auto.read_cells([RESULTS / "cells-xeon" / "hvd-lab-n2" / "steps.csv"], "horovod")
    written = tta_auto.write_step_s(cells, "horovod", "lab", 2, tmp_path)
    assert [p.name for p, _ in written] == [f"{link}.json" for link in tta_grid.LINKS]
    for path, fastest in written:
        made = json.loads(path.read_text())
        committed = json.loads((RESULTS / "auto" / "step_s" / path.name).read_text())
        assert list(made) == ["value", *convergence.DEFAULT_METHODS] == list(committed)
        assert made == pytest.approx(committed, abs=1e-6), path.name
        assert fastest == "ours:bit8:allgather"
    for method in convergence.DEFAULT_METHODS:          # what auto accepts as a method's key
        convergence.parse_method(method)


def test_value_is_the_fastest_of_the_value_plans_codecs_and_each_method_its_own_cell():
    """int8 (a method of its own), bf16 and onebit faster than every value codec: value is
    still the fastest of the value plan's candidates (here bit8 two-phase)."""
    own = {m: 50.0 + i for i, m in enumerate(convergence.DEFAULT_METHODS)}
    rows = {"ours:none": 40.0, "ours:fp16": 35.0, "ours:bit8:allgather": 33.0,
            "ours:bit8:alltoall": 31.0, "ours:bf16": 10.0, "stock:none": 5.0,
            **{tta_grid.TRAINED[m].bench_row: ms for m, ms in own.items()}}
    rows.update({"ours:int8": 12.0, "ours:onebit": 11.0})
    cells = pd.DataFrame([dict(front="ddp", model="lab", link="1gbit", ranks=2, row=r, step_ms=ms)
                          for r, ms in rows.items()])
    values, fastest = tta_auto.step_s_of(cells, "ddp", "lab", 2, "1gbit")
    assert fastest == "ours:bit8:alltoall" and values["value"] == 0.031
    assert values["int8"] == 0.012 and values["onebit"] == 0.011
    assert values["powersgd1"] == 0.05


def test_a_missing_candidate_cell_is_an_error_naming_it_and_nothing_is_written(tmp_path, capsys):
    """The DDP grid's cells (results/ddp-grid) have no row for six of auto's methods: the files
    are not written, and the error names every missing row and how to measure it."""
    code = tta_auto.main(["--write-step-s", "--cells",
                          str(RESULTS.parent / "ddp-grid" / "steps.csv"),
                          "--front", "ddp", "--model", "lab", "--ranks", "2",
                          "--dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and list(tmp_path.iterdir()) == []
    for row in ("ours:powersgd2", "ours:powersgd4", "ours:topk0.1", "ours:topk0.001",
                "ours:onebit", "ours:int8"):
        assert row in err
    assert "ddp, lab, 2 ranks, loopback: no step cell for" in err
    assert "python -m labs.bench.ddp --models lab --ranks 2 --rows ours:powersgd2," in err
    cells = tta_auto.read_cells([RESULTS / "step_times.csv"], "horovod")
    only_int8 = cells[~((cells.front == "horovod") & (cells.row == "ours:int8")
                        & (cells.link == "10mbit"))]
    with pytest.raises(KeyError, match="horovod, lab, 2 ranks, 10mbit: no step cell for "
                                       "ours:int8"):
        tta_auto.write_step_s(only_int8, "horovod", "horovod", 2, tmp_path)
    no_value = cells[~cells.row.isin(tta_auto.value_rows("horovod"))]
    with pytest.raises(KeyError, match="no step cell for one of ours:none"):
        tta_auto.step_s_of(no_value, "horovod", "lab", 2, "loopback")


def test_the_step_s_files_can_be_written_from_a_step_benchmarks_own_steps_csv(tmp_path, capsys):
    rows = {"ours:bit8:allgather": 20.0, **{tta_grid.TRAINED[m].bench_row: 30.0
                                            for m in convergence.DEFAULT_METHODS}}
    bench = bench_csv(tmp_path / "steps.csv", rows, links=tta_grid.LINKS, model="lab")
    assert tta_auto.main(["--write-step-s", "--cells", str(bench), "--front", "ddp",
                          "--dir", str(tmp_path / "s")]) == 0
    made = json.loads((tmp_path / "s" / "ddp-10mbit.json").read_text())
    assert made["value"] == pytest.approx(4 * 20.0e-3 + 1.5e-3)    # 10mbit x4, rounds +1/+2
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(
        f"ddp-{link}.json" for link in tta_grid.LINKS)
    assert "value = ours:bit8:allgather" in capsys.readouterr().out
