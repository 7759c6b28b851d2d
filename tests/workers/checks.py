"""Tiny assertion log for worker scripts that run under horovodrun.

Each rank appends `name` per passed check to $HVDC_CHECK_DIR/rank<r>.txt (stdout of several
MPI ranks interleaves on one line, so the tests read these files instead), and raises on the
first failure so the launcher exits non-zero.
"""
import os

_rank = None


def start(rank):
    global _rank
    _rank = rank
    _path().write_text("")


def _path():
    from pathlib import Path
    return Path(os.environ["HVDC_CHECK_DIR"]) / f"rank{_rank}.txt"


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"rank {_rank}: {name} failed {detail}")
    with open(_path(), "a") as f:
        f.write(name + "\n")


def done():
    check("ALL CHECKS DONE", True)
