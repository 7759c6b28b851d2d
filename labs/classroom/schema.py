"""Everything that comes back from a kit's sandbox, held to a schema in one place before the
grader reads it.

The student side writes its records inside the kit's own processes, where the kit's code can
overwrite any of them, and the kit's trainer writes its logs and report itself: every one is
the kit's to spoil. So each is read with a bound and never through a link, parsed without
running anything (JSON, NPZ without pickles, CSV, Markdown as text), and checked here: its
keys, its types, its shapes and sizes, numbers finite and in range, text and lists of bounded
length. Keys a schema does not name are dropped, so that no judging code ever meets a value
nobody checked. Whatever does not fit raises Malformed, which names the field and what it
should have held: that kit's check fails with the reason, and no other kit's row changes.

    collect(run, name, schema)         OUT/name.json (+ .npz) of a run: (index, arrays)
    calls_results / rank_record / exhaustive_results
                                       the student side's records, values unpacked
    read_log(path, "steps"|"epochs")   a kitlog CSV, typed row by row
    read_report(path)                  report.md as text, and the rows of its table
"""
import csv
import io
import json
import math
import os
import re
import stat
import zipfile
from pathlib import Path

import numpy as np

from . import nofollow
from .student_side import Garbage, unpack

JSON_BYTES = 8 << 20            # the largest record the student side writes is ~100 KB
NPZ_MEMBERS = 10_000            # step 2's outputs are ~1,500 arrays
LOG_BYTES = 16 << 20            # kitlog's rows are ~40 bytes: 400,000 steps
REPORT_BYTES = 1 << 20
TEXT = 2000                     # an error's text, as the student side cuts it


class Malformed(Garbage):
    """An output that does not fit its schema: where, and what it should have held."""

    def __init__(self, where, what):
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what


def shown(value, width=60):
    """A short, printable picture of a value a kit wrote (never the whole of a flood)."""
    text = repr(value)
    text = text if len(text) <= width else text[:width - 3] + "..."
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                   for c in text)


# --- the schema's parts: each checks a value at `where` and returns what it keeps --------------

class Int:
    def __init__(self, lo=0, hi=2 ** 31):
        self.lo, self.hi = lo, hi

    def __call__(self, value, where):
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            raise Malformed(where, f"a whole number in {self.lo}..{self.hi} expected, got {shown(value)}")
        return value


class Num:
    """A finite number in [lo, hi]."""

    def __init__(self, lo=-1e30, hi=1e30):
        self.lo, self.hi = lo, hi

    def __call__(self, value, where):
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or not self.lo <= value <= self.hi):
            raise Malformed(where, f"a finite number in {self.lo:g}..{self.hi:g} expected, got {shown(value)}")
        return float(value)


class Text:
    def __init__(self, longest=TEXT, pattern=None):
        self.longest, self.pattern = longest, pattern and re.compile(pattern)

    def __call__(self, value, where):
        if not isinstance(value, str) or len(value) > self.longest:
            raise Malformed(where, f"a text of at most {self.longest} characters expected, got {shown(value)}")
        if self.pattern and not self.pattern.fullmatch(value):
            raise Malformed(where, f"{shown(value)} is not of the form {self.pattern.pattern}")
        return value


class Const:
    def __init__(self, *choices):
        self.choices = choices

    def __call__(self, value, where):
        if not any(value == c and type(value) is type(c) for c in self.choices):
            raise Malformed(where, f"one of {', '.join(map(repr, self.choices))} expected, got {shown(value)}")
        return value


class Nullable:
    def __init__(self, schema):
        self.schema = schema

    def __call__(self, value, where):
        return None if value is None else self.schema(value, where)


class List:
    def __init__(self, item, longest):
        self.item, self.longest = item, longest

    def __call__(self, value, where):
        if not isinstance(value, list) or len(value) > self.longest:
            raise Malformed(where, f"a list of at most {self.longest} items expected, got {shown(value)}")
        return [self.item(v, f"{where}[{i}]") for i, v in enumerate(value)]


class Obj:
    """A JSON object with `required` keys and `optional` ones; other keys are dropped."""

    def __init__(self, required, optional=None):
        self.required, self.optional = required, optional or {}

    def __call__(self, value, where):
        if not isinstance(value, dict):
            raise Malformed(where, f"an object expected, got {shown(value)}")
        missing = [k for k in self.required if k not in value]
        if missing:
            raise Malformed(where, f"no {missing[0]!r}")
        kept = {}
        for key, schema in {**self.required, **self.optional}.items():
            if key in value:
                kept[key] = schema(value[key], f"{where}.{key}")
        return kept


