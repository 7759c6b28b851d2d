"""The step benchmark's own arithmetic (labs/bench/step.py: its grid, steps per cell, the
round-to-round spread, the summary's ratios and plan columns) and the wins-and-losses count
(labs/bench/wins_losses.py), on hand-made frames whose answers are known by construction. Nothing
here starts Horovod."""
import math

import pandas as pd
import pytest

from conftest import ROOT, load_script

pytestmark = pytest.mark.unit

from labs.bench import step as bench, wins_losses as wins

FIXED = [r for r in bench.ROWS if r != bench.AUTO_ROW]


# ---- the grid -------------------------------------------------------------------------------

def test_the_grid_has_a_10mbit_link_the_emulator_reads_as_10_mbit_per_s():
    from labs import netem
    args = bench.parse_args(["--rows", ",".join(FIXED)])
    assert args.links == ["loopback", "100mbit", "1gbit", "10mbit"]
    assert args.models == ["lab", "basic"] and args.ranks == [2, 4]
    assert bench.LINKS["10mbit"] == "10mbit" and netem.parse_rate("10mbit") == 1e7
    assert [netem.parse_rate(bench.LINKS[k]) for k in ("1gbit", "100mbit")] == [1e9, 1e8]
    assert bench.LINKS["loopback"] is None
    assert bench.AUTO_ROW in bench.ROWS and bench.ROWS[:7] == FIXED


def test_the_default_rows_include_auto_with_the_runtime():
    """With Compression.auto in this checkout, the default grid runs every row, auto last."""
    args = bench.parse_args([])
    assert args.rows == bench.ROWS and args.rows[-1] == "ours:auto"
    assert (args.steps, args.rounds, args.max_rounds, args.target_spread) == (None, None, None, 3.0)
    assert args.auto_trial_steps == 0                        # Compression.auto's default


def test_the_auto_row_asks_for_the_trial_when_told():
    """--auto-trial-steps reaches the auto row's Compression.auto (results/step-auto-trial: 5);
    the fixed rows are unchanged by it."""
    from labs.kit.flags import auto_compression
    assert auto_compression()(trial_steps=5).trial_steps == 5
    assert bench.parse_args(["--auto-trial-steps", "5"]).auto_trial_steps == 5


