"""The grade sheet: one table for a class (a row per kit, a column per step), then each
kit's failed checks with their reasons; Markdown in English or Chinese, and CSV.

Every text a kit can put in the sheet (its folder's name, the errors its code raised, quoted
in reasons) is escaped before it is written: a control character (a newline among them) or a
`|` would start a row of its own that looks like another kit's, in the Markdown table and in
any line-based reader of the CSV. No line of the sheet holds more than one kit's text.
"""
import csv
import io
import os
import tempfile
import unicodedata
from pathlib import Path

from .checks import STEPS

TEXT = {
    "en": {"title": "Grade sheet", "kit": "Kit", "total": "Checks passed", "failed": "Failed checks",
           "all": "every check passed", "check": "check", "reason": "reason"},
    "zh": {"title": "评分表", "kit": "实验包", "total": "通过的检查", "failed": "未通过的检查",
           "all": "全部检查通过", "check": "检查", "reason": "原因"},
}


SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def escape(text, markdown=False):
    """`text` on one line, every character shown: control and format characters and line or
    paragraph separators (Unicode's Cc, Cf, Zl, Zp) as backslash escapes, the backslash
    doubled (so that no escape can be typed by hand), and in Markdown `|` as `\\|`."""
    out = []
    for c in str(text):
        if c in SHORT:
            out.append(SHORT[c])
        elif markdown and c == "|":
            out.append("\\|")
        elif unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


def _cell(checks, lang):
    if not checks:
        return "—"
    passed = sum(c.passed for c in checks)
    mark = "✅" if passed == len(checks) else "❌"
    return f"{mark} {passed}/{len(checks)}"


def kit_names(results):
    """{kit: the name its row shows}: the folder's name, or its whole path where two kits'
    names would look alike once escaped (the sheet escapes every name as it writes it)."""
    shown = {kit: escape(kit.name) for kit in results}
    clashes = {n for n in shown.values() if list(shown.values()).count(n) > 1}
    return {kit: (str(kit) if shown[kit] in clashes else kit.name) for kit in results}


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
        lines.append(f"| {escape(names[kit], True)} | " + " | ".join(cells) + f" | {passed}/{len(checks)} |")
    for kit in kits:
        checks = results[kit]
        failed = [c for c in checks if not c.passed]
        lines += ["", f"## {escape(names[kit], True)}", ""]
        if not failed:
            lines.append(text["all"])
        lines += [f"- `{escape(c.name, True)}`: {escape(c.reason(lang), True)}" for c in failed]
    return "\n".join(lines) + "\n"


def csv_text(results, names=None):
    names = names or kit_names(results)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["kit", "step", "check", "passed", "reason_en", "reason_zh"])
    for kit in _ordered(results, names):
        for c in results[kit]:
            writer.writerow([escape(names[kit]), c.step, escape(c.name), int(c.passed), escape(c.en), escape(c.zh)])
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
