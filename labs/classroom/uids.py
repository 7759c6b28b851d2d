"""The sandboxes' user ids, unique across every grader process on the machine: a lock file per
user id under /run/hvd-classroom/uids, held (flock) while a sandbox runs as it.

Why a lock per id: RLIMIT_NPROC counts a user's processes machine-wide, and a kit's fork bomb
must count against its own sandbox only; so no two sandboxes running at once may share a user
id, whichever grader started them. A pool of each process's own (200000 + pid % 50000 * 16,
sixteen ids) was not enough: two graders whose pids are equal modulo 50000 (P and P + 50000
where pid_max is larger, or two graders that are each PID 1 or 7 of a container of their own)
gave their kits the same ids. An flock is the kernel's: it ends with the process that holds
it (a grader killed mid-class leaves no id taken), and two opens of one file conflict even in
one process, so the grader's own threads are kept apart by it too.

Each grader walks the pool from where its pid puts it (the range it used to have), one id
further at each sandbox: an id that just ended, whose killed processes the kernel may have yet
to reap, is the last this grader takes again. An id whose lock is free but that still has a
live process (a crashed grader's sandbox the kernel has not finished killing) is skipped.
"""
import errno
import fcntl
import os
import stat
import threading
from pathlib import Path

LOW = 200000                        # the first sandbox user id (docs/instructor.md)
POOL = 4096                         # ids of every grader together: 256 graders of 16 sandboxes
PER_GRADER = 16                     # sandboxes of one grader at once (UIDS in sandbox.py)
LOCKS = Path("/run/hvd-classroom/uids")


class UidError(RuntimeError):
    """No user id can be taken (the lock folder is not root's, or every id is in use)."""


_held = {}                          # uid -> the fd holding its lock
_used = set()                       # every id this process has handed out (processes_left)
_cursor = None                      # the next id to try, as an offset in the pool
_changed = threading.Condition()


def _lock_folder():
    """LOCKS, made if need be, and checked: a folder (no link) of root's that no one else may
    write, so that no user of the host can hold or forge an id's lock."""
    for folder in (LOCKS.parent, LOCKS):
        try:
            os.mkdir(folder, 0o755)
        except FileExistsError:
            pass
        except OSError as err:
            raise UidError(f"cannot make {folder} for the sandboxes' user id locks: {err}") from None
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise UidError(f"{folder} must be a folder of root's that only root may write (the "
                           f"sandboxes' user id locks): remove it and grade again")
    return LOCKS


def _live_uids():
    """User ids in the pool of every live (not zombie) process this host's /proc shows."""
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
            uid = int(fields["Uid"].split()[0])
        except (OSError, KeyError, ValueError):
            continue
        if LOW <= uid < LOW + POOL and not fields.get("State", "").strip().startswith("Z"):
            found.add(uid)
    return found


def _try(folder, uid):
    """The fd holding uid's lock, or None when another holds it."""
    fd = os.open(folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def take():
    """A user id no sandbox of any grader on the machine runs as, held until give_back (waits
    while this grader's PER_GRADER sandboxes run). Raises UidError."""
    global _cursor
    with _changed:
        while len(_held) >= PER_GRADER:
            _changed.wait()
        folder = _lock_folder()
        if _cursor is None:
            _cursor = (os.getpid() % (POOL // PER_GRADER)) * PER_GRADER
        live = _live_uids()
        for step in range(POOL):
            uid = LOW + (_cursor + step) % POOL
            if uid in _held or uid in live:
                continue
            fd = _try(folder, uid)
            if fd is None:
                continue
            if uid in _live_uids():     # a process of it started meanwhile: not ours to take
                os.close(fd)
                continue
            _cursor = (_cursor + step + 1) % POOL
            _held[uid] = fd
            _used.add(uid)
            return uid
        raise UidError(f"every sandbox user id ({LOW}-{LOW + POOL - 1}) is in use by the graders "
                       f"on this machine")


def give_back(uid):
    """Release a user id of take()'s (its sandbox has ended, every process of it killed)."""
    with _changed:
        fd = _held.pop(uid, None)
        if fd is not None:
            os.close(fd)                # the lock goes with the last fd of its open file
        _changed.notify()


def held():
    """The ids this process holds now."""
    with _changed:
        return set(_held)


def used():
    """Every id this process has handed out."""
    with _changed:
        return set(_used)
