"""Stock Horovod for the sandboxes: the 0.28.1 sdist's own files, over the grader's build.

The grader's virtualenv holds Horovod built with the project's patches/series, whose course
patch is step 3b's answer (its horovod/torch/compression.py, mpi_ops.py, optimizer.py, and
their __pycache__). A sandbox must not read it. So every sandbox gets, bound over the venv's
horovod/ package, a folder made once per machine from the sdist's pristine Python files and
the venv's compiled ones (its C++, built with the given fixes: C++17 and Gloo's): stock
Horovod as the kit's README promises it, with no bytecode of the patched files anywhere.

The same cache holds the sdist unpacked (src/), bound read-only at /horovod-src: a kit's own
course patch is applied to those pristine files inside its sandbox (build_side.py).

Made atomically: built in a folder of a unique name (mkdtemp: per thread and process), renamed
into place whole; a reader takes only a folder under its final name, so a half-built one is
never used, and a builder that loses the race throws its copy away.
"""
import hashlib
import importlib.util
import os
import shutil
import stat
import tarfile
import tempfile
import threading
from pathlib import Path, PurePosixPath

from .patchfile import Tree

VERSION = "0.28.1"
TOP = f"horovod-{VERSION}"
SOURCE_INSIDE = "/horovod-src"          # the unpacked sdist, inside every sandbox
_LOCK = threading.Lock()


class PristineError(RuntimeError):
    """No pristine Horovod can be made (no sdist): the grader's set-up, not a kit's fault."""


def sdist():
    """The sdist scripts/setup.sh downloads and builds: HVD_COMPRESS_CACHE/sdist/."""
    base = os.environ.get("HVD_COMPRESS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                 "hvd-compress")
    return Path(base) / "sdist" / f"{TOP}.tar.gz"


def installed():
    """The venv's horovod package folder (found, not imported)."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.origin:
        raise PristineError("Horovod is not installed in the grader's virtualenv (scripts/setup.sh)")
    return Path(spec.origin).parent


def _key(package):
    archive = sdist()
    st = archive.stat()
    stamp = f"{archive}:{st.st_size}:{st.st_mtime_ns}:{package.resolve()}:" \
            f"{(package / '__init__.py').stat().st_mtime_ns}"
    return hashlib.sha256(stamp.encode()).hexdigest()[:16]


def folder():
    """The machine's pristine Horovod for this venv (made now if missing): src/horovod-0.28.1
    (the sdist unpacked) and site/horovod (the package to bind over the venv's)."""
    if not sdist().is_file():
        raise PristineError(f"no Horovod sdist at {sdist()} (scripts/setup.sh downloads it)")
    package = installed()
    root = _cache_root()
    final = root / f"{TOP}-{_key(package)}"
    if final.is_dir():
        return final
    with _LOCK:                             # threads of one grader build it once
        if final.is_dir():
            return final
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        work = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
        try:
            _unpack(work / "src")
            _site(work / "src" / TOP / "horovod", package, work / "site" / "horovod")
            for top, dirs, files in os.walk(work):
                os.chmod(top, 0o755)
                for name in files:
                    path = os.path.join(top, name)
                    if not os.path.islink(path) and not os.stat(path).st_mode & stat.S_IROTH:
                        os.chmod(path, os.stat(path).st_mode | stat.S_IROTH)
            try:
                os.rename(work, final)
            except OSError:
                if not final.is_dir():          # not another grader's copy: a real failure
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _cache_root():
    """Where the classroom's machine-level cache lives: below the folder HVD_CLASSROOM_CACHE
    names, else /var/tmp; tests point it at an empty folder."""
    return Path(os.environ.get("HVD_CLASSROOM_CACHE") or "/var/tmp") / "hvd-classroom-horovod"


def _unpack(dest):
    dest.mkdir(parents=True)
    with tarfile.open(sdist()) as archive:
        members = [m for m in archive.getmembers()
                   if (m.isfile() or m.isdir()) and PurePosixPath(m.name).parts[:1] == (TOP,)]
        archive.extractall(dest, members=members, filter="data")


def _site(pristine, package, dest):
    """The venv's package with every Python file the sdist has replaced by the sdist's, and no
    __pycache__: hard links to the venv's other files (copies across file systems: a link
    would resolve, inside the sandbox, to the very folder bound over it)."""
    for top, dirs, files in os.walk(package):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = Path(top).relative_to(package)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.endswith(".pyc"):
                continue
            own, stock = Path(top) / name, pristine / rel / name
            source = stock if name.endswith(".py") and stock.is_file() else own
            if os.path.islink(source):
                continue
            try:
                os.link(source, dest / rel / name)
            except OSError:
                shutil.copy2(source, dest / rel / name)


def binds():
    """[(source, dest)]: stock Horovod bound over the venv's, and the sdist at /horovod-src."""
    made = folder()
    return [(made / "site" / "horovod", installed()), (made / "src" / TOP, SOURCE_INSIDE)]


def tree():
    """patchfile.Tree of the sdist: its regular files and folders, paths inside horovod-0.28.1/."""
    src = folder() / "src" / TOP
    files, folders = set(), set()
    for top, dirs, names in os.walk(src):
        rel = Path(top).relative_to(src)
        if str(rel) != ".":
            folders.add(str(rel))
        files |= {str(rel / n) if str(rel) != "." else n for n in names
                  if not os.path.islink(os.path.join(top, n))}
    return Tree.of(files, folders)
