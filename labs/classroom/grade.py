"""Grade kits: each kit in a sandbox of its own (sandbox.py), its raw outputs judged here.

Per kit, one sandbox whose fork server (fork_server.py) forks the kit's runs in turn: step 2's
calls (the checks' inputs sent in, the kit's outputs replayed to the checks: replay.py), then
steps 1, 3a and 3b on 2 Horovod ranks, then step 1 on 4; step 5 is read from the kit. No code
of a kit runs in the grader's process, and no kit's run can see another kit: a kit's row
depends on that kit alone.
"""
import ast
import json
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from labs.kit.data import DATASETS, DataError, find_file, load_dataset, locate

from . import intree, nofollow, pristine, replay, sandbox
from .checks import STEPS, fail, ok
from .job_checks import exchange_checks, trainer_checks
from .kit import is_kit
from .kit_runs import Task, release, run_tasks, student_side
from .report_checks import report_checks
from .student_side import Garbage, pack, unpack

# The quick trainer run the grader makes at 2 and 4 processes, and the accuracy documented for
# it (docs/instructor.md): 1 epoch of the first 2048 training images, scored on the first 1000
# test images of Fashion-MNIST.
QUICK = dict(train_samples=2048, test_samples=1000, epochs=1, min_accuracy=0.45)
REFERENCE_PACKAGES = ("hvd_compress", "labs")


@dataclass
class Options:
    steps: tuple = tuple(STEPS)
    dataset: str = "fashion-mnist"
    data_dir: str = None
    train_samples: int = QUICK["train_samples"]     # 0: the whole training set
    test_samples: int = QUICK["test_samples"]
    epochs: int = QUICK["epochs"]
    min_accuracy: float = QUICK["min_accuracy"]
    sizes: tuple = (2, 4)
    task_timeout: int = 240          # seconds for one kit's Horovod job
    build_timeout: int = 1800        # seconds for one kit's Horovod build (the full route)
    codec_timeout: int = 120         # seconds for one kit's step 2
    exhaustive: bool = False
    limits: sandbox.Limits = sandbox.DEFAULT
    parallel: int = 3                # kits graded at once: each kit's sandbox is its own, and
                                     # one kit's runs go one after another


class GradeError(RuntimeError):
    pass


def find_kits(paths):
    """Kits named directly, or every kit one level inside a folder (a class's submissions)."""
    kits = []
    for path in map(Path, paths):
        if is_kit(path):
            kits.append(path.resolve())
        elif path.is_dir():
            inside = sorted(p.resolve() for p in path.iterdir() if is_kit(p))
            if not inside:
                raise GradeError(f"{path}: neither a kit (train.py, compression.py) nor a folder of kits")
            kits += inside
        else:
            raise GradeError(f"{path}: no such folder")
    return kits


def _all_fail(step, names, en, zh):
    return [fail(step, name, en, zh) for name in names]


def _reference_reason(imports, kit=None):
    """The failing reason of a kit that tried to import the reference: the modules its files
    name (read, not run) where they match what the student side refused at run time."""
    named = [n for n in (reference_imports(kit) if kit else [])
             if any(n == i or n.startswith(i + ".") for i in imports)]
    shown = ", ".join((named or imports)[:3])
    return (f"imports the reference solution ({shown}): the course's reference is not available "
            f"while grading; the work must be your own.",
            f"导入了参考答案（{shown}）：评分时参考答案不可用；作业必须是你自己完成的。")


def reference_imports(kit):
    """The course's reference packages the kit's Python files import (read, not run): the
    evidence beside what the student side saw refused at run time."""
    found = set()
    for path in sorted(Path(kit).glob("*.py")):
        try:
            tree = ast.parse(sandbox.read_text(path, 1 << 20, root=kit))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found |= {n for n in names if n.split(".")[0] in REFERENCE_PACKAGES}
    return sorted(found)


# --- step 2 ------------------------------------------------------------------------------------

def codec_task(options):
    """Step 2's run: the kit's functions on the checks' inputs."""
    index, arrays = replay.plan()
    return Task("codecs", "calls", student_side("calls", "/grader/calls", "/out/codecs/results")[1:],
                options.codec_timeout, inputs={"calls": (index, arrays)})


