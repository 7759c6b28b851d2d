"""The student's kit: `python -m labs.classroom init DIR` writes it; no solution in it.

What it holds (labs/classroom/kit_files, and three of the project's patches):
train.py (pytorch/examples' MNIST trainer, serial, reading the lab's offline data),
compression.py (the codecs, compressors and exchange to write, the spec in its docstring),
kitlog.py, data.py and report.py (given helpers), report_template.md, README.md (the steps),
patches/ (series, the C++17 and Gloo fixes applied by the project's setup, the course's patch
left to write).
"""
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT_FILES = Path(__file__).resolve().parent / "kit_files"
SOLUTION_FILES = Path(__file__).resolve().parent / "solution_files"
GIVEN_PATCHES = ("series", "build-cxx17.patch", "gloo-post-receives-first.patch")
COURSE_PATCH = "course-bit8-bit16.patch"


class KitError(RuntimeError):
    pass


def init(folder, force=False):
    """Write a fresh kit into `folder` (which must be empty or absent unless force)."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not force:
        raise KitError(f"{folder} is not empty: a kit is written into a new folder "
                       f"(--force overwrites the kit's files, never other files)")
    shutil.copytree(KIT_FILES, folder, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in GIVEN_PATCHES:
        shutil.copyfile(ROOT / "patches" / name, folder / "patches" / name)
    return folder


def install_solution(folder):
    """Put the course's solution into a kit: the grader's own test (never handed out)."""
    folder = Path(folder)
    if not (folder / "compression.py").is_file():
        raise KitError(f"{folder} is not a kit (no compression.py): run init first")
    for path in SOLUTION_FILES.glob("*.py"):
        shutil.copyfile(path, folder / path.name)
    shutil.copyfile(SOLUTION_FILES / COURSE_PATCH, folder / "patches" / COURSE_PATCH)
    return folder


def is_kit(folder):
    folder = Path(folder)
    return (folder / "compression.py").is_file() and (folder / "train.py").is_file()
