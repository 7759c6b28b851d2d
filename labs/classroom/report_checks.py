"""Step 5: the report is filled, and every figure of its table is one a run supports.

report.own_runs holds each row of report.md's table (report.py writes it from runs/) to the
run it quotes: the run's folder is there (a folder, not a link), with every rank's steps and
rank 0's evaluations logged as kitlog writes them (schema.read_log), on the processes the row
says; its epochs, steps per epoch, mean step and accuracy are the logs' own; the accuracy is
one the logged test loss allows (a wrong answer costs at least ln 2 of loss: the model gave
the right class at most half its probability), no higher than the course's network reaches
on the data set, and, for a run no longer than the grader's own run of the kit's train.py on
as many processes, not far above what that run scored on the grader's held-out labels. The
student's own runs are not run again: a report typed by hand with logs typed to match is not
caught here; its figures still have to be ones a run of this network could give.
"""
import math
import os
import re
import stat
from pathlib import Path

from . import schema
from .checks import fail, ok

STEP = "report"
# the most the course's network reaches on each data set, however long it trains (pytorch/
# examples' network: about 92-93% on Fashion-MNIST, 99.2-99.4% on MNIST)
CEILING = {"fashion-mnist": 95.0, "mnist": 99.7}
GRADER_MARGIN = 20.0            # points a run as short as the grader's may score above it


def _real_folder(kit, *parts):
    """kit/parts as a real folder (no part of it a link), or None."""
    path = Path(kit)
    for part in parts:
        path = path / part
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return None
        except OSError:
            return None
    return path


def _run_problem(kit, row, dataset, grader_runs):
    """Why `row` of the table is no figure of the run it quotes (en, zh), or None."""
    name, size = row["run"], row["processes"]
    quoted = f"report.md line {row['line']} quotes run {name}"
    folder = _real_folder(kit, "runs", name)
    if folder is None:
        return (f"{quoted}, which has no folder runs/{name}.",
                f"report.md 第 {row['line']} 行引用了运行 {name}，但没有 runs/{name} 文件夹。")
    try:
        epochs = schema.read_log(folder / "epochs-rank0.csv", "epochs", root=kit)
        steps = {r: schema.read_log(folder / f"steps-rank{r}.csv", "steps", root=kit) for r in range(size)}
    except schema.Malformed as err:
        return (f"{quoted}, whose logs are not kitlog's ({err}).",
                f"report.md 第 {row['line']} 行引用的运行 {name} 的日志不是 kitlog 写出的（{err}）。")
    missing = ["epochs-rank0.csv"] * (not epochs) + [f"steps-rank{r}.csv" for r, rows in steps.items() if not rows]
    if missing:
        return (f"{quoted} on {size} processes, which has no {missing[0]} (or an empty one): a run "
                f"on {size} processes logs every rank's steps and rank 0's evaluations (kitlog).",
                f"report.md 第 {row['line']} 行引用的 {size} 进程运行 {name} 没有 {missing[0]}（或为空）。")
    sizes = {r["size"] for r in epochs} | {r["size"] for rows in steps.values() for r in rows}
    if sizes != {size}:
        return (f"{quoted} on {size} processes; its logs say {', '.join(map(str, sorted(sizes)))}.",
                f"report.md 第 {row['line']} 行说运行 {name} 有 {size} 个进程，日志记录的是 "
                f"{', '.join(map(str, sorted(sizes)))}。")
    figures = _figures(epochs, steps)
    for field, unit, tolerance in (("epochs", "", 0), ("steps", "", 0), ("step_ms", " ms", 0.051),
                                   ("accuracy", "%", 0.0051)):
        if field in row and abs(row[field] - figures[field]) > tolerance:
            shown = f"{figures[field]:.2f}" if isinstance(figures[field], float) else str(figures[field])
            return (f"report.md gives run {name} {row[field]:g}{unit} ({_LABEL[field]}), its logs "
                    f"{shown}{unit}: fill the table from the runs (python report.py), not by hand.",
                    f"report.md 中运行 {name} 的{_LABEL_ZH[field]}为 {row[field]:g}{unit}，日志为 "
                    f"{shown}{unit}：请用 python report.py 从运行记录生成表格，不要手填。")
    last = epochs[-1]
    if last["test_loss"] < (1 - last["test_accuracy"]) * math.log(2) - 1e-6:
        return (f"run {name} logs test accuracy {100 * last['test_accuracy']:.2f}% with test loss "
                f"{last['test_loss']:.4f}: with the mean loss test() computes, each wrong answer "
                f"costs at least ln 2 = 0.693, so no run logs these two together (log them as "
                f"test() returns them).",
                f"运行 {name} 记录的测试正确率 {100 * last['test_accuracy']:.2f}% 与测试损失 "
                f"{last['test_loss']:.4f} 不可能同时出现（按 test() 计算的平均损失，每个错误至少贡献 "
                f"ln 2 = 0.693）：请按 test() 的返回值记录。")
    ceiling = CEILING.get(dataset, 100.0)
    if figures["accuracy"] > ceiling:
        return (f"run {name} logs {figures['accuracy']:.2f}% test accuracy, more than the course's "
                f"network reaches on {dataset} ({ceiling:g}%, however long it trains).",
                f"运行 {name} 记录的测试正确率 {figures['accuracy']:.2f}% 高于课程网络在 {dataset} "
                f"上能达到的 {ceiling:g}%。")
    grader = grader_runs.get(f"np{size}")
    grader_steps = grader_runs.get(f"np{size}.steps")
    trained = figures["epochs"] * figures["steps"]
    if (grader is not None and grader_steps and trained <= grader_steps
            and figures["accuracy"] > 100 * grader + GRADER_MARGIN):
        return (f"run {name} logs {figures['accuracy']:.2f}% after {trained} steps on {size} "
                f"processes, where the grader's own run of your train.py ({grader_steps} steps) "
                f"scored {100 * grader:.1f}% on the grader's test labels.",
                f"运行 {name} 在 {size} 个进程上训练 {trained} 步后记录 {figures['accuracy']:.2f}%，而评分器"
                f"自己运行你的 train.py（{grader_steps} 步）只得到 {100 * grader:.1f}%。")
    return None


