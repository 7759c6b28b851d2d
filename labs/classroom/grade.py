"""Grade kits: each kit in a sandbox of its own (sandbox.py), its raw outputs judged here.

Per kit, one sandbox whose fork server (fork_server.py) forks the kit's runs in turn: step 2's
calls (the checks' inputs sent in, the kit's outputs replayed to the checks: replay.py), then
steps 1, 3a and 3b on 2 Horovod ranks, the runs that count the bytes the kit's compressors
send (one exchange each), then step 1 on 4; step 5 is read from the kit. No code of a kit runs
in the grader's process, and no kit's run can see another kit: a kit's row depends on that kit
alone. Every output is held to a schema (schema.py) before it is judged; the test labels never
enter a sandbox (held_out_labels), and the grader scores the trainer's weights itself.
"""
import ast
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from labs.kit.data import DATASETS, DataError, find_file, load_dataset, locate

from . import course_net, intree, nofollow, normal_form, pristine, replay, sandbox, schema
from .checks import STEPS, fail
from .compressor_checks import HEADER, SPECS
from .job_checks import TRAINER_CHECKS, exchange_checks, trainer_checks
from .kit import is_kit
from .kit_runs import Task, release, run_tasks, student_side
from .report_checks import report_checks
from .sandbox import SandboxError
from .student_side import WIRE_MODEL, Garbage, pack

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
    wire_timeout: int = 30           # seconds for one run that counts a compressor's bytes
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
            tree = normal_form.parse(sandbox.read_text(path, 1 << 20, root=kit))
        except normal_form.UNPARSABLE:
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
        results = schema.calls_results(*schema.collect(run, "results", limits.read_bytes),
                                       replay.planned())
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
    checks = replay.all_checks(replay.ReplayedKit(results))
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
    return _all_fail(step, names, f"the kit's run wrote outputs the grader cannot read ({err}): "
                     f"they are the student side's to write, never the kit's.",
                     f"实验包的运行写出了评分器无法读取的结果（{err}）：这些结果只能由评分器的学生端写出，"
                     f"实验包不得改写。")


def cannot_judge(step, name, err):
    """A check the grader failed to judge: the grader's failure, said as such (never a reason
    blamed on the student), with the error for the instructor."""
    text = f"{type(err).__name__}: {str(err)[:300]}"
    return fail(step, name, f"the grader could not judge this check (an error in the grader: "
                f"{text}); your instructor has the details.",
                f"评分器无法评判此项检查（评分器内部错误：{text}）；详情请询问教师。")


def guarded(kit, checks_of, judge):
    """judge()'s checks; when the grader itself fails while judging (any exception but one that
    says the host cannot sandbox: that stops the grading), every check of checks_of()
    ([(step, name)]) fails with cannot_judge, and the traceback goes to stderr for the
    instructor: no kit's outputs stop the class, nor pass a check."""
    try:
        return judge()
    except (SandboxError, GradeError):
        raise
    except Exception as err:
        print(f"[labs.classroom] the grader could not judge {kit}:\n{normal_form.format_exc()}",
              file=sys.stderr, flush=True)
        return [cannot_judge(step, name, err) for step, name in checks_of()]


# --- steps 1, 3a, 3b: one sandboxed Horovod job per kit and world size -------------------------

def rank_input(rank, numel=1000, seed=26):
    """The exchange check's input on `rank`: gradient-sized values, different on every rank."""
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(numel, generator=g) * 1e-3


class TestSet:
    """The grader's test images and labels (both kept here: the trainers in the sandboxes see
    the images and a placeholder for the labels: held_out_labels), and the data set's other
    files the trainers read (the fork server decompresses them once per kit)."""

    def __init__(self, options):
        data = load_dataset(options.dataset, options.data_dir)
        spec = DATASETS[options.dataset]
        try:
            folder = locate(spec, options.data_dir, True)
            self.files = [p for idx in (spec.train_images, spec.train_labels, spec.test_images)
                          for p in [find_file(folder, idx)] if p and p.suffix == ".gz"]
        except DataError:
            self.files = []
        n = options.test_samples or None
        self.x = data.test_x[:n].contiguous()
        self.y = data.test_y[:n].clone()

    def score(self, weights):
        """(accuracy, None) of `weights` (rank 0's model's state, as it came back) loaded into
        the grader's own copy of the course's network, or (None, why it cannot be)."""
        if weights is None:
            return None, "train.py ran no model the grader could see (no forward pass)"
        try:
            net = course_net.load(weights)
        except ValueError as err:
            return None, str(err)
        return course_net.accuracy(net, self.x, self.y), None


