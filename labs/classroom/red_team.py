"""The grader's own red team: kits that want the marks without the work, or want to spoil
someone else's. Each is a seeded kit (mistakes.py's machinery: code appended to the kit's
compression.py, which runs when the student side imports it) on the untouched kit or on the
solution, with what its honest grade must say. tests/test_classroom_red_team.py grades them
beside the solution and an honest failing kit: each gets its honest grade with its reason,
and the other kits' rows are byte for byte those of grading them alone.
"""
from dataclasses import dataclass

from .kit import init, install_solution


@dataclass(frozen=True)
class Trick:
    name: str
    base: str           # "untouched" or "solution": the kit the trick is planted in
    code: str           # appended to compression.py
    words: str          # words every failing codec check's reason must hold ("" : all pass)


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
]
BY_NAME = {t.name: t for t in TRICKS}


def plant(folder, trick):
    """A kit at `folder` with the trick in its compression.py."""
    folder = init(folder)
    if trick.base == "solution":
        install_solution(folder)
    path = folder / "compression.py"
    path.write_text(path.read_text() + "\n" + trick.code)
    return folder
