"""Step 5: the report is filled, and its table quotes the student's own runs."""
import csv
import io
import re
from pathlib import Path

from .checks import fail, ok
from .sandbox import inside, read_text

STEP = "report"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(\d+)\s*\|.*\|\s*([0-9.]+)%\s*\|\s*$")


def report_checks(kit):
    kit = Path(kit)
    report = kit / "report.md"
    if not report.is_file():
        reason = ("no report.md: run your trainings into runs/<name> (serial, 2 and 4 processes, "
                  "with and without compression), then `python report.py`, then write the "
                  "observations.")
        zh = "没有 report.md：先把各次训练记录到 runs/<name>，再运行 python report.py，然后写观察。"
        return [fail(STEP, "report.filled", reason, zh),
                fail(STEP, "report.own_runs", "not checked: no report.md.", "未检查：没有 report.md。")]
    text = read_text(report, 1 << 20) if inside(report, kit) else ""
    left = re.findall(r"\{\{\s*\w+\s*\}\}", text)
    results = [fail(STEP, "report.filled", f"report.md still holds {', '.join(sorted(set(left)))}: "
                    f"run `python report.py`.", f"report.md 中仍有 {', '.join(sorted(set(left)))}：请运行 "
                    f"python report.py。") if left else ok(STEP, "report.filled")]
    rows = [ROW.match(line) for line in text.splitlines()]
    rows = [m for m in rows if m]
    sizes = {int(m.group(2)) for m in rows}
    for m in rows:
        epochs = kit / "runs" / m.group(1) / "epochs-rank0.csv"
        if not epochs.is_file():
            return results + [fail(STEP, "report.own_runs", f"report.md quotes run {m.group(1)}, "
                                   f"which has no {epochs.relative_to(kit)}.",
                                   f"report.md 引用了运行 {m.group(1)}，但没有 {epochs.relative_to(kit)}。")]
        try:
            rows = list(csv.DictReader(io.StringIO(read_text(epochs, 16 << 20) if inside(epochs, kit) else "")))
            logged = 100 * float(rows[-1]["test_accuracy"])
        except (IndexError, KeyError, TypeError, ValueError, csv.Error):
            return results + [fail(STEP, "report.own_runs", f"{epochs.relative_to(kit)} is not a "
                                   f"log kitlog wrote (no test_accuracy in its last row).",
                                   f"{epochs.relative_to(kit)} 不是 kitlog 写出的日志。")]
        if abs(logged - float(m.group(3))) > 0.005:
            return results + [fail(STEP, "report.own_runs", f"report.md gives run {m.group(1)} "
                                   f"{m.group(3)}% accuracy, its log {logged:.2f}%: fill the table "
                                   f"from the runs (python report.py), not by hand.",
                                   f"report.md 中运行 {m.group(1)} 的正确率为 {m.group(3)}%，日志为 "
                                   f"{logged:.2f}%：请用 python report.py 从运行记录生成表格。")]
    if not {2, 4} <= sizes:
        return results + [fail(STEP, "report.own_runs", f"report.md's table has runs on "
                               f"{sorted(sizes) or 'no'} processes; it needs 2 and 4 (and serial).",
                               f"report.md 的表格只有 {sorted(sizes) or '无'} 进程的运行；需要 2 和 4 进程（及串行）。")]
    return results + [ok(STEP, "report.own_runs")]
