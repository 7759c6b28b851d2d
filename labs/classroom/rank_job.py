"""What the grader runs on every Horovod rank: the exchange check and the student's trainer.

    horovodrun -np N --gloo python -m labs.classroom.rank_job JOB.json

JOB.json lists tasks, one per kit: {"kit", "out", "exchange": bool, "intree": bool, "trainer":
[argv] or null, "dataset", "data_dir", "test_samples"}. Each rank writes out/rank<R>.json. Several kits share one job (a class costs
one launch per world size); each kit's modules are dropped from sys.modules before the next
kit's are imported. Why in-process: the grader watches the trainer from outside its code (a
global forward hook sees the model, the samples it trains on, its weights before the first
step and after the last), so a student's trainer needs no cooperation to be checked.
"""
import functools
import hashlib
import json
import runpy
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import horovod.torch as hvd

from labs.classroom.checks import error_text
from labs.kit import data as lab_data
from labs.kit.ranks import set_horovod_defaults

KIT_MODULES = ("compression", "kitlog", "data", "train")
SEED_STRIDE = 1000003            # every rank starts from a different seed: see _rank_seeds


def weights_digest(model):
    """sha1 of every parameter's bytes: equal on two ranks iff the weights are equal."""
    digest = hashlib.sha1()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@contextmanager
def kit_on_path(kit):
    """Import the kit's modules (compression, data, ...) from `kit`, and forget them after."""
    for name in KIT_MODULES:
        sys.modules.pop(name, None)
    sys.path.insert(0, str(kit))
    try:
        yield
    finally:
        sys.path.remove(str(kit))
        for name in KIT_MODULES:
            sys.modules.pop(name, None)


def rank_input(rank, numel=1000, seed=26):
    """The exchange check's input on `rank`: gradient-sized values, different on every rank."""
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(numel, generator=g) * 1e-3


def exchange_check(compression_module):
    """Each compressor through the student's allreduce on every rank, against the average of
    every rank's packet decoded by the student's own decompress (float32 sum in rank order)."""
    results = {}
    n = hvd.size()
    for name in ("Bit8Compressor", "Bit16Compressor"):
        try:
            compressor = getattr(compression_module, name)
            got = compression_module.allreduce(rank_input(hvd.rank()), compressor,
                                               name=f"classroom.{name}")
            got = torch.as_tensor(got).detach().reshape(-1).to(torch.float32)
            total = torch.zeros(1000, dtype=torch.float32)
            for r in range(n):
                packet, ctx = compressor.compress(rank_input(r))
                total += torch.as_tensor(compressor.decompress(packet, ctx)).reshape(-1).float()
            want = total / n
            every = hvd.allgather(got.reshape(1, -1), name=f"classroom.check.{name}")
            same_everywhere = bool((every == every[0]).all())
            diff = (got - want).abs()
            results[name] = {"ok": bool(torch.equal(got, want)) and same_everywhere,
                             "same_on_every_rank": same_everywhere,
                             "max_error": float(diff.max()) if diff.numel() else 0.0,
                             "first_bad": int(torch.nonzero(got != want)[0]) if not torch.equal(got, want) else -1,
                             "got": float(got[0]), "want": float(want[0]), "error": None}
        except Exception as err:              # the student's code: any error is a finding
            results[name] = {"ok": False, "error": error_text(err)}
    return results


@contextmanager
def _rank_seeds(rank):
    """Seed every rank differently, whatever the trainer seeds: only a broadcast of rank 0's
    weights then makes the ranks start alike (with one seed everywhere a forgotten broadcast
    would go unseen)."""
    original = torch.manual_seed
    torch.manual_seed(1234 + SEED_STRIDE * rank)
    torch.manual_seed = torch.random.manual_seed = lambda seed: original(int(seed) + SEED_STRIDE * rank)
    try:
        yield
    finally:
        torch.manual_seed = torch.random.manual_seed = original


def run_trainer(kit, argv, task):
    """Run the kit's train.py as __main__ with `argv`, watching the model it trains."""
    seen = {"model": None, "start": None, "train_samples": 0, "train_steps": 0}

    def watch(module, inputs):
        if seen["model"] is None:
            seen["model"], seen["start"] = module, weights_digest(module)
        if module is seen["model"] and module.training:
            seen["train_samples"] += int(inputs[0].shape[0])
            seen["train_steps"] += 1

    result = {"error": None}
    hook = torch.nn.modules.module.register_module_forward_pre_hook(watch)
    old_argv, start = sys.argv, time.perf_counter()
    try:
        with _rank_seeds(hvd.rank()):
            sys.argv = [str(kit / "train.py")] + list(argv)
            runpy.run_path(str(kit / "train.py"), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            result["error"] = f"exited with status {stop.code}"
    except Exception as err:
        result["error"] = error_text(err)
    finally:
        sys.argv = old_argv
        hook.remove()
    result["seconds"] = time.perf_counter() - start
    model = seen.pop("model")
    result.update(seen)
    if model is not None:
        result["end"] = weights_digest(model)
        if hvd.rank() == 0:
            result["accuracy"] = evaluate(model, task)
    return result


def evaluate(model, task):
    """The grader's own accuracy of the trained model on the shared test set's first images."""
    import data as kit_data                    # the kit's given data module
    _, test = kit_data.load(task["dataset"], task.get("data_dir"), 1, task.get("test_samples"))
    x, y = test.tensors
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def read_data_once():
    """Every kit's data.py (and the grader's evaluation) reads the files once per rank, not
    once per kit: labs.kit.data.load_dataset is memoised for the job (its tensors are not
    written to by the trainer's code, which slices them)."""
    lab_data.load_dataset = functools.lru_cache(maxsize=None)(lab_data.load_dataset)


def main(job_path):
    job = json.loads(Path(job_path).read_text())
    read_data_once()
    set_horovod_defaults()              # a dead or silent rank ends the job, never hangs it
    hvd.init()
    torch.set_num_threads(1)
    for task in job["tasks"]:
        kit, out = Path(task["kit"]), Path(task["out"])
        record = {"size": hvd.size(), "rank": hvd.rank()}
        with kit_on_path(kit):
            if task.get("exchange"):
                try:
                    import compression
                    record["exchange"] = exchange_check(compression)
                except Exception as err:
                    record["exchange"] = {"import_error": error_text(err)}
            if task.get("intree"):                # the in-tree script, this Horovod being the kit's
                from labs.classroom import intree_job
                record["intree"] = intree_job.run_checks()
            if task.get("trainer") is not None:
                record["trainer"] = run_trainer(kit, task["trainer"], task)
        hvd.allreduce(torch.zeros(1), name=f"classroom.done.{task['kit']}")   # all ranks end the kit
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{hvd.rank()}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
