"""A kit's runs in its sandbox: a fresh copy of the kit, the student side and the grader's
inputs in, the raw outputs out, read back with bounds. Nothing here judges (grade.py does).

run_tasks: every run of a kit (step 2's calls, its Horovod jobs) in one sandbox, forked by the
fork server (fork_server.py) from one process that imported torch once. run_kit: one run in
a sandbox of its own (the exhaustive check, hours long, needs no fork server)."""
import json
import os
import shutil
import signal
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import sandbox
from .student_side import Garbage, save

STUDENT_SIDE = Path(__file__).resolve().parent / "student_side.py"
FORK_SERVER = Path(__file__).resolve().parent / "fork_server.py"


@dataclass
class Run:
    """What came back from one sandboxed run."""
    outcome: sandbox.Outcome
    out: Path                       # /out of the sandbox, on the grader's side
    kit_copy: Path                  # /kit of the sandbox, on the grader's side
    imports: list = field(default_factory=list)   # reference modules the kit tried to import
    loopback_bytes: int = None      # bytes its processes sent on the sandbox's loopback, counted
                                    # by the fork server around the run (None: not counted)

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


def _prepare(kit, base, limits, sources):
    """A sandbox's folders made anew under `base`: grader/ (the grader's `sources` copied in),
    out/, and a fresh copy of the kit. (base, grader_dir, out, kit_copy), or None when the kit
    is too large to copy."""
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
    for source in sources:
        shutil.copyfile(source, grader_dir / source.name)
    return base, grader_dir, out, kit_copy


def run_kit(kit, work, name, argv, *, inputs=None, files=None, limits=sandbox.DEFAULT, env=None,
            extra_ro=()):
    """Run `argv` (the student side: "python /grader/student_side.py ...") in a sandbox over a
    fresh copy of `kit`. inputs: {file stem: (index, arrays)} written into /grader; files:
    {name: text}. Returns a Run, or None when the kit is too large to copy."""
    prepared = _prepare(kit, Path(work) / name, limits, (STUDENT_SIDE,))
    if prepared is None:
        return None
    base, grader_dir, out, kit_copy = prepared
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


@dataclass
class Task:
    """One run of a kit in its sandbox: the student side's argv (student_side(...)), forked once
    ("calls") or on `ranks` Horovod ranks ("ranks"); its own time limit and /out/NAME."""
    name: str
    mode: str                       # "calls" or "ranks"
    argv: list                      # student_side(...)[1:]
    seconds: float
    ranks: int = 1
    inputs: dict = field(default_factory=dict)     # {file stem: (index, arrays)} into /grader
    files: dict = field(default_factory=dict)      # {name: text} into /grader
    path: list = field(default_factory=list)       # first on sys.path (the in-tree site, /kit)


SANDBOX_SLACK_S = 30                # the fork server's own start and sweeps, over the tasks' time


def run_tasks(kit, work, tasks, *, limits=sandbox.DEFAULT, extra_ro=(), data_files=(),
              warm_up=False, hide=None):
    """Every task of a kit, in order, in one sandbox over one fresh copy of the kit (shared by
    the kit's own runs only): {task name: Run}, or None when the kit is too large to copy.
    data_files: the data set's files, which the fork server decompresses once for every run;
    warm_up: a run trains (the fork server pays torch's first step once for all); hide: paths
    masked inside the sandbox (sandbox.hide_binds: the test labels)."""
    prepared = _prepare(kit, Path(work) / "sandbox", limits, (STUDENT_SIDE, FORK_SERVER))
    if prepared is None:
        return None
    base, grader_dir, out, kit_copy = prepared
    for task in tasks:
        for stem, (index, arrays) in task.inputs.items():
            save(str(grader_dir / stem), index, arrays)
        for file_name, text in task.files.items():
            (grader_dir / file_name).write_text(text)
    plan = [{"name": t.name, "mode": t.mode, "argv": list(map(str, t.argv)), "ranks": t.ranks,
             "seconds": t.seconds, "path": list(map(str, t.path))} for t in tasks]
    (grader_dir / "plan.json").write_text(json.dumps({"tasks": plan,
                                                      "data": list(map(str, data_files)),
                                                      "warm_up": bool(warm_up)}))
    for path in grader_dir.iterdir():
        os.chmod(path, 0o644)
    whole = sandbox.Limits(**{**limits.__dict__,
                              "seconds": sum(t.seconds for t in tasks) + SANDBOX_SLACK_S})
    report_path = base / "report.jsonl"
    whole_outcome = sandbox.run([python(), "/grader/fork_server.py", "/grader/plan.json"],
                                kit_copy=kit_copy, out_dir=out, grader_dir=grader_dir,
                                limits=whole, extra_ro=extra_ro, log_path=base / "server.log",
                                report_path=report_path, hide=hide)
    reports = _reports(report_path)
    runs = {}
    for task in tasks:
        task_out = out / task.name
        outcome = _task_outcome(reports.get(task.name), whole_outcome, task_out)
        imports = sandbox.read_text(task_out / "imports.txt", 4096).split()
        sent = (reports.get(task.name) or {}).get("loopback_bytes")
        runs[task.name] = Run(outcome, task_out, kit_copy, sorted(set(imports)),
                              sent if isinstance(sent, int) and sent >= 0 else None)
    return runs


def _reports(path):
    """{task name: what the fork server reported} (it alone writes that file: the sandbox's
    stdout, closed in every run)."""
    found = {}
    for line in sandbox.read_text(path, 1 << 16).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            found[entry["name"]] = entry
    return found


def _task_outcome(report, whole, task_out):
    """The task's sandbox.Outcome, as a sandbox of its own would have given it."""
    log = task_out / "output.log"
    output = sandbox.read_text(log, 4000, tail=True)
    size = os.path.getsize(log) if os.path.isfile(log) else 0
    if report is None:                  # the sandbox ended (its time, its memory) before it
        killed_by = whole.killed_by if whole.killed_by in ("timeout", "memory") else "not run"
        return sandbox.Outcome(None, output or whole.output, whole.seconds, killed_by, size)
    seconds = float(report.get("seconds") or 0.0)
    if not report.get("started", True):
        return sandbox.Outcome(None, str(report.get("error", ""))[:300], seconds, "no fork", size)
    if report.get("timeout"):
        return sandbox.Outcome(None, output, seconds, "timeout", size)
    status, sig = report.get("status"), report.get("signal")
    killed_by = ""
    if sig == signal.SIGXFSZ or status == 128 + signal.SIGXFSZ:
        killed_by = "file size"
    elif sig == signal.SIGKILL and whole.oom:
        killed_by = "memory"
    elif sig:
        killed_by = f"signal {sig}"
    return sandbox.Outcome(status if sig is None else -int(sig), output, seconds, killed_by, size)


def python():
    """The virtualenv's Python, as the sandbox sees it (the same path: bound read-only)."""
    return str(Path(sys.prefix) / "bin" / "python")


def student_side(*args):
    """The student side's command line: argv of a process of its own (run_kit), or, without
    its first item, sys.argv of a forked task (Task.argv)."""
    return [python(), "/grader/student_side.py", *map(str, args)]

