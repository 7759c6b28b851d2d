"""A class with two hostile kits against the same class without them: wall time of the grading.

    /work/bin/cpu-quiet .venv/bin/python results/classroom-timing/hostile.py ROUND

Appends one round (three gradings) to hostile-class.csv beside this file (one row per grading;
see README.md): one quiet hold per round. The class:
the demo's solution and 7 of its seeded mistakes (8 honest kits); the two hostile kits are
the solution with, at every import of its compression.py (every run of the kit), either 100
busy processes of their own sessions (the CPU hog) or files written until its sandbox's disk
refuses (the disk filler). Three classes are graded in turn, each round in a new order:
`honest` (the 8), `hostile` (the 8 and the 2), `bases` (the 8 and two plain solutions, the
hostile kits' own work without their tricks). Every grading runs the command, all steps, at
`--parallel 3` (the default), with the README's quick options; its sheet is kept to compare.
"""
import csv
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from labs.classroom import kit as classroom_kit                         # noqa: E402
from labs.classroom.mistakes import MISTAKES, seed                      # noqa: E402

HONEST = ["averaged_codes", "big_endian_fp16", "nan_inf_lost", "no_broadcast", "no_sampler",
          "no_saturation", "truncation"]
HOG = '''
import os as _os
for _ in range(100):                            # busy processes of their own sessions
    if _os.fork() == 0:
        _os.setsid()
        while True:
            pass
'''
FILLER = '''
import errno as _errno
_block, _i = b"x" * (1 << 20), 0
while True:                                     # files under any size limit, until refused
    try:
        with open(f"/tmp/fill{_i}", "wb") as _f:
            for _ in range(32):
                _f.write(_block)
    except OSError as _err:
        if _err.errno != _errno.EFBIG:
            break
    _i += 1
'''
QUICK = ["--train-samples", "512", "--test-samples", "200"]


def write_class(folder, which):
    folder.mkdir(parents=True)
    classroom_kit.install_solution(classroom_kit.init(folder / "solution"))
    by_name = {m.name: m for m in MISTAKES}
    for name in HONEST:
        seed(classroom_kit.init(folder / name), by_name[name])
    extra = {"hostile": {"cpu_hog": HOG, "disk_filler": FILLER},
             "bases": {"cpu_hog": "", "disk_filler": ""}}.get(which, {})
    for name, code in extra.items():
        kit = classroom_kit.install_solution(classroom_kit.init(folder / name))
        path = kit / "compression.py"
        path.write_text(path.read_text() + "\n" + code)
    return folder


def uptime():
    return float(Path("/proc/loadavg").read_text().split()[0])


def main(round_no):
    work = Path(tempfile.mkdtemp(prefix="classroom-hostile-"))
    work.chmod(0o755)
    rows = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    orders = [["honest", "hostile", "bases"], ["hostile", "bases", "honest"], ["bases", "honest", "hostile"]]
    try:
        for which in orders[(round_no - 1) % 3]:
            folder = write_class(work / which / "class", which)
            out = folder.parent / "grades"
            load = uptime()
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "labs.classroom", "grade", str(folder),
                                   *QUICK, "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            sheet = (out / "grades.csv").read_text() if (out / "grades.csv").is_file() else ""
            honest = "\n".join(line for line in sheet.splitlines()
                               if line.split(",", 1)[0] in ["solution", *HONEST])
            rows.append({"round": round_no, "class": which, "kits": len(list(folder.iterdir())),
                         "seconds": round(seconds, 1), "status": done.returncode,
                         "sheet": "yes" if sheet else "no",
                         "honest_rows_sha": hashlib.sha256(honest.encode()).hexdigest()[:12],
                         "load_start": load, "load_end": uptime(), "commit": commit})
            print(rows[-1], flush=True)
            if not sheet:
                print(done.stderr[-3000:], file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = HERE / "hostile-class.csv"
    new = not path.exists()
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return 0 if len({r["honest_rows_sha"] for r in rows}) == 1 else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
