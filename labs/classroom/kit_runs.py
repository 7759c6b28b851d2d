"""A kit's runs in its sandbox: a fresh copy of the kit, the student side and the grader's
inputs in, the raw outputs out, read back with bounds. Nothing here judges (grade.py does).

run_tasks: every run of a kit (step 3b's build, step 2's calls, its Horovod jobs) in one
sandbox, forked by the fork server (fork_server.py) from one process that imported torch once.
run_kit: one run in a sandbox of its own (the exhaustive check, hours long, needs no fork
server). Each sandbox's folders (its /kit, /out, /tmp and /grader) lie on a tmpfs of its own
(sandbox.Scratch): release(work) unmounts them once the grader has read what came back.

Everything read back is the kit's to have forged: each read is bounded and follows no link
below the sandbox's /out (sandbox.read_bytes with root)."""
import io
import json
import os
import signal
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import nofollow, sandbox
from .student_side import Garbage, save

STUDENT_SIDE = Path(__file__).resolve().parent / "student_side.py"
FORK_SERVER = Path(__file__).resolve().parent / "fork_server.py"
BUILD_SIDE = Path(__file__).resolve().parent / "build_side.py"


@dataclass
class Run:
    """What came back from one sandboxed run."""
    outcome: sandbox.Outcome
    out: Path                       # /out of the run (the sandbox's /out/NAME), grader's side
    kit_copy: Path                  # /kit of the sandbox, on the grader's side
    imports: list = field(default_factory=list)   # reference modules the kit tried to import
    root: Path = None               # the sandbox's /out, grader's side: no link below it followed
    loopback_bytes: int = None      # bytes its processes sent on the sandbox's loopback, counted
                                    # by the fork server around the run (None: not counted)

    def collect(self, name, limits=sandbox.DEFAULT):
        """(index, arrays) the student side saved as OUT/name.json + .npz; raises Garbage if
        they are unreadable, FileNotFoundError if absent (the run ended before)."""
        root = self.root or self.out
        raw = sandbox.read_bytes(self.out / f"{name}.json", limits.read_bytes, root=root)
        if raw is None:
            raise FileNotFoundError(name)
        try:
            index = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise Garbage(f"{name}.json is not JSON ({err})") from None
        if not isinstance(index, dict):
            raise Garbage(f"{name}.json is not an object")
        return index, read_npz(self.out / f"{name}.npz", limits.read_bytes, root=root)


def read_npz(path, limit, root=None):
    """The arrays of an .npz the sandbox wrote: no pickles, no member larger than `limit`,
    read once (bounded, no link) and parsed from memory."""
    raw, why = (nofollow.read(root, os.path.relpath(path, root), limit) if root is not None
                else nofollow.read_path(path, limit))
    if raw is None:
        if why.endswith("is missing"):
            return {}
        raise Garbage(f"{path.name} is not a regular file of at most {limit} bytes")
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            if sum(info.file_size for info in archive.infolist()) > limit:
                raise Garbage(f"{path.name} unpacks beyond {limit} bytes")
        with np.load(io.BytesIO(raw), allow_pickle=False) as arrays:
            return {key: arrays[key] for key in arrays.files}
    except Garbage:
        raise
    except Exception as err:            # a corrupt archive: the kit's (or its sandbox's) doing
        raise Garbage(f"{path.name} is unreadable ({type(err).__name__})") from None


def _prepare(kit, base, limits, sources):
    """A sandbox's folders made anew on a Scratch (its tmpfs) at `base`: grader/ (the grader's
    `sources` copied in), out/, tmp/, and a fresh copy of the kit. (scratch, grader_dir, out,
    tmp, kit_copy), or None when the kit is too large to copy."""
    scratch = sandbox.Scratch(base, limits)
    grader_dir, out, tmp = base / "grader", base / "out", base / "tmp"
    for folder in (grader_dir, out, tmp):
        folder.mkdir()
    os.chmod(grader_dir, 0o755)
    kit_copy = sandbox.copy_kit(kit, base / "kit", limits)
    if kit_copy is None:
        sandbox.release(base)
        return None
    for source in sources:
        (grader_dir / source.name).write_bytes(source.read_bytes())
    return scratch, grader_dir, out, tmp, kit_copy


