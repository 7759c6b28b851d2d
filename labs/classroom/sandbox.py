"""Each kit graded in a sandbox of its own: bubblewrap (Debian's `bubblewrap`) mount, PID,
network, IPC and UTS namespaces, an unprivileged user, limits on time, CPU, memory, processes
and disk.

What a kit's code can reach inside (docs/instructor.md says the same for the instructor):
- read-write: /kit, a fresh copy of the kit (owned by the sandbox's user), /out (where the
  student side writes its raw outputs), /tmp; the three on one tmpfs of the sandbox's own
  (Scratch), whose size and file count are the sandbox's disk limit;
- read-only: /usr and /etc (the system, Python, the data sets of Debian's packages), the
  grader's virtualenv (its Python, torch, Horovod: stock Horovod's Python files, pristine.py,
  over the venv's own, which the project's course patch changed) and the Python it was made
  from, /grader (the student side, the fork server, the inputs the grader sent), /horovod-src
  (Horovod's pristine sdist, for a kit's own build), a --data-dir;
- nothing else: not the checkout (hvd_compress, labs, the solution), not the grader's output
  folder, not the other kits, no network (a namespace of its own, loopback only: the kit's own
  Horovod ranks talk over it), no other process (a PID namespace of its own).

Who does what: bwrap runs as the grader's root, so that it can mount the virtualenv and its
interpreter wherever they are (a clone under /root, a folder only root may pass); inside, the
sandbox's first process drops to a user id of its own (setpriv: every uid, gid and group, no
capability, no_new_privs) before any code of the grader's student side or of the kit runs. So
nothing in a sandbox is root anywhere, and RLIMIT_NPROC counts this sandbox's processes only:
no two sandboxes running at once, of any grader on the machine, share a user id (uids.py).

Limits, and why these mechanisms (this host offers cgroup v1; a fresh Debian offers v2: both
are taken, whichever this host mounts, else rlimits alone):
- CPU: a cgroup of its own per sandbox (v1 `cpu`, v2 `cpu.weight`), all of equal weight: the
  kernel shares the cores between the sandboxes, not between their processes, so a kit that
  forks 100 busy processes gets one sandbox's share, never 100 processes' worth of the cores
  beside an honest kit. A share, not a cap: an idle machine lends a kit all of it. And on v1 a
  second group per sandbox, `cpu.idle` (SCHED_IDLE beside every other process of the host):
  the fork server moves into it every process of the sandbox it did not start itself (a kit's
  own subprocesses, the setsid processes of a hog), which then run only on cycles nobody else
  wants; a group's share counts its processes together, so without it a hog would still hold
  a whole sandbox's share of the cores for as long as its kit is graded.
- memory and processes: the same group's memory and pids controllers (else RLIMIT_AS);
  RLIMIT_NPROC as well, for the sandbox's user.
- disk: a tmpfs per sandbox (size= and nr_inodes=) holding /kit, /out and /tmp, so that the
  total bytes and the file count of everything the sandbox writes are bounded by the kernel,
  not by a scan after the fact; RLIMIT_FSIZE still caps each file. Its pages are charged to
  the sandbox's memory group as they are written, so disk and memory together stay within
  the memory limit too. (A loop-mounted image would keep the data off RAM, at the cost of a
  file system made per sandbox; a kit's files are small, so RAM it is.)
- time: the grader kills the sandbox's process group at the timeout, and --die-with-parent,
  the PID namespace and the cgroup take every process inside with it.
"""
import atexit
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import nofollow, uids

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    seconds: float = 120            # wall time, then the whole sandbox is killed
    memory: int = 4 << 30           # bytes, every process of the sandbox and its tmpfs together
    tasks: int = 512                # processes and threads (torch and Horovod run many)
    file_size: int = 256 * MiB      # the largest file it may write (stdout and stderr included)
    disk: int = 1 << 30             # bytes of /kit, /out and /tmp together
    files: int = 20000              # files and folders of /kit, /out and /tmp together
    kit_size: int = 64 * MiB        # the largest kit the grader copies in
    kit_files: int = 2000           # the most files and folders of a kit it copies in
    read_bytes: int = 64 * MiB      # the most the grader reads of any file it collects


DEFAULT = Limits()


