"""MNIST's IDX files fetched from the mirrors torchvision uses, with no torchvision.

Why: torchvision cannot be installed beside the CPU torch the lab uses, so without this the
course's command (`python labs/mnist.py`) would find no MNIST on a fresh machine that is online.

* ``mirrors()``  the base URLs to try in order: HVD_COMPRESS_MNIST_MIRRORS (space-separated;
                 set but empty: no download at all, what the test suite sets) or MIRRORS.
* ``fetch()``    each file of a {name: md5} table that the folder lacks, from the first mirror
                 that serves it whole and with the right MD5.

A file reaches its final name only complete and verified: it is written to a temporary file in
the same folder, checked, then renamed. A dropped connection, a wrong MD5, a full disk: a
DownloadError that says what happened, and nothing left under the final name (nor the
temporary file). One process downloads at a time, under a lock file in the folder: every rank
of a job, and every job started at the same time, calls fetch(); the first downloads, the
others wait on the lock (not in a Horovod collective, which would time out on a slow link) and
then find the files there. A failed attempt is remembered in the folder, so the other ranks of
the same job (processes started before it failed) report it instead of each trying again; a
run started later tries again.

Plain standard library, no torch: it loads in a fraction of a second.
"""
from __future__ import annotations

import fcntl
import hashlib
import http.client
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

# torchvision's MNIST mirrors, in its order.
MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")
MIRRORS_ENV = "HVD_COMPRESS_MNIST_MIRRORS"
# Seconds a connection or a read may stall before the mirror counts as unreachable (offline,
# a host that drops packets): short, since an offline lab then trains on Fashion-MNIST.
TIMEOUT_S = 10
STARTED = time.time()       # this process's start, near enough: a failure after it is this job's
LOCK_NAME, FAILED_NAME = ".download.lock", ".download-failed.json"
CHUNK = 1 << 16


class DownloadError(RuntimeError):
    """No complete, verified copy could be had; nothing partial was left behind."""


class DiskError(DownloadError):
    """Writing the local copy failed (a full or read-only disk): no other mirror will help."""


def mirrors(environ=os.environ) -> tuple[str, ...]:
    """The base URLs to try, in order: HVD_COMPRESS_MNIST_MIRRORS where it is set (empty: none),
    else torchvision's."""
    if MIRRORS_ENV in environ:
        return tuple(environ[MIRRORS_ENV].split())
    return MIRRORS


def fetch(folder, sums: dict, bases=None, out=None) -> list:
    """Download each file of `sums` ({file name: md5 of the file}) that `folder` lacks; returns
    the paths fetched. Raises DownloadError, naming every mirror tried, on the first file no
    mirror serves whole (the files fetched before it stay: complete and verified). Progress goes
    to `out` (default: stdout)."""
    bases = mirrors() if bases is None else tuple(bases)
    out = sys.stdout if out is None else out
    if not bases:
        raise DownloadError(f"downloads are off ({MIRRORS_ENV} is set and empty)")
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DiskError(f"cannot create {folder}: {err}") from err
    fetched = []
    with _locked(folder):
        missing = {name: md5 for name, md5 in sums.items() if not (folder / name).is_file()}
        if not missing:
            return fetched
        _raise_recent_failure(folder, bases)
        try:
            for name, md5 in missing.items():
                fetched.append(_fetch_one(folder, name, md5, bases, out))
        except DownloadError as err:
            _remember_failure(folder, bases, str(err))
            raise
        (folder / FAILED_NAME).unlink(missing_ok=True)
    return fetched


@contextmanager
def _locked(folder):
    """Hold the folder's lock file (flock: released by the kernel if this process dies)."""
    try:
        lock = open(folder / LOCK_NAME, "a")
    except OSError as err:
        raise DiskError(f"cannot create the lock file in {folder}: {err}") from err
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _raise_recent_failure(folder, bases):
    """Another process failed with the same mirrors since this one started (a rank of the same
    job that took the lock first): say what it met instead of trying again."""
    try:
        failed = json.loads((folder / FAILED_NAME).read_text())
        when = float(failed["time"])
        same = failed["mirrors"] == list(bases)
    except (OSError, ValueError, KeyError, TypeError):
        return
    if same and when >= STARTED:
        raise DownloadError(f"{failed['error']} (met by process {failed.get('pid')} "
                            f"{time.time() - when:.0f} s ago)")


def _remember_failure(folder, bases, error):
    try:
        (folder / FAILED_NAME).write_text(json.dumps(
            {"time": time.time(), "mirrors": list(bases), "error": error, "pid": os.getpid()}))
    except OSError:
        pass                            # a full disk: the others will try and fail themselves