def codec_step(kit, options, work, run=...):
    """Step 2, judged here from the raw outputs of the kit's codecs run (None: the kit was too
    large to copy; not given: run here, in a sandbox of the kit's own)."""
    names = replay.check_names()
    if run is ...:
        try:
            runs = run_tasks(kit, work, [codec_task(options)], limits=options.limits)
            return codec_step(kit, options, work, runs["codecs"] if runs else None)
        finally:
            release(work)
    if run is None:
        return _too_large("codecs", names, options.limits)
    limits = options.limits
    if run.imports:
        return _all_fail("codecs", names, *_reference_reason(run.imports, kit))
    try:
        results, outputs = run.collect("results", limits)
    except FileNotFoundError:
        how = run.outcome.how()
        return _all_fail("codecs", names,
                         f"the kit's code {how} before it returned its outputs (compression.py "
                         f"must import and its functions return; nothing may end the process).",
                         f"实验包的代码在返回结果之前{_zh_how(run.outcome)}（compression.py 必须能导入、"
                         f"函数必须返回；不得结束进程）。")
    except Garbage as err:
        return _garbage("codecs", names, err)
    if "import_error" in results:
        text = str(results["import_error"])[:500]
        return [fail("codecs", "compression.import", f"compression.py does not import: {text}.",
                     f"compression.py 无法导入：{text}。")]
    try:
        kit_module = replay.ReplayedKit(results, outputs)
        kit_module.check_readable()
        checks = replay.all_checks(kit_module)
    except Garbage as err:
        return _garbage("codecs", names, err)
    if options.exhaustive:
        checks.append(replay.exhaustive(kit, work))
    return checks


def _zh_how(outcome):
    return {"timeout": "超时被终止", "memory": "超出内存限制被终止",
            "file size": "输出超出限制被终止", "no fork": "无法启动（实验包自己的进程占满了沙箱）",
            "not run": "未启动（沙箱已先结束）"}.get(outcome.killed_by, f"结束（{outcome.how()}）")


def _too_large(step, names, limits):
    return _all_fail(step, names, f"the kit is larger than {limits.kit_size >> 20} MiB or holds "
                     f"more than {limits.kit_files} files: hand in the kit's files, not data or builds.",
                     f"实验包大于 {limits.kit_size >> 20} MiB 或多于 {limits.kit_files} 个文件：只提交实验包的文件，不要提交数据或构建产物。")


def _garbage(step, names, err):
    return _all_fail(step, names, f"the kit's run wrote outputs the grader cannot read ({err}).",
                     f"实验包的运行写出了评分器无法读取的结果（{err}）。")


# --- steps 1, 3a, 3b: one sandboxed Horovod job per kit and world size -------------------------

def rank_input(rank, numel=1000, seed=26):
    """The exchange check's input on `rank`: gradient-sized values, different on every rank."""
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(numel, generator=g) * 1e-3


class TestSet:
    """The grader's test images (sent into the sandbox) and labels (kept here), and the data
    set's files the trainers read (the fork server decompresses them once per kit)."""

    def __init__(self, options):
        data = load_dataset(options.dataset, options.data_dir)
        spec = DATASETS[options.dataset]
        try:
            folder = locate(spec, options.data_dir, True)
            self.files = [p for idx in (spec.train_images, spec.train_labels, spec.test_images,
                                        spec.test_labels)
                          for p in [find_file(folder, idx)] if p and p.suffix == ".gz"]
        except DataError:
            self.files = []
        n = options.test_samples or None
        self.x = data.test_x[:n].contiguous().numpy()
        self.y = data.test_y[:n].numpy()

    def accuracy(self, predictions):
        if not isinstance(predictions, torch.Tensor) or predictions.shape != (len(self.y),):
            return None
        return float((predictions.numpy().astype(np.int64) == self.y).mean())


def _trainer_argv(n, options):
    argv = ["--epochs", options.epochs, "--test-samples", options.test_samples,
            "--log-dir", f"runs/grader-np{n}", "--dataset", options.dataset]
    if options.train_samples:
        argv += ["--train-samples", options.train_samples]
    if options.data_dir:
        argv += ["--data-dir", options.data_dir]
    return list(map(str, argv))