TEST_LABELS = "t10k-labels"
SYSTEM_DATASETS = Path("/usr/share/datasets")


def held_out_labels(work, data_dir=None):
    """{path: what a sandbox sees there}: every test-labels file a sandbox could read (Debian's
    data sets under /usr/share/datasets, a --data-dir, a link's target), shown as a file of
    the same IDX format whose 10,000 labels are all 0 (the kit's data.py accepts it by its
    md5), written once into work/held-out. The labels themselves never enter a sandbox."""
    raw = (0x801).to_bytes(4, "big") + (10000).to_bytes(4, "big") + bytes(10000)
    folder = Path(work) / "held-out"
    folder.mkdir(mode=0o755, exist_ok=True)
    placeholders = {".gz": folder / f"{TEST_LABELS}.gz", "": folder / TEST_LABELS}
    placeholders[".gz"].write_bytes(gzip.compress(raw, mtime=0))
    placeholders[""].write_bytes(raw)
    for path in placeholders.values():
        path.chmod(0o644)
    tops = [SYSTEM_DATASETS] + ([Path(data_dir).resolve()] if data_dir else [])
    hide = {}
    for top in tops:
        for root, dirs, files in os.walk(top):
            if len(Path(root).relative_to(top).parts) >= 3:
                dirs[:] = []
            for name in files:
                if not name.startswith(TEST_LABELS):
                    continue
                target = Path(os.path.realpath(Path(root) / name))
                if not any(target == t or t in target.parents for t in tops + [Path("/usr")]):
                    continue                # a link out of what a sandbox sees: not there
                hide[target] = placeholders.get(".gz" if name.endswith(".gz") else "") if (
                    name.endswith((".gz", "-ubyte"))) else None
    return hide


def _trainer_argv(n, options):
    argv = ["--epochs", options.epochs, "--test-samples", options.test_samples,
            "--log-dir", f"runs/grader-np{n}", "--dataset", options.dataset]
    if options.train_samples:
        argv += ["--train-samples", options.train_samples]
    if options.data_dir:
        argv += ["--data-dir", options.data_dir]
    return list(map(str, argv))


def job_spec(n, options, exchange, in_tree, trainer):
    """What the student side's job of `n` ranks is asked (its JOB file)."""
    return {"exchange": exchange, "intree": bool(in_tree), "inputs": f"/grader/np{n}-inputs",
            "trainer": _trainer_argv(n, options) if trainer else None}


def job_task(n, options, test_set, exchange, in_tree, trainer):
    """One Horovod job of `n` ranks: the exchange, the in-tree script, the trainer (the test
    images stay here: the grader scores the trainer's weights itself)."""
    arrays = {f"rank{r}": rank_input(r).numpy() for r in range(n)}
    job = job_spec(n, options, exchange, in_tree, trainer)
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


def job_collect(run, n, options, job=None):
    """(Run, {rank: record}) of one job's run (None: the kit was too large): each rank's record
    held to its schema (schema.rank_record: what `job` asked), values unpacked; a record that
    does not fit is {"garbage": why}."""
    if run is None:
        return None, {}
    records = {}
    for r in range(n):
        try:
            records[r] = schema.rank_record(*schema.collect(run, f"rank{r}", options.limits.read_bytes),
                                            job or {}, r, n)
        except FileNotFoundError:
            continue
        except Garbage as err:
            records[r] = {"garbage": str(err)}
    return run, records