class Keyed:
    """A JSON object whose keys are data (each a Text), each value one schema."""

    def __init__(self, value, longest, key=Text(200)):
        self.value, self.longest, self.key = value, longest, key

    def __call__(self, value, where):
        if not isinstance(value, dict) or len(value) > self.longest:
            raise Malformed(where, f"an object of at most {self.longest} entries expected, got {shown(value)}")
        return {self.key(k, f"{where} key"): self.value(v, f"{where}[{shown(k, 40)}]") for k, v in value.items()}


class OneOf:
    """The first schema that fits; when none does, the complaint of the first whose required
    keys the value holds (the one it was meant to be), else of the first."""

    def __init__(self, *schemas):
        self.schemas = schemas

    def __call__(self, value, where):
        meant = sorted(self.schemas, key=lambda s: not (isinstance(s, Obj) and isinstance(value, dict)
                                                        and all(k in value for k in s.required)))
        first = None
        for schema in meant:
            try:
                return schema(value, where)
            except Malformed as err:
                first = first or err
        raise first


# what student_side.pack writes for one value (its bytes are in the .npz)
DTYPE = r"[<>|=]?[biuf][1248]|torch\.(float(16|32|64)|bfloat16|u?int(8|16|32|64)|bool)"
PACKED = OneOf(Obj({"kind": Const("tensor", "ndarray"), "dtype": Text(16, DTYPE),
                    "shape": List(Int(0, 1 << 31), 8)}),
               Obj({"kind": Const("other"), "type": Text(80)}))


def value(packed, arrays, key, where):
    """The value a checked PACKED describes (a tensor, an array or student_side.Other)."""
    try:
        return unpack(packed, arrays, key)
    except Garbage as err:
        raise Malformed(where, str(err)) from None
    except (ValueError, TypeError, OverflowError, MemoryError) as err:
        raise Malformed(where, f"unreadable ({type(err).__name__})") from None


# --- reading a run's outputs ------------------------------------------------------------------

