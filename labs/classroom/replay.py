"""Step 2 judged outside the sandbox: the checks' inputs planned here, the kit's raw outputs
replayed to the same checks.

The checks (codec_checks, compressor_checks) are written against a module: they call
`module.encode_e4m3(x)`, `module.Bit8Compressor.compress(x)`. Planning runs them once on a
module that answers with the reference and writes down every input (`plan`): the inputs the
grader sends into the sandbox. The student side applies the kit's functions to them and
returns the raw outputs; `ReplayedKit` then stands for the kit's module in the grader's own
process, answering each call with the kit's recorded output (or raising its recorded error),
so the same checks judge the kit with their own reasons. No code of the kit runs here.
"""
import functools
import hashlib
from pathlib import Path

import numpy as np

from .codec_checks import E4M3, codec_checks, fp16_numpy, fp8_numpy
from .compressor_checks import SPECS, compressor_checks
from .student_side import Garbage, Other, digest, pack

CODEC_REFERENCE = {
    "encode_e4m3": functools.partial(fp8_numpy.encode, fmt=E4M3, saturate=True),
    "decode_e4m3": functools.partial(fp8_numpy.decode, fmt=E4M3),
    "encode_fp16": fp16_numpy.encode,
    "decode_fp16": fp16_numpy.decode,
}
COMPRESSORS = tuple(SPECS)


def all_checks(module):
    return codec_checks(module) + compressor_checks(module)


class _Recorder:
    """The reference, writing down every input it is given."""

    def __init__(self):
        self.calls = {}                       # id -> (target, op, input)

    def note(self, target, op, x):
        cid = f"{target}.{digest(x)}"
        self.calls.setdefault(cid, (target, op, x))

    def __getattr__(self, name):
        if name in CODEC_REFERENCE:
            def call(x):
                self.note(name, "call", x)
                return CODEC_REFERENCE[name](x)
            return call
        if name in COMPRESSORS:
            reference, recorder = SPECS[name][0], self

            class Recording:
                @staticmethod
                def compress(x):
                    recorder.note(name, "roundtrip", x)
                    return reference.compress(x)

                @staticmethod
                def decompress(packet, ctx):
                    return reference.decompress(packet, ctx)
            return Recording
        raise AttributeError(name)


@functools.lru_cache(maxsize=1)
def plan():
    """(index, arrays): the calls the checks make, as the student side reads them."""
    recorder = _Recorder()
    all_checks(recorder)
    arrays, calls = {}, []
    for cid, (target, op, x) in recorder.calls.items():
        calls.append({"id": cid, "target": target, "op": op, "input": pack(x, arrays, cid)})
    return {"calls": calls}, arrays


class KitError(Exception):
    """An error the kit's code raised in the sandbox, as the student side recorded it."""

    def __init__(self, type_name, text):
        super().__init__(text)
        self.type_name, self.text = type_name, text


class Missing(Exception):
    """The plan did not foresee this input: a grader bug, never the kit's fault."""


def planned():
    """{call id: op} of the plan: what the kit's record of step 2 must answer."""
    return {call["id"]: call["op"] for call in plan()[0]["calls"]}


class _Ctx:
    def __init__(self, cid):
        self.cid = cid


class ReplayedKit:
    """The kit's compression module as its raw outputs (checked and unpacked by
    schema.calls_results): attributes it defines, calls answered from the record."""

    def __init__(self, results):
        self.names = set(results.get("names", []))
        self.calls = results.get("calls", {})

    def _record(self, target, x):
        cid = f"{target}.{digest(x)}"
        record = self.calls.get(cid)
        if record is None:
            raise Missing(f"no recorded output for {cid}")
        return cid, record

    def __getattr__(self, name):
        if name not in self.names or name.startswith("_"):
            raise AttributeError(name)
        if name in CODEC_REFERENCE:
            def call(x):
                cid, record = self._record(name, x)
                if "error" in record:
                    raise KitError(record.get("type", "Exception"), record["error"])
                return record["out"]
            return call
        if name in COMPRESSORS:
            kit = self

            class Replayed:
                @staticmethod
                def compress(x):
                    cid, record = kit._record(name, x)
                    if "error" in record and record.get("stage") != "decompress":
                        raise KitError(record.get("type", "Exception"), record["error"])
                    return record["packet"], _Ctx(cid)

                @staticmethod
                def decompress(packet, ctx):
                    record = kit.calls[ctx.cid]
                    if "error" in record:
                        raise KitError(record.get("type", "Exception"), record["error"])
                    return record["y"]
            return Replayed
        return Other("object")