_LABEL = {"epochs": "epochs", "steps": "steps per epoch on rank 0", "step_ms": "mean step",
          "accuracy": "accuracy"}
_LABEL_ZH = {"epochs": "轮数", "steps": "进程 0 每轮步数", "step_ms": "平均步时间", "accuracy": "正确率"}


def _figures(epochs, steps):
    """The figures report.py computes from a run's logs."""
    rows = [r for _, ranks in sorted(steps.items()) for r in ranks]
    return {"epochs": len(epochs), "steps": len(steps[0]) // len(epochs),
            "step_ms": 1000 * sum(r["seconds"] for r in rows) / len(rows),
            "accuracy": 100 * epochs[-1]["test_accuracy"]}


def report_checks(kit, dataset="fashion-mnist", grader_runs=None):
    """report.filled and report.own_runs. grader_runs: {"np<n>": the grader's score of its own
    run of the kit's trainer on n processes (0..1, None when it had none), "np<n>.steps":
    that run's training steps on rank 0}."""
    kit = Path(kit)
    try:
        text = schema.read_report(kit / "report.md", root=kit)
    except schema.Malformed as err:
        text, unreadable = None, err
    else:
        unreadable = None
    if text is None:
        reason = ("no report.md: run your trainings into runs/<name> (serial, 2 and 4 processes, "
                  "with and without compression), then `python report.py`, then write the "
                  "observations.")
        zh = "没有 report.md：先把各次训练记录到 runs/<name>，再运行 python report.py，然后写观察。"
        if unreadable:
            reason, zh = f"report.md is not a file the grader reads ({unreadable}).", f"report.md 无法读取（{unreadable}）。"
        return [fail(STEP, "report.filled", reason, zh),
                fail(STEP, "report.own_runs", "not checked: no report.md.", "未检查：没有 report.md。")]
    left = sorted(set(re.findall(r"\{\{\s*\w{1,40}\s*\}\}", text)))[:5]
    results = [fail(STEP, "report.filled", f"report.md still holds {', '.join(left)}: run `python "
                    f"report.py`.", f"report.md 中仍有 {', '.join(left)}：请运行 python report.py。")
               if left else ok(STEP, "report.filled")]
    try:
        rows = schema.report_rows(text)
    except schema.Malformed as err:
        return results + [fail(STEP, "report.own_runs", f"{err}: the table is report.py's, filled "
                               f"from your runs.", f"{err}：表格应由 report.py 从你的运行生成。")]
    for row in rows:
        problem = _run_problem(kit, row, dataset, grader_runs or {})
        if problem:
            return results + [fail(STEP, "report.own_runs", *problem)]
    sizes = {row["processes"] for row in rows}
    if not {2, 4} <= sizes:
        return results + [fail(STEP, "report.own_runs", f"report.md's table has runs on "
                               f"{sorted(sizes) or 'no'} processes; it needs 2 and 4 (and serial).",
                               f"report.md 的表格只有 {sorted(sizes) or '无'} 进程的运行；需要 2 和 4 进程（及串行）。")]
    return results + [ok(STEP, "report.own_runs")]