def release(work):
    """Unmount every sandbox folder below `work` (after the grader has read what came back)."""
    sandbox.release_under(work)


def run_kit(kit, work, name, argv, *, inputs=None, files=None, limits=sandbox.DEFAULT, env=None,
            extra_ro=()):
    """Run `argv` (the student side: "python /grader/student_side.py ...") in a sandbox over a
    fresh copy of `kit`. inputs: {file stem: (index, arrays)} written into /grader; files:
    {name: text}. Returns a Run, or None when the kit is too large to copy."""
    prepared = _prepare(kit, Path(work) / name, limits, (STUDENT_SIDE,))
    if prepared is None:
        return None
    scratch, grader_dir, out, tmp, kit_copy = prepared
    base = scratch.path
    for stem, (index, arrays) in (inputs or {}).items():
        save(str(grader_dir / stem), index, arrays)
    for file_name, text in (files or {}).items():
        (grader_dir / file_name).write_text(text)
    for path in grader_dir.iterdir():
        os.chmod(path, 0o644)
    outcome = sandbox.run(argv, kit_copy=kit_copy, out_dir=out, tmp_dir=tmp, grader_dir=grader_dir,
                          limits=limits, env=env, extra_ro=extra_ro, log_path=base / "output.log",
                          scratch=scratch)
    imports = sandbox.read_text(out / "imports.txt", 4096, root=out).split()
    return Run(outcome, out, kit_copy, sorted(set(imports)), root=out)


@dataclass
class Task:
    """One run of a kit in its sandbox: the student side's argv (student_side(...)), forked once
    ("calls"), on `ranks` Horovod ranks ("ranks"), or the build side's ("build": build_side(...),
    step 3b's Horovod); its own time limit and /out/NAME."""
    name: str
    mode: str                       # "build", "calls" or "ranks"
    argv: list                      # student_side(...)[1:]
    seconds: float
    ranks: int = 1
    inputs: dict = field(default_factory=dict)     # {file stem: (index, arrays)} into /grader
    files: dict = field(default_factory=dict)      # {name: text} into /grader
    path: list = field(default_factory=list)       # first on sys.path (the in-tree site, /kit)
    requires: str = ""              # a build task's name: without its Horovod, run `unbuilt`
    unbuilt: dict = field(default_factory=dict)    # {"argv", "path"} when the build failed


SANDBOX_SLACK_S = 30                # the fork server's own start and sweeps, over the tasks' time


def run_tasks(kit, work, tasks, *, limits=sandbox.DEFAULT, extra_ro=(), data_files=(),
              warm_up=False, hide=None):
    """Every task of a kit, in order, in one sandbox over one fresh copy of the kit (shared by
    the kit's own runs only): {task name: Run}, or None when the kit is too large to copy.
    data_files: the data set's files, which the fork server decompresses once for every run;
    warm_up: a run trains (the fork server pays torch's first step once for all); hide: paths
    masked inside the sandbox (sandbox.hide_binds: the test labels). Raises SandboxError when
    the sandbox did not start (the grader's failure, not the kit's): its fork server, which
    runs no code of the kit, never said it was ready."""
    prepared = _prepare(kit, Path(work) / "sandbox", limits, (STUDENT_SIDE, FORK_SERVER, BUILD_SIDE))
    if prepared is None:
        return None
    scratch, grader_dir, out, tmp, kit_copy = prepared
    base = scratch.path
    for task in tasks:
        for stem, (index, arrays) in task.inputs.items():
            save(str(grader_dir / stem), index, arrays)
        for file_name, text in task.files.items():
            (grader_dir / file_name).write_text(text)
    plan = [{"name": t.name, "mode": t.mode, "argv": list(map(str, t.argv)), "ranks": t.ranks,
             "seconds": t.seconds, "path": list(map(str, t.path)), "requires": t.requires,
             "unbuilt": {k: list(map(str, v)) for k, v in t.unbuilt.items()}} for t in tasks]
    (grader_dir / "plan.json").write_text(json.dumps({"tasks": plan,
                                                      "data": list(map(str, data_files)),
                                                      "warm_up": bool(warm_up)}))
    for path in grader_dir.iterdir():
        os.chmod(path, 0o644)
    whole = sandbox.Limits(**{**limits.__dict__,
                              "seconds": sum(t.seconds for t in tasks) + SANDBOX_SLACK_S})
    report_path = base / "report.jsonl"
    whole_outcome = sandbox.run([python(), "/grader/fork_server.py", "/grader/plan.json"],
                                kit_copy=kit_copy, out_dir=out, tmp_dir=tmp, grader_dir=grader_dir,
                                limits=whole, extra_ro=extra_ro, log_path=base / "server.log",
                                report_path=report_path, scratch=scratch, hide=hide)
    reports = _reports(report_path)
    if not reports.pop(None, False):
        raise sandbox.SandboxError(f"the sandbox of {kit} did not start ({whole_outcome.how()}): "
                                   f"{whole_outcome.output.strip()[-1500:] or 'no output'}")
    runs = {}
    for task in tasks:
        outcome = _task_outcome(reports.get(task.name), whole_outcome, out, task.name)
        imports = sandbox.read_text(out / task.name / "imports.txt", 4096, root=out).split()
        sent = (reports.get(task.name) or {}).get("loopback_bytes")
        runs[task.name] = Run(outcome, out / task.name, kit_copy, sorted(set(imports)), root=out,
                              loopback_bytes=sent if isinstance(sent, int) and sent >= 0 else None)
    return runs