def exhaustive(kit, work, inputs=range(0, 1 << 32), chunk=1 << 24, timeout=7200):
    """Every float32 input in `inputs` through the kit's encoders, in its sandbox: the kit
    returns a digest per chunk, the grader compares each with the reference's; the first chunk
    that differs is asked again, whole, to name the first input that breaks."""
    from . import sandbox, schema
    from .codec_checks import STEP, _hex
    from .checks import fail, ok
    from .kit_runs import release, run_kit, student_side
    functions = {"encode_e4m3": functools.partial(fp8_numpy.encode, fmt=E4M3),
                 "encode_fp16": fp16_numpy.encode}
    limits = sandbox.Limits(seconds=timeout)

    def ask(start, stop, raw):
        index = {"functions": list(functions), "start": start, "stop": stop, "chunk": chunk, "raw": raw}
        run = run_kit(kit, work, "exhaustive", student_side("exhaustive", "/grader/range", "/out/results"),
                      inputs={"range": (index, {})}, limits=limits)
        try:
            return schema.exhaustive_results(*schema.collect(run, "results", limits.read_bytes)) if run else None
        except (FileNotFoundError, Garbage):
            return None
        finally:
            release(Path(work) / "exhaustive")      # its folders, once read: the next ask remakes them

    results = ask(inputs.start, inputs.stop, False)
    if results is None or "import_error" in results:
        return fail(STEP, "exhaustive", "the exhaustive run gave no outputs (compression.py must "
                    "import and its encoders return).", "穷举检查没有得到结果。")
    for name, reference in functions.items():
        if results.get("errors", {}).get(name):
            return fail(STEP, "exhaustive", f"{name} raised {results['errors'][name]}.",
                        f"{name} 抛出异常 {results['errors'][name]}。")
        got = results.get("digests", {}).get(name, [])
        for i, start in enumerate(range(inputs.start, inputs.stop, chunk)):
            stop = min(start + chunk, inputs.stop)
            x = np.arange(start, stop, dtype=np.uint64).astype(np.uint32).view(np.float32)
            want = np.ascontiguousarray(reference(x))
            digest_want = hashlib.sha1(f"{want.dtype.str}:{want.shape}".encode() + want.tobytes()).hexdigest()
            if i < len(got) and got[i] == digest_want:
                continue
            again = ask(start, stop, True)
            out = (again or {}).get("raw", {}).get(name)
            if isinstance(out, np.ndarray):
                out = out.reshape(-1)
                bad = np.flatnonzero(out != want.reshape(-1)) if out.size == want.size else [0]
            else:
                bad, out = [0], None
            j = int(bad[0]) if len(bad) else 0
            shown = (f"{int(out[j]):#x}" if out is not None and out.size == want.size and out.dtype.kind in "iu"
                     else repr(out[j].item()) if out is not None and out.size == want.size else "no output")
            return fail(STEP, "exhaustive", f"{name} differs from the reference at float32 bits "
                        f"{_hex(x.view(np.uint32)[j], 8)}: want {int(want.reshape(-1)[j]):#x}, got {shown}.",
                        f"{name} 在 float32 位模式 {_hex(x.view(np.uint32)[j], 8)} 处与参考不同。")
    return ok(STEP, "exhaustive")


@functools.lru_cache(maxsize=1)
def check_names():
    """The names of step 2's checks, in order (for a kit whose run gave nothing to judge)."""
    return tuple(c.name for c in all_checks(_Recorder()))


__all__ = ["plan", "ReplayedKit", "KitError", "Missing", "Garbage", "all_checks", "np"]