def job_task(n, options, test_set, exchange, in_tree, trainer):
    """One Horovod job of `n` ranks: the exchange, the in-tree script, the trainer."""
    arrays = {f"rank{r}": rank_input(r).numpy() for r in range(n)}
    if trainer:
        arrays["test_x"] = test_set.x
    job = {"exchange": exchange, "intree": bool(in_tree), "inputs": f"/grader/np{n}-inputs",
           "trainer": _trainer_argv(n, options) if trainer else None}
    site = in_tree.site if in_tree else None
    files = {f"np{n}.json": json.dumps(job)}
    unbuilt = {}
    if in_tree:                 # the same job without step 3b where the kit's Horovod did not build
        files[f"np{n}-unbuilt.json"] = json.dumps({**job, "intree": False})
        unbuilt = {"argv": student_side("ranks", f"/grader/np{n}-unbuilt.json", f"/out/np{n}")[1:],
                   "path": ["/kit"]}
    return Task(f"np{n}", "ranks", student_side("ranks", f"/grader/np{n}.json", f"/out/np{n}")[1:],
                options.task_timeout, ranks=n, inputs={f"np{n}-inputs": ({}, arrays)},
                files=files, path=([str(site)] if site else []) + ["/kit"],
                requires="build" if in_tree else "", unbuilt=unbuilt)


def job_collect(run, n, options):
    """(Run, {rank: (record, arrays)}) of one job's run (None: the kit was too large)."""
    if run is None:
        return None, {}
    records = {}
    for r in range(n):
        try:
            records[r] = run.collect(f"rank{r}", options.limits)
        except FileNotFoundError:
            continue
        except Garbage as err:
            records[r] = ({"garbage": str(err)}, {})
    return run, records


def _value(record, arrays, field, key):
    return unpack(record[field], arrays, key)


def judge_route(records, n, section, key_prefix):
    """{rank: {compressor: {"ok", "same_on_every_rank", "max_error", "got", "want", "error"}}}:
    each rank's result against the float32 average of every rank's own packet decoded by the
    kit's decompress (summed in rank order), the same on every rank."""
    judged = {r: {} for r in range(n)}
    for name, key in (("Bit8Compressor", "bit8"), ("Bit16Compressor", "bit16")):
        raws = {r: records[r][0][section].get(name, {}) for r in range(n)}
        errors = [(r, raw["error"]) for r, raw in raws.items() if "error" in raw]
        if errors:
            for r in range(n):
                judged[r][name] = {"ok": False, "error": str(raws[r].get("error") or errors[0][1])[:500],
                                   "routed_to": raws[r].get("routed_to")}
            continue
        got = {r: _value(raws[r], records[r][1], "got", f"{key_prefix}.{key}.got") for r in range(n)}
        decoded = {r: _value(raws[r], records[r][1], "decoded", f"{key_prefix}.{key}.decoded")
                   for r in range(n)}
        shapes_ok = all(isinstance(t, torch.Tensor) and t.numel() == 1000 for t in [*got.values(), *decoded.values()])
        if not shapes_ok:
            for r in range(n):
                judged[r][name] = {"ok": False, "error": "returned something that is not a tensor of "
                                   "the input's 1000 values", "routed_to": raws[r].get("routed_to")}
            continue
        total = torch.zeros(1000, dtype=torch.float32)
        for r in range(n):
            total += decoded[r].reshape(-1).to(torch.float32)
        want = total / n
        flat = {r: got[r].reshape(-1).to(torch.float32) for r in range(n)}
        same = all(torch.equal(flat[r], flat[0]) or bool(((flat[r] == flat[0]) | (flat[r].isnan() & flat[0].isnan())).all())
                   for r in range(n))
        for r in range(n):
            diff = (flat[r] - want).abs()
            equal = torch.equal(flat[r], want)
            judged[r][name] = {"ok": equal and same, "same_on_every_rank": same,
                               "max_error": float(diff.max()), "got": float(flat[r][0]),
                               "want": float(want[0]), "error": None,
                               "routed_to": raws[r].get("routed_to")}
    return judged


def job_records(run, records, n, options, test_set, what):
    """The job's raw records turned into what job_checks reads: {rank: record} and, when a rank
    left none, None: (how the job ended, "")."""
    usable = {r: rec for r, rec in records.items() if "garbage" not in rec[0]}
    judged = {}
    if len(usable) < n:
        how = run.outcome.how() if run else "could not start: the kit is too large to copy"
        bad = [rec[0]["garbage"] for rec in records.values() if "garbage" in rec[0]]
        judged[None] = (how + (f"; unreadable outputs ({bad[0]})" if bad else ""), "")
        return judged, usable
    for r in range(n):
        record, arrays = usable[r]
        judged[r] = {}
        if "import_error" in record:
            judged[r]["exchange"] = {"import_error": str(record["import_error"])[:500]}
        if "trainer" in record:
            trainer = dict(record["trainer"])
            predictions = trainer.pop("predictions", None)
            if r == 0 and predictions is not None:
                try:
                    trainer["accuracy"] = test_set.accuracy(unpack(predictions, arrays, "trainer.predictions"))
                except Garbage:
                    trainer["accuracy"] = None
            judged[r]["trainer"] = trainer
    return judged, usable


