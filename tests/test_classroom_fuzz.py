"""One kit's outputs never stop the class: the solution's real outputs (one sandbox of every
run grading makes: step 2's calls, the 2-rank job with the trainer, the wire runs), mutated
field by field (wrong types, missing keys, huge and non-finite numbers, deep nesting, wrong
shapes and dtypes, files that are links, FIFOs or garbage, kitlog rows that are not numbers),
each judged as a kit of its own beside the solution's unmutated outputs: the judging
completes, with no check the grader could not judge (every malformed output meets its schema
first), the sheet is written, and the solution's rows are byte for byte those of judging it
alone. Then the last safety net, and what stops a grading: a host that cannot sandbox."""
import copy
import csv
import dataclasses
import io
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from labs.classroom import grade as grading
from labs.classroom import intree
from labs.classroom import kit as classroom_kit
from labs.classroom.grade import GradeError, Options, judge_kit, kit_tasks
from labs.classroom.kit_runs import release, run_tasks
from labs.classroom.sandbox import SandboxError
from labs.classroom.sheet import csv_text, markdown, write_sheets

pytestmark = pytest.mark.multiprocess      # one sandbox of the solution's runs, then in-process

OPTIONS = Options(steps=("trainer", "codecs", "exchange", "intree"), sizes=(2,),
                  train_samples=512, test_samples=100, min_accuracy=0.2)
SEED = 53
VALUES = [None, "n/a", -1, 1e308, float("nan"), float("inf"), [], {}, True, "x" * (1 << 20),
          [[[[[[[[0]]]]]]]], 10 ** 30]


@pytest.fixture(scope="module")
def real():
    """The solution's kit and its real runs, in a folder a sandbox's user can reach."""
    base = Path(tempfile.mkdtemp(prefix="classroom-fuzz-"))
    base.chmod(0o711)
    kit = classroom_kit.install_solution(classroom_kit.init(base / "solution"))
    test_set = grading.TestSet(OPTIONS)
    prepared = intree.prepare(kit)
    work = base / "work"
    work.mkdir(mode=0o711)
    runs = run_tasks(kit, work, kit_tasks(OPTIONS, test_set, prepared), limits=OPTIONS.limits,
                     data_files=test_set.files, warm_up=True, hide=grading.held_out_labels(work))
    prepared = intree.built(prepared, runs["build"])
    alone = judge_kit(kit, OPTIONS, work, test_set, prepared, runs)
    assert [c.name for c in alone if not c.passed] == []
    yield {"base": base, "kit": kit, "runs": runs, "test_set": test_set, "prepared": prepared,
           "alone": alone, "work": work}
    release(work)
    shutil.rmtree(base, ignore_errors=True)


def _paths(value, prefix=()):
    """Every path into a JSON value: each key of each object, the first item of each list."""
    yield prefix
    if isinstance(value, dict):
        for key in value:
            yield from _paths(value[key], prefix + (key,))
    elif isinstance(value, list) and value:
        yield from _paths(value[0], prefix + (0,))


def _set(value, path, new):
    for key in path[:-1]:
        value = value[key]
    if new is _DELETE:
        del value[path[-1]]
    else:
        value[path[-1]] = new


_DELETE = object()


def _mutations(real):
    """(label, task, file, how): how(path) rewrites that file of a copy of the task's output."""
    found = []
    rnd = random.Random(SEED)
    for task, name in (("codecs", "results.json"), ("np2", "rank0.json"), ("np2", "rank1.json"),
                       ("wire-kit-bit8", "rank0.json"), ("wire-horovod", "rank1.json")):
        record = json.loads((real["runs"][task].out / name).read_text())
        paths = [p for p in _paths(record) if p]
        if task == "codecs":          # 1,500 calls: the top, and a few calls' every field
            calls = rnd.sample(sorted(record["calls"]), 3)
            paths = [p for p in paths if len(p) < 2 or p[1] in calls]
        deep = [p for p in paths if len(p) > 2]
        for path in [p for p in paths if len(p) <= 2] + rnd.sample(deep, min(16, len(deep))):
            for new in (_DELETE, rnd.choice(VALUES)):
                def how(file, path=path, new=new, record=record):
                    mutated = copy.deepcopy(record)
                    _set(mutated, path, new)
                    file.write_text(json.dumps(mutated))
                found.append((f"{task}/{name}{list(path)}={str(new)[:20]!r}", task, name, how))
        nested = lambda file: file.write_text("[" * 200_000 + "]" * 200_000)   # noqa: E731
        found.append((f"{task}/{name} nested", task, name, nested))
    for task, name in (("codecs", "results.npz"), ("np2", "rank0.npz")):
        with np.load(real["runs"][task].out / name) as arrays:
            arrays = dict(arrays)
        keys = sorted(arrays)
        for key in rnd.sample(keys, 4):
            for label, change in (("dropped", lambda a, k: a.pop(k)),
                                  ("float64", lambda a, k: a.__setitem__(k, a[k].astype(np.float64))),
                                  ("short", lambda a, k: a.__setitem__(k, a[k][:-1]))):
                def how(file, key=key, change=change, arrays=arrays):
                    mutated = dict(arrays)
                    change(mutated, key)
                    np.savez(file, **mutated)
                found.append((f"{task}/{name}[{key}] {label}", task, name, how))
        found.append((f"{task}/{name} garbage", task, name, lambda file: file.write_bytes(b"PK\x03\x04" + os.urandom(64))))
        found.append((f"{task}/{name} fifo", task, name, lambda file: (file.unlink(), os.mkfifo(file))))
        found.append((f"{task}/{name} link", task, name,
                      lambda file: (file.unlink(), file.symlink_to("/etc/shadow"))))
    logs = real["runs"]["np2"].kit_copy / "runs" / "grader-np2"
    for name in ("steps-rank0.csv", "steps-rank1.csv", "epochs-rank0.csv"):
        rows = list(csv.reader(io.StringIO((logs / name).read_text())))
        for column in range(len(rows[0])):
            for new in rnd.sample(["n/a", "nan", "-inf", "1e999", "", "\x00", "1,2"], 2):
                def how(file, column=column, new=new, rows=rows):
                    mutated = [list(r) for r in rows]
                    mutated[1][column] = new
                    out = io.StringIO()
                    csv.writer(out).writerows(mutated)
                    file.write_text(out.getvalue())
                found.append((f"log {name}[{rows[0][column]}]={new!r}", "np2", f"log:{name}", how))
    return found


