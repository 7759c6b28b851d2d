"""The student side of the grader: the only grader code that runs inside a kit's sandbox.

    python student_side.py calls  IN OUT        # the kit's functions on the grader's inputs
    python student_side.py ranks  JOB OUT       # on every Horovod rank (under horovodrun)
    (forked by fork_server.py: a process per call run, one per Horovod rank)

It judges nothing. It imports the kit's compression.py (and runs its train.py), applies them to
the inputs the grader wrote into IN (or JOB), and writes what came back, raw, into OUT: the
bytes of every output, the type of anything that is not an array, the text of every error. The
grader reads OUT after the sandbox has exited and judges it in its own process against its own
reference (labs.classroom.replay, job_checks). A kit that tampers with this file's code in its
process can only spoil its own outputs.

Standalone on purpose: the standard library, NumPy, torch and (for `ranks`) Horovod. It imports
nothing of the grader, and refuses hvd_compress and labs (the course's reference): each attempt
is recorded in OUT/imports.txt and raises ImportError.
"""
import hashlib
import importlib.abc
import json
import os
import runpy
import sys
import time
import traceback

import numpy as np
import torch

REFERENCE_PACKAGES = ("hvd_compress", "labs")
KIT_MODULES = ("compression", "kitlog", "data", "train")
SEED_STRIDE = 1000003          # every rank starts from a different seed (see _rank_seeds)
TORCH_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                    torch.uint8, torch.int8, torch.int16, torch.int32,
                                    torch.int64, torch.bool)}


class RefuseReference(importlib.abc.MetaPathFinder):
    """Refuses the course's reference packages, writing each attempt down first (so that an
    attempt is on record even if the kit then catches the error or ends the process)."""

    def __init__(self, record_path):
        self.record_path = record_path

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFERENCE_PACKAGES:
            if _asked_by_the_kit():
                with open(self.record_path, "a") as record:
                    record.write(name + "\n")
            raise ImportError(f"{name} is the course's reference solution: not importable "
                              f"while grading")
        return None


def _asked_by_the_kit():
    """False only when the import comes from Horovod itself (the closest frame outside the
    import machinery is in horovod/): the project's own Horovod build looks for hvd_compress on
    every allreduce, and is refused quietly. Any other attempt is the kit's."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                 or os.sep + "importlib" + os.sep in frame.f_code.co_filename):
        frame = frame.f_back
    return frame is None or f"{os.sep}site-packages{os.sep}horovod{os.sep}" not in frame.f_code.co_filename


def guard(out_dir):
    sys.meta_path.insert(0, RefuseReference(os.path.join(out_dir, "imports.txt")))


def error_text(err):
    """'NotImplementedError: TODO ... (compression.py:52)': what went wrong and where."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"[:2000]


def error_record(err):
    return {"error": error_text(err), "type": type(err).__name__}


# --- raw values: arrays and tensors as bytes, everything else as its type name ---------------