def _copy_logs_back(run, kit, n):
    """The grader's trainer logs, from the sandbox's copy into the kit (its runs/grader-np<n>):
    regular CSV files only, each read with a bound, no link followed on either side (a kit's
    runs/ or runs/grader-np<n> that is a link is replaced by a folder, the link itself removed,
    never what it names)."""
    found = {}
    for r in range(n if run else 0):
        for kind in ("steps", "epochs"):
            name = f"{kind}-rank{r}.csv"
            data, _ = nofollow.read(run.kit_copy, f"runs/grader-np{n}/{name}", 16 << 20)
            if data is not None:
                found[name] = data
    folder = nofollow.replace_folder(kit, f"runs/grader-np{n}")
    try:
        for name in os.listdir(folder):
            if re.fullmatch(r"(steps|epochs)-rank\d+\.csv", name):
                os.unlink(name, dir_fd=folder)          # unlinkat: a link's name, never its target
        for name, data in found.items():
            nofollow.write_at(folder, name, data)
    finally:
        os.close(folder)
    return Path(kit) / "runs" / f"grader-np{n}"


def job_sizes(options, prepared):
    """{n: (exchange, in_tree, trainer)}: the Horovod jobs a kit's grading needs."""
    sizes = set(options.sizes) if "trainer" in options.steps else set()
    if "exchange" in options.steps or (prepared and prepared.ready):
        sizes.add(2)
    return {n: ("exchange" in options.steps and n == 2,
                prepared if (n == 2 and prepared and prepared.ready) else None,
                "trainer" in options.steps and n in options.sizes) for n in sorted(sizes)}


def job_checks(kit, options, test_set, prepared, runs, jobs=None):
    """The exchange and the in-tree script (2 ranks), the trainer (each size); jobs: the jobs
    the kit's sandbox ran (job_sizes before the build)."""
    results = []
    train_samples = options.train_samples or DATASETS[options.dataset].train_images.count
    for n, (exchange, in_tree, trainer) in (jobs or job_sizes(options, prepared)).items():
        run, records = job_collect(runs[f"np{n}"] if runs else None, n, options)
        imports = run.imports if run else []
        judged, usable = job_records(run, records, n, options, test_set, (exchange, in_tree, trainer))
        step_checks = []
        if exchange:
            if None not in judged and not any("import_error" in judged[r].get("exchange", {}) for r in range(n)):
                routes = judge_route(usable, n, "exchange", "exchange")
                for r in range(n):
                    judged[r]["exchange"] = routes[r]
            step_checks += exchange_checks(judged, n)
        if in_tree and prepared.ready:
            step_checks += intree_checks(prepared, judged, usable, n)
        if trainer:
            log_dir = _copy_logs_back(run, kit, n)      # (no run: the old logs cleared, none read)
            step_checks += trainer_checks(judged, n, log_dir, train_samples, options.epochs,
                                          options.min_accuracy, options.test_samples)
        if imports:
            en, zh = _reference_reason(imports, kit)
            step_checks = [c if c.step == "intree" and c.name in ("intree.patch", "intree.build")
                           else fail(c.step, c.name, en, zh) for c in step_checks]
        results += step_checks
    return results


def intree_checks(prepared, judged, usable, n):
    if None in judged:
        return intree.record_checks(prepared, {}, judged[None][0])
    if any("import_error" in usable[r][0] for r in range(n)):
        return intree.record_checks(prepared, {}, f"compression.py does not import: "
                                    f"{str(usable[0][0].get('import_error'))[:300]}")
    routes = judge_route(usable, n, "intree", "intree")
    records = {}
    weights = []
    for r in range(n):
        opt = usable[r][0]["intree"].get("optimizer", {})
        if "error" in opt:
            records[r] = {"optimizer": {"ok": False, "error": str(opt["error"])[:500]}}
        else:
            try:
                weights.append(unpack(opt["weights"], usable[r][1], "optimizer.weights"))
            except (Garbage, KeyError):
                weights.append(None)
            records[r] = {"optimizer": None}
        records[r]["bit8"] = routes[r]["Bit8Compressor"]
        records[r]["bit16"] = routes[r]["Bit16Compressor"]
    same = (len(weights) == n and all(isinstance(w, torch.Tensor) for w in weights)
            and all(torch.equal(w, weights[0]) for w in weights))
    for r in range(n):
        if records[r]["optimizer"] is None:
            records[r]["optimizer"] = {"ok": same, "error": None}
    return intree.record_checks(prepared, records)