def judge_route(records, n, section):
    """{rank: {compressor: {"ok", "same_on_every_rank", "max_error", "got", "want", "error"}}}:
    each rank's result against the float32 average of every rank's own packet decoded by the
    kit's decompress (summed in rank order), the same on every rank."""
    judged = {r: {} for r in range(n)}
    for name, key in (("Bit8Compressor", "bit8"), ("Bit16Compressor", "bit16")):
        raws = {r: records[r][section][name] for r in range(n)}
        errors = [(r, raw["error"]) for r, raw in raws.items() if "error" in raw]
        if errors:
            for r in range(n):
                judged[r][name] = {"ok": False, "error": str(raws[r].get("error") or errors[0][1])[:500],
                                   "routed_to": raws[r].get("routed_to")}
            continue
        got = {r: raws[r]["got"] for r in range(n)}
        decoded = {r: raws[r]["decoded"] for r in range(n)}
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
    """The job's checked records turned into what job_checks reads: {rank: record} and, when a
    rank left none, None: (how the job ended, ""); rank 0's trainer record gains the grader's
    own score of its weights ("accuracy", or "network_error": why there is none)."""
    usable = {r: rec for r, rec in records.items() if "garbage" not in rec}
    judged = {}
    if len(usable) < n:
        how = run.outcome.how() if run else "could not start: the kit is too large to copy"
        bad = [rec["garbage"] for rec in records.values() if "garbage" in rec]
        judged[None] = ((f"wrote outputs the grader cannot read ({bad[0]}): they are the student "
                         f"side's to write, never the kit's", "unreadable") if bad else (how, ""))
        return judged, usable
    for r in range(n):
        record = usable[r]
        judged[r] = {}
        if "import_error" in record:
            judged[r]["exchange"] = {"import_error": record["import_error"][:500]}
        if "trainer" in record:
            trainer = dict(record["trainer"])
            weights = trainer.pop("weights", None)
            if r == 0 and test_set is not None:
                trainer["accuracy"], trainer["network_error"] = test_set.score(weights)
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
    the kit's sandbox ran (job_sizes before the build). Each job judged on its own (guarded):
    one job's odd outputs leave the other job's checks as they are."""
    results = []
    for n, parts in (jobs or job_sizes(options, prepared)).items():
        results += guarded(kit, lambda n=n, parts=parts: _job_check_names(n, parts, prepared),
                           lambda n=n, parts=parts: _one_job_checks(kit, options, test_set, prepared,
                                                                     runs, n, parts))
    return results


def _job_check_names(n, parts, prepared):
    exchange, in_tree, trainer = parts
    names = [("exchange", f"exchange.{c}") for c in SPECS] if exchange else []
    in_tree = in_tree and prepared.ready        # (not built: its checks come with `prepared`)
    names += [("intree", c.name) for c in prepared.checks] if in_tree else []
    names += [("intree", f"intree.{c}") for c in ("allreduce", "optimizer")] if in_tree else []
    names += [("trainer", f"trainer.np{n}.{c}") for c in TRAINER_CHECKS] if trainer else []
    return names


def _one_job_checks(kit, options, test_set, prepared, runs, n, parts):
    exchange, in_tree, trainer = parts
    train_samples = options.train_samples or DATASETS[options.dataset].train_images.count
    run, records = job_collect(runs[f"np{n}"] if runs else None, n, options,
                               job_spec(n, options, *parts))
    imports = run.imports if run else []
    judged, usable = job_records(run, records, n, options, test_set, parts)
    step_checks = []
    if exchange:
        if None not in judged and not any("import_error" in judged[r].get("exchange", {}) for r in range(n)):
            routes = judge_route(usable, n, "exchange")
            for r in range(n):
                judged[r]["exchange"] = routes[r]
        wire = {name: wire_failure(runs, f"wire-kit-{schema.COMPRESSORS[name]}", options) for name in SPECS}
        step_checks += exchange_checks(judged, n, wire)
    if in_tree and prepared.ready:
        step_checks += intree_checks(prepared, judged, usable, n, runs, options)
    if trainer:
        log_dir = _copy_logs_back(run, kit, n) if run else Path(kit) / "runs" / f"grader-np{n}"
        step_checks += trainer_checks(judged, n, log_dir, train_samples, options.epochs,
                                      options.min_accuracy, options.test_samples,
                                      run.loopback_bytes if run else None)
    if imports:
        en, zh = _reference_reason(imports, kit)
        step_checks = [c if c.step == "intree" and c.name in ("intree.patch", "intree.build")
                       else fail(c.step, c.name, en, zh) for c in step_checks]
    return step_checks


def intree_checks(prepared, judged, usable, n, runs=None, options=None):
    if None in judged:
        return intree.record_checks(prepared, {}, judged[None][0])
    if any("import_error" in usable[r] for r in range(n)):
        return intree.record_checks(prepared, {}, f"compression.py does not import: "
                                    f"{str(usable[0].get('import_error'))[:300]}")
    routes = judge_route(usable, n, "intree")
    records = {}
    weights = []
    for r in range(n):
        opt = usable[r]["intree"]["optimizer"]
        if "error" in opt:
            records[r] = {"optimizer": {"ok": False, "error": opt["error"][:500]}}
        else:
            weights.append(opt["weights"])
            records[r] = {"optimizer": None}
        records[r]["bit8"] = routes[r]["Bit8Compressor"]
        records[r]["bit16"] = routes[r]["Bit16Compressor"]
    same = (len(weights) == n and all(isinstance(w, torch.Tensor) for w in weights)
            and all(w.shape == weights[0].shape and w.dtype == weights[0].dtype
                    and torch.equal(w, weights[0]) for w in weights))
    for r in range(n):
        if records[r]["optimizer"] is None:
            records[r]["optimizer"] = {"ok": same, "error": None}
    checks = intree.record_checks(prepared, records)
    if runs is None:
        return checks
    wire = {"intree.allreduce": wire_failure(runs, "wire-horovod", options),
            "intree.optimizer": wire_failure(runs, "wire-optimizer", options)}
    return [fail(c.step, c.name, *wire[c.name]) if c.passed and wire.get(c.name) else c
            for c in checks]


# --- the bytes a kit's compressors send --------------------------------------------------------

WIRE_NUMEL = 1 << 20            # values of the tensor each counted exchange sends (4 MiB float32)
WIRE_RANKS = 2
WIRE_OVER = 1.25                # the count may exceed the packets by a quarter (TCP/IP's headers
WIRE_SLACK = 128 << 10          # are 0.1% of it) plus Horovod's own control messages: its start,
WIRE_PER_SECOND = 16 << 10      # and a few messages per 100 ms cycle (student_side.WIRE_CYCLE_MS)
WIRE_UNDER = 0.98               # and never fall short of them: the packets must travel
ROUTES = {"kit": "compression.allreduce(x, {names})",
          "horovod": "hvd.allreduce(x, compression=hvd.Compression.{keys})",
          "optimizer": "a hvd.DistributedOptimizer(..., compression=hvd.Compression.{keys}) step"}


# task -> (route, compressors): the runs that count the bytes the kit's compressors send, each
# compressor's own for the exchange (a check each), both in one for the in-tree allreduce (one
# check), bit8 for the optimizer
WIRE_RUNS = {"wire-kit-bit8": ("kit", ("Bit8Compressor",)),
             "wire-kit-bit16": ("kit", ("Bit16Compressor",)),
             "wire-horovod": ("horovod", ("Bit8Compressor", "Bit16Compressor")),
             "wire-optimizer": ("optimizer", ("Bit8Compressor",))}


def wire_runs(options, prepared):
    """The wire runs a kit's grading needs: the exchange's, the in-tree route's once it built."""
    wanted = {"kit"} if "exchange" in options.steps else set()
    if prepared and prepared.ready:
        wanted |= {"horovod", "optimizer"}
    return [task for task, (route, _) in WIRE_RUNS.items() if route in wanted]