def pack(value, arrays, key):
    """The JSON description of `value`; its bytes (if an array or a tensor) go to arrays[key]."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        arrays[key] = t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        return {"kind": "tensor", "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        arrays[key] = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        return {"kind": "ndarray", "dtype": value.dtype.str, "shape": list(value.shape)}
    return {"kind": "other", "type": type(value).__name__[:80]}


class Garbage(ValueError):
    """A raw value the grader cannot read back: the kit (or something in its sandbox) wrote it."""


def unpack(meta, arrays, key):
    """The value `pack` described (the grader's side: every field checked, nothing executed)."""
    if not isinstance(meta, dict) or meta.get("kind") not in ("tensor", "ndarray", "other"):
        raise Garbage(f"not a value description: {str(meta)[:80]}")
    if meta["kind"] == "other":
        return Other(str(meta.get("type", "?"))[:80])
    shape = meta.get("shape")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise Garbage(f"bad shape {str(shape)[:80]}")
    if key not in arrays:
        raise Garbage(f"no bytes for {key}")
    raw = arrays[key]
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise Garbage(f"bytes of {key} are {raw.dtype} {raw.shape}")
    count = int(np.prod(shape, dtype=np.int64))
    if meta["kind"] == "ndarray":
        try:
            dtype = np.dtype(str(meta["dtype"]))
        except TypeError:
            raise Garbage(f"bad dtype {str(meta['dtype'])[:40]}") from None
        if dtype.kind not in "biuf" or raw.size != count * dtype.itemsize:
            raise Garbage(f"{key}: {raw.size} bytes for {dtype} {shape}")
        return raw.view(dtype).reshape(shape).copy()
    dtype = TORCH_DTYPES.get(meta.get("dtype"))
    if dtype is None:
        raise Garbage(f"bad tensor dtype {str(meta.get('dtype'))[:40]}")
    size = torch.empty(0, dtype=dtype).element_size()
    if raw.size != count * size:
        raise Garbage(f"{key}: {raw.size} bytes for {dtype} {shape}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


class Other:
    """Stands for a value that was not an array or a tensor (its type's name only)."""

    def __init__(self, type_name):
        self.type_name = type_name

    def __repr__(self):
        return f"<{self.type_name}>"


def save(out_path, index, arrays):
    """OUT.json (the index) and OUT.npz (the bytes), the index last: it marks the end."""
    np.savez(out_path + ".npz", **arrays)
    with open(out_path + ".json.tmp", "w") as handle:
        json.dump(index, handle)
    os.replace(out_path + ".json.tmp", out_path + ".json")


def load_inputs(path):
    with open(path + ".json") as handle:
        index = json.load(handle)
    with np.load(path + ".npz", allow_pickle=False) as arrays:
        arrays = dict(arrays)
    return index, arrays


def digest(value):
    """The key of one input: its type, shape and bytes (the grader computes the same)."""
    h = hashlib.sha1()
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous().reshape(-1)
        h.update(f"tensor:{value.dtype}:{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(f"ndarray:{value.dtype.str}:{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


# --- calls: the kit's codec functions and compressors on the grader's inputs -----------------

def run_calls(in_path, out_path):
    """IN lists calls {"id", "target", "op", "input"}; OUT gets each one's raw result."""
    index, inputs = load_inputs(in_path)
    results, arrays = {"names": [], "calls": {}}, {}
    try:
        import compression
    except BaseException as err:                      # SystemExit too: the kit's own error
        save(out_path, {"import_error": error_text(err), "type": type(err).__name__}, {})
        return
    results["names"] = sorted(n for n in dir(compression) if not n.startswith("__"))[:500]
    for call in index["calls"]:
        cid, target, op = call["id"], call["target"], call["op"]
        record = {}
        x = unpack(call["input"], inputs, cid)
        fn = getattr(compression, target, None)
        try:
            if op == "call":
                record["out"] = pack(fn(x.copy()), arrays, cid + ".out")
            else:
                packet, ctx = fn.compress(x.clone())
                record["packet"] = pack(packet, arrays, cid + ".packet")
                record["y"] = pack(fn.decompress(packet, ctx), arrays, cid + ".y")
        except Exception as err:
            record.update(error_record(err))
            record["stage"] = "compress" if "packet" not in record else "decompress"
        results["calls"][cid] = record
    save(out_path, results, arrays)


def run_exhaustive(in_path, out_path):
    """IN: {"functions", "start", "stop", "chunk", "raw"}: every float32 bit pattern in
    [start, stop) through each function, chunk by chunk; OUT gets each chunk's sha1 of the
    output bytes (or, with raw, the outputs themselves: one chunk, asked again)."""
    index, _ = load_inputs(in_path)
    results, arrays = {"digests": {}, "errors": {}}, {}
    try:
        import compression
    except BaseException as err:
        save(out_path, {"import_error": error_text(err), "type": type(err).__name__}, {})
        return
    for name in index["functions"]:
        digests = results["digests"][name] = []
        for start in range(index["start"], index["stop"], index["chunk"]):
            stop = min(start + index["chunk"], index["stop"])
            x = np.arange(start, stop, dtype=np.uint64).astype(np.uint32).view(np.float32)
            try:
                out = np.ascontiguousarray(getattr(compression, name)(x.copy()))
            except Exception as err:
                results["errors"][name] = error_text(err)
                break
            if index.get("raw"):
                results.setdefault("raw", {})[name] = pack(out, arrays, name)
            digests.append(hashlib.sha1(f"{out.dtype.str}:{out.shape}".encode() + out.tobytes()).hexdigest())
    save(out_path, results, arrays)


# --- ranks: the exchange, the in-tree route and the trainer, under horovodrun ----------------

def weights_digest(model):
    """sha1 of every parameter's bytes: equal on two ranks iff the weights are equal."""
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def exchange_outputs(hvd, compression, inputs, arrays, prefix, route):
    """For each compressor: this rank's result of the route (the kit's allreduce, or Horovod's
    own allreduce with compression=hvd.Compression.<bit8|bit16>), and this rank's own packet
    decoded by the kit's compressor: raw; the grader averages and compares."""
    x = torch.from_numpy(inputs[f"rank{hvd.rank()}"].copy())
    found = {}
    for name, key in (("Bit8Compressor", "bit8"), ("Bit16Compressor", "bit16")):
        record = {}
        try:
            compressor = getattr(compression, name)
            if route == "kit":
                got = compression.allreduce(x.clone(), compressor, name=f"classroom.{name}")
            else:
                routed = getattr(hvd.Compression, key)
                record["routed_to"] = f"{getattr(routed, '__module__', '?')}.{getattr(routed, '__name__', type(routed).__name__)}"
                got = hvd.allreduce(x.clone(), compression=routed, name=f"intree.{key}")
            record["got"] = pack(got, arrays, f"{prefix}.{key}.got")
            packet, ctx = compressor.compress(x.clone())
            record["decoded"] = pack(compressor.decompress(packet, ctx), arrays, f"{prefix}.{key}.decoded")
        except Exception as err:
            record.update(error_record(err))
        found[name] = record
    return found


def optimizer_outputs(hvd, arrays):
    """One hvd.DistributedOptimizer step with compression=bit8: this rank's weights after it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.bit8)
    torch.manual_seed(1 + hvd.rank())
    model(torch.randn(8, 10)).sum().backward()
    opt.step()
    return pack(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), arrays,
                "optimizer.weights")


WIRE_MODEL = (1024, 1024)      # the optimizer's wire run: one Linear layer, 1,049,600 parameters
WIRE_CYCLE_MS = "100"


def wire_outputs(hvd, compression, wire):
    """Exchanges of the kit's compressors and nothing else, on a tensor large enough that
    Horovod's own control messages are small beside it: the fork server counts every byte the
    task's ranks send (its loopback counter, read around the task). route "kit": the kit's
    compression.allreduce; "horovod": hvd.allreduce(..., compression=hvd.Compression.<key>);
    "optimizer": one hvd.DistributedOptimizer step of a WIRE_MODEL layer with it."""
    record = {}
    try:
        for name in wire["compressors"]:
            key = {"Bit8Compressor": "bit8", "Bit16Compressor": "bit16"}[name]
            generator = torch.Generator().manual_seed(int(wire["seed"]) + hvd.rank())
            if wire["route"] == "optimizer":
                model = torch.nn.Linear(*WIRE_MODEL)
                opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters(),
                                               compression=getattr(hvd.Compression, key))
                model(torch.randn(8, WIRE_MODEL[0], generator=generator)).sum().backward()
                opt.step()
                continue
            x = torch.randn(int(wire["numel"]), generator=generator) * 1e-3
            if wire["route"] == "kit":
                compression.allreduce(x, getattr(compression, name), name=f"wire.{key}")
            else:
                hvd.allreduce(x, compression=getattr(hvd.Compression, key), name=f"wire.{key}")
    except Exception as err:
        record.update(error_record(err))
    return record


class _RankSeeds:
    """Seed every rank differently, whatever the trainer seeds: only a broadcast of rank 0's
    weights then makes the ranks start alike (with one seed everywhere a forgotten broadcast
    would go unseen)."""

    def __init__(self, rank):
        self.rank = rank

    def __enter__(self):
        self.original = original = torch.manual_seed
        rank = self.rank
        original(1234 + SEED_STRIDE * rank)
        torch.manual_seed = torch.random.manual_seed = lambda seed: original(int(seed) + SEED_STRIDE * rank)

    def __exit__(self, *exc):
        torch.manual_seed = torch.random.manual_seed = self.original


MAX_WEIGHTS = 64               # state entries of rank 0's model sent back (the course's has 8)


def run_trainer(hvd, argv, arrays):
    """The kit's train.py as __main__ with `argv`, watched from outside its code (a global
    forward hook: the model, the samples it trains on, its weights before the first step and
    after the last); rank 0's model's final state then goes back as plain arrays, for the
    grader to load into its own copy of the course's network and score on the test labels,
    which it alone holds (the trainer's own test set here has placeholder labels)."""
    seen = {"model": None, "start": None, "train_samples": 0, "train_steps": 0}

    def watch(module, inputs):
        if seen["model"] is None:
            seen["model"], seen["start"] = module, weights_digest(module)
        if module is seen["model"] and module.training:
            seen["train_samples"] += int(inputs[0].shape[0])
            seen["train_steps"] += 1

    result = {"error": None}
    hook = torch.nn.modules.module.register_module_forward_pre_hook(watch)
    old_argv = sys.argv
    try:
        with _RankSeeds(hvd.rank()):
            sys.argv = ["train.py"] + list(argv)
            runpy.run_path("train.py", run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            result["error"] = f"exited with status {stop.code}"
    except Exception as err:
        result["error"] = error_text(err)
    finally:
        sys.argv = old_argv
        hook.remove()
    model = seen.pop("model")
    result.update(seen)
    if model is not None:
        result["end"] = weights_digest(model)
        if hvd.rank() == 0:
            state = list(model.state_dict().items())[:MAX_WEIGHTS]
            result["weights"] = [{"name": str(name)[:200],
                                  "value": pack(t, arrays, f"trainer.weights.{i}")}
                                 for i, (name, t) in enumerate(state)]
    return result


def run_ranks(job_path, out_dir):
    """JOB: {"exchange", "intree", "trainer": argv or null, "inputs": path}; this rank's record
    goes to OUT/rank<R>.json (+ .npz)."""
    with open(job_path) as handle:
        job = json.load(handle)
    inputs = load_inputs(job["inputs"])[1] if job.get("inputs") else {}
    if job.get("wire"):
        # Horovod's background loop exchanges a few control messages each cycle, 1 ms by
        # default: in a run whose bytes are counted, a slow kit would pay for its time in bytes
        os.environ["HOROVOD_CYCLE_TIME"] = WIRE_CYCLE_MS
    for name, value in {"HOROVOD_GLOO_TIMEOUT_SECONDS": "60",
                        "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
                        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"}.items():
        os.environ.setdefault(name, value)     # a dead or silent rank ends the job, never hangs
    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    record, arrays = {"size": hvd.size(), "rank": hvd.rank()}, {}
    compression = None
    if job.get("exchange") or job.get("intree") or job.get("wire"):
        try:
            import compression
        except BaseException as err:
            record["import_error"] = error_text(err)
    if job.get("exchange") and compression is not None:
        record["exchange"] = exchange_outputs(hvd, compression, inputs, arrays, "exchange", "kit")
    if job.get("intree") and compression is not None:
        record["intree"] = exchange_outputs(hvd, compression, inputs, arrays, "intree", "horovod")
        try:
            record["intree"]["optimizer"] = {"weights": optimizer_outputs(hvd, arrays)}
        except Exception as err:
            record["intree"]["optimizer"] = error_record(err)
    if job.get("wire") and compression is not None:
        record["wire"] = wire_outputs(hvd, compression, job["wire"])
    if job.get("trainer") is not None:
        start = time.perf_counter()
        record["trainer"] = run_trainer(hvd, job["trainer"], arrays)
        record["trainer"]["seconds"] = time.perf_counter() - start
    hvd.allreduce(torch.zeros(1), name="classroom.done")       # every rank ends the kit
    save(os.path.join(out_dir, f"rank{hvd.rank()}"), record, arrays)


def main(argv):
    mode, first, out = argv[1], argv[2], argv[3]
    out_dir = out if mode == "ranks" else os.path.dirname(out)
    guard(out_dir)
    sys.path.insert(0, os.getcwd())             # the kit's folder: compression, data, kitlog
    if mode == "calls":
        run_calls(first, out)
    elif mode == "exhaustive":
        run_exhaustive(first, out)
    elif mode == "ranks":
        run_ranks(first, out)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv)
