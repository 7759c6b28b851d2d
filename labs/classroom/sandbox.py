"""Each kit graded in a sandbox of its own: bubblewrap (Debian's `bubblewrap`) namespaces, an
unprivileged user, limits on time, memory, processes and output size.

What a kit's code can reach inside (docs/instructor.md says the same for the instructor):
- read-write: /kit, a fresh copy of the kit (owned by the sandbox's user), /out (where the
  student side writes its raw outputs), a private /tmp;
- read-only: /usr and /etc (the system, Python, the data sets of Debian's packages), the
  grader's virtualenv (its Python, torch, Horovod; not the checkout it lives in), /grader (the
  student side, labs/classroom/student_side.py, and the inputs the grader sent), a --data-dir;
- nothing else: not the checkout (hvd_compress, labs, the solution), not the grader's output
  folder, not the other kits, no network (a namespace of its own, loopback only: the kit's own
  Horovod ranks talk over it), no other process (a PID namespace of its own).

The sandbox runs as a user id of its own outside (setpriv) and uid 1000 inside (bwrap's user
namespace): no capability, and RLIMIT_NPROC counts this sandbox's processes only. Memory and
processes: a cgroup (v1 memory + pids) when this host lets the grader make one, else
RLIMIT_AS; every file it writes (its stdout and stderr too) is capped by RLIMIT_FSIZE. Time:
the grader kills the sandbox's process group at the timeout, and --die-with-parent plus the
PID namespace take every process inside with it.
"""
import itertools
import re
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
INSIDE_UID = 1000
_counter = itertools.count()


@dataclass(frozen=True)
class Limits:
    seconds: float = 120            # wall time, then the whole sandbox is killed
    memory: int = 4 << 30           # bytes, every process of the sandbox together (cgroup)
    tasks: int = 512                # processes and threads (torch and Horovod run many)
    file_size: int = 256 * MiB      # the largest file it may write (stdout and stderr included)
    kit_size: int = 64 * MiB        # the largest kit the grader copies in
    read_bytes: int = 64 * MiB      # the most the grader reads of any file it collects


DEFAULT = Limits()


class SandboxError(RuntimeError):
    """The host cannot sandbox (no bwrap, no user namespaces): grading refuses to go on."""


def available():
    """None when this host can run a sandbox, else why not."""
    for tool in ("bwrap", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install bubblewrap util-linux)"
    return None


@dataclass
class Outcome:
    status: int | None              # exit status; None when killed at the timeout
    output: str                     # the head and the tail of its stdout + stderr
    seconds: float
    killed_by: str = ""             # "timeout", "memory", "signal N", "" (exited)
    output_bytes: int = 0
    oom: bool = False               # the sandbox's memory group killed a process (fork server)

    def how(self):
        """How it ended, in words (the same words for the same ending: no timings)."""
        if self.killed_by == "timeout":
            return "did not finish in time and was stopped"
        if self.killed_by == "memory":
            return "ran out of the memory it is allowed and was stopped"
        if self.killed_by == "file size":
            return "wrote more output than allowed and was stopped"
        if self.killed_by == "no fork":
            return "could not start: the kit's own processes filled its sandbox"
        if self.killed_by == "not run":
            return "never started: the kit's sandbox ended before it"
        if self.killed_by:
            return f"was killed ({self.killed_by})"
        return f"ended with exit status {self.status}"


def _readable_tree(path):
    """Every folder above `path` must let an unprivileged user through (bwrap opens its
    sources as the sandbox's user)."""
    for parent in [Path(path), *Path(path).parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            raise SandboxError(f"{parent} is not searchable by other users (mode {oct(mode)}): the "
                               f"sandbox's user cannot reach {path}")


MIRRORS = Path("/var/tmp/hvd-classroom-python")


def _reachable(path):
    try:
        _readable_tree(path)
        return True
    except SandboxError:
        return False


def python_base():
    """(source, path inside) of the Python the virtualenv was made from. When other users
    cannot reach it (pyenv under /root), a mirror of hard links (a copy across file systems)
    that they can, made once: its interpreter, libpython and standard library (without its
    site-packages and tests, which the virtualenv does not use)."""
    base = Path(sys.base_prefix)
    if str(base).startswith("/usr") or _reachable(base):
        return base, base
    mirror = MIRRORS / str(base).strip("/").replace("/", "_")
    if mirror.is_dir():
        return mirror, base
    MIRRORS.mkdir(parents=True, exist_ok=True)
    MIRRORS.chmod(0o755)
    tmp = Path(f"{mirror}.{os.getpid()}.tmp")
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    skip = {base / "lib" / version / "site-packages", base / "lib" / version / "test"}
    wanted = [base / "lib"] + sorted(p for p in (base / "bin").glob("python3*"))
    for top in wanted:
        for root, dirs, files in os.walk(top):
            root = Path(root)
            dirs[:] = [d for d in dirs if root / d not in skip and d != "__pycache__"]
            dest = tmp / root.relative_to(base) if root != top or top.is_dir() else tmp / "bin"
            dest.mkdir(parents=True, exist_ok=True)
            dest.chmod(0o755)
            for name in files:
                _link(root / name, dest / name)
        if top.is_file() or top.is_symlink():
            (tmp / "bin").mkdir(parents=True, exist_ok=True)
            _link(top, tmp / "bin" / top.name)
    try:
        os.replace(tmp, mirror)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)     # made meanwhile by another grader
    return mirror, base


