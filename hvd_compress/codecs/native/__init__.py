"""The C++ block kernel (blocks.cpp): compiled once per user, on first use, into a cache.

    hvd-compress-build-kernel      # build it now (scripts/setup.sh does), then check it
                                   # (python -m hvd_compress.codecs.native is the same)

The sources ship with the package, so a plain `pip install` has everything to build it. The
library lives in CACHE_ROOT/<name>-<key>/, the key a hash of the sources, the flags, torch's
version and Python's; another torch or an edited source gets a folder of its own. `module()`
loads it, building it first where it is missing: under a file lock, so that of several ranks
starting at once one compiles (with a one-line message on stderr: a C++ compile, seconds on
idle cores and minutes on busy ones) and the others wait and load its library. Never at
import: a process builds when it first codes a bucket. A build removes the kernels of older
sources for the same torch and Python. Where no C++ compiler or ninja is found, or the build
failed before (its log is the folder's FAILED file; `hvd-compress-build-kernel` tries again),
`module()` returns None and codecs/blocks.py runs its pure-torch path, the reference the kernel
is tested against bit for bit, with one warning that says why.

HVD_COMPRESS_NATIVE=0 switches the kernel off; HVD_COMPRESS_F16C=0 keeps its portable loops on a
CPU with AVX2 and F16C (kernels_x86.h otherwise); HVD_COMPRESS_CACHE moves the cache (default
~/.cache/hvd-compress, where scripts/setup.sh also keeps its Horovod wheels); CXX names the
compiler (torch's cpp_extension reads it).
"""
import fcntl
import functools
import glob
import hashlib
import os
import platform
import shutil
import sys
import threading

__all__ = ["module", "built", "build", "prune_stale", "why_missing", "kernel_dir", "SOURCES",
           "FORMATS"]

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, f) for f in ("blocks.cpp", "kernels.h", "kernels_x86.h")]  # hashed into the key
NAME = "hvdc_blocks"
FORMATS = ("e4m3fn", "float16")
# -O3 and -fno-trapping-math let GCC vectorise the branch-free loops (blocks.cpp says why each
# flag is safe for exactness); AVX2 clones are chosen at run time, so no -march=native: the
# library must run on whichever x86-64 runs the tests. -fopenmp: at::parallel_for's threads.
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
_BUILDING = threading.Lock()       # threads of one process; the file lock orders processes


