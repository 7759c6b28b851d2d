"""A student's patch read by the grader itself: a unified-diff parser of its own, strict.

The course's patch is the student's file, and `patch` follows whatever names it holds: an
absolute path, `..`, a name that git says is a symbolic link (`new file mode 120000`). So the
grader never hands the student's file to a tool. It reads it (nofollow.read: bounded, no
link, no FIFO or device), parses it here, refuses with a reason for the student a patch that
names anything but a file of Horovod 0.28.1's tree, a link, a special file, a binary patch,
or that exceeds the size cap, and writes what it understood back as a plain unified diff
(`text`): that, and only that, is applied, inside the kit's sandbox.

What is taken: GNU diff's and git's unified diffs (`diff -ruN`, `git diff`), with text before
and between the files' sections (the kit's patch begins with the course's explanation),
timestamps after a tab, `\\ No newline at end of file`, git's extended header lines for
regular files. What is refused: context and normal diffs (no unified hunks: "holds no
diff"), renames and copies, modes other than a regular file's, hunks whose line counts do
not match their header (`patch` would stop or guess).
"""
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

MAX_BYTES = 1 << 20                 # a course patch is a few KiB; the cap is the read's bound
NAME = re.compile(r"[A-Za-z0-9_.+-]+")
HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
REGULAR_MODES = ("100644", "100755")
GIT_HEADER = ("index ", "old mode ", "new mode ", "deleted file mode ", "new file mode ",
              "similarity index ", "dissimilarity index ", "rename from ", "rename to ",
              "copy from ", "copy to ")


class PatchError(ValueError):
    """A patch the grader does not apply: why, for the student (English and Chinese)."""

    def __init__(self, en, zh):
        super().__init__(en)
        self.en, self.zh = en, zh


@dataclass
class Hunk:
    old_start: int
    old_count: int
    new_start: int
    new_count: int
    lines: list                     # each with its ' ', '-', '+' or '\\' first character


@dataclass
class FileDiff:
    path: str                       # inside the sdist's tree, the a/ or b/ stripped
    kind: str                       # "modify", "create" or "delete"
    hunks: list = field(default_factory=list)

    def added(self):
        return [line[1:] for hunk in self.hunks for line in hunk.lines if line.startswith("+")]


def _refuse(en, zh):
    raise PatchError(en, zh)


def decode(data, shown):
    """The patch's text: UTF-8, no NUL (a binary file is not a diff)."""
    if b"\0" in data:
        _refuse(f"{shown} holds NUL bytes: a patch is text (a binary patch is not taken).",
                f"{shown} 含有 NUL 字节：补丁必须是文本（不接受二进制补丁）。")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        _refuse(f"{shown} is not UTF-8 text (byte {err.start}).",
                f"{shown} 不是 UTF-8 文本（第 {err.start} 字节）。")


def _name(raw, shown):
    """The path a ---/+++ line names, as `patch -p1` takes it (None for /dev/null), checked:
    no absolute path, no `..`, plain characters only."""
    raw = raw.split("\t")[0].rstrip()
    if raw == "/dev/null":
        return None
    if raw.startswith('"'):
        _refuse(f"{shown} names a quoted path ({raw[:80]}): the files of Horovod's tree have "
                f"plain names.", f"{shown} 含有带引号的路径（{raw[:80]}）。")
    if raw.startswith("/"):
        _refuse(f"{shown} names an absolute path ({raw[:80]}): a patch names files inside "
                f"Horovod's tree only (a/horovod/..., b/horovod/...).",
                f"{shown} 含有绝对路径（{raw[:80]}）：补丁只能修改 Horovod 源码树内的文件。")
    parts = raw.split("/")
    if ".." in parts:
        _refuse(f"{shown} names a path with `..` ({raw[:80]}): a patch names files inside "
                f"Horovod's tree only.", f"{shown} 含有带 `..` 的路径（{raw[:80]}）：补丁只能修改 "
                f"Horovod 源码树内的文件。")
    stripped = parts[1:]
    if not stripped or not all(NAME.fullmatch(p) and p != "." for p in stripped):
        _refuse(f"{shown} names {raw[:80]!r}, not a path a/<file> of Horovod's tree.",
                f"{shown} 中的 {raw[:80]!r} 不是 Horovod 源码树中的路径（a/<文件>）。")
    return "/".join(stripped)