def wire_tasks(options, prepared):
    """The wire runs' tasks: each on 2 ranks, exchanges of a tensor of WIRE_NUMEL values (the
    optimizer: one step of a WIRE_MODEL layer) and nothing else."""
    site = prepared.site if prepared and prepared.ready else None
    tasks = []
    for task in wire_runs(options, prepared):
        route, names = WIRE_RUNS[task]
        job = {"wire": {"route": route, "compressors": list(names), "numel": WIRE_NUMEL, "seed": 53}}
        files, unbuilt = {f"{task}.json": json.dumps(job)}, {}
        if route != "kit":      # the kit's Horovod did not build: a token run (its checks failed)
            files[f"{task}-unbuilt.json"] = json.dumps(
                {"wire": {**job["wire"], "route": "kit", "numel": 1}})
            unbuilt = {"argv": student_side("ranks", f"/grader/{task}-unbuilt.json", f"/out/{task}")[1:],
                       "path": ["/kit"]}
        tasks.append(Task(task, "ranks", student_side("ranks", f"/grader/{task}.json", f"/out/{task}")[1:],
                          options.wire_timeout, ranks=WIRE_RANKS, files=files,
                          path=([str(site)] if route != "kit" else []) + ["/kit"],
                          requires="build" if route != "kit" else "", unbuilt=unbuilt))
    return tasks


def wire_bytes(route, names, n=WIRE_RANKS):
    """(the bytes exchanges by allgather of the schemes' packets send on n ranks, those of the
    float32 values themselves): each rank sends its packet to each other rank."""
    sizes = [WIRE_MODEL[0] * WIRE_MODEL[1], WIRE_MODEL[1]] if route == "optimizer" else [WIRE_NUMEL]
    return (n * (n - 1) * sum(HEADER + SPECS[name][1] * size for name in names for size in sizes),
            n * (n - 1) * sum(4 * size for _ in names for size in sizes))


