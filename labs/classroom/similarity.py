"""Which kits look like the course's own code, or like each other: a report for the instructor
to read, never a grade.

    python -m labs.classroom similar submissions/ [--out DIR] [--top N]

Each kit's work (compression.py, the lines its course patch adds, train.py) is compared, always,
with the reference solution (labs/classroom/solution_files) and with the project's own code a
student could paste from (the codecs and compressors the handout points to, the project's
course patch, labs/mnist.py), and with every other kit. A file is first written in a normal
form (normal_form.py: names, no-op statements, operand order and the order of independent
statements do not change it), then the text the kit gives (its stubs, its docstring, the serial
trainer) is taken out, as JPlag does with base code; what is left is tiled against the other
side (tiling.py: the longest common runs of at least MIN_TILE tokens, each token in one tile
at most). A pair's share is its tiled tokens over the smaller side's own tokens; the report
lists each tile as line ranges in both files, side by side.
"""
import functools
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .kit import COURSE_PATCH, KIT_FILES, ROOT, SOLUTION_FILES
from .normal_form import normal_tokens, own_names
from .tiling import gram_index, tiles

MIN_TILE = 16        # normal-form tokens (about two statements): shorter runs are idiom
MIN_GIVEN = 8        # a run of the kit's given text this long is taken out as given
FLAG = 0.5           # from this share on the report marks a pair: read the two side by side
REGIONS_FROM = 0.25  # pairs from this share on have their matching regions listed
MAX_REGIONS = 16     # regions listed per pair: the largest, in the order of the first file
REGION_GAP = 12      # lines a region may skip (dropped no-ops, comments, given text)
MAX_BYTES = 1 << 18  # of a kit's file read: more is not a student's work
MAX_LINES = 3000     # of one file compared (a solution's file: 100-300 lines)
MAX_TOKENS = 60000   # of one side's files of one kind compared (the project's codecs: ~10000)
PATCH = f"patches/{COURSE_PATCH}"
FILES = ("compression.py", PATCH, "train.py")
FILES_ORDER = {name: n for n, name in enumerate(FILES)}

REFERENCE = {"compression.py": [SOLUTION_FILES / "compression.py"],
             PATCH: [SOLUTION_FILES / COURSE_PATCH],
             "train.py": [SOLUTION_FILES / "train.py"]}
# The project's code a student could paste from: the files handout.md section 2 points to,
# what they rest on, the project's own course patch and trainer.
_CODECS = ROOT / "hvd_compress" / "codecs"
_COMPRESSORS = ROOT / "hvd_compress" / "compressors"
PROJECT = {"compression.py": [_CODECS / f"{m}.py" for m in (
               "formats", "reference", "fp8_numpy", "fp16_numpy", "numpy_common", "scaling",
               "fp8_torch", "fp16_torch", "torch_common", "blocks")]
                           + [_COMPRESSORS / f"{m}.py" for m in ("scaled_float", "blockcodec", "bit8", "bit16")],
           PATCH: [ROOT / "patches" / COURSE_PATCH],
           "train.py": [ROOT / "labs" / "mnist.py"]}
SOURCES = {"reference": ("reference solution", "参考答案", REFERENCE),
           "project": ("project's code", "项目代码", PROJECT)}


def read_kit_file(kit, name):
    """The kit's file `name` (a path inside the kit) as text: a regular file only (a link, a
    FIFO or a device is no work), no link followed on the way from the kit's folder, at most
    MAX_BYTES; '' when there is none."""
    fds = []
    try:
        fds.append(os.open(kit, os.O_RDONLY | os.O_DIRECTORY))
        *folders, leaf = Path(name).parts
        for part in folders:
            fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
        fds.append(os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fds[-1]))
        if not stat.S_ISREG(os.fstat(fds[-1]).st_mode):
            return ""
        with os.fdopen(os.dup(fds[-1]), "rb") as f:
            return f.read(MAX_BYTES).decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return ""
    finally:
        for fd in fds:
            os.close(fd)