def _reports(path):
    """{task name: what the fork server reported, None: whether it started} (it alone writes
    that file: the sandbox's stdout, closed in every run)."""
    found = {}
    for line in sandbox.read_text(path, 1 << 16).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("ready") is True:
            found[None] = True
        elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
            found[entry["name"]] = entry
    return found


def _size(root, rel):
    try:
        fd, st = nofollow.open_file(root, rel)
    except OSError:
        return 0
    os.close(fd)
    return st.st_size


def _task_outcome(report, whole, out, name):
    """The task's sandbox.Outcome, as a sandbox of its own would have given it."""
    output = sandbox.read_text(out / name / "output.log", 4000, tail=True, root=out)
    size = _size(out, f"{name}/output.log")
    if report is None:                  # the sandbox ended (its time, its memory) before it
        killed_by = whole.killed_by if whole.killed_by in ("timeout", "memory") else "not run"
        return sandbox.Outcome(None, output or whole.output, whole.seconds, killed_by, size)
    seconds = float(report.get("seconds") or 0.0)
    full = bool(report.get("disk_full"))
    left = report.get("left_behind")
    left = left if isinstance(left, int) and left >= 0 else 0
    if not report.get("started", True):
        return sandbox.Outcome(None, str(report.get("error", ""))[:300], seconds,
                               "disk" if full else "no fork", size, disk_full=full)
    if report.get("timeout"):
        return sandbox.Outcome(None, output, seconds, "timeout", size, disk_full=full,
                               left_behind=left)
    status, sig = report.get("status"), report.get("signal")
    killed_by = ""
    if sig == signal.SIGXFSZ or status == 128 + signal.SIGXFSZ:
        killed_by = "file size"
    elif sig == signal.SIGKILL and whole.oom:
        killed_by = "memory"
    elif sig:
        killed_by = f"signal {sig}"
    elif full:                          # what it wrote last may be what the disk refused
        killed_by = "disk"
    return sandbox.Outcome(status if sig is None else -int(sig), output, seconds, killed_by, size,
                           disk_full=full, left_behind=left)


def python():
    """The virtualenv's Python, as the sandbox sees it (the same path: bound read-only)."""
    return str(Path(sys.prefix) / "bin" / "python")


def student_side(*args):
    """The student side's command line: argv of a process of its own (run_kit), or, without
    its first item, sys.argv of a forked task (Task.argv)."""
    return [python(), "/grader/student_side.py", *map(str, args)]


def build_side(*args):
    """The build side's command line (a "build" Task's argv: its [1:])."""
    return [python(), "/grader/build_side.py", *map(str, args)]