def cache_root():
    """Where the built kernels live: HVD_COMPRESS_CACHE/kernels, else ~/.cache/hvd-compress/kernels
    (the same root as scripts/setup.sh, so its prebuilt kernel is the one every process loads)."""
    base = os.environ.get("HVD_COMPRESS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                 "hvd-compress")
    return os.path.join(base, "kernels")


def _tag():
    """What the library must have been built from: sources, flags, torch, Python, machine."""
    import torch
    digest = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for path in SOURCES:
        with open(path, "rb") as f:
            digest.update(f.read())
    return (f"{digest.hexdigest()[:16]} torch {torch.__version__} "
            f"{sys.implementation.cache_tag} {platform.machine()}")


def kernel_dir():
    """This source's and this torch's folder in the cache."""
    key = hashlib.sha256(_tag().encode()).hexdigest()[:16]
    return os.path.join(cache_root(), f"{NAME}-{key}")


def built(build_dir=None):
    """The path of the library in `build_dir` (default kernel_dir()) if it was built from these
    sources for this torch, else None. Builds nothing (HVD_COMPRESS_NATIVE plays no part:
    scripts/setup.sh asks this)."""
    build_dir = build_dir or kernel_dir()
    try:
        with open(os.path.join(build_dir, "TAG")) as f:
            if f.read().strip() != _tag():
                return None
    except OSError:
        return None
    found = glob.glob(os.path.join(build_dir, NAME + "*.so"))
    return found[0] if found else None


def _ninja_dir():
    """The folder of a ninja binary (torch's cpp_extension builds with it): PATH's, else the
    `ninja` package's (a dependency; its script is not on PATH when the venv is not activated)."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja
    except ImportError:
        return None
    return ninja.BIN_DIR if os.path.exists(os.path.join(ninja.BIN_DIR, "ninja")) else None


def _toolchain_missing():
    """Why this machine cannot build the kernel ('no C++ compiler ...'), or None if it can."""
    compiler = os.environ.get("CXX", "c++")
    if not shutil.which(compiler):
        return f"no C++ compiler found ({compiler!r}; set CXX or install g++)"
    if not shutil.which("ninja") and _ninja_dir() is None:
        return "no ninja found (pip install ninja)"
    return None


def why_missing():
    """Why module() has no kernel ('' when it has one): what the warning of blocks.py says."""
    if os.environ.get("HVD_COMPRESS_NATIVE", "1") == "0":
        return "switched off (HVD_COMPRESS_NATIVE=0)"
    if module() is not None:
        return ""
    failed = os.path.join(kernel_dir(), "FAILED")
    if os.path.exists(failed):
        return f"its build failed (log: {failed})"
    return _toolchain_missing() or f"it could not be built into {kernel_dir()}"


@functools.lru_cache(maxsize=None)
def module():
    """torch.ops.hvdc (encode, decode_accumulate, encode_values, ...), built first if this
    source has no library in the cache yet; None when switched off by HVD_COMPRESS_NATIVE=0 or
    when it cannot be built here (why_missing() says why)."""
    if os.environ.get("HVD_COMPRESS_NATIVE", "1") == "0":
        return None
    path = built() or _build_on_first_use()
    if path is None:
        return None
    import torch
    torch.ops.load_library(path)
    return torch.ops.hvdc


def _build_on_first_use():
    """Build into kernel_dir() unless another process has (or its build failed): one process
    compiles, the others wait on the lock, then find its library."""
    if _toolchain_missing():
        return None
    build_dir = kernel_dir()
    try:
        with _BUILDING, _locked(build_dir):
            if built(build_dir) or os.path.exists(os.path.join(build_dir, "FAILED")):
                return built(build_dir)
            print(f"hvd_compress: compiling the native codec kernel once, into {build_dir} "
                  "(a C++ compile: seconds on idle cores, minutes on busy ones; other "
                  "processes wait for it)", file=sys.stderr, flush=True)
            return _build_locked(build_dir, verbose=False)
    except Exception:               # a failed build (FAILED says why), an unwritable cache
        return None                 # the torch path runs, and blocks.py warns once


class _locked:
    """An exclusive flock on build_dir's `.lock` (made with its folders). The OS drops it when
    its holder exits, so a rank killed mid-build leaves no lock behind (torch's own lock file,
    FileBaton, would stay and make every later build wait for ever)."""

    def __init__(self, build_dir):
        self.path = os.path.join(build_dir, ".lock")

    def __enter__(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)          # closing releases the flock


def build(verbose=False, build_dir=None):
    """Compile blocks.cpp into `build_dir` (default kernel_dir()) now, under the same lock as a
    first use, even where an earlier build failed. Returns the library's path."""
    build_dir = build_dir or kernel_dir()
    with _BUILDING, _locked(build_dir):
        path = _build_locked(build_dir, verbose)
    module.cache_clear()
    return path


def _build_locked(build_dir, verbose):
    """torch's cpp_extension.load (which also loads the library into this process), TAG written
    last: a reader takes the library only once TAG says it is whole; a failure is written to
    FAILED instead. The caller holds the lock."""
    from torch.utils.cpp_extension import load
    for stale in ("TAG", "FAILED", "lock"):     # lock: torch's own baton, left by a killed build
        if os.path.exists(os.path.join(build_dir, stale)):
            os.remove(os.path.join(build_dir, stale))
    ninja_dir = _ninja_dir()
    path_before = os.environ.get("PATH", "")
    if ninja_dir:
        os.environ["PATH"] = ninja_dir + os.pathsep + path_before
    try:
        load(name=NAME, sources=SOURCES[:1], build_directory=build_dir, extra_cflags=list(CFLAGS),
             extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=verbose)  # load() edits them
    except Exception as e:          # recorded: later processes take the torch path at once
        with open(os.path.join(build_dir, "FAILED"), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n")
        raise
    finally:
        os.environ["PATH"] = path_before
    with open(os.path.join(build_dir, "TAG"), "w") as f:
        f.write(_tag() + "\n")
    prune_stale(build_dir)
    return built(build_dir)


def prune_stale(build_dir=None):
    """Remove the cache's kernels built from other sources for this same torch, Python and
    machine (an upgrade of this package left them; nothing here can load them again), each
    under its own lock, skipped while another process holds it. Kernels of another torch or
    Python (another venv sharing the cache) stay. Returns the folders removed."""
    build_dir = build_dir or kernel_dir()
    ours = _tag().split(" ", 1)
    removed = []
    for other in glob.glob(os.path.join(cache_root(), NAME + "-*")):
        if os.path.abspath(other) == os.path.abspath(build_dir):
            continue
        try:
            with open(os.path.join(other, "TAG")) as f:
                theirs = f.read().strip().split(" ", 1)
        except OSError:
            continue                # mid-build, or failed: not provably stale
        if len(theirs) != 2 or theirs[1] != ours[1] or theirs[0] == ours[0]:
            continue
        fd = os.open(os.path.join(other, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:
            shutil.rmtree(other, ignore_errors=True)
            removed.append(other)
        finally:
            os.close(fd)
    return removed
