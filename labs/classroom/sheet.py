"""The grade sheet: one table for a class (a row per kit, a column per step), then each
kit's failed checks with their reasons; Markdown in English or Chinese, and CSV."""
import csv
import io
import os
import tempfile
from pathlib import Path

from .checks import STEPS

TEXT = {
    "en": {"title": "Grade sheet", "kit": "Kit", "total": "Checks passed", "failed": "Failed checks",
           "all": "every check passed", "check": "check", "reason": "reason"},
    "zh": {"title": "评分表", "kit": "实验包", "total": "通过的检查", "failed": "未通过的检查",
           "all": "全部检查通过", "check": "检查", "reason": "原因"},
}


def _cell(checks, lang):
    if not checks:
        return "—"
    passed = sum(c.passed for c in checks)
    mark = "✅" if passed == len(checks) else "❌"
    return f"{mark} {passed}/{len(checks)}"


def kit_names(results):
    """{kit: the name its row shows}: the folder's name, or as much of its path as tells two
    kits of one name apart."""
    names = {kit: kit.name for kit in results}
    clashes = {n for n in names.values() if list(names.values()).count(n) > 1}
    return {kit: (str(kit) if name in clashes else name) for kit, name in names.items()}


def _ordered(results, names):
    """The kits in the order of their names: a class graded in any order gives one sheet."""
    return sorted(results, key=lambda kit: (names[kit], str(kit)))


def markdown(results, lang="en", names=None):
    text = TEXT[lang]
    names = names or kit_names(results)
    kits = _ordered(results, names)
    steps = [s for s in STEPS if any(c.step == s for checks in results.values() for c in checks)]
    titles = [STEPS[s][1 if lang == "zh" else 0] for s in steps]
    lines = [f"# {text['title']}", "", f"| {text['kit']} | " + " | ".join(titles) + f" | {text['total']} |",
             "|" + "---|" * (len(steps) + 2)]
    for kit in kits:
        checks = results[kit]
        cells = [_cell([c for c in checks if c.step == s], lang) for s in steps]
        passed = sum(c.passed for c in checks)
        lines.append(f"| {names[kit]} | " + " | ".join(cells) + f" | {passed}/{len(checks)} |")
    for kit in kits:
        checks = results[kit]
        failed = [c for c in checks if not c.passed]
        lines += ["", f"## {names[kit]}", ""]
        if not failed:
            lines.append(text["all"])
        lines += [f"- `{c.name}`: {c.reason(lang)}" for c in failed]
    return "\n".join(lines) + "\n"


def csv_text(results, names=None):
    names = names or kit_names(results)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["kit", "step", "check", "passed", "reason_en", "reason_zh"])
    for kit in _ordered(results, names):
        for c in results[kit]:
            writer.writerow([names[kit], c.step, c.name, int(c.passed), c.en, c.zh])
    return out.getvalue()


def write_sheets(folder, sheets):
    """Each sheet ({file name: text}) written whole or not at all (a temporary file renamed
    over the old), by the grader alone, once per grading."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in sheets.items():
        handle, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as stream:
            stream.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / name)