class SandboxError(RuntimeError):
    """The grader cannot run a sandbox (no bwrap, not root, a mount refused): grading stops
    with this, for the instructor; no kit is ever told it."""


def available():
    """None when this host can run a sandbox, else why not."""
    for tool in ("bwrap", "setpriv", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install bubblewrap util-linux mount)"
    if os.geteuid() != 0:
        return ("the grader runs as root: it mounts each sandbox's folders and gives each "
                "sandbox a user id of its own")
    return None


# --- the sandbox's writable folders: one tmpfs, its size and inodes the disk limit ----------

_MOUNTED = set()
_MOUNTED_LOCK = threading.Lock()


class Scratch:
    """A tmpfs of the sandbox's own at `path` (on the grader's side), mounted by the grader:
    kit/, out/, tmp/ and grader/ inside it. It outlives the sandbox so that the grader can
    read what came back; release() (or release_under, or the grader's exit) unmounts it."""

    def __init__(self, path, limits):
        self.path = Path(path)
        release(self.path)
        if self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)    # (a mount point left by a killed grader stays)
        self.path.mkdir(parents=True, exist_ok=True)
        options = (f"size={limits.disk},nr_inodes={limits.files},mode=0711,uid=0,gid=0,"
                   f"nosuid,nodev")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "hvd-classroom", str(self.path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SandboxError(f"cannot mount a tmpfs for a sandbox at {self.path}: "
                               f"{done.stderr.strip() or done.stdout.strip()}")
        with _MOUNTED_LOCK:
            _MOUNTED.add(self.path)

    def full(self):
        """True when the sandbox's disk is (all but) full: its bytes or its files."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < MiB or st.f_favail < 16


def release(path):
    """Unmount the Scratch at `path`, if it is one of ours."""
    path = Path(path)
    with _MOUNTED_LOCK:
        if path not in _MOUNTED:
            return
        _MOUNTED.discard(path)
    subprocess.run(["umount", "--lazy", str(path)], capture_output=True)


def release_under(folder):
    """Unmount every Scratch below `folder` (a kit's or a class's work folder)."""
    folder = Path(folder)
    with _MOUNTED_LOCK:
        found = [p for p in _MOUNTED if p == folder or folder in p.parents]
    for path in found:
        release(path)


@atexit.register
def _release_all():
    for path in list(_MOUNTED):
        release(path)


# --- mounts ------------------------------------------------------------------------------------

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


def _bind(source, dest, made, writable=False):
    """bwrap's arguments binding `source` at `dest`, each folder above `dest` made first with
    mode 0755 (bwrap copies the mode of the host's folder: /root's 0700 would shut the
    sandbox's user out of a venv bound below it)."""
    args = []
    for parent in map(str, reversed(Path(dest).parents)):
        if parent in ("/", "/tmp") or parent in made or parent.startswith(("/usr", "/etc")):
            continue                    # the system's folders are the host's, whole
        args += ["--perms", "0755", "--dir", parent]
        made[parent] = "folder"
    args += ["--bind" if writable else "--ro-bind", str(source), str(dest)]
    made[str(dest)] = "bound"
    return args


def _interpreter_binds(made):
    """The virtualenv and the Python it was made from, each at its own path."""
    venv, base = Path(sys.prefix), Path(sys.base_prefix)
    args = []
    for path in dict.fromkeys([base, Path(os.path.realpath(base)), venv]):
        if str(path).startswith(("/usr/", "/etc/")) or str(path) == "/usr":
            continue
        args += _bind(path, path, made)
    return args


def mounts(kit_copy, out_dir, tmp_dir, grader_dir, extra_ro=(), ro_binds=()):
    """bwrap's mount arguments, in order: the system, /proc, /dev, /tmp first (a bind below
    /tmp, the venv of a clone under /tmp, must come after it or the tmpfs would hide it),
    then the interpreter, stock Horovod over the venv's, the kit's folders, what the grader
    sends; a caller's masks (bound over any of these) go last."""
    from . import pristine
    made = {}
    args = _system_binds() + ["--proc", "/proc", "--dev", "/dev"]
    args += ["--bind", str(tmp_dir), "/tmp"]
    made["/tmp"] = "bound"
    args += _interpreter_binds(made)
    for source, dest in pristine.binds():
        args += ["--ro-bind", str(source), str(dest)]
    args += _bind(kit_copy, "/kit", made, writable=True) + _bind(out_dir, "/out", made, writable=True)
    args += _bind(grader_dir, "/grader", made)
    for path in extra_ro:
        args += _bind(path, path, made)
    for source, dest in ro_binds:
        args += _bind(source, dest, made)
    return args


# --- cgroups: CPU share, memory, processes ------------------------------------------------------

IDLE_PROCS = "/idle.procs"             # inside: the idle group's cgroup.procs (fork_server.py)


class _Cgroup:
    """A sandbox's own cgroup: v1's cpu, cpuacct, memory and pids controllers where this host
    mounts them (below the grader's own group in each, so a limit the host put on the grader
    still holds), else v2's with cpu, memory and pids; none when the host lets us make none
    (rlimits then stand alone). On v1, `idle`: the sandbox's idle CPU group beside it, whose
    cgroup.procs the sandbox's user may write (it can move its own processes there, no others,
    and none out: the file of the sandbox's main group is not in reach).

    Named for the sandbox's user id, which this grader holds the machine-wide lock of
    (uids.py): a folder of that name already there is no live sandbox's but one an earlier
    grading left (a grader killed before it closed its groups, a group whose processes would
    not die): it is emptied and removed, then made afresh. Where it cannot be, or a limit
    cannot be set, SandboxError: a kit never runs without the limits its group should hold."""

    ROOT = Path("/sys/fs/cgroup")

    def __init__(self, name, limits, uid=None):
        self.dirs = {}                  # controller ("cpu", "memory", "pids", "cpuacct", "v2") -> folder
        self.idle = None                # the v1 idle group's folder
        self.made = []                  # every folder made, to remove at close
        try:
            self._groups(name, limits, uid)
        except SandboxError:
            self.close()
            raise

    def _groups(self, name, limits, uid):
        own = _own_groups()
        v1 = {"cpu": {"cpu.shares": 1024},
              "cpuacct": {},
              "memory": {"memory.limit_in_bytes": limits.memory,
                         "memory.memsw.limit_in_bytes": limits.memory},
              "pids": {"pids.max": limits.tasks}}
        for controller, settings in v1.items():
            base = self.ROOT / controller
            if not (base / "cgroup.procs").is_file():
                continue
            folder = base / own.get(controller, "").strip("/") / name
            if self._make(folder, settings):
                self.dirs[controller] = folder
        if "cpu" in self.dirs and uid is not None:
            idle = self.dirs["cpu"].with_name(name + "-idle")
            if self._make(idle, {"cpu.idle": 1}):
                try:
                    if (idle / "cpu.idle").read_text().strip() != "1":
                        (idle / "cpu.shares").write_text("2")       # a kernel before cpu.idle
                    os.chown(idle / "cgroup.procs", uid, uid)
                    self.idle = idle
                except OSError:
                    self.made.remove(idle)
                    idle.rmdir()
        if not self.dirs and (self.ROOT / "cgroup.controllers").is_file():
            self._v2(name, limits)

    def _v2(self, name, limits):
        try:
            wanted = {"cpu", "memory", "pids"} & set((self.ROOT / "cgroup.controllers").read_text().split())
            (self.ROOT / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
        except OSError:
            return
        folder = self.ROOT / name
        if self._make(folder, {"cpu.weight": 100, "memory.max": limits.memory,
                               "memory.swap.max": 0, "pids.max": limits.tasks}):
            self.dirs["v2"] = folder

    # settings a host may lack: swap accounting (memory alone still holds), cpu.idle (a kernel
    # before 5.15: the idle group gets a share of 2 instead); every other one is a limit
    OPTIONAL = ("memory.memsw.limit_in_bytes", "memory.swap.max", "cpu.idle")

    def _make(self, folder, settings, optional=OPTIONAL):
        """Make `folder` with `settings`: True; False where the host lets no group be made there
        (rlimits stand in). Raises SandboxError for a stale folder that cannot be removed, or a
        limit that cannot be set."""
        try:
            folder.mkdir()
        except FileExistsError:
            _remove_stale(folder)
            try:
                folder.mkdir()
            except OSError as err:
                raise SandboxError(f"cannot make the sandbox's cgroup {folder}: {err}") from None
        except OSError:
            return False
        self.made.append(folder)
        for key, value in settings.items():
            try:
                (folder / key).write_text(str(value))
            except OSError as err:
                if key not in optional:
                    raise SandboxError(f"cannot set {key} of the sandbox's cgroup {folder} to "
                                       f"{value}: {err}") from None
        return True

    @property
    def memory(self):
        return "memory" in self.dirs or "v2" in self.dirs

    def enter(self):
        for folder in self.dirs.values():
            (folder / "cgroup.procs").write_text(str(os.getpid()))

    def cpu_seconds(self):
        """CPU time every process of the sandbox used (None where no group counts it)."""
        try:
            if "cpuacct" in self.dirs:
                return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
            if "v2" in self.dirs:
                stat_text = (self.dirs["v2"] / "cpu.stat").read_text()
                return int(re.search(r"usage_usec (\d+)", stat_text).group(1)) / 1e6
        except (OSError, AttributeError, ValueError):
            pass
        return None

    def oom_killed(self):
        name, folder = (("memory.oom_control", self.dirs["memory"]) if "memory" in self.dirs else
                        ("memory.events", self.dirs["v2"]) if "v2" in self.dirs else (None, None))
        if folder is None:
            return False
        try:
            kills = re.search(r"oom_kill (\d+)", (folder / name).read_text())
        except OSError:
            return False
        return bool(kills and int(kills.group(1)))

    def close(self):
        """Kill what is left in the group (it is this sandbox's, by construction) and remove it."""
        for folder in self.made:
            _empty(folder)
            try:
                folder.rmdir()
            except OSError:
                pass


def _empty(folder):
    """Kill every process in the cgroup `folder` (and its subgroups), up to 10 s: a fork bomb's
    children die slowly."""
    for _ in range(500):
        pids = []
        for procs in [folder / "cgroup.procs", *folder.glob("**/cgroup.procs")]:
            try:
                pids += [int(p) for p in procs.read_text().split()]
            except (OSError, ValueError):
                pass
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _remove_stale(folder):
    """Remove a cgroup an earlier grading left at `folder` (its name is a user id this grader
    holds the lock of: no live sandbox's), every process in it killed; SandboxError where it
    cannot be."""
    _empty(folder)
    try:
        for sub in sorted((p for p in folder.glob("**/") if p != folder), key=lambda p: -len(p.parts)):
            sub.rmdir()
        folder.rmdir()
    except OSError as err:
        raise SandboxError(f"a sandbox's cgroup {folder} is left from an earlier grading and "
                           f"cannot be removed ({err}): kill the processes in its cgroup.procs, "
                           f"remove it (rmdir) and grade again") from None


def cgroup_name(uid):
    """The name of the cgroups of a sandbox running as `uid` (its idle group's: NAME-idle): a
    user id this grader holds the lock of (uids.py), so no live sandbox of any grader has it."""
    return f"hvd-classroom-{uid}"


def _own_groups():
    """{v1 controller: the grader's own group's path} from /proc/self/cgroup."""
    found = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                if controller:
                    found[controller] = path
    except (OSError, ValueError):
        pass
    return found


# --- the kit's files in, the sandbox's user -------------------------------------------------------

# a kit's own folders the sandbox does without: its virtualenv, runs, caches, version control
LEFT_OUT = (".venv", "runs", "__pycache__", ".grade", ".git")


def copy_kit(kit, dest, limits=DEFAULT):
    """A fresh copy of the kit's regular files and folders (links, FIFOs and devices left out,
    never followed), at most limits.kit_size bytes and limits.kit_files entries; None when it
    is larger."""
    kit, dest = Path(kit), Path(dest)
    total, count = 0, 0
    dest.mkdir(parents=True, exist_ok=True)
    stack = [""]
    while stack:
        rel = stack.pop()
        for name, mode in nofollow.listdir(kit, rel or None):
            path = f"{rel}/{name}" if rel else name
            count += 1
            if count > limits.kit_files:
                return None
            if stat.S_ISDIR(mode):
                if not (rel == "" and name in LEFT_OUT):
                    (dest / path).mkdir()
                    stack.append(path)
            elif stat.S_ISREG(mode):
                data, why = nofollow.read(kit, path, limits.kit_size - total)
                if data is None:
                    if "larger than" in why:
                        return None
                    continue                    # changed under the grader: left out
                total += len(data)
                (dest / path).write_bytes(data)
    return dest


def hand_over(folder, uid):
    """Give `folder` (and all in it) to the sandbox's user."""
    for root, dirs, files in os.walk(folder):
        os.chown(root, uid, uid, follow_symlinks=False)
        for name in files:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)


UIDS = uids.PER_GRADER              # user ids of one grader: its sandboxes running at once


def new_uid():
    """A user id of its own for each sandbox: no process of another sandbox, of this grader or
    of another on the machine, of anyone on the host counts against its RLIMIT_NPROC. Held
    until free_uid (waits while UIDS sandboxes of this grader run): uids.py."""
    try:
        return uids.take()
    except uids.UidError as err:
        raise SandboxError(str(err)) from None


def free_uid(uid):
    """Give back a user id of new_uid's (its sandbox has ended, every process of it killed)."""
    uids.give_back(uid)


def processes_left():
    """The pids of this grader's sandboxes' processes still alive (their user ids: new_uid's);
    zombies not counted (a killed sandbox's init stays one until the host's init reaps it)."""
    mine, left = uids.used(), []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            uid = int(fields["Uid"].split()[0])
        except (OSError, KeyError, ValueError):
            continue
        if not fields.get("State", "").strip().startswith("Z") and uid in mine:
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


# --- a run -------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: int | None              # exit status; None when killed at the timeout
    output: str                     # the head and the tail of its stdout + stderr
    seconds: float
    killed_by: str = ""             # "timeout", "memory", "disk", "signal N", "" (exited)
    output_bytes: int = 0
    oom: bool = False               # the sandbox's memory group killed a process (fork server)
    cpu_seconds: float = None       # every process of the sandbox together (its cgroup)
    disk_full: bool = False         # its tmpfs was full when it ended
    left_behind: int = 0            # a build's processes left running on their own, killed
                                    # (fork_server.stop_the_detached)

    def how(self):
        """How it ended, in words (the same words for the same ending: no timings)."""
        if self.killed_by == "timeout":
            return "did not finish in time and was stopped"
        if self.killed_by == "memory":
            return "ran out of the memory it is allowed and was stopped"
        if self.killed_by == "file size":
            return "wrote more output than allowed and was stopped"
        if self.killed_by == "disk":
            return "filled the disk space it is allowed (its bytes or its file count)"
        if self.killed_by == "no fork":
            return "could not start: the kit's own processes filled its sandbox"
        if self.killed_by == "not run":
            return "never started: the kit's sandbox ended before it"
        if self.killed_by:
            return f"was killed ({self.killed_by})"
        return f"ended with exit status {self.status}"


def run(command, *, kit_copy, out_dir, tmp_dir, grader_dir, limits=DEFAULT, env=None,
        extra_ro=(), ro_binds=(), log_path, uid=None, report_path=None, scratch=None, hide=None):
    """`command` (argv) inside a sandbox, cwd /kit; its stdout + stderr go to log_path. With
    report_path, `command` is the sandbox's PID 1 (the fork server: fork_server.py) and its
    stdout goes to report_path, its stderr to log_path. kit_copy, out_dir, tmp_dir: the
    sandbox's /kit, /out and /tmp (on `scratch`, its Scratch, whose fullness is reported).
    hide: paths masked inside (hide_binds)."""
    why = available()
    if why:
        raise SandboxError(why)
    if uid is None:
        uid = new_uid()
        try:
            return run(command, kit_copy=kit_copy, out_dir=out_dir, tmp_dir=tmp_dir,
                       grader_dir=grader_dir, limits=limits, env=env, extra_ro=extra_ro,
                       ro_binds=ro_binds, log_path=log_path, uid=uid, report_path=report_path,
                       scratch=scratch, hide=hide)
        finally:
            free_uid(uid)               # after group.close(): none of its processes is left
    for folder in (kit_copy, out_dir, tmp_dir):
        hand_over(folder, uid)
    os.chmod(tmp_dir, 0o700)
    environment = {"PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": "1",
                   "VIRTUAL_ENV": str(sys.prefix), "TMPDIR": "/tmp"}
    environment.update(env or {})
    argv = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            *(["--as-pid-1"] if report_path else []),
            *mounts(kit_copy, out_dir, tmp_dir, grader_dir, extra_ro, ro_binds), *hide_binds(hide)]
    group = _Cgroup(cgroup_name(uid), limits, uid)
    if group.idle is not None:
        argv += ["--bind", str(group.idle / "cgroup.procs"), IDLE_PROCS]
    argv += ["--chdir", "/kit", "--clearenv"]
    for key, value in environment.items():
        argv += ["--setenv", key, value]
    # the drop: every id to the sandbox's own, no capability (not even inheritable or bounding),
    # no_new_privs; the parent-death signal again (a change of uid clears it)
    argv += ["--", "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
             "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--pdeathsig=SIGKILL",
             "--", *map(str, command)]

    def limit():                       # in the child, before bwrap
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
    oom, cpu = group.oom_killed(), group.cpu_seconds()
    group.close()
    full = bool(scratch and scratch.full())
    seconds = time.perf_counter() - start
    size = os.path.getsize(log_path)
    tail = read_text(log_path, 4000, tail=True)
    if report_path:                     # the runs' endings are in the report: oom says
        return Outcome(status, tail, seconds, killed_by or ("memory" if oom else ""), size, oom=oom,
                       cpu_seconds=cpu, disk_full=full)
    if not killed_by and status is not None and status < 0:
        killed_by = {signal.SIGXFSZ: "file size"}.get(-status, f"signal {-status}")
    if not killed_by and status == 128 + signal.SIGXFSZ:
        killed_by = "file size"
    if oom and killed_by != "timeout":
        killed_by = "memory"
    if full and not killed_by and status:
        killed_by = "disk"
    return Outcome(status, tail, seconds, killed_by, size, cpu_seconds=cpu, disk_full=full)


CANARY = "hvd-classroom-canary"


def canary(work):
    """Start one sandbox the way every kit's starts (its mounts, its user, its limits) and run
    the virtualenv's Python in it: None when it works, else why not (bwrap's own words). The
    grader asks this before any kit: a sandbox that cannot start is the grader's failure,
    said to the instructor, never written into a student's row."""
    scratch = Scratch(Path(work) / "canary", DEFAULT)
    try:
        folders = {n: scratch.path / n for n in ("kit", "out", "tmp", "grader")}
        for folder in folders.values():
            folder.mkdir()
        os.chmod(folders["grader"], 0o755)
        probe = ("import os, sys; "
                 "open('/out/w', 'w').write('x'); open('/kit/w', 'w').write('x'); open('/tmp/w', 'w').write('x'); "
                 "assert os.getuid() != 0 and os.geteuid() != 0, 'root'; "
                 "import horovod; "
                 f"print('{CANARY}', sys.prefix)")
        outcome = run([str(Path(sys.prefix) / "bin" / "python"), "-c", probe],
                      kit_copy=folders["kit"], out_dir=folders["out"], tmp_dir=folders["tmp"],
                      grader_dir=folders["grader"], limits=Limits(seconds=120),
                      log_path=scratch.path / "canary.log", scratch=scratch)
        if outcome.status != 0 or CANARY not in outcome.output:
            return (f"a sandbox does not start here ({outcome.how()}): "
                    f"{outcome.output.strip()[-1500:] or 'no output'}")
        return None
    finally:
        release(scratch.path)


# --- reading what came back ------------------------------------------------------------------------

def _read(path, limit, root, part):
    if root is None:
        return nofollow.read_path(path, limit, part)[0]
    rel = os.path.relpath(path, root)
    if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
        return None
    return nofollow.read(root, rel, limit, part)[0]


def read_bytes(path, limit=DEFAULT.read_bytes, root=None):
    """At most `limit` bytes of a regular file a sandbox wrote, or a kit holds (None if it is
    not one, or is larger: the grader never reads without a bound, nor through a link, nor
    opens a FIFO or a device). With `root` (a kit, a sandbox's /out or /kit), no name between
    root and the file is followed either; without, only the file's own name (its folder is
    the grader's)."""
    return _read(path, limit, root, None)


def read_text(path, limit, tail=False, root=None):
    """The head (or the tail) of a text file, at most `limit` bytes, never the whole of a flood
    (read_bytes' rules)."""
    data = _read(path, limit, root, "tail" if tail else "head")
    return (data or b"").decode("utf-8", "replace")


def inside(path, root):
    """True when `path`, every link resolved, lies inside `root` (a kit's copy may hold links
    that point anywhere on the grader's side)."""
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)