def _link(src, dest):
    if src.is_symlink():
        os.symlink(os.readlink(src), dest)
        return
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)
    if not os.stat(dest).st_mode & stat.S_IROTH:
        os.chmod(dest, os.stat(dest).st_mode | stat.S_IROTH)


def _system_binds():
    args = []
    for top in ("/usr", "/etc"):
        args += ["--ro-bind", top, top]
    for link in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    return args


class _Cgroup:
    """A cgroup v1 memory + pids group for one sandbox, if this host lets us make one."""

    ROOT = Path("/sys/fs/cgroup")

    def __init__(self, name, limits):
        self.dirs = []
        for controller, settings in (("memory", {"memory.limit_in_bytes": limits.memory,
                                                 "memory.memsw.limit_in_bytes": limits.memory}),
                                     ("pids", {"pids.max": limits.tasks})):
            base = self.ROOT / controller
            if not base.is_dir() or not os.access(base, os.W_OK):
                continue
            folder = base / name
            try:
                folder.mkdir()
            except OSError:
                continue
            self.dirs.append(folder)
            for key, value in settings.items():
                try:
                    (folder / key).write_text(str(value))
                except OSError:
                    pass            # memsw needs swap accounting: memory alone still holds

    @property
    def memory(self):
        return any(d.parent.name == "memory" for d in self.dirs)

    def enter(self):
        for folder in self.dirs:
            (folder / "cgroup.procs").write_text(str(os.getpid()))

    def oom_killed(self):
        for folder in self.dirs:
            if folder.parent.name == "memory":
                try:
                    text = (folder / "memory.oom_control").read_text()
                except OSError:
                    return False
                kills = re.search(r"oom_kill (\d+)", text)
                return bool(kills and int(kills.group(1)))
        return False

    def close(self):
        """Kill what is left in the group (it is this sandbox's, by construction) and remove it."""
        for folder in self.dirs:
            for _ in range(500):                # up to 10 s: a fork bomb's children die slowly
                try:
                    pids = [int(p) for p in (folder / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.02)
            try:
                folder.rmdir()
            except OSError:
                pass


# a kit's own folders the sandbox does without: its virtualenv, runs, caches, version control
LEFT_OUT = (".venv", "runs", "__pycache__", ".grade", ".git")


def copy_kit(kit, dest, limits=DEFAULT):
    """A fresh copy of the kit's regular files and folders (links and devices left out), at
    most limits.kit_size bytes; None when it is larger."""
    kit, dest = Path(kit), Path(dest)
    total = 0
    for root, dirs, files in os.walk(kit):
        rel = Path(root).relative_to(kit)
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(root, d))
                         and not (rel == Path(".") and d in LEFT_OUT))
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            src = Path(root) / name
            st = src.lstat()
            if not stat.S_ISREG(st.st_mode):
                continue
            total += st.st_size
            if total > limits.kit_size:
                return None
            shutil.copyfile(src, dest / rel / name)
    return dest


def hand_over(folder, uid):
    """Give `folder` (and all in it) to the sandbox's user."""
    for root, dirs, files in os.walk(folder):
        os.chown(root, uid, uid)
        for name in files:
            os.chown(os.path.join(root, name), uid, uid)


def _uid_base():
    return 200000 + (os.getpid() % 50000) * 16


def new_uid():
    """A user id of its own for each sandbox: no process of another sandbox, of the grader or
    of anyone on the host counts against its RLIMIT_NPROC."""
    return _uid_base() + next(_counter) % 16


def processes_left():
    """The pids of this grader's sandboxes' processes still alive (their user ids: new_uid's);
    zombies not counted (a killed sandbox's init stays one until the host's init reaps it)."""
    low, left = _uid_base(), []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            uid = int(fields["Uid"].split()[0])
        except (OSError, KeyError, ValueError):
            continue
        if not fields.get("State", "").strip().startswith("Z") and low <= uid < low + 16:
            left.append(status.parent.name)
    return left


