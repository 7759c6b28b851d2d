"""One sandboxed run of a kit: a fresh copy, the student side and the grader's inputs in,
the raw outputs out, read back with bounds. Nothing here judges (grade.py does)."""
import json
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import sandbox
from .student_side import Garbage, save

STUDENT_SIDE = Path(__file__).resolve().parent / "student_side.py"
LAUNCHER = Path(__file__).resolve().parent / "launcher.py"


@dataclass
class Run:
    """What came back from one sandboxed run."""
    outcome: sandbox.Outcome
    out: Path                       # /out of the sandbox, on the grader's side
    kit_copy: Path                  # /kit of the sandbox, on the grader's side
    imports: list = field(default_factory=list)   # reference modules the kit tried to import

    def collect(self, name, limits=sandbox.DEFAULT):
        """(index, arrays) the student side saved as OUT/name.json + .npz; raises Garbage if
        they are unreadable, FileNotFoundError if absent (the run ended before)."""
        raw = sandbox.read_bytes(self.out / f"{name}.json", limits.read_bytes)
        if raw is None:
            raise FileNotFoundError(name)
        try:
            index = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise Garbage(f"{name}.json is not JSON ({err})") from None
        if not isinstance(index, dict):
            raise Garbage(f"{name}.json is not an object")
        return index, read_npz(self.out / f"{name}.npz", limits.read_bytes)


def read_npz(path, limit):
    """The arrays of an .npz the sandbox wrote: no pickles, no member larger than `limit`."""
    if not os.path.exists(path):
        return {}
    if sandbox.read_bytes(path, limit) is None:
        raise Garbage(f"{path.name} is not a regular file of at most {limit} bytes")
    try:
        with zipfile.ZipFile(path) as archive:
            if sum(info.file_size for info in archive.infolist()) > limit:
                raise Garbage(f"{path.name} unpacks beyond {limit} bytes")
        with np.load(path, allow_pickle=False) as arrays:
            return {key: arrays[key] for key in arrays.files}
    except Garbage:
        raise
    except Exception as err:            # a corrupt archive: the kit's (or its sandbox's) doing
        raise Garbage(f"{path.name} is unreadable ({type(err).__name__})") from None


def run_kit(kit, work, name, argv, *, inputs=None, files=None, limits=sandbox.DEFAULT, env=None,
            extra_ro=()):
    """Run `argv` (the student side: "python /grader/student_side.py ...") in a sandbox over a
    fresh copy of `kit`. inputs: {file stem: (index, arrays)} written into /grader; files:
    {name: text}. Returns a Run, or None when the kit is too large to copy."""
    base = Path(work) / name
    if base.exists():
        shutil.rmtree(base)
    grader_dir, out = base / "grader", base / "out"
    for folder in (grader_dir, out):
        folder.mkdir(parents=True)
    os.chmod(base, 0o711)
    os.chmod(grader_dir, 0o755)
    kit_copy = sandbox.copy_kit(kit, base / "kit", limits)
    if kit_copy is None:
        return None
    for source in (STUDENT_SIDE, LAUNCHER):
        shutil.copyfile(source, grader_dir / source.name)
    for stem, (index, arrays) in (inputs or {}).items():
        save(str(grader_dir / stem), index, arrays)
    for file_name, text in (files or {}).items():
        (grader_dir / file_name).write_text(text)
    for path in grader_dir.iterdir():
        os.chmod(path, 0o644)
    outcome = sandbox.run(argv, kit_copy=kit_copy, out_dir=out, grader_dir=grader_dir,
                          limits=limits, env=env, extra_ro=extra_ro, log_path=base / "output.log")
    imports = sandbox.read_text(out / "imports.txt", 4096).split()
    return Run(outcome, out, kit_copy, sorted(set(imports)))


def python():
    """The virtualenv's Python, as the sandbox sees it (the same path: bound read-only)."""
    return str(Path(sys.prefix) / "bin" / "python")


def student_side(*args):
    return [python(), "/grader/student_side.py", *map(str, args)]


def horovodrun(n, *command):
    """horovodrun -np n --gloo command, inside the sandbox (launcher.py)."""
    return [python(), "/grader/launcher.py", "-np", str(n), "--gloo", *map(str, command)]
