"""--auto-allreduce in the lab kit, without a Horovod job: the flag and what it refuses, the
run name and the matrix's rows, the plan columns of a step, the manifest's plan report, the
summary's plan and the report's auto rows, on hand-made inputs. (The lab trained with it, end
to end: tests/test_lab.py.)"""
import math

import pandas as pd
import pytest

from hvd_compress.auto.records import BucketLabel, PlanReport
from hvd_compress.registry import parse_label
from labs.kit import flags, job, manifest, matrix, network, recorder, report, runlog, table

pytestmark = pytest.mark.unit

PLAN = "none:allreduce bit8:allgather fp16:allreduce"


# ---- the flag -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--auto-allreduce", "--bit8-allreduce"], "not allowed with"),
    (["--auto-allreduce", "--route", "alltoall"], "--route cannot be combined with --auto"),
    (["--auto-allreduce", "--error-feedback"], "--error-feedback cannot be combined"),
    (["--auto-allreduce", "--no-error-feedback"], "--error-feedback cannot be combined"),
    (["--auto-allreduce", "--use-adasum"], "--use-adasum cannot be combined"),
    (["--auto-allreduce", "--optimizer", "horovod"], "needs --optimizer plugin"),
])
def test_auto_refuses_flags_that_fix_what_the_plan_chooses(lab, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        lab.parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_auto_without_the_runtime_is_a_clear_error(lab, capsys, monkeypatch):
    """An hvd_compress without Compression.auto: refused before Horovod starts (exit code 2)."""
    from hvd_compress import compression

    class Fixed:                         # Compression as it was before the runtime
        none = compression.Compression.none
    monkeypatch.setattr(compression, "Compression", Fixed)
    with pytest.raises(SystemExit) as stop:
        lab.parse_args(["--auto-allreduce"])
    assert stop.value.code == 2
    assert "no Compression.auto" in capsys.readouterr().err


def test_auto_is_one_flag_and_one_run_name(lab):
    """The trainer's --auto-allreduce gives hc.Compression.auto, named np2-auto as the matrix
    names its --auto rows."""
    from hvd_compress.compression import Compression
    args = lab.parse_args(["--auto-allreduce"])
    assert args.compression == "auto" and flags.compression_of(args) is Compression.auto
    assert table.config_name(args, 2) == "np2-auto"
    assert table.config_name(lab.parse_args(["--auto-allreduce", "--model", "horovod"]), 4) \
        == "np4-auto-small"
    auto_runs = [r for r in table.course_runs(auto=True) if r.scheme == "auto"]
    assert [(r.name, r.flags) for r in auto_runs] == [("np2-auto", ["--auto-allreduce"]),
                                                      ("np4-auto", ["--auto-allreduce"])]
    for run in auto_runs:
        assert table.config_name(lab.parse_args(run.flags), run.ranks) == run.name
    assert "auto" not in {r.scheme for r in table.course_runs(extras=True, methods=True)}
    assert table.ROW_ORDER == [r for r in table.ROW_ORDER if "auto" not in r]   # unchanged


def test_the_matrix_and_the_job_run_auto_rows_when_asked(capsys, tmp_path):
    args = matrix.parse_args(["--auto", "--only", "np*-auto", "--out", str(tmp_path / "m")])
    assert [r.name for r in matrix.select(table.course_runs(auto=True), args.only)] == [
        "np2-auto", "np4-auto"]
    assert job.main(["--dry-run", "--auto", "--out", str(tmp_path / "m")]) == 0
    lines = capsys.readouterr().out.splitlines()
    table_lines = [l for l in lines if l.startswith("[table ")]
    net_lines = [l for l in lines if l.startswith("[network ")]
    assert len(table_lines) == 11 and len(net_lines) == 10
    assert sum("--auto-allreduce" in l for l in table_lines + net_lines) == 4
    assert not (tmp_path / "m").exists()


# ---- a step's plan columns and the manifest's plan report -----------------------------------

def test_plan_columns_of_a_step():
    stats = {"plan": PLAN, "plan_predicted_s": 0.25, "plan_measured_s": 0.2625,
             "plan_event": "planned", "compress_s": 0.0}
    row = recorder.plan_columns(stats)
    assert list(row) == runlog.PLAN_COLUMNS
    assert row == {"plan": PLAN, "plan_predicted_ms": 250.0, "plan_measured_ms": 262.5,
                   "plan_event": "planned"}
    before = recorder.plan_columns(dict(stats, plan="", plan_predicted_s=math.nan,
                                        plan_measured_s=math.nan, plan_event="calibrating"))
    assert before["plan"] == "" and math.isnan(before["plan_predicted_ms"])
    with pytest.raises(RuntimeError, match="pop_stats\\(\\) has no plan_measured_s, plan_event"):
        recorder.plan_columns({"plan": PLAN, "plan_predicted_s": 0.25})


def test_the_manifest_keeps_the_plan_report_of_auto_only():
    class Args:
        compression = "auto"

    class Planning:
        def plan_report(self):
            return PlanReport("", "measuring", (BucketLabel("fc2.bias", 5736, "none:allreduce"),))
    kept = manifest.plan_report(Planning(), Args())          # the record's dict, for the JSON
    assert kept["buckets"][0]["label"] == "none:allreduce" and kept["phase"] == "measuring"
    assert PlanReport.from_dict(kept).labels == ["none:allreduce"]
    with pytest.raises(RuntimeError, match="no plan_report"):
        manifest.plan_report(object(), Args())
    Args.compression = "bit8"
    assert manifest.plan_report(Planning(), Args()) is None
    assert not manifest.plans(Args())


# ---- the summary, the network table and the report ------------------------------------------

def auto_steps():
    """Two ranks, four steps: calibrating, planned, then the plan again, a re-plan."""
    rows = []
    for rank in (0, 1):
        for step, (plan, event) in enumerate([("", "calibrating"), (PLAN, "planned"),
                                              (PLAN, ""), ("bit8:allgather " * 2 + "fp16:allreduce",
                                                           "replanned: drift 22%")]):
            rows.append({"rank": rank, "step": step, "plan": plan or float("nan"),
                         "plan_predicted_ms": 100.0 + step if plan else math.nan,
                         "plan_measured_ms": 110.0 + step if plan else math.nan,
                         "plan_event": event or float("nan")})
    return pd.DataFrame(rows)


def test_the_summary_takes_the_last_plan_and_counts_re_plans():
    got = matrix.plan_summary(auto_steps())
    assert got == {"plan": "bit8:allgather bit8:allgather fp16:allreduce",
                   "plan_predicted_ms": 103.0, "plan_measured_ms": 113.0, "plan_replans": 1,
                   "plan_fallbacks": 0, "plan_fallback": ""}
    for label in got["plan"].split():
        parse_label(label)              # every label is a registry scheme:route
    never = auto_steps().assign(plan=float("nan"), plan_event="calibrating")
    assert matrix.plan_summary(never)["plan"] == ""
    fell = never.copy()
    fell.loc[1, "plan_event"] = "fallback: calibration failed: timeout"
    got = matrix.plan_summary(fell)
    assert (got["plan"], got["plan_fallbacks"], got["plan_fallback"]) == (
        "", 1, "fallback: calibration failed: timeout")
    assert math.isnan(got["plan_predicted_ms"])


def summary_frame():
    """A loopback table with float32 and auto at 2 processes, as matrix.summarize_run writes it."""
    base = {"ranks": 2, "status": "complete", "reduction": "allreduce", "error_feedback": False,
            "train_time_s": 100.0, "forward_backward_ms": 20.0, "compress_ms": 1.0,
            "communicate_ms": 5.0, "decompress_ms": 1.0, "update_ms": 2.0,
            "bytes_per_step": 1000.0, "run_dir": "x"}
    return pd.DataFrame([
        dict(base, run="np2-none", compression="none", final_test_accuracy=0.9012, step_ms=40.0,
             plan="", plan_predicted_ms=math.nan, plan_measured_ms=math.nan),
        dict(base, run="np2-auto", compression="auto", reduction="auto",
             final_test_accuracy=0.8995, step_ms=36.0, plan=PLAN, plan_predicted_ms=33.0,
             plan_measured_ms=30.0, plan_calibration_s=0.8)])


def test_the_report_sets_the_plan_beside_predicted_and_measured():
    text = report.auto_section(summary_frame())
    line = next(l for l in text.splitlines() if l.endswith("`np2-auto` |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == ["2", f"`{PLAN}`", "33.0", "30.0", "+10%", "36.0", "0.90", "0.80 (0.8%)",
                     "89.95%", "-0.17", "`np2-auto`"]
    assert "plan_report" in text and "15%" in text
    fixed_only = summary_frame().iloc[:1]
    assert report.auto_section(fixed_only).startswith("Not run in this matrix")
    assert report.auto_on_link(fixed_only, {}, 1e8) == ""
    on_link = report.auto_on_link(summary_frame(), {r.run: r for r in
                                                    summary_frame().itertuples()}, 1e8)
    assert "100 Mbit/s" in on_link and f"`{PLAN}`" in on_link


def test_an_auto_row_without_a_plan_or_a_float32_row_is_refused():
    frame = summary_frame()
    frame.loc[1, "plan"] = math.nan
    with pytest.raises(report.ReportError, match="np2-auto: no plan and no fallback"):
        report.auto_section(frame)
    frame = summary_frame()
    frame.loc[1, ["plan", "plan_predicted_ms", "plan_measured_ms"]] = ["", math.nan, math.nan]
    frame["plan_fallback"] = ["", "fallback: calibration failed: timeout"]
    line = report.auto_section(frame).splitlines()[2]      # the run that fell back: a row too
    assert line.startswith("| 2 | `float32 on every bucket (fallback: calibration failed: "
                           "timeout)` | — | — | — | 36.0 | 0.90 |")
    frame = summary_frame()
    frame.loc[1, "plan_measured_ms"] = math.nan
    with pytest.raises(report.ReportError, match="no predicted or no measured step"):
        report.auto_section(frame)
    frame = summary_frame()
    frame.loc[1, "plan_calibration_s"] = math.nan
    with pytest.raises(report.ReportError, match="no calibration_s"):
        report.auto_section(frame)
    with pytest.raises(report.ReportError, match="no np2-none to compare"):
        report.auto_section(summary_frame().iloc[1:])


def test_the_nan_guard_reads_numbers_not_a_fallbacks_words():
    """A fallback's reason is free text: 'nan' in it (a word, or inside one) is no NaN number,
    and the report is written; a NaN the report prints as a number is still refused."""
    frame = summary_frame()
    frame.loc[1, ["plan", "plan_predicted_ms", "plan_measured_ms"]] = ["", math.nan, math.nan]
    for reason in ("calibration failed: rank 1's median step is nan, not a finite time >= 0",
                   "calibration failed: finance's `quote is NaN"):
        frame["plan_fallback"] = ["", f"fallback: {reason}"]
        text = report.fill("{{auto}}", {"auto": report.auto_section(frame)})
        assert f"(fallback: {reason.replace('`', chr(39))})`" in text
    frame["final_test_accuracy"] = [0.9012, math.nan]            # a number: 'nan%'
    with pytest.raises(report.ReportError, match="would contain NaN"):
        report.fill("{{auto}}", {"auto": report.auto_section(frame)})
    for number in ("| nan |", "xnan", "+nan", "-nan ms", "(NaN%)"):
        with pytest.raises(report.ReportError, match="would contain NaN"):
            report.fill("step {{x}}", {"x": number})


def test_network_predictions_leave_the_plan_to_its_own_prediction():
    """The alpha-beta prediction of a fixed row's exchange needs one scheme: an auto row is
    not predicted there (its plan predicts its step), and needs no loopback twin."""
    from hvd_compress.costmodel import methods
    from hvd_compress.costmodel.model import Link
    links = {2: {c: Link(1e-3, 8e-8) for c in ("allreduce", "allgather", "alltoall")}}
    shapes = methods.MODEL_SHAPES["horovod"]
    manifests = {"np2-none": {"parameter_shapes": shapes, "compression": "none",
                              "world_size": 2, "reduction": "allreduce", "args": {}},
                 "np2-auto": {"parameter_shapes": shapes, "compression": "auto",
                              "world_size": 2, "reduction": "auto", "args": {}}}
    net = summary_frame().assign(exchange_ms=[10.0, 8.0], launch_span_ms=[5.0, 5.0],
                                 netem_rate_bps=1e8)
    loop = pd.DataFrame({"run": ["np2-none"], "decompress_ms": [0.1]})
    preds = network.predictions(net, manifests, loop, links)
    assert [p.run for p in preds] == ["np2-none"]
    assert [p.run for p in network.plan_rows(net)] == ["np2-auto"]