def parse(text, shown="the patch"):
    """[FileDiff] of a unified diff, in its order; PatchError when it holds anything but
    unified diffs of regular files."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    diffs, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            i = _git_header(lines, i + 1, shown)
            continue
        if line.startswith("Binary files ") or line.startswith("GIT binary patch"):
            _refuse(f"{shown} holds a binary patch ({line[:80]}): only text diffs are taken.",
                    f"{shown} 含有二进制补丁：只接受文本 diff。")
        if line.startswith("*** ") and i + 1 < len(lines) and lines[i + 1].startswith("--- "):
            _refuse(f"{shown} holds a context diff ({line[:60]}): write a unified diff "
                    f"(diff -ru, or git diff).", f"{shown} 是 context diff：请写 unified diff（diff -ru 或 git diff）。")
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _name(line[4:], shown), _name(lines[i + 1][4:], shown)
            if old is None and new is None:
                _refuse(f"{shown}: a section from /dev/null to /dev/null.", f"{shown}：/dev/null 到 /dev/null 的一节。")
            if old is not None and new is not None and old != new:
                _refuse(f"{shown} changes {old} into {new} (a rename): a diff of Horovod's tree "
                        f"names each file once (a/PATH, b/PATH).",
                        f"{shown} 把 {old} 改成 {new}（重命名）：每个文件的两行名字必须相同。")
            kind = "create" if old is None else "delete" if new is None else "modify"
            diff = FileDiff(new or old, kind)
            i += 2
            while i < len(lines) and lines[i].startswith("@@ "):
                hunk, i = _hunk(lines, i, diff.path, shown)
                diff.hunks.append(hunk)
            if not diff.hunks:
                _refuse(f"{shown}: the section of {diff.path} has no hunk (@@ ... @@).",
                        f"{shown}：{diff.path} 一节没有任何 hunk（@@ ... @@）。")
            diffs.append(diff)
            continue
        i += 1
    return diffs


def _git_header(lines, i, shown):
    """git's extended header after `diff --git`: modes of regular files only, no rename,
    copy or binary."""
    while i < len(lines) and lines[i].startswith(GIT_HEADER):
        line = lines[i]
        for key in ("old mode ", "new mode ", "deleted file mode ", "new file mode "):
            if line.startswith(key):
                mode = line[len(key):].strip()
                if mode == "120000":
                    _refuse(f"{shown} makes a symbolic link ({line}): the grader takes changes "
                            f"to regular files only.", f"{shown} 创建了符号链接（{line}）：只接受对普通文件的修改。")
                if mode not in REGULAR_MODES:
                    _refuse(f"{shown} names a file of mode {mode[:12]} ({line[:60]}): only "
                            f"regular files are taken.", f"{shown} 中的文件模式 {mode[:12]} 不是普通文件。")
        if line.startswith(("rename ", "copy ", "similarity index ", "dissimilarity index ")):
            _refuse(f"{shown} renames or copies a file ({line[:60]}): give each change as a "
                    f"diff of the file itself.", f"{shown} 重命名或复制了文件：请直接给出文件内容的 diff。")
        i += 1
    if i < len(lines) and (lines[i].startswith("GIT binary patch") or lines[i].startswith("Binary files ")):
        _refuse(f"{shown} holds a binary patch ({lines[i][:80]}): only text diffs are taken.",
                f"{shown} 含有二进制补丁：只接受文本 diff。")
    return i


def _hunk(lines, i, path, shown):
    match = HUNK.match(lines[i])
    if not match:
        _refuse(f"{shown}: a hunk header of {path} is malformed ({lines[i][:60]}).",
                f"{shown}：{path} 的 hunk 头格式错误（{lines[i][:60]}）。")
    old_start, old_count, new_start, new_count = (int(g) if g is not None else 1 for g in match.groups())
    header = lines[i][:40]
    hunk, i = Hunk(old_start, old_count, new_start, new_count, []), i + 1
    old_left, new_left = old_count, new_count
    while old_left > 0 or new_left > 0:
        if i >= len(lines):
            break
        line = lines[i]
        tag = line[:1] or " "           # an empty line: an empty context line (editors strip the space)
        if tag == " " and old_left and new_left:
            old_left, new_left = old_left - 1, new_left - 1
        elif tag == "-" and old_left:
            old_left -= 1
        elif tag == "+" and new_left:
            new_left -= 1
        elif tag == "\\":
            pass
        else:
            break
        hunk.lines.append(line if line else " ")
        i += 1
    if old_left or new_left:
        _refuse(f"{shown}: a hunk of {path} ({header}) is cut short or "
                f"its lines do not match its header's counts.",
                f"{shown}：{path} 的一个 hunk 行数与其头部不符或被截断。")
    if i < len(lines) and lines[i].startswith("\\"):
        hunk.lines.append(lines[i])
        i += 1
    return hunk, i


@dataclass
class Tree:
    """The regular files and folders of Horovod 0.28.1's sdist (paths inside horovod-0.28.1/)."""
    files: frozenset
    folders: frozenset

    @classmethod
    def of(cls, names, folders):
        return cls(frozenset(names), frozenset(folders))

    def after(self, diffs):
        """The tree once `diffs` applied (created files added, deleted ones gone)."""
        files = set(self.files)
        for diff in diffs:
            if diff.kind == "create":
                files.add(diff.path)
            elif diff.kind == "delete":
                files.discard(diff.path)
        folders = set(self.folders) | {str(p) for d in diffs if d.kind == "create"
                                       for p in PurePosixPath(d.path).parents if str(p) != "."}
        return Tree(frozenset(files), frozenset(folders))