def wire_failure(runs, task, options):
    """(en, zh) when the wire run `task` (wire_runs) shows that the kit's compressors do not
    send their schemes' packets (more bytes, or fewer), else None. A run that failed says how
    (its value checks, the main job's, say it better when they fail too)."""
    route, names = WIRE_RUNS[task]
    what = ROUTES[route].format(names=" / ".join(names),
                                keys=" / ".join(schema.COMPRESSORS[n] for n in names))
    where = f"{what} on {WIRE_RANKS} processes, in the grader's run that counts the bytes sent"
    zh_where = f"{what}（评分器在 {WIRE_RANKS} 个进程上统计其发送字节数的运行）"
    run = (runs or {}).get(task)
    if run is None:
        return f"{where}: never ran.", f"{zh_where}没有运行。"
    _, records = job_collect(run, WIRE_RANKS, options, {"wire": True})
    usable = {r: rec for r, rec in records.items() if "garbage" not in rec}
    if len(usable) < WIRE_RANKS:
        bad = [rec["garbage"] for rec in records.values() if "garbage" in rec]
        how = run.outcome.how() + (f"; unreadable outputs ({bad[0]})" if bad else "")
        return f"{where}: {how} before every rank finished.", f"{zh_where}在所有进程完成之前结束（{how}）。"
    for r, record in sorted(usable.items()):
        problem = record.get("import_error") or record.get("wire", {}).get("error")
        if problem:
            return f"{where}: rank {r} raised {problem}.", f"{zh_where}在进程 {r} 上抛出 {problem}。"
    sent, (packets, plain) = run.loopback_bytes, wire_bytes(route, names)
    if sent is None:
        print(f"[labs.classroom] the fork server could not count the bytes of {run.out}", file=sys.stderr)
        return (f"{where}: the grader could not count them (an error in the grader); your "
                f"instructor has the details.", f"{zh_where}：评分器无法统计发送的字节数（评分器内部错误）。")
    most = WIRE_OVER * packets + WIRE_SLACK + WIRE_PER_SECOND * run.outcome.seconds
    values = (f"{WIRE_MODEL[0] * WIRE_MODEL[1] + WIRE_MODEL[1]:,} parameters" if route == "optimizer"
              else f"{WIRE_NUMEL:,} float32 values")
    layout = " and ".join(f"{name}: 8-byte header + {SPECS[name][1]} per value" for name in names)
    if sent > most:
        return (f"{where}: {sent:,} bytes for {values}, where the packets ({layout}) are "
                f"{packets:,} in all, each rank's to each other rank (the float32 values "
                f"themselves: {plain:,}): only the packets may travel, by allgather; compress "
                f"first, then send.",
                f"{zh_where}为 {values} 发送了 {sent:,} 字节，而数据包（{layout}）一共只有 {packets:,} "
                f"字节（float32 原值为 {plain:,} 字节）：只能发送数据包（allgather），先压缩再发送。")
    if sent < WIRE_UNDER * packets:
        return (f"{where}: only {sent:,} bytes for {values}, fewer than the packets ({packets:,} "
                f"in all, each rank's to each other rank): the packets must travel between the "
                f"ranks through Horovod (hvd.allgather).",
                f"{zh_where}只发送了 {sent:,} 字节，少于数据包（一共 {packets:,} 字节）：数据包必须"
                f"通过 Horovod（hvd.allgather）在进程之间传送。")
    return None


# --- a class -----------------------------------------------------------------------------------

def check_names(step, options, prepared=None):
    """[(step, name)] of the checks `step` gives a kit under `options` (those the grader fails
    when it cannot judge them)."""
    if step == "codecs":
        return [("codecs", n) for n in replay.check_names() + (("exhaustive",) if options.exhaustive else ())]
    if step == "trainer":
        return [("trainer", f"trainer.np{n}.{c}") for n in sorted(options.sizes) for c in TRAINER_CHECKS]
    if step == "exchange":
        return [("exchange", f"exchange.{c}") for c in SPECS]
    if step == "intree":
        return [("intree", f"intree.{c}") for c in ("patch", "build", "allreduce", "optimizer")]
    return [("report", "report.filled"), ("report", "report.own_runs")]


def grade_kit(kit, options, work, test_set, hide=None):
    """[Check] of one kit, in the course's step order: its runs in one sandbox of its own
    (forked by its fork server), judged here. hide: paths masked in its sandbox
    (held_out_labels). Where the grader fails while judging, the checks concerned fail saying
    so (guarded); a host that cannot sandbox stops the grading (SandboxError)."""
    every = lambda: [c for step in options.steps for c in check_names(step, options)]  # noqa: E731
    try:
        return guarded(kit, every, lambda: _grade_kit(kit, options, work, test_set, hide))
    finally:
        release(work)               # the sandbox's folders, once all that came back is read