def added_lines(text):
    """A unified diff's added lines as blocks of consecutive lines: [(text, first line)]."""
    blocks, current, first = [], [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("+") and not line.startswith("+++"):
            if not current:
                first = n
            current.append(line[1:])
        elif current:
            blocks.append(("\n".join(current), first))
            current = []
    if current:
        blocks.append(("\n".join(current), first))
    return blocks


OWN, GIVEN, SEAM = 0, 1, 2     # what a token of a Doc is


@dataclass
class Doc:
    """One side's files of one kind as one token sequence: token ids, (file, line) of each,
    and what each is: the side's own work, text the kit gave (taken out), or a seam between
    two files or two blocks of a patch (no tile crosses it)."""
    tokens: list = field(default_factory=list)
    where: list = field(default_factory=list)
    kind: list = field(default_factory=list)
    cut: list = field(default_factory=list)        # files of which MAX_LINES were compared
    _work: tuple = None

    def add(self, files):
        """files: [(label, text, patch)], one body of code: what one binds, the others use."""
        parts = []
        for label, text, patch in files:
            lines = text.splitlines()
            if len(lines) > MAX_LINES:
                self.cut.append(label)
                text = "\n".join(lines[:MAX_LINES])
            parts += [(label, part, first) for part, first in (added_lines(text) if patch else [(text, 1)])]
        found = [own_names(part) for _, part, _ in parts]
        names = set().union(*(f[0] for f in found))
        attrs = set().union(*(f[1] for f in found))
        for n, (label, part, first) in enumerate(parts):
            read_elsewhere = set().union(*(f[2] for m, f in enumerate(found) if m != n))
            self._append(SEAM, (label, first), SEAM)
            for tok, line in normal_tokens(part, (names, attrs, read_elsewhere)):
                if len(self.tokens) >= MAX_TOKENS:
                    self.cut.append(label)
                    return self
                self._append(tok, (label, line + first - 1), OWN)
        return self

    def _append(self, tok, where, kind):
        self.tokens.append(_ID.setdefault(tok, len(_ID)))
        self.where.append(where)
        self.kind.append(kind)

    @property
    def own(self):
        return self.kind.count(OWN)

    def take_out(self, given):
        """Mark as given every run of the given text's tokens found here."""
        found = tiles(self.tokens, given.tokens, MIN_GIVEN, [k == SEAM for k in self.kind],
                      [k == SEAM for k in given.kind])
        for i, _, length in found:
            self.kind[i:i + length] = [GIVEN] * length
        return self

    def work(self):
        """(tokens, seams, where, index) of the work alone: the given text cut out, so that
        two changes a student made around a given line are one run, as in a diff; the index
        of its grams for the tiling."""
        if self._work is None:
            kept = [n for n, k in enumerate(self.kind) if k != GIVEN]
            tokens, seams = [self.tokens[n] for n in kept], [self.kind[n] == SEAM for n in kept]
            self._work = (tokens, seams, [self.where[n] for n in kept],
                          gram_index(tokens, seams, MIN_TILE))
        return self._work


_ID = {}


@functools.lru_cache(maxsize=None)
def _given():
    return {name: Doc().add([(name, (KIT_FILES / name).read_text(), name == PATCH)]) for name in FILES}


def kit_docs(kit, given):
    return {name: Doc().add([(name, read_kit_file(kit, name), name == PATCH)]).take_out(given[name])
            for name in FILES}


@functools.lru_cache(maxsize=None)
def source_docs(key):
    """The Docs of a source ("reference", "project"): the course's own files, read once."""
    files, given = SOURCES[key][2], _given()
    return {name: Doc().add([(str(path.relative_to(ROOT)), path.read_text(), name == PATCH)
                             for path in files[name]]).take_out(given[name])
            for name in FILES}


@dataclass
class Region:
    """Lines a0..a1 of file_a match lines b0..b1 of file_b, in `tokens` tiled tokens."""
    file_a: str
    a0: int
    a1: int
    file_b: str
    b0: int
    b1: int
    tokens: int

    @property
    def lines_a(self):
        return f"{self.a0}" if self.a0 == self.a1 else f"{self.a0}-{self.a1}"

    @property
    def lines_b(self):
        return f"{self.b0}" if self.b0 == self.b1 else f"{self.b0}-{self.b1}"

    def near(self, other):
        return (self.file_a == other.file_a and self.file_b == other.file_b
                and self.a0 <= other.a1 + REGION_GAP and other.a0 <= self.a1 + REGION_GAP
                and self.b0 <= other.b1 + REGION_GAP and other.b0 <= self.b1 + REGION_GAP)

    def merge(self, other):
        return Region(self.file_a, min(self.a0, other.a0), max(self.a1, other.a1), self.file_b,
                      min(self.b0, other.b0), max(self.b1, other.b1), self.tokens + other.tokens)


def merged(regions):
    """Regions near each other on both sides as one: a function's statements put in another
    order are one region again."""
    out = []
    for region in sorted(regions, key=lambda r: (r.file_a, r.a0, r.b0)):
        for n, other in enumerate(out):
            if other.near(region):
                out[n] = other.merge(region)
                break
        else:
            out.append(region)
    changed = True
    while changed:
        changed = False
        for i in range(len(out)):
            for j in range(i + 1, len(out)):
                if out[i].near(out[j]):
                    out[i] = out[i].merge(out.pop(j))
                    changed = True
                    break
            if changed:
                break
    return out


@dataclass
class Pair:
    a: str
    b: str
    kind: str                   # "kits", or the source b is: "reference", "project"
    score: float                # tiled tokens / the smaller side's own tokens, all files
    shared: int                 # tiled tokens
    per_file: dict              # file -> (score, shared)
    regions: list               # Region


def _regions(wa, wb):
    """A tile as regions of nearby lines in both files: a new region where either side goes
    back (statements put in canonical order) or jumps further than a gap of dropped lines."""
    out, start = [], 0
    for n in range(1, len(wa) + 1):
        if n < len(wa) and all(0 <= w[n][1] - w[n - 1][1] <= REGION_GAP for w in (wa, wb)):
            continue
        la = [line for _, line in wa[start:n]]
        lb = [line for _, line in wb[start:n]]
        out.append(Region(wa[start][0], min(la), max(la), wb[start][0], min(lb), max(lb), n - start))
        start = n
    return out


def compare_docs(a, b, name_a, name_b, kind):
    """One Pair from two sides' {file: Doc}."""
    per_file, regions, shared, own_a, own_b = {}, [], 0, 0, 0
    for name in FILES:
        (ta, sa, wa, _), (tb, sb, wb, index) = a[name].work(), b[name].work()
        found = tiles(ta, tb, MIN_TILE, sa, sb, index)
        covered = sum(length for _, _, length in found)
        smaller = min(a[name].own, b[name].own)
        per_file[name] = (covered / smaller if smaller else 0.0, covered)
        shared, own_a, own_b = shared + covered, own_a + a[name].own, own_b + b[name].own
        for i, j, length in found:
            regions += _regions(wa[i:i + length], wb[j:j + length])
    smaller = min(own_a, own_b)
    return Pair(name_a, name_b, kind, shared / smaller if smaller else 0.0, shared, per_file,
                merged(regions))


def _names(kits):
    names = {kit: Path(kit).name for kit in kits}
    clashes = {n for n in names.values() if list(names.values()).count(n) > 1}
    return {kit: (str(kit) if name in clashes else name) for kit, name in names.items()}


def compare(kits):
    """(pairs closest first: each kit against each source, then every two kits; {kit: its own
    tokens})."""
    pairs, sizes, _ = compare_all(kits)
    return pairs, sizes


def compare_all(kits):
    """compare's pairs and sizes, and {kit: its files compared only in part (too long)}."""
    given = _given()
    names = _names(kits)
    docs = {names[kit]: kit_docs(kit, given) for kit in kits}
    sources = {key: source_docs(key) for key in SOURCES}
    pairs = []
    for name in sorted(docs):
        for key, (label, _, _) in SOURCES.items():
            pairs.append(compare_docs(docs[name], sources[key], name, label, key))
    ordered = sorted(docs)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            pairs.append(compare_docs(docs[a], docs[b], a, b, "kits"))
    pairs.sort(key=lambda p: (-p.score, p.kind, p.a, p.b))
    cut = {name: [label for d in docs[name].values() for label in d.cut] for name in ordered}
    return (pairs, {name: sum(d.own for d in docs[name].values()) for name in ordered},
            {name: labels for name, labels in cut.items() if labels})


def _cell(text):
    """A name as a Markdown table cell: no row or column can be forged from it."""
    out = []
    for ch in str(text):
        if ch in "|\\`*[]<>":
            out.append("\\" + ch)
        elif not ch.isprintable():
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out)