def _options(task):
    """The steps a task's outputs feed (the others' judging is left out, to keep the file fast)."""
    return dataclasses.replace(OPTIONS, steps=("codecs",) if task == "codecs" else
                               ("trainer", "exchange", "intree"))


def _judge_mutant(real, task, name, how, root):
    """The solution's runs with one output of one task rewritten, judged as a kit of its own."""
    kit = classroom_kit.install_solution(classroom_kit.init(root / "mutant"))
    runs = dict(real["runs"])
    run = runs[task]
    out = root / "out"
    shutil.copytree(run.out, out)
    kit_copy = run.kit_copy
    if name.startswith("log:"):
        kit_copy = root / "kit-copy"
        shutil.copytree(run.kit_copy / "runs", kit_copy / "runs")
        how(kit_copy / "runs" / "grader-np2" / name[4:])
    else:
        how(out / name)
    runs[task] = dataclasses.replace(run, out=out, kit_copy=kit_copy, root=out)
    return kit, judge_kit(kit, _options(task), real["work"], real["test_set"], real["prepared"], runs)


def test_no_mutated_output_stops_the_class_or_changes_another_row(real, tmp_path):
    solution = real["kit"]
    alone = {}
    failed_somewhere = 0
    mutations = _mutations(real)
    assert len(mutations) > 150
    for i, (label, task, name, how) in enumerate(mutations):
        options = _options(task)
        if options.steps not in alone:
            alone[options.steps] = judge_kit(solution, options, real["work"], real["test_set"],
                                             real["prepared"], real["runs"])
        solo = {solution: alone[options.steps]}
        names = [c.name for c in solo[solution]]
        root = tmp_path / f"m{i}"
        root.mkdir()
        kit, checks = _judge_mutant(real, task, name, how, root)
        assert [c.name for c in checks] == names, label
        assert not any("could not judge" in c.en for c in checks), (label, [c.en for c in checks if not c.passed])
        failed_somewhere += any(not c.passed for c in checks)
        klass = {solution: solo[solution], kit: checks}
        write_sheets(root / "sheet", {"grades.md": markdown(klass), "grades.csv": csv_text(klass)})
        sheet = (root / "sheet" / "grades.csv").read_text(encoding="utf-8")
        assert [r for r in csv.reader(io.StringIO(sheet)) if r[0] == "solution"] == \
            [r for r in csv.reader(io.StringIO(csv_text(solo))) if r[0] == "solution"], label
        shutil.rmtree(root)
    # most mutations break a check with a reason; some touch what no check reads
    assert failed_somewhere > len(mutations) // 2


def test_a_failure_in_the_grader_fails_that_kits_checks_saying_so(real, tmp_path, monkeypatch, capsys):
    """The last safety net: an error of the grader's own while it judges one kit fails that
    kit's checks of that step with a reason that says the grader could not judge them, the
    traceback goes to the instructor; the other steps are judged as ever."""
    def broken(module):
        raise RuntimeError("a bug in the grader")
    monkeypatch.setattr(grading.replay, "all_checks", broken)
    checks = judge_kit(real["kit"], OPTIONS, real["work"], real["test_set"], real["prepared"], real["runs"])
    codecs = [c for c in checks if c.step == "codecs"]
    assert len(codecs) == 14 and all(not c.passed and "the grader could not judge this check" in c.en
                                     and "RuntimeError: a bug in the grader" in c.en and c.zh
                                     for c in codecs)
    assert all(c.passed for c in checks if c.step != "codecs")
    assert "a bug in the grader" in capsys.readouterr().err


def test_a_host_that_cannot_sandbox_stops_the_grading(real, monkeypatch):
    def cannot(*args, **kwargs):
        raise SandboxError("bwrap: setting up uid map: Permission denied")
    monkeypatch.setattr(grading, "run_tasks", cannot)
    with pytest.raises(GradeError, match="cannot sandbox the kits: .*uid map"):
        grading.grade([real["kit"]], Options(steps=("codecs",)))
    monkeypatch.setattr(grading, "report_checks", lambda *a: (_ for _ in ()).throw(GradeError("stop")))
    with pytest.raises(GradeError, match="stop"):
        grading.grade([real["kit"]], Options(steps=("report",)))