def _grade_kit(kit, options, work, test_set, hide):
    prepared = intree.prepare(kit) if "intree" in options.steps else None
    jobs = job_sizes(options, prepared)
    tasks = kit_tasks(options, test_set, prepared, jobs)
    if not ({"trainer", "exchange"} & set(options.steps) or (prepared and prepared.ready)):
        jobs = {}
    runs = None
    if tasks:
        runs = run_tasks(kit, work, tasks, limits=options.limits,
                         extra_ro=[Path(p) for p in [options.data_dir] if p],
                         data_files=test_set.files if test_set and "trainer" in options.steps else (),
                         warm_up="trainer" in options.steps, hide=hide)
    if prepared is not None and prepared.ready:
        prepared = intree.built(prepared, runs["build"] if runs else None)
    return judge_kit(kit, options, work, test_set, prepared, runs, jobs)


def kit_tasks(options, test_set, prepared, jobs=None):
    """The runs of one kit's sandbox, in order: the build of its Horovod, step 2's calls, the
    2-rank job, the wire runs, the other jobs (jobs: job_sizes')."""
    jobs = job_sizes(options, prepared) if jobs is None else jobs
    tasks = ([intree.build_task(prepared, options.build_timeout, options.limits.memory)]
             if prepared and prepared.ready else [])
    tasks += [codec_task(options)] if "codecs" in options.steps else []
    if {"trainer", "exchange"} & set(options.steps) or (prepared and prepared.ready):
        tasks += [job_task(n, options, test_set, *parts) for n, parts in jobs.items() if n == 2]
        tasks += wire_tasks(options, prepared)
        tasks += [job_task(n, options, test_set, *parts) for n, parts in jobs.items() if n != 2]
    return tasks


def judge_kit(kit, options, work, test_set, prepared, runs, jobs=None):
    """[Check] of one kit from its runs ({task: Run}, None: the kit was too large to copy),
    each step judged on its own (guarded), in the course's step order; `prepared` as built,
    `jobs` as run (job_sizes' before the build)."""
    if jobs is None:
        jobs = (job_sizes(options, prepared) if {"trainer", "exchange"} & set(options.steps)
                or (prepared and prepared.ready) else {})
    results = []
    if "codecs" in options.steps:
        results += guarded(kit, lambda: check_names("codecs", options),
                           lambda: codec_step(kit, options, work, runs["codecs"] if runs else None))
    if prepared is not None and not prepared.ready:
        results += prepared.checks
    if jobs:
        results += job_checks(kit, options, test_set, prepared, runs, jobs)
    if "report" in options.steps:
        grader_runs = {}
        for c in results:                   # the grader's own trainer runs, as it scored them
            if c.step == "trainer" and c.name.endswith(".accuracy"):
                n = c.name.split(".")[1]
                grader_runs[n], grader_runs[f"{n}.steps"] = c.details.get("accuracy"), c.details.get("steps")
        results += guarded(kit, lambda: check_names("report", options),
                           lambda: report_checks(kit, options.dataset, grader_runs))
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
        hide = held_out_labels(work, options.data_dir)
        # a kit's grading writes into its folder (runs/grader-np<n>, then read back): a folder
        # named twice is graded by one thread, never by two at once
        reals = [Path(kit).resolve() for kit in kits]
        named = {}
        for kit, real in zip(kits, reals):
            named.setdefault(real, kit)
        folders = []
        for i in range(len(named)):
            folders.append(work / f"kit{i}")
            folders[-1].mkdir(mode=0o711)
            folders[-1].chmod(0o711)
        with ThreadPoolExecutor(max_workers=max(1, options.parallel)) as pool:
            graded = {real: pool.submit(grade_kit, kit, options, folder, test_set, hide)
                      for (real, kit), folder in zip(named.items(), folders)}
            try:
                return {kit: list(graded[real].result()) for kit, real in zip(kits, reals)}
            except sandbox.SandboxError as err:     # a sandbox that did not start: the grader's
                raise GradeError(f"cannot sandbox the kits: {err}") from None
    finally:
        release(work)
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["Options", "GradeError", "QUICK", "find_kits", "grade", "grade_kit", "codec_step",
           "reference_imports", "pack", "held_out_labels"]