def _share(score, shared):
    return f"{'⚠ ' if score >= FLAG else ''}{100 * score:.0f}% ({shared})"


def report(kits, top=20):
    """The report as Markdown, for the instructor (en, with the Chinese headings)."""
    pairs, sizes, cut = compare_all(kits)
    short = {"compression.py": "compression.py", PATCH: "patch", "train.py": "train.py"}
    lines = ["# Similarity of the kits / 实验包相似度", "",
             f"{len(sizes)} kits. Each kit's compression.py, the lines its course patch adds and its "
             f"train.py, in a normal form that renaming, no-op statements, operand order and the order "
             f"of independent statements do not change, the kit's given text taken out, tiled against "
             f"the reference solution, the project's code (hvd_compress's codecs and compressors, its "
             f"course patch, labs/mnist.py) and every other kit, in runs of at least {MIN_TILE} tokens. "
             f"A share is the tiled tokens (in brackets) over the smaller side's own tokens; ⚠ from "
             f"{100 * FLAG:.0f}%: read the two side by side (the regions below) before concluding "
             f"anything. train.py's Horovod changes are the handout's five lines: high shares there "
             f"are expected. Never a grade. / 仅供教师参考，不计分：⚠ 表示请对照阅读两份代码。", "",
             "## Against the course's own code / 与课程自身代码的比较", "",
             "| kit / 实验包 | against / 对照 | share / 相似度 | "
             + " | ".join(short[f] for f in FILES) + " | own tokens / 自写记号 |",
             "|---|---|---|" + "---|" * len(FILES) + "---|"]
    against = sorted((p for p in pairs if p.kind != "kits"), key=lambda p: (p.a, p.kind))
    for p in against:
        cells = [_share(*p.per_file[f]) for f in FILES]
        lines.append(f"| {_cell(p.a)} | {p.b} | {_share(p.score, p.shared)} | " + " | ".join(cells)
                     + f" | {sizes[p.a]} |")
    kit_pairs = [p for p in pairs if p.kind == "kits"][:top]
    lines += ["", f"## Pairs of kits, closest first / 实验包两两比较 (top {top})", ""]
    if kit_pairs:
        lines += ["| kits / 实验包 | share / 相似度 | " + " | ".join(short[f] for f in FILES) + " |",
                  "|---|---|" + "---|" * len(FILES)]
        for p in kit_pairs:
            lines.append(f"| {_cell(p.a)} - {_cell(p.b)} | {_share(p.score, p.shared)} | "
                         + " | ".join(_share(*p.per_file[f]) for f in FILES) + " |")
    else:
        lines.append("One kit: no pairs. / 只有一个实验包。")
    empty = sorted(n for n, size in sizes.items() if size == 0)
    if empty:
        lines += ["", "No work of their own to compare (only the given text) / 没有可比较的内容: "
                  + ", ".join(_cell(n) for n in empty)]
    if cut:
        lines += ["", f"Compared in part (the first {MAX_LINES} lines or {MAX_TOKENS} tokens) / 仅比较了开头部分: "
                  + "; ".join(f"{_cell(n)} ({', '.join(_cell(l) for l in labels)})" for n, labels in sorted(cut.items()))]
    shown = [p for p in sorted(against, key=lambda p: (-p.score, p.a, p.kind)) + kit_pairs
             if p.score >= REGIONS_FROM and p.regions]
    if shown:
        lines += ["", "## Matching regions / 匹配区域", "",
                  f"The largest regions of each pair (at most {MAX_REGIONS}), as line ranges in both "
                  f"files side by side, in the order of the first; statements put in another order "
                  f"show as several regions. / 两个文件中对应的行号，逐段对照。"]
    for p in shown:
        lines += ["", f"### {_cell(p.a)} — {_cell(p.b)}: {100 * p.score:.0f}%", "",
                  f"| {_cell(p.a)} | {_cell(p.b)} | tokens / 记号 |", "|---|---|---|"]
        largest = sorted(p.regions, key=lambda r: -r.tokens)
        for r in sorted(largest[:MAX_REGIONS], key=lambda r: (FILES_ORDER.get(r.file_a, 9), r.file_a, r.a0)):
            lines.append(f"| {_cell(r.file_a)} {r.lines_a} | {_cell(r.file_b)} {r.lines_b} | {r.tokens} |")
        if len(largest) > MAX_REGIONS:
            lines.append(f"| … {len(largest) - MAX_REGIONS} smaller regions | | "
                         f"{sum(r.tokens for r in largest[MAX_REGIONS:])} |")
    return "\n".join(lines) + "\n"
