"""The grade sheet: one table for a class (a row per kit, a column per step), then each
kit's failed checks with their reasons; Markdown in English or Chinese, and CSV."""
import csv
import io

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


def markdown(results, lang="en", names=None):
    text = TEXT[lang]
    names = names or {kit: kit.name for kit in results}
    steps = [s for s in STEPS if any(c.step == s for checks in results.values() for c in checks)]
    titles = [STEPS[s][1 if lang == "zh" else 0] for s in steps]
    lines = [f"# {text['title']}", "", f"| {text['kit']} | " + " | ".join(titles) + f" | {text['total']} |",
             "|" + "---|" * (len(steps) + 2)]
    for kit, checks in results.items():
        cells = [_cell([c for c in checks if c.step == s], lang) for s in steps]
        passed = sum(c.passed for c in checks)
        lines.append(f"| {names[kit]} | " + " | ".join(cells) + f" | {passed}/{len(checks)} |")
    for kit, checks in results.items():
        failed = [c for c in checks if not c.passed]
        lines += ["", f"## {names[kit]}", ""]
        if not failed:
            lines.append(text["all"])
        lines += [f"- `{c.name}`: {c.reason(lang)}" for c in failed]
    return "\n".join(lines) + "\n"


def csv_text(results, names=None):
    names = names or {kit: kit.name for kit in results}
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["kit", "step", "check", "passed", "reason_en", "reason_zh"])
    for kit, checks in results.items():
        for c in checks:
            writer.writerow([names[kit], c.step, c.name, int(c.passed), c.en, c.zh])
    return out.getvalue()
