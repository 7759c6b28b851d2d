"""Grade kits: every step's checks, in one process where they can run there, on Horovod ranks
where they need them (a whole class shares one launch per world size)."""
import importlib
from dataclasses import dataclass
from pathlib import Path

from labs.kit.data import DATASETS

from . import intree, launch
from .checks import STEPS, fail, error_text
from .codec_checks import codec_checks, exhaustive_check
from .compressor_checks import compressor_checks
from .job_checks import exchange_checks, trainer_checks
from .kit import is_kit
from .report_checks import report_checks
from .rank_job import kit_on_path

# The quick trainer run the grader makes at 2 and 4 processes, and the accuracy documented for
# it (docs/instructor.md): 1 epoch of the first 2048 training images, scored on the first 1000
# test images of Fashion-MNIST.
QUICK = dict(train_samples=2048, test_samples=1000, epochs=1, min_accuracy=0.45)


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
    task_timeout: int = 240
    exhaustive: bool = False


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


def in_process_checks(kit, options):
    """Step 2: import the kit's compression.py here and hold it to the reference."""
    with kit_on_path(kit):
        try:
            module = importlib.import_module("compression")
        except Exception as err:
            return [fail("codecs", "compression.import", f"compression.py does not import: "
                         f"{error_text(err)}.", f"compression.py 无法导入：{error_text(err)}。")]
        results = codec_checks(module) + compressor_checks(module)
        if options.exhaustive:
            results.append(exhaustive_check(module))
        return results


def _trainer_argv(kit, n, options):
    argv = ["--epochs", options.epochs, "--test-samples", options.test_samples,
            "--log-dir", kit / "runs" / f"grader-np{n}", "--dataset", options.dataset]
    if options.train_samples:
        argv += ["--train-samples", options.train_samples]
    if options.data_dir:
        argv += ["--data-dir", options.data_dir]
    return list(map(str, argv))


def job_checks(kits, options, intree_ready=None):
    """The exchange (2 ranks) and the trainer (each size), a launch per size for all kits; and
    the in-tree script of the kits in `intree_ready` ({kit: intree.Prepared} whose Horovod is
    the one the ranks import) inside the 2-rank launch."""
    intree_ready = intree_ready or {}
    results = {kit: [] for kit in kits}
    train_samples = options.train_samples or DATASETS[options.dataset].train_images.count
    sizes = set(options.sizes) if "trainer" in options.steps else set()
    if "exchange" in options.steps or intree_ready:
        sizes.add(2)
    for n in sorted(sizes):
        trainer = "trainer" in options.steps and n in options.sizes
        exchange = "exchange" in options.steps and n == 2
        tasks = []
        for kit in kits:
            in_tree = n == 2 and kit in intree_ready
            if not (trainer or exchange or in_tree):
                continue
            log_dir = kit / "runs" / f"grader-np{n}"
            for old in log_dir.glob("*-rank*.csv"):
                old.unlink()
            tasks.append({"kit": str(kit), "out": str(kit / ".grade" / f"np{n}"),
                          "exchange": exchange, "intree": in_tree, "dataset": options.dataset,
                          "data_dir": options.data_dir, "test_samples": options.test_samples,
                          "trainer": _trainer_argv(kit, n, options) if trainer else None})
        if not tasks:
            continue
        records = launch.run_tasks(n, tasks, options.task_timeout)
        for task in tasks:
            kit = Path(task["kit"])
            if exchange:
                results[kit] += exchange_checks(records[str(kit)], n)
            if task["intree"]:
                ranks = {r: rec["intree"] for r, rec in records[str(kit)].items()
                         if r is not None and "intree" in rec}
                status, tail = records[str(kit)].get(None, ("?", ""))
                results[kit] += intree.record_checks(intree_ready[kit], ranks, status, tail)
            if trainer:
                results[kit] += trainer_checks(records[str(kit)], n, kit / "runs" / f"grader-np{n}",
                                               train_samples, options.epochs,
                                               options.min_accuracy, options.test_samples)
    return results


def grade(kits, options=Options()):
    """{kit: [Check]} in the course's step order."""
    unknown = set(options.steps) - set(STEPS)
    if unknown:
        raise GradeError(f"unknown step(s) {', '.join(sorted(unknown))}; steps: {', '.join(STEPS)}")
    results = {kit: [] for kit in kits}
    for kit in kits:
        if "codecs" in options.steps:
            results[kit] += in_process_checks(kit, options)
    prepared = {kit: intree.prepare(kit) for kit in kits} if "intree" in options.steps else {}
    in_job = {kit: p for kit, p in prepared.items() if p.in_grader_job}
    for kit, checks in job_checks(kits, options, in_job).items():
        results[kit] += checks
    for kit in kits:
        if kit in prepared and kit not in in_job:
            p = prepared[kit]
            results[kit] += intree.run_apart(kit, p) if p.ready else p.checks
        if "report" in options.steps:
            results[kit] += report_checks(kit)
    order = list(STEPS)
    return {kit: sorted(checks, key=lambda c: order.index(c.step)) for kit, checks in results.items()}
