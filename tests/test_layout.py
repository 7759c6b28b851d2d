"""The checkout's top folder holds the project's own names, and what the lab writes goes under
runs/ by default: a report or a plot that lands beside pyproject.toml is an output that escaped."""
import shutil
import subprocess

import pandas as pd
import pytest

from conftest import ROOT

pytestmark = pytest.mark.unit

TOP_LEVEL = {"pyproject.toml", "MANIFEST.in", "LICENSE", "hvd_compress", "labs", "patches", "scripts",
             "tests", "report_template.md", "README.md", "requirements.txt", "pytest.ini", "docs",
             "results", ".ci", ".gitignore"}
COMMITTED_LAB = ROOT / "results" / "lab"


def test_the_top_folder_holds_only_the_projects_names():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert files, "git ls-files listed nothing: run the tests from a git checkout"
    top = {name.split("/", 1)[0] for name in files}
    assert top <= TOP_LEVEL, sorted(top - TOP_LEVEL)


def test_report_and_plots_default_to_runs(tmp_path, monkeypatch):
    """Run with no arguments from a folder laid out like a checkout after a matrix (the
    committed table, plus the per-step records it does not commit): the report and its plots
    land in runs/, next to each other, and nothing is written beside the template. Both
    commands' main([]) in this process, from that folder (two interpreters importing pandas and
    matplotlib cost more than the work)."""
    from labs.kit import plots, report
    table = tmp_path / "runs" / "matrix"
    shutil.copytree(COMMITTED_LAB / "matrix", table)
    shutil.copy(ROOT / "report_template.md", tmp_path)
    for run in pd.read_csv(table / "summary.csv")["run_dir"]:
        epochs = pd.read_csv(table / run / "epochs.csv")
        pd.DataFrame({"rank": 0, "epoch": epochs["epoch"], "step": epochs.index,
                      "batch": 0, "loss": epochs["train_loss"]}).to_csv(
                          table / run / "steps.csv", index=False)
    monkeypatch.chdir(tmp_path)
    assert report.main([]) == 0
    assert plots.main([]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report_template.md", "runs"]
    written = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert written == ["accuracy.png", "loss.png", "matrix", "report.md", "step_time.png"]
    assert "![测试正确率 / Test accuracy per epoch](accuracy.png)" in (
        tmp_path / "runs" / "report.md").read_text(encoding="utf-8")


def test_the_lab_job_reports_into_runs():
    from labs.kit import job
    args, _ = job.parse_args([])
    assert args.report == "runs/report.md" and args.out == "runs/matrix"