def check_tree(diffs, tree, shown="the patch"):
    """Every file `diffs` change is one of the tree's regular files (a new one lies inside one
    of its folders): PatchError otherwise."""
    for diff in diffs:
        path = PurePosixPath(diff.path)
        if diff.kind in ("modify", "delete"):
            if diff.path not in tree.files:
                _refuse(f"{shown} changes {diff.path}, which is not one of Horovod 0.28.1's files.",
                        f"{shown} 修改了 {diff.path}，它不是 Horovod 0.28.1 的文件。")
        else:
            above = [str(p) for p in path.parents if str(p) != "."]
            if diff.path in tree.files or diff.path in tree.folders:
                _refuse(f"{shown} creates {diff.path}, which Horovod 0.28.1 already holds: change "
                        f"it with a diff from a/{diff.path}.", f"{shown} 新建了已存在的 {diff.path}。")
            if any(p in tree.files for p in above) or not above or above[-1] not in tree.folders:
                _refuse(f"{shown} creates {diff.path}, outside Horovod 0.28.1's folders.",
                        f"{shown} 新建的 {diff.path} 不在 Horovod 0.28.1 的目录中。")


def text(diffs):
    """The diffs as a plain unified diff that `patch -p1` reads as the grader did: each file
    named once (a/PATH, b/PATH or /dev/null), its hunks, nothing else."""
    out = []
    for diff in diffs:
        out.append(f"--- {'/dev/null' if diff.kind == 'create' else 'a/' + diff.path}")
        out.append(f"+++ {'/dev/null' if diff.kind == 'delete' else 'b/' + diff.path}")
        for hunk in diff.hunks:
            out.append(f"@@ -{hunk.old_start},{hunk.old_count} +{hunk.new_start},{hunk.new_count} @@")
            out.extend(hunk.lines)
    return "\n".join(out) + "\n" if out else ""