@pytest.mark.parametrize("argv,message", [
    (["--links", "56kbit"], "links among"),
    (["--rows", "ours:bit4"], "rows must be among"),
    (["--models", "resnet"], "models must be among"),
    (["--ranks", "two"], "comma-separated numbers"),
    (["--ranks", "1"], "at least 2 ranks"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--max-rounds", "0"], "--max-rounds must be at least 1"),
    (["--auto-trial-steps", "-1"], "--auto-trial-steps must be at least 0"),
])
def test_bad_arguments_are_clear_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(argv + (["--rows", "stock:none"] if "--rows" not in argv else []))
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_the_auto_row_without_the_runtime_is_refused_before_anything_runs(monkeypatch, capsys):
    """An hvd_compress without Compression.auto: the auto row is refused at once, saying how
    to leave it out (labs.kit.flags.auto_compression's error, replaced here by one that says
    the same thing, since this checkout may have the runtime)."""
    from labs.kit import flags

    def missing():
        raise RuntimeError("--auto-allreduce: this hvd_compress has no Compression.auto")
    monkeypatch.setattr(flags, "auto_compression", missing)
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--rows", "stock:none,ours:auto"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "ours:auto" in err and "no Compression.auto" in err and "--rows" in err


def test_steps_per_cell_defaults_and_overrides():
    """The lab net 10 steps a round, 10 rounds going on to 40 while a row's median is not known
    to the target; the basic net 5 a round, 8 to 30, and at 10mbit 3, 6 to 10. --steps/--rounds
    run exactly what they say (--steps 5: five rounds of one step), --max-rounds allows more."""
    assert bench.cell_steps("lab", "loopback") == (10, 10, 40)
    assert bench.cell_steps("lab", "10mbit") == (10, 10, 40)
    assert bench.cell_steps("basic", "100mbit") == (5, 8, 30)
    assert bench.cell_steps("basic", "10mbit") == (3, 6, 10)
    assert bench.cell_steps("lab", "loopback", steps=5) == (1, 5, 5)
    assert bench.cell_steps("basic", "loopback", steps=40) == (5, 8, 8)
    assert bench.cell_steps("basic", "10mbit", steps=12) == (2, 6, 6)
    assert bench.cell_steps("lab", "loopback", rounds=4) == (10, 4, 4)
    assert bench.cell_steps("basic", "loopback", steps=20, rounds=4) == (5, 4, 4)
    assert bench.cell_steps("lab", "loopback", max_rounds=12) == (10, 10, 12)
    assert bench.cell_steps("basic", "loopback", steps=40, max_rounds=3) == (5, 8, 8)


# ---- the spread and the summary -------------------------------------------------------------

def test_round_spread_by_hand():
    """Round 1: 10, 10, 12 (median 10); round 2: 11, 11 (median 11); all five: median 11.
    Spread (11 - 10) / 11 = 9.09%. One round: no spread."""
    assert bench.round_spread_pct([10, 10, 12, 11, 11], [1, 1, 1, 2, 2]) == pytest.approx(
        100 / 11)
    assert bench.round_spread_pct([5, 5, 5, 5], [1, 2, 3, 4]) == 0.0
    assert math.isnan(bench.round_spread_pct([10, 12], [1, 1]))


def test_median_confidence_interval_by_hand():
    """k round medians; the interval is [r_(j), r_(k+1-j)], j the largest with
    P(Bin(k, 1/2) < j) <= 2.5%: k=5 is too few (P(B=0) = 3.1%); k=6: j=1 (1.6%), the whole
    range; k=16: j=4 (P(B<=3) = 1.06%, P(B<=4) = 3.84%), the 4th to the 13th."""
    assert math.isnan(bench.median_ci_pct([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]))
    six = [10, 11, 12, 13, 14, 20]
    assert bench.median_ci_pct(six, range(6)) == pytest.approx(100 * 10 / 12.5)
    sixteen = list(range(100, 116))                 # one step a round, sorted 100..115
    assert bench.median_ci_pct(sixteen, range(16)) == pytest.approx(100 * (112 - 103) / 107.5)
    # more rounds of the same spread of round medians narrow it; the round range does not
    many = [100 + (i * 7) % 16 for i in range(160)]
    assert bench.median_ci_pct(many, range(160)) < bench.median_ci_pct(sixteen, range(16)) / 2
    assert bench.round_spread_pct(many, range(160)) == bench.round_spread_pct(sixteen, range(16))
    # a round's median, not its steps: rounds of 1, 1, 9 and 1, 1, 1 ... are all 1
    steps = [1, 1, 9] * 6
    assert bench.median_ci_pct(steps, [i // 3 for i in range(18)]) == 0.0


def test_paired_ratio_by_hand():
    """Round by round: a row 2% slower than its base in every round, while the machine
    drifts by 40% between rounds, is known to be 2% slower exactly; its medians alone are
    not. Only rounds both rows ran count; five ratios are too few for an interval at 95%."""
    base = [100, 140, 90, 120, 110, 130]
    row = [1.02 * b for b in base]
    assert bench.paired_ratio(row, range(6), base, range(6)) == pytest.approx((1.02, 1.02, 1.02))
    assert bench.median_ci_pct(row, range(6)) > 40
    ratios = [0.9, 0.95, 1.0, 1.05, 1.1, 1.2]          # k=6: j=1, the whole range
    assert bench.paired_ratio([100 * r for r in ratios], range(6), [100] * 6,
                              range(6)) == pytest.approx((1.025, 0.9, 1.2))
    median, lo, hi = bench.paired_ratio([1, 2, 3, 4, 5, 6], range(6), [1] * 5, range(5))
    assert median == 3 and math.isnan(lo) and math.isnan(hi)
    # each round's median first: steps 1, 1, 9 in a round against 2, 2, 2 is a ratio of 1/2
    assert bench.paired_ratio([1, 1, 9] * 6, [i // 3 for i in range(18)], [2] * 6,
                              range(6)) == pytest.approx((0.5, 0.5, 0.5))
    assert all(math.isnan(v) for v in bench.paired_ratio([1.0], [1], [1.0], [2]))


def steps_frame():
    """Two cells, each row four steps in two rounds; auto's plan columns filled."""
    rows = []
    steps = {("lab", "loopback", 2): {"stock:none": [10, 10, 10, 10], "ours:bit8:allgather":
                                      [9, 9, 9.9, 9.9], "ours:auto": [9.5, 9.5, 9.5, 9.5]},
             ("basic", "10mbit", 2): {"stock:none": [4000, 4100, 4000, 4100],
                                      "stock:fp16": [2000, 2000, 2000, 2000],
                                      "ours:auto": [1000, 1000, 1100, 1100]}}
    for (model, link, n), cell in steps.items():
        for row, values in cell.items():
            for i, ms in enumerate(values):
                auto = row == "ours:auto"
                rows.append({"model": model, "link": link, "ranks": n, "row": row,
                             "round": 1 + i // 2, "step": i % 2, "step_ms": ms,
                             "forward_backward_ms": 1.0, "copy_ms": 0.05, "compress_ms": 0.1,
                             "communicate_ms": 0.2, "decompress_ms": 0.1, "overlap_ms": 0.0,
                             "bytes_sent": 100.0,
                             "plan": ("none:allreduce bit8:allgather" if i else "") if auto else "",
                             "plan_predicted_ms": (0.9 * ms if i else math.nan) if auto else math.nan,
                             "plan_measured_ms": (ms + i if i else math.nan) if auto else math.nan,
                             "plan_event": ("planned" if i == 1 else "replanned: drift"
                                            if i == 3 else "") if auto else ""})
    return pd.DataFrame(rows, columns=bench.STEP_COLUMNS)


def test_summary_ratios_spread_plan_and_calibration():
    calibration = pd.DataFrame([{"model": "basic", "link": "10mbit", "ranks": 2,
                                 "row": "ours:auto", "auto_warmup_steps": 12,
                                 "auto_warmup_s": 30.5, "calibration_s": 4.25,
                                 "auto_outcome": "planned", "plan": "bit8:allgather"}])
    summary = bench.summarise(steps_frame(), calibration).set_index(["link", "row"])
    # the fastest fixed row of each cell; auto is judged against it, never counted as it
    assert summary.loc[("loopback", "ours:auto"), "fastest_row"] == "ours:bit8:allgather"
    assert summary.loc[("loopback", "ours:auto"), "vs_fastest"] == pytest.approx(9.5 / 9.45)
    assert summary.loc[("loopback", "stock:none"), "vs_fastest"] == pytest.approx(10 / 9.45)
    assert summary.loc[("10mbit", "ours:auto"), "fastest_row"] == "stock:fp16"
    assert summary.loc[("10mbit", "ours:auto"), "vs_fastest"] == pytest.approx(1050 / 2000)
    assert summary.loc[("10mbit", "ours:auto"), "vs_stock_none"] == pytest.approx(1050 / 4050)
    # round by round: auto 9.5 against bit8's 9 and 9.9, ratios 1.056 and 0.960; two rounds
    # are too few for an interval
    auto = summary.loc[("loopback", "ours:auto")]
    assert auto.vs_fastest_paired == pytest.approx((9.5 / 9 + 9.5 / 9.9) / 2)
    assert math.isnan(auto.vs_fastest_paired_lo) and math.isnan(auto.vs_fastest_paired_hi)
    assert auto.vs_stock_none_paired == pytest.approx(0.95)
    assert summary.loc[("10mbit", "ours:auto"), "vs_stock_none_paired"] == pytest.approx(
        (1000 / 4050 + 1100 / 4050) / 2)
    assert summary.loc[("10mbit", "stock:fp16"), "vs_fastest_paired"] == 1.0
    # round to round: bit8 9 then 9.9 around a median of 9.45; stock 4050 in both rounds
    assert summary.loc[("loopback", "ours:bit8:allgather"), "round_spread_pct"] == pytest.approx(
        100 * 0.9 / 9.45)
    assert summary.loc[("10mbit", "stock:none"), "round_spread_pct"] == 0.0
    assert summary.median_ci_pct.isna().all()                 # two rounds are too few
    assert (summary.rounds == 2).all() and (summary.steps == 4).all()
    # the plan of the last timed step, the median predicted over planned steps, re-plans
    auto = summary.loc[("10mbit", "ours:auto")]
    assert auto.plan == "none:allreduce bit8:allgather"
    assert auto.plan_predicted_ms == pytest.approx(0.9 * 1100)     # of 1000, 1100, 1100
    assert auto.plan_measured_ms == 1100 + 3 and auto.plan_replans == 1
    assert summary.loc[("loopback", "stock:none"), "plan"] == ""
    assert math.isnan(summary.loc[("loopback", "stock:none"), "plan_predicted_ms"])
    # auto's warm-up to its plan, on its own row only
    assert (auto.auto_warmup_steps, auto.auto_warmup_s, auto.calibration_s,
            auto.auto_outcome) == (12, 30.5, 4.25, "planned")
    assert math.isnan(summary.loc[("loopback", "ours:auto"), "calibration_s"])


def test_step_over_bound_by_hand():
    """The bound of a row is max(the cell's local step, its bytes at the link rate): at 10
    Mbit/s 100 kB a step take 80 ms on the wire, more than the local row's 50 ms floor; over
    loopback no wire time is counted, the floor is the bound. The local row is no contender
    for the fastest row."""
    rows = []
    for link, cell in (("10mbit", {"local": (50, 0), "ours:bit8:allgather": (120, 100_000),
                                   "ours:bit8:allgather+overlap": (88, 100_000)}),
                       ("loopback", {"local": (40, 0), "stock:none": (60, 400_000)})):
        for row, (ms, sent) in cell.items():
            for i in range(4):
                rows.append({"model": "basic", "link": link, "ranks": 2, "row": row,
                             "round": 1 + i // 2, "step": i % 2, "step_ms": ms,
                             "forward_backward_ms": 1.0, "copy_ms": 0, "compress_ms": 0,
                             "communicate_ms": 0, "decompress_ms": 0, "overlap_ms": 0,
                             "bytes_sent": sent, "plan": "", "plan_predicted_ms": math.nan,
                             "plan_measured_ms": math.nan, "plan_event": ""})
    summary = bench.summarise(pd.DataFrame(rows, columns=bench.STEP_COLUMNS)).set_index(
        ["link", "row"])
    bit8 = summary.loc[("10mbit", "ours:bit8:allgather")]
    assert (bit8.floor_ms, bit8.wire_ms, bit8.bound_ms) == (50, pytest.approx(80), pytest.approx(80))
    assert bit8.step_over_bound == pytest.approx(1.5)
    assert summary.loc[("10mbit", "ours:bit8:allgather+overlap"), "step_over_bound"] == pytest.approx(1.1)
    assert summary.loc[("10mbit", "local"), "step_over_bound"] == 1.0
    stock = summary.loc[("loopback", "stock:none")]
    assert (stock.wire_ms, stock.bound_ms, stock.step_over_bound) == (0, 40, 1.5)
    assert summary.loc[("10mbit", "local"), "fastest_row"] == "ours:bit8:allgather+overlap"


def test_round_mean_counts_each_exchange_once():
    """An overlapped row whose rounds run 20, 60 and 220 ms (nothing pending at a round's start,
    its own flush at its end): its median step is 60 ms, the median of its round means 100 ms,
    1.25 of a bound of 80 ms (100 kB at 10 Mbit/s over a 50 ms floor)."""
    rows = []
    for row, values, sent in (("local", [50] * 6, 0),
                              ("ours:bit8:allgather+overlap", [20, 60, 220] * 2, 100_000)):
        for i, ms in enumerate(values):
            rows.append({"model": "basic", "link": "10mbit", "ranks": 2, "row": row,
                         "round": 1 + i // 3, "step": i % 3, "step_ms": ms,
                         "forward_backward_ms": 1.0, "copy_ms": 0, "compress_ms": 0,
                         "communicate_ms": 0, "decompress_ms": 0, "overlap_ms": 0,
                         "bytes_sent": sent, "plan": "", "plan_predicted_ms": math.nan,
                         "plan_measured_ms": math.nan, "plan_event": ""})
    summary = bench.summarise(pd.DataFrame(rows, columns=bench.STEP_COLUMNS)).set_index("row")
    row = summary.loc["ours:bit8:allgather+overlap"]
    assert row.step_ms == 60 and row.round_mean_ms == pytest.approx(100)
    assert row.step_over_bound == pytest.approx(60 / 80)
    assert row.round_mean_over_bound == pytest.approx(100 / 80)


def test_steady_state_leaves_out_each_rounds_first_and_last_step():
    """An overlapped row's rounds of 5 steps: the first starts with nothing pending (20 ms),
    the last pays the flush (300 ms); the middle three (100, 100, 130 ms) are what a training
    run's steps look like. steady_ms is their mean, 110 ms (the median of all steps: 100, the
    median of round means: 130); rounds of 2 steps have no middle."""
    rows = []
    for row, values, per in (("local", [50] * 10, 5), ("ours:bit8:allgather+overlap",
                                                        [20, 100, 100, 130, 300] * 2, 5),
                             ("ours:bit8:allgather", [90, 95] * 2, 2)):
        for i, ms in enumerate(values):
            rows.append({"model": "basic", "link": "10mbit", "ranks": 2, "row": row,
                         "round": 1 + i // per, "step": i % per, "step_ms": ms,
                         "forward_backward_ms": 1.0, "copy_ms": 0, "compress_ms": 0,
                         "communicate_ms": 0, "decompress_ms": 0, "overlap_ms": 0,
                         "bytes_sent": 100_000, "plan": "", "plan_predicted_ms": math.nan,
                         "plan_measured_ms": math.nan, "plan_event": ""})
    summary = bench.summarise(pd.DataFrame(rows, columns=bench.STEP_COLUMNS)).set_index("row")
    row = summary.loc["ours:bit8:allgather+overlap"]
    assert (row.step_ms, row.round_mean_ms, row.steady_ms) == (100, 130, 110)
    assert row.steady_over_bound == pytest.approx(110 / 80)
    assert math.isnan(summary.loc["ours:bit8:allgather", "steady_ms"])


def test_the_local_and_overlap_rows_are_known():
    rows = bench.known_rows()
    assert bench.LOCAL_ROW in rows and "ours:bit8:allgather+overlap" in rows
    assert "stock:none+overlap" not in rows and "ours:auto+overlap" in rows
    assert bench.parse_args(["--rows", "local,ours:bit8+overlap"]).rows == [
        "local", "ours:bit8+overlap"]


def test_the_whole_bucket_row_asks_the_optimizer_for_whole_buckets():
    """ours:...+whole+overlap: the same scheme and route, overlapped (the model given) with no
    bucket cut (prioritise=False, an argument of the optimizer: no environment flag); the
    other rows of ours wait, +overlap cuts."""
    assert "ours:bit8:alltoall+whole+overlap" in bench.known_rows()
    compression, route = bench.row_compression("ours:bit8:alltoall+whole+overlap")
    assert (compression.name, route) == ("bit8", "alltoall")
    model = object()
    assert bench.schedule_options("ours:bit8:alltoall+whole+overlap", model) == {
        "model": model, "prioritise": False}
    assert bench.schedule_options("ours:bit8:allgather+overlap", model) == {
        "model": model, "prioritise": True}
    assert bench.schedule_options("ours:bit8:allgather", model) == {"schedule": "wait"}


def test_the_overlapped_auto_row_plans_itself_and_keeps_its_own_plan_report():
    assert bench.is_auto("ours:auto") and bench.is_auto("ours:auto+overlap")
    assert not bench.is_auto("ours:bit8+overlap") and not bench.is_auto("local")
    assert bench.plans_name("basic", "100mbit", 2, "ours:auto") == "basic-100mbit-n2.json"
    assert bench.plans_name("basic", "100mbit", 2, "ours:auto+overlap") == \
        "basic-100mbit-n2-overlap.json"
    assert bench.plan_fields("ours:bit8+overlap", {})["plan"] == ""


def test_summary_keeps_a_replanned_rows_last_prediction_apart():
    """A row re-planned in its timed steps: plan_predicted_ms is the median over them (900,
    990 and the new plan's 1200), plan_last_predicted_ms the last plan's own."""
    steps = steps_frame()
    auto = steps.index[(steps.link == "10mbit") & (steps.row == "ours:auto")]
    steps.loc[auto[-1], "plan_predicted_ms"] = 1200.0
    summary = bench.summarise(steps).set_index(["link", "row"])
    row = summary.loc[("10mbit", "ours:auto")]
    assert row.plan_predicted_ms == pytest.approx(990) and row.plan_last_predicted_ms == 1200
    assert math.isnan(summary.loc[("10mbit", "stock:none"), "plan_last_predicted_ms"])  # fixed


def test_summary_of_a_benchmark_from_before_the_plan_columns():
    """results/step/steps.csv as committed (no plan columns, no auto row) still summarises."""
    old = pd.read_csv(ROOT / "results" / "step" / "steps.csv")
    assert "plan" not in old
    summary = bench.summarise(old)
    assert len(summary) == 84 and (summary.plan == "").all()
    assert summary.round_spread_pct.notna().all() and (summary.vs_fastest >= 1).all()
    assert (summary.groupby(["model", "link", "ranks"]).vs_fastest.min() == 1).all()


# ---- wins and losses ------------------------------------------------------------------------

def hand_made_summary():
    """Three cells whose answers are known:
    A lab/loopback/2:   bit8 9 fastest; auto 9.3 (x1.033 of it, x0.93 of stock float32 10)
    B basic/100mbit/2:  bit8 300 fastest fixed; auto 290 faster still (x0.967; x0.58 of 500)
    C basic/1gbit/4:    stock float32 270 fastest, ours none 272 (0.74% behind); auto 290
                        (x1.074 of both: a loss worth naming)"""
    steps = {("lab", "loopback", 2): [10, 12, 11, 9, 9.3],
             ("basic", "100mbit", 2): [500, 350, 490, 300, 290],
             ("basic", "1gbit", 4): [270, 300, 272, 280, 290]}
    rows = ["stock:none", "stock:fp16", "ours:none", "ours:bit8:allgather", "ours:auto"]
    return pd.DataFrame([{"model": m, "link": l, "ranks": n, "row": r, "step_ms": ms,
                          "plan": "bit8:allgather" if r == "ours:auto" else "",
                          "round_spread_pct": 1.5}
                         for (m, l, n), values in steps.items() for r, ms in zip(rows, values)])


def test_wins_and_losses_by_construction(tmp_path):
    path = tmp_path / "summary.csv"
    hand_made_summary().to_csv(path, index=False)
    assert wins.main([str(path)]) == 0
    table = pd.read_csv(tmp_path / "wins_losses.csv").set_index("row")
    assert table.fastest_in.to_dict() == {"stock:none": 1, "stock:fp16": 0, "ours:none": 0,
                                          "ours:bit8:allgather": 2, "ours:auto": 1}
    assert table.beats_stock_none_in.to_dict() == {"stock:none": 0, "stock:fp16": 1,
                                                   "ours:none": 1, "ours:bit8:allgather": 2,
                                                   "ours:auto": 2}
    assert (table.cells == 3).all()
    auto = table.loc["ours:auto"]
    assert (auto.within_5pct_of_fastest_in, auto.within_5pct_of_stock_none_in) == (2, 2)
    assert auto.median_vs_fastest == pytest.approx(9.3 / 9, rel=1e-3)
    assert auto.worst_vs_fastest == pytest.approx(290 / 270, rel=1e-3)
    assert table.loc[["stock:none", "ours:none"], "within_5pct_of_fastest_in"].isna().all()
    cells = pd.read_csv(tmp_path / "wins_losses_cells.csv")
    assert cells.fastest_row.tolist() == ["ours:bit8:allgather", "ours:bit8:allgather",
                                          "stock:none"]
    assert cells.auto_vs_stock_none.tolist() == pytest.approx([0.93, 0.58, 290 / 270], rel=1e-3)
    assert cells.auto_plan.tolist() == ["bit8:allgather"] * 3
    assert (cells.fastest_spread_pct == 1.5).all() and (cells.auto_spread_pct == 1.5).all()
    text = (tmp_path / "wins_losses.md").read_text()
    assert "3 cells" in text and "| ours:bit8:allgather | 3 | 2 | 2 |" in text


def test_cells_say_how_well_medians_are_known_and_the_prediction_error(tmp_path):
    """A summary with median_ci_pct reports it (not the round range); auto's predicted step
    and its error against its measured median: 9.3 ms predicted 10.23 ms is +10%."""
    frame = hand_made_summary().assign(median_ci_pct=2.5, plan_predicted_ms=math.nan)
    frame.loc[frame.row == "ours:auto", "plan_predicted_ms"] = frame[
        frame.row == "ours:auto"].step_ms * 1.1
    frame.to_csv(tmp_path / "summary.csv", index=False)
    assert wins.main([str(tmp_path / "summary.csv")]) == 0
    cells = pd.read_csv(tmp_path / "wins_losses_cells.csv")
    assert (cells.fastest_spread_pct == 2.5).all() and (cells.auto_spread_pct == 2.5).all()
    assert cells.auto_predicted_ms.iloc[0] == pytest.approx(10.23, rel=1e-3)
    assert cells.auto_prediction_error_pct.tolist() == pytest.approx([10.0] * 3, rel=1e-3)
    assert cells.auto_last_plan_error_pct.isna().all()      # a summary without the columns
    frame["plan_last_predicted_ms"], frame["plan_measured_ms"] = 12.0, 10.0
    frame.to_csv(tmp_path / "summary.csv", index=False)
    assert wins.main([str(tmp_path / "summary.csv")]) == 0
    cells = pd.read_csv(tmp_path / "wins_losses_cells.csv")
    assert cells.auto_last_plan_error_pct.tolist() == pytest.approx([20.0] * 3)


def test_ties_within_a_margin_count_for_every_tied_row(tmp_path):
    """With --tie-pct 1, ours none (272, 0.74% behind stock's 270) shares cell C's win."""
    path = tmp_path / "summary.csv"
    hand_made_summary().to_csv(path, index=False)
    assert wins.main([str(path), "--tie-pct", "1", "--out-dir", str(tmp_path / "tied")]) == 0
    table = pd.read_csv(tmp_path / "tied" / "wins_losses.csv").set_index("row")
    assert table.loc["ours:none", "fastest_in"] == 1 and table.loc["stock:none", "fastest_in"] == 1
    cells = pd.read_csv(tmp_path / "tied" / "wins_losses_cells.csv")
    assert cells.fastest_row.iloc[2] == "stock:none ours:none"


def test_a_summary_without_auto_counts_the_fixed_schemes_alone(tmp_path):
    frame = hand_made_summary()
    frame[frame.row != "ours:auto"].to_csv(tmp_path / "summary.csv", index=False)
    assert wins.main([str(tmp_path / "summary.csv")]) == 0
    table = pd.read_csv(tmp_path / "wins_losses.csv")
    assert "ours:auto" not in set(table.row) and table.fastest_in.sum() == 3


def test_wins_losses_refuses_what_it_cannot_count(tmp_path, capsys):
    pd.DataFrame({"model": ["lab"], "row": ["stock:none"]}).to_csv(tmp_path / "a.csv", index=False)
    assert wins.main([str(tmp_path / "a.csv")]) == 1
    assert "not a labs.bench.step summary (no link, ranks, step_ms)" in capsys.readouterr().err
    frame = hand_made_summary()
    frame.loc[2, "step_ms"] = math.nan
    frame.to_csv(tmp_path / "b.csv", index=False)
    assert wins.main([str(tmp_path / "b.csv")]) == 1
    assert "lab/loopback/n=2/ours:none" in capsys.readouterr().err
    frame = hand_made_summary()
    frame[frame.row == "ours:auto"].to_csv(tmp_path / "c.csv", index=False)
    assert wins.main([str(tmp_path / "c.csv")]) == 1
    assert "no fixed row" in capsys.readouterr().err
    assert not (tmp_path / "wins_losses.csv").exists()


def test_the_paired_interval_says_slower_tie_or_faster(tmp_path):
    """Auto's round-by-round ratio to the fastest row: an interval above 1 is a loss the data
    can tell (cell A), one holding 1 a tie (B), one below 1 a win (C); without the columns
    (a summary from before them) no verdict."""
    frame = hand_made_summary()
    auto = frame.row == "ours:auto"
    for column, values in (("vs_fastest_paired", [1.03, 0.99, 0.95]),
                           ("vs_fastest_paired_lo", [1.01, 0.97, 0.93]),
                           ("vs_fastest_paired_hi", [1.05, 1.02, 0.98])):
        frame[column] = math.nan
        frame.loc[auto, column] = values
    frame.to_csv(tmp_path / "summary.csv", index=False)
    assert wins.main([str(tmp_path / "summary.csv")]) == 0
    cells = pd.read_csv(tmp_path / "wins_losses_cells.csv")
    assert cells.auto_paired_verdict.tolist() == ["slower", "tie", "faster"]
    assert cells.auto_vs_fastest_paired_hi.tolist() == [1.05, 1.02, 0.98]
    table = pd.read_csv(tmp_path / "wins_losses.csv").set_index("row")
    assert table.loc["ours:auto", ["paired_slower_in", "paired_tie_in",
                                   "paired_faster_in"]].tolist() == [1, 1, 1]
    hand_made_summary().to_csv(tmp_path / "old.csv", index=False)
    assert wins.main([str(tmp_path / "old.csv"), "--out-dir", str(tmp_path / "old")]) == 0
    old = pd.read_csv(tmp_path / "old" / "wins_losses_cells.csv", keep_default_na=False)
    assert (old.auto_paired_verdict == "").all()


def test_collective_trace_splits_each_step_into_wire_and_loop():
    """results/step-bound/trace_collectives.py (the probe beside its data): per step, wire runs from the later rank's first chunk to
    the last chunk complete on every rank, loop from there to the later rank's next first
    chunk; a step whose next launch is missing is not counted; on the two-phase route the
    last chunk's allgather (.gather) ends the wire, not its alltoall."""
    trace = load_script(ROOT / "results" / "step-bound" / "trace_collectives.py", "trace_collectives")
    name = "hvdc.bit8/allgather.fc1.weight.c{}of2"

    def event(rank, t, what, k):
        return {"rank": str(rank), "t_ms": str(t), "event": what, "name": name.format(k)}
    events = [event(0, 0, "launch", 0), event(1, 4, "launch", 0),       # skew 4
              event(0, 50, "done", 1), event(1, 54, "done", 1),          # wire 54 - 4 = 50
              event(1, 60, "launch", 0), event(0, 66, "launch", 0),      # loop 66 - 54 = 12
              event(0, 120, "done", 1), event(1, 121, "done", 1)]        # no next launch
    got = trace.phases(events)
    assert got == {"wire": [50.0], "loop": [12.0], "skew": [4.0], "cycle": [62.0]}
    two = "hvdc.bit8/alltoall.fc1.weight.c{}of2"
    events = [dict(e, name=two.format(e["name"][-4])) for e in events]
    assert trace.phases(events)["wire"] == []          # the alltoalls alone do not end it
    for e in events:
        if e["event"] == "done":
            e["name"] += ".gather"
    assert trace.phases(events) == got