def _regular(path):
    """The lstat of `path` when it is a regular file (a link, a FIFO, a device: None)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def read_bounded(path, limit, root=None):
    """The bytes of a regular file of at most `limit` bytes, read without following a link
    (O_NOFOLLOW; with `root`, no name between root and the file either: nofollow); None when
    there is none; Malformed when it is something else or larger."""
    if root is not None:
        return _read_below(Path(root), Path(path), limit)
    st = os.lstat(path) if os.path.lexists(path) else None
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise Malformed(os.path.basename(path), "not a regular file")
    if st.st_size > limit:
        raise Malformed(os.path.basename(path), f"{st.st_size} bytes, more than the {limit} allowed")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        raise Malformed(os.path.basename(path), f"unreadable ({err.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise Malformed(os.path.basename(path), "not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise Malformed(os.path.basename(path), f"more than the {limit} bytes allowed")
    return data


def _read_below(root, path, limit):
    name = path.name
    try:
        fd, st = nofollow.open_file(root, path.relative_to(root).as_posix())
    except FileNotFoundError:
        return None
    except nofollow.Refused as err:
        raise Malformed(name, err.strerror) from None
    except OSError as err:
        raise Malformed(name, f"unreadable ({err.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        if st.st_size > limit:
            raise Malformed(name, f"{st.st_size} bytes, more than the {limit} allowed")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise Malformed(name, f"more than the {limit} bytes allowed")
    return data


def parse_json(raw, where):
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise Malformed(where, "nested too deep to be a record the student side wrote") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise Malformed(where, f"not JSON ({shown(str(err), 80)})") from None


def read_arrays(path, limit, root=None):
    """The arrays of an .npz: no pickles, at most NPZ_MEMBERS members and `limit` bytes in all
    (the members' sizes are read from the archive's index before anything is unpacked)."""
    raw = read_bounded(path, limit, root)
    if raw is None:
        return {}
    where = os.path.basename(path)
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            members = archive.infolist()
            if len(members) > NPZ_MEMBERS:
                raise Malformed(where, f"{len(members)} arrays, more than the {NPZ_MEMBERS} allowed")
            if sum(m.file_size for m in members) > limit:
                raise Malformed(where, f"unpacks beyond the {limit} bytes allowed")
        with np.load(io.BytesIO(raw), allow_pickle=False) as arrays:
            return {key: arrays[key] for key in arrays.files}
    except Malformed:
        raise
    except Exception as err:                # a corrupt archive: the kit's (or its sandbox's) doing
        raise Malformed(where, f"unreadable ({type(err).__name__})") from None


def collect(run, name, limit):
    """(index, arrays) the student side saved as OUT/name.json + .npz: FileNotFoundError when
    absent (the run ended before), Malformed when they are not what it writes."""
    root = getattr(run, "root", None) or run.out
    raw = read_bounded(run.out / f"{name}.json", min(limit, JSON_BYTES), root)
    if raw is None:
        raise FileNotFoundError(name)
    index = parse_json(raw, f"{name}.json")
    if not isinstance(index, dict):
        raise Malformed(f"{name}.json", f"an object expected, got {shown(index)}")
    return index, read_arrays(run.out / f"{name}.npz", limit, root)


# --- step 2's record ------------------------------------------------------------------------

ERROR = {"error": Text(TEXT)}
CALL = Obj({}, {"out": PACKED, "packet": PACKED, "y": PACKED, "error": Text(TEXT),
                "type": Text(100), "stage": Const("compress", "decompress")})
CALLS = OneOf(Obj({"import_error": Text(TEXT)}, {"type": Text(100)}),
              Obj({"names": List(Text(200), 500), "calls": Keyed(CALL, 20_000)}))


def calls_results(index, arrays, planned):
    """Step 2's record checked against the calls planned ({id: op}): every call answered, by
    its outputs or an error; values unpacked. {"import_error"} or {"names", "calls"}."""
    results = CALLS(index, "results")
    if "import_error" in results:
        return results
    for cid, op in planned.items():
        where = f"results.calls[{shown(cid, 40)}]"
        record = results["calls"].get(cid)
        if record is None:
            raise Malformed(where, "no result: every call the grader sent is answered")
        fields = ("out",) if op == "call" else ("packet", "y")
        if "error" in record:
            fields = ("packet",) if record.get("stage") == "decompress" else ()
        for field in fields:
            if field not in record:
                raise Malformed(where, f"no {field!r}")
            record[field] = value(record[field], arrays, f"{cid}.{field}", f"{where}.{field}")
    results["calls"] = {cid: results["calls"][cid] for cid in planned}
    return results


EXHAUSTIVE = OneOf(Obj({"import_error": Text(TEXT)}, {"type": Text(100)}),
                   Obj({"digests": Keyed(List(Text(40, "[0-9a-f]{40}"), 1 << 12), 8),
                        "errors": Keyed(Text(TEXT), 8)}, {"raw": Keyed(PACKED, 8)}))


def exhaustive_results(index, arrays):
    """The exhaustive run's record: digests per function and chunk, errors, raw outputs
    (values unpacked)."""
    results = EXHAUSTIVE(index, "results")
    for name, packed in results.get("raw", {}).items():
        results["raw"][name] = value(packed, arrays, name, f"results.raw.{name}")
    return results


# --- a Horovod rank's record ------------------------------------------------------------------

COMPRESSORS = {"Bit8Compressor": "bit8", "Bit16Compressor": "bit16"}
EXCHANGED = OneOf(Obj(ERROR, {"type": Text(100), "routed_to": Text(300)}),
                  Obj({"got": PACKED, "decoded": PACKED}, {"routed_to": Text(300)}))
OPTIMIZER = OneOf(Obj(ERROR, {"type": Text(100)}), Obj({"weights": PACKED}))
TRAINER = Obj({"error": Nullable(Text(TEXT)), "train_samples": Int(0, 1 << 40),
               "train_steps": Int(0, 1 << 40), "start": Nullable(Text(40, "[0-9a-f]{40}")),
               "seconds": Num(0, 1e7)},
              {"end": Text(40, "[0-9a-f]{40}"),
               "weights": List(Obj({"name": Text(200), "value": PACKED}), 64)})
WIRE = Obj({}, {"error": Text(TEXT), "type": Text(100)})


def _exchanged(section, arrays, prefix, where):
    found = {}
    for name, key in COMPRESSORS.items():
        if name not in section:
            raise Malformed(where, f"no {name!r}")
        entry = EXCHANGED(section[name], f"{where}.{name}")
        for field in ("got", "decoded"):
            if field in entry:
                entry[field] = value(entry[field], arrays, f"{prefix}.{key}.{field}", f"{where}.{name}.{field}")
        found[name] = entry
    return found


def rank_record(index, arrays, job, rank, size):
    """Rank `rank`'s record of a job of `size` ranks, checked against what the job asked
    (job: {"exchange", "intree", "wire", "trainer"}), values unpacked:
    {"import_error"?, "exchange"?, "intree"?, "wire"?, "trainer"?}."""
    where = f"rank{rank}.json"
    record = Obj({"size": Int(size, size), "rank": Int(rank, rank)},
                 {"import_error": Text(TEXT), "exchange": Obj({}), "intree": Obj({}),
                  "wire": WIRE, "trainer": TRAINER})(index, where)
    needs_kit = [s for s in ("exchange", "intree", "wire") if job.get(s)]
    if "import_error" not in record:
        for section in needs_kit:
            if section not in record:
                raise Malformed(where, f"no {section!r} record")
    if job.get("trainer") and "trainer" not in record:
        raise Malformed(where, "no 'trainer' record")
    for section in ("exchange", "intree"):
        if section in record:
            raw = index[section]
            record[section] = _exchanged(raw, arrays, section, f"{where}.{section}")
            if section == "intree":
                if "optimizer" not in raw:
                    raise Malformed(f"{where}.intree", "no 'optimizer'")
                opt = OPTIMIZER(raw["optimizer"], f"{where}.intree.optimizer")
                if "weights" in opt:
                    opt["weights"] = value(opt["weights"], arrays, "optimizer.weights",
                                           f"{where}.intree.optimizer.weights")
                record[section]["optimizer"] = opt
    trainer = record.get("trainer")
    if trainer and "weights" in trainer:
        trainer["weights"] = [(w["name"], value(w["value"], arrays, f"trainer.weights.{i}",
                                                f"{where}.trainer.weights[{i}]"))
                              for i, w in enumerate(trainer["weights"])]
    return record


# --- the kit's own files: kitlog's CSV logs, report.md ----------------------------------------

LOGS = {
    "steps": {"epoch": Int(0, 1 << 20), "step": Int(0, 1 << 40), "seconds": Num(0, 1e7),
              "loss": Num(), "size": Int(1, 1 << 16)},
    "epochs": {"epoch": Int(0, 1 << 20), "test_loss": Num(), "test_accuracy": Num(0, 1),
               "size": Int(1, 1 << 16)},
}


def _number(text):
    """A CSV cell as kitlog writes numbers ("3", "0.051234"): int, float or the text itself."""
    if re.fullmatch(r"[+-]?\d{1,18}", text):
        return int(text)
    try:
        return float(text) if len(text) <= 40 else text
    except ValueError:
        return text


def read_log(path, kind, limit=LOG_BYTES, root=None):
    """The rows of a kitlog CSV ("steps" or "epochs"), each field typed and checked, or None
    when there is no such regular file; Malformed names the line and the field."""
    raw = read_bounded(path, limit, root)
    if raw is None:
        return None
    name = os.path.basename(path)
    fields = LOGS[kind]
    try:
        reader = csv.reader(io.StringIO(raw.decode("utf-8")))
        header = next(reader, None)
        if header is None:
            return []
        missing = [f for f in fields if f not in header]
        if missing:
            raise Malformed(f"{name} line 1", f"no column {missing[0]!r} (kitlog writes "
                            f"{','.join(fields)})")
        columns = {f: header.index(f) for f in fields}
        rows = []
        for line, cells in enumerate(reader, start=2):
            if not cells:
                continue
            if len(cells) != len(header):
                raise Malformed(f"{name} line {line}", f"{len(cells)} fields, the header has {len(header)}")
            rows.append({f: schema(_number(cells[columns[f]]), f"{name} line {line}, {f}")
                         for f, schema in fields.items()})
        return rows
    except UnicodeDecodeError:
        raise Malformed(name, "not UTF-8 text") from None
    except csv.Error as err:
        raise Malformed(name, f"not CSV ({shown(str(err), 80)})") from None


def read_report(path, limit=REPORT_BYTES, root=None):
    """report.md as text (None when there is no such regular file)."""
    raw = read_bounded(path, limit, root)
    return None if raw is None else raw.decode("utf-8", "replace")


RUN_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
ROW = re.compile(r"\|\s*`([^`\n]{1,200})`\s*\|(.*)\|\s*([0-9.]{1,12})%\s*\|\s*")


def report_rows(text):
    """The rows of report.md's table (report.py writes `| `run` | processes | epochs | steps
    per epoch (rank 0) | mean step (ms) | accuracy |`): [{"line", "run", "processes",
    "accuracy", and, when all six cells are there, "epochs", "steps", "step_ms"}]. Malformed
    names a row whose run is no folder name or whose figures are no numbers."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        m = ROW.fullmatch(line.strip())
        if not m:
            continue
        where = f"report.md line {number}"
        run = Text(100, RUN_NAME)(m.group(1), f"{where}, run")
        middle = [c.strip() for c in m.group(2).split("|")]
        row = {"line": number, "run": run,
               "processes": Int(1, 1024)(_number(middle[0]), f"{where}, processes"),
               "accuracy": Num(0, 100)(_number(m.group(3)), f"{where}, accuracy")}
        if len(middle) == 4:
            row["epochs"] = Int(0, 1 << 20)(_number(middle[1]), f"{where}, epochs")
            row["steps"] = Int(0, 1 << 40)(_number(middle[2]), f"{where}, steps per epoch")
            row["step_ms"] = Num(0, 1e9)(_number(middle[3]), f"{where}, mean step")
        rows.append(row)
    return rows
