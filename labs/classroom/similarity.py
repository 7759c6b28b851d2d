"""Which kits of a class look alike: a report for the instructor to read, never a grade.

    python -m labs.classroom similar submissions/ [--out DIR] [--top N]

In the spirit of MOSS and JPlag: each kit's `compression.py` and the lines its course patch
adds become Python tokens (tokenize) with identifiers, numbers and strings normalised (so
renaming variables or rewording comments changes nothing), comments dropped; k-grams of
tokens are hashed and winnowed (the smallest hash of every window of w, Schleimer, Wilkerson
and Aiken, SIGMOD 2003) into a kit's fingerprints. The kit's given text (the untouched kit's
files: the spec, the stubs, the hook points' description) is the base code: its fingerprints
are removed first, as JPlag does, so that only the students' own work is compared. A pair's
score is the share of the smaller kit's fingerprints that the other kit holds too.
"""
import hashlib
import io
import keyword
import tokenize
from dataclasses import dataclass
from pathlib import Path

from .kit import COURSE_PATCH, KIT_FILES

K = 12          # tokens per k-gram: shorter matches are common idiom
WINDOW = 8      # winnowing window: any match of K + WINDOW - 1 tokens is always caught
FILES = ("compression.py", f"patches/{COURSE_PATCH}")


def _source(path, name):
    """The Python text of a kit's file: compression.py as it is, the patch's added lines."""
    text = path.read_text(errors="replace")[:1 << 20] if path.is_file() else ""
    if name.endswith(".patch"):
        text = "\n".join(line[1:] for line in text.splitlines()
                         if line.startswith("+") and not line.startswith("+++"))
    return text


def tokens(text):
    """Normalised tokens: keywords and operators as they are, every other name ID, numbers N,
    strings S; comments and blank lines dropped. Text that does not tokenize (a patch's
    fragments of Python) is read line by line, as far as each line goes."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            out += _norm(tok)
        return out
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    out = []
    for line in text.splitlines():
        try:
            for tok in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
                out += _norm(tok)
        except (tokenize.TokenError, IndentationError, SyntaxError):
            continue
    return out


def _norm(tok):
    if tok.type == tokenize.NAME:
        return [tok.string if keyword.iskeyword(tok.string) else "ID"]
    if tok.type == tokenize.NUMBER:
        return ["N"]
    if tok.type == tokenize.STRING:
        return ["S"]
    if tok.type == tokenize.OP:
        return [tok.string]
    if tok.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE):
        return [tokenize.tok_name[tok.type]]
    return []


def fingerprints(toks, k=K, window=WINDOW):
    """The winnowed hashes of the k-grams of `toks`."""
    grams = [int.from_bytes(hashlib.blake2b(" ".join(toks[i:i + k]).encode(), digest_size=8).digest(), "big")
             for i in range(len(toks) - k + 1)]
    if len(grams) <= window:
        return set(grams)
    return {min(grams[i:i + window]) for i in range(len(grams) - window + 1)}


def kit_fingerprints(kit, base):
    """{file: fingerprints} of a kit, the base code's taken out."""
    return {name: fingerprints(tokens(_source(Path(kit) / name, name))) - base.get(name, set())
            for name in FILES}


def base_fingerprints():
    return {name: fingerprints(tokens(_source(KIT_FILES / name, name))) for name in FILES}


@dataclass
class Pair:
    a: str
    b: str
    score: float                # shared fingerprints / the smaller kit's, both files together
    shared: int
    per_file: dict              # file -> (score, shared)


def _score(x, y):
    shared = len(x & y)
    return (shared / min(len(x), len(y)) if x and y else 0.0), shared


def compare(kits):
    """Every pair of kits, closest first."""
    base = base_fingerprints()
    prints = {Path(kit).name: kit_fingerprints(kit, base) for kit in kits}
    names = sorted(prints)
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            per_file = {f: _score(prints[a][f], prints[b][f]) for f in FILES}
            all_a = set().union(*prints[a].values())
            all_b = set().union(*prints[b].values())
            score, shared = _score(all_a, all_b)
            pairs.append(Pair(a, b, score, shared, per_file))
    return sorted(pairs, key=lambda p: (-p.score, p.a, p.b)), {n: sum(map(len, prints[n].values())) for n in names}


def report(kits, top=20):
    """The closest pairs as Markdown, for the instructor (en, with the Chinese headings)."""
    pairs, sizes = compare(kits)
    lines = ["# Similarity of the kits / 实验包相似度", "",
             f"{len(sizes)} kits, {len(pairs)} pairs. Tokens of compression.py and of the lines the "
             f"course patch adds, identifiers and literals normalised, the given text removed; "
             f"k-grams of {K} tokens winnowed over windows of {WINDOW}. A score is the share of the "
             f"smaller kit's fingerprints the other holds too: read the two kits before drawing any "
             f"conclusion (the same spec leads to similar code). Never a grade. / 仅供教师参考，不计分。", "",
             "| kits / 实验包 | score / 相似度 | shared / 共同指纹 | compression.py | patch |",
             "|---|---|---|---|---|"]
    for p in pairs[:top]:
        cells = [f"{100 * p.per_file[f][0]:.0f}% ({p.per_file[f][1]})" for f in FILES]
        lines.append(f"| {p.a} - {p.b} | {100 * p.score:.0f}% | {p.shared} | " + " | ".join(cells) + " |")
    empty = sorted(n for n, size in sizes.items() if size == 0)
    if empty:
        lines += ["", "No work of their own to compare (only the given text) / 没有可比较的内容: " + ", ".join(empty)]
    return "\n".join(lines) + "\n"