def hide_binds(hide):
    """bwrap's arguments that mask each path of `hide` ({path inside: a file to show there
    instead, or None}), placed after every other bind so that they cover what those bound: a
    file replaced by the one given, or by an empty read-only one (/dev/null), a folder by an
    empty read-only one. Paths that do not exist are left alone (nothing to mask)."""
    args = []
    for path, instead in sorted((hide or {}).items()):
        if instead is not None:
            args += ["--ro-bind", str(instead), str(path)]
        elif os.path.isdir(path):
            args += ["--tmpfs", str(path), "--remount-ro", str(path)]
        elif os.path.lexists(path):
            args += ["--ro-bind", "/dev/null", str(path)]
    return args


def run(command, *, kit_copy, out_dir, grader_dir, limits=DEFAULT, env=None, extra_ro=(),
        log_path, uid=None, report_path=None, hide=None):
    """`command` (argv) inside a sandbox, cwd /kit; its stdout + stderr go to log_path. With
    report_path, `command` is the sandbox's PID 1 (the fork server: fork_server.py) and its
    stdout goes to report_path, its stderr to log_path. hide: paths masked inside
    (hide_binds)."""
    why = available()
    if why:
        raise SandboxError(why)
    venv = Path(sys.prefix)
    for path in (venv, grader_dir, kit_copy, out_dir, *extra_ro):
        _readable_tree(path)
    base_source, base_inside = python_base()
    uid = new_uid() if uid is None else uid
    for folder in (kit_copy, out_dir):
        hand_over(folder, uid)
    binds = _system_binds() + ["--ro-bind", str(base_source), str(base_inside),
                               "--ro-bind", str(venv), str(venv),
                               "--bind", str(kit_copy), "/kit", "--bind", str(out_dir), "/out",
                               "--ro-bind", str(grader_dir), "/grader"]
    for path in extra_ro:
        binds += ["--ro-bind", str(path), str(path)]
    binds += hide_binds(hide)
    environment = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": "1",
                   "VIRTUAL_ENV": str(venv)}
    environment.update(env or {})
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
            "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            *(["--as-pid-1"] if report_path else []),
            "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID),
            *binds, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--chdir", "/kit", "--clearenv"]
    for key, value in environment.items():
        argv += ["--setenv", key, value]
    argv += ["--", *map(str, command)]
    group = _Cgroup(f"hvd-classroom-{os.getpid()}-{uid}", limits)

    def limit():                       # in the child, before setpriv and bwrap
        group.enter()
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.tasks, limits.tasks))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size, limits.file_size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if not group.memory:
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory, limits.memory))

    start = time.perf_counter()
    killed_by = ""
    with open(log_path, "wb") as log, open(report_path or os.devnull, "wb") as report:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=report if report_path else log,
                                stderr=log if report_path else subprocess.STDOUT,
                                start_new_session=True, preexec_fn=limit)
        try:
            status = proc.wait(timeout=limits.seconds)
        except subprocess.TimeoutExpired:
            killed_by = "timeout"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = None
    oom = group.oom_killed()
    group.close()
    if report_path:                     # the runs' endings are in the report: oom says
        return Outcome(status, read_text(log_path, 4000, tail=True), time.perf_counter() - start,
                       killed_by or ("memory" if oom else ""), os.path.getsize(log_path), oom=oom)
    seconds = time.perf_counter() - start
    if not killed_by and status is not None and status < 0:
        killed_by = {signal.SIGXFSZ: "file size"}.get(-status, f"signal {-status}")
    if not killed_by and status == 128 + signal.SIGXFSZ:
        killed_by = "file size"
    if oom and killed_by != "timeout":
        killed_by = "memory"
    size = os.path.getsize(log_path)
    return Outcome(status, read_text(log_path, 4000, tail=True), seconds, killed_by, size)


def read_bytes(path, limit=DEFAULT.read_bytes):
    """At most `limit` bytes of a regular file the sandbox wrote (None if it is not one, or
    is larger: the grader never reads without a bound)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        return None
    with open(path, "rb") as handle:
        return handle.read(limit)


def read_text(path, limit, tail=False):
    """The head (or the tail) of a text file, at most `limit` bytes, never the whole of a flood."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return ""
        with open(path, "rb") as handle:
            if tail and st.st_size > limit:
                handle.seek(st.st_size - limit)
            return handle.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def inside(path, root):
    """True when `path`, every link resolved, lies inside `root` (a kit's copy may hold links
    that point anywhere on the grader's side)."""
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)