def _fetch_one(folder, name, md5, bases, out):
    problems = []
    for base in bases:
        url = urllib.parse.urljoin(base if base.endswith("/") else base + "/", name)
        try:
            return _download(url, folder / name, md5, out)
        except DiskError:
            raise
        except DownloadError as err:
            problems.append(f"{urllib.parse.urlsplit(url).netloc}: {err}")
    raise DownloadError(f"could not download {name} ({'; '.join(problems)})")


def _download(url, target, md5, out):
    """`url` into `target` through a temporary file in the same folder, renamed into place
    once complete and its MD5 is `md5`; the temporary file never outlives the call."""
    try:
        part = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.",
                                           suffix=".part", delete=False)
    except OSError as err:
        raise DiskError(f"cannot write in {target.parent}: {err}") from err
    try:
        with part:
            digest, size = _copy(url, part, target.name, out)
            try:
                part.flush()
                os.fsync(part.fileno())
            except OSError as err:
                raise DiskError(f"cannot write {target}: {err}") from err
        if digest != md5:
            raise DownloadError(f"md5 {digest}, expected {md5}: the file served is corrupt "
                                f"or another one")
        try:
            os.replace(part.name, target)
        except OSError as err:
            raise DiskError(f"cannot write {target}: {err}") from err
    except BaseException:
        Path(part.name).unlink(missing_ok=True)
        raise
    _say(out, f"downloaded {target} ({_size(size)}, md5 {md5} as expected)")
    return target


def _copy(url, stream, name, out):
    """Write what `url` serves into `stream`; returns (md5, bytes). A short body (the server
    closed early), an HTTP error or a timeout is a DownloadError; a failed write a DiskError."""
    digest, done = hashlib.md5(), 0
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            total = int(response.headers.get("Content-Length") or 0)
            progress = _Progress(out, f"downloading {url}", total)
            while True:
                chunk = response.read(CHUNK)
                if not chunk:
                    break
                try:
                    stream.write(chunk)
                except OSError as err:
                    progress.end()
                    raise DiskError(f"cannot write the download of {name} in "
                                    f"{Path(stream.name).parent}: {err}") from err
                digest.update(chunk)
                done += len(chunk)
                progress.update(done)
            progress.end()
    except DownloadError:
        raise
    except urllib.error.HTTPError as err:
        raise DownloadError(f"HTTP {err.code} {err.reason}") from err
    except urllib.error.URLError as err:
        raise DownloadError(str(err.reason)) from err
    except http.client.IncompleteRead as err:
        raise DownloadError(f"the connection closed after {done + len(err.partial):,} of "
                            f"{done + len(err.partial) + (err.expected or 0):,} bytes") from err
    except (OSError, http.client.HTTPException) as err:     # reset, timeout, bad response
        raise DownloadError(f"{type(err).__name__}: {err}" if str(err) else
                            type(err).__name__) from err
    if total and done != total:
        raise DownloadError(f"the connection closed after {done:,} of {total:,} bytes")
    return digest.hexdigest(), done


class _Progress:
    """One line: redrawn with \\r on a terminal; elsewhere (horovodrun's pipes, logs) printed
    at the start and each quarter."""

    def __init__(self, out, label, total):
        self.out, self.label, self.total = out, label, total
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.next_quarter, self.shown = 0, False
        self.update(0)

    def update(self, done):
        fraction = done / self.total if self.total else None
        if not self.tty:
            if fraction is None and self.shown:
                return
            if fraction is not None and fraction < self.next_quarter:
                return
            self.next_quarter = (int(fraction * 4) + 1) / 4 if fraction is not None else 2
        amount = (f"{_size(done, self.total).split()[0]} of {_size(self.total)} "
                  f"({100 * fraction:.0f}%)" if fraction is not None else _size(done))
        _say(self.out, f"{self.label}: {amount}", end="" if self.tty else "\n", redraw=self.tty)
        self.shown = True

    def end(self):
        if self.tty and self.shown:
            _say(self.out, "", end="\n")


def _size(n, scale=None):
    """n bytes in MB, or kB below 0.1 MB (in the unit that suits `scale` where given)."""
    return f"{n / 1e6:.1f} MB" if (scale or n) >= 100_000 else f"{n / 1e3:.1f} kB"


def _say(out, text, end="\n", redraw=False):
    if out is not None:
        print(("\r" + text) if redraw else text, end=end, file=out, flush=True)