# --- a class -----------------------------------------------------------------------------------

def grade_kit(kit, options, work, test_set):
    """[Check] of one kit, in the course's step order: its runs in one sandbox of its own
    (forked by its fork server), judged here."""
    try:
        return _grade_kit(kit, options, work, test_set)
    finally:
        release(work)               # the sandbox's folders, once all that came back is read


def _grade_kit(kit, options, work, test_set):
    prepared = intree.prepare(kit) if "intree" in options.steps else None
    tasks = ([intree.build_task(prepared, options.build_timeout, options.limits.memory)]
             if prepared and prepared.ready else [])
    tasks += [codec_task(options)] if "codecs" in options.steps else []
    jobs = job_sizes(options, prepared)
    if {"trainer", "exchange"} & set(options.steps) or (prepared and prepared.ready):
        tasks += [job_task(n, options, test_set, *parts) for n, parts in jobs.items()]
    else:
        jobs = {}
    runs = None
    if tasks:
        runs = run_tasks(kit, work, tasks, limits=options.limits,
                         extra_ro=[Path(p) for p in [options.data_dir] if p],
                         data_files=test_set.files if test_set and "trainer" in options.steps else (),
                         warm_up="trainer" in options.steps)
    if prepared is not None and prepared.ready:
        prepared = intree.built(prepared, runs["build"] if runs else None)
    results = []
    if "codecs" in options.steps:
        results += codec_step(kit, options, work, runs["codecs"] if runs else None)
    if prepared is not None and not prepared.ready:
        results += prepared.checks
    if jobs:
        results += job_checks(kit, options, test_set, prepared, runs, jobs)
    if "report" in options.steps:
        results += report_checks(kit)
    order = list(STEPS)
    return sorted(results, key=lambda c: order.index(c.step))


def grade(kits, options=Options()):
    """{kit: [Check]}, each kit graded in sandboxes of its own, `options.parallel` kits at a
    time (a kit's row depends on that kit alone, so the order and the overlap change nothing)."""
    unknown = set(options.steps) - set(STEPS)
    if unknown:
        raise GradeError(f"unknown step(s) {', '.join(sorted(unknown))}; steps: {', '.join(STEPS)}")
    why = sandbox.available()
    if why:
        raise GradeError(f"cannot sandbox the kits: {why}")
    test_set = TestSet(options) if "trainer" in options.steps else None
    if "codecs" in options.steps:
        replay.plan()                   # once, before the threads: its gradients seed torch's
        replay.check_names()            # global RNG, which concurrent first calls would share
    work = Path(tempfile.mkdtemp(prefix="classroom-grade-"))
    work.chmod(0o711)
    try:
        try:                            # the grader's own set-up, before any kit: said, then stop
            pristine.folder()
            why = sandbox.canary(work)
        except (pristine.PristineError, sandbox.SandboxError) as err:
            why = str(err)
        if why:
            raise GradeError(f"cannot sandbox the kits: {why}")
        folders = []
        for i in range(len(kits)):
            folders.append(work / f"kit{i}")
            folders[-1].mkdir(mode=0o711)
            folders[-1].chmod(0o711)
        with ThreadPoolExecutor(max_workers=max(1, options.parallel)) as pool:
            graded = [pool.submit(grade_kit, kit, options, folder, test_set)
                      for kit, folder in zip(kits, folders)]
            try:
                return {kit: future.result() for kit, future in zip(kits, graded)}
            except sandbox.SandboxError as err:     # a sandbox that did not start: the grader's
                raise GradeError(f"cannot sandbox the kits: {err}") from None
    finally:
        release(work)
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["Options", "GradeError", "QUICK", "find_kits", "grade", "grade_kit", "codec_step",
           "reference_imports", "pack"]
