"""The fork server of a kit's sandbox: the first process inside it (its PID 1), which imports
NumPy and torch once and then forks every run the grader asks of this kit.

    python fork_server.py PLAN.json        (copied to /grader beside student_side.py)

PLAN: {"tasks": [{"name", "mode": "build"|"calls"|"ranks", "ranks", "seconds", "argv", "path",
"requires", "unbuilt"}], "data": [the data set's .gz files], "warm_up": bool (a run trains)};
the tasks run in order. A task of mode "build" is one forked process running the build side
(build_side.main(argv): the kit's patched Horovod, step 3b); a task that "requires" it runs
with its "unbuilt" argv and path instead when the build failed. A task of mode "calls" is one
forked process running the student side (student_side.main(argv)); "ranks" is a Horovod job
of `ranks` forked processes, Gloo's
rendezvous server in a forked process of its own, each rank given the environment horovodrun's
Gloo launcher gives it (horovod/runner/gloo_run.py), then the student side. Each task keeps what
a process of its own had: its own time limit, its own output folder /out/NAME with its stdout
and stderr (output.log), its own exit status. Between two tasks every process left in the
sandbox is killed: a run that forked away cannot reach the next. During a build, a process left
running on its own (its parent gone) is killed as soon as it is seen (stop_the_detached): a
pipe it held would keep the build waiting to its time limit.

Why: importing torch costs about 1.2 s of a core, its first training step about 1 s more, and
reading the data set 0.4 s; a kit's runs (step 2, 2 ranks, 4 ranks) used to import torch 7
times and pay the step and the data 6 times each, in three sandboxes, with horovodrun's own
processes beside them. Here each is paid once per kit (warm_up, memo_data), and a forked run starts in
milliseconds. Nothing of a kit's code runs here: every run starts from the same clean process.

What the kit cannot do to it: signal it (a PID namespace's init receives no signal it has no
handler for from inside: SIGKILL and SIGSTOP never), trace or read it (not dumpable), reach its
report (stdout, closed in every run, where one JSON line per task tells the grader how it
ended). It writes nothing that decides a grade.
"""
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import sys
import time
import traceback

import numpy  # noqa: F401  (imported once, before any fork)
import torch  # noqa: F401

import build_side
import student_side

PR_SET_DUMPABLE = 4
RANK_GRACE_S = 5                # horovodrun's: the other ranks' time to stop after one failed
IDLE_PROCS = "/idle.procs"      # the sandbox's idle CPU group (sandbox.py), where the host has one
IDLE_EVERY_S = 0.1
DETACHED_EVERY_S = 0.1          # how often a build's left-behind processes are looked for


def warm_up():
    """One step of a small convolutional network, forward, backward and SGD, then an
    evaluation: torch pays about 1 s of a core lazily at a process's first such step (kernels
    chosen and built), which every forked run then inherits instead of paying again. The
    grader's own network on random inputs; the global RNG's state is restored after, so a run
    sees the generator a fresh process would."""
    import torch.nn.functional as F
    state = torch.get_rng_state()
    torch.set_num_threads(1)
    conv, fc = torch.nn.Conv2d(1, 4, 3, 1), torch.nn.Linear(4 * 13 * 13, 10)
    params = [*conv.parameters(), *fc.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def forward(x):
        x = F.dropout(F.max_pool2d(F.relu(conv(x)), 2), 0.25, training=conv.training)
        return F.log_softmax(fc(torch.flatten(x, 1)), dim=1)

    F.nll_loss(forward(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
    optimizer.step()
    conv.eval()
    with torch.no_grad():
        forward(torch.randn(8, 1, 28, 28)).argmax(dim=1)
    torch.set_rng_state(state)


def memo_data(paths):
    """The data set's .gz files decompressed and hashed once, here, for every run: a memo on
    gzip.decompress (the same compressed bytes give the same bytes object) and hashlib.md5 (of
    that very object: a copy of its hash). Each of a kit's 6 ranks used to decompress and
    md5 the 47 MB training images itself: 0.4 s of a core each. The same values either way;
    a loader that reads otherwise (gzip.open) just does the work itself."""
    import gzip
    import hashlib
    cache = {}
    for path in paths:
        try:
            with open(path, "rb") as handle:
                raw = handle.read(1 << 28)
            out = gzip.decompress(raw)
        except (OSError, EOFError, ValueError):
            continue
        cache[len(raw)] = (raw, out, hashlib.md5(out))
    if not cache:
        return
    decompress, md5 = gzip.decompress, hashlib.md5

    def memo_decompress(data, *args, **kwargs):
        hit = cache.get(len(data)) if isinstance(data, bytes) and not (args or kwargs) else None
        return hit[1] if hit is not None and hit[0] == data else decompress(data, *args, **kwargs)

    def memo_md5(*args, **kwargs):
        if len(args) == 1 and not kwargs:
            for _, out, digest in cache.values():
                if args[0] is out:
                    return digest.copy()
        return md5(*args, **kwargs)

    gzip.decompress, hashlib.md5 = memo_decompress, memo_md5


def _not_dumpable():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _first_to_go():
    """A run's processes before the fork server when the sandbox's memory runs out: each run
    (a fork bomb's thousand copies of it too) looks as large as the server to the OOM killer."""
    try:
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("500")
    except OSError:
        pass


def _dumpable():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _fork(out_dir, body, report_fd):
    """A child that runs body() with stdout and stderr on out_dir/output.log, then exits with
    its status (atexit handlers run, as at any process's end); the child never returns here."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.close(report_fd)
        _dumpable()
        _first_to_go()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log = os.open(os.path.join(out_dir, "output.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        code = 0
        body()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def _student_side(argv, path, side=student_side):
    def body():
        sys.argv = list(argv)
        sys.path[1:1] = list(path)
        if path:
            os.environ["PYTHONPATH"] = ":".join(path)
        side.main(argv)
    return body


def _rendezvous(n, port_fd):
    """Gloo's rendezvous server for one job (Horovod's own, as horovodrun starts it)."""
    def body():
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer
        server = RendezvousServer()
        port = server.start()
        server.init(get_host_assignments(parse_hosts(f"localhost:{n}"), n))
        os.write(port_fd, f"{port}\n".encode())
        os.close(port_fd)
        while True:
            time.sleep(3600)
    return body


def _rank_env(rank, n, port):
    return {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": "lo", "NCCL_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
            "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(n),
            "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(n),
            "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}


class Waiter:
    """Reaps every child (PID 1 inherits the orphans too) and keeps the statuses it is asked for."""

    def __init__(self):
        self.statuses = {}

    def poll(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.statuses[pid] = status


def _ended(status):
    """(exit status or None, signal number or None)."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.WEXITSTATUS(status), None


def run_task(task, report_fd, waiter):
    """Fork the task's processes, wait for them within its time limit; how it ended."""
    out_dir = os.path.join("/out", task["name"])
    start = time.monotonic()
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        os.makedirs(out_dir)
    except OSError as err:            # the kit's own files fill its sandbox's disk
        return {"timeout": False, "status": None, "signal": None, "started": False,
                "error": f"{type(err).__name__}: {err}"[:300], "seconds": time.monotonic() - start}
    deadline = start + float(task["seconds"])
    body = _student_side(task["argv"], task.get("path") or [],
                         build_side if task["mode"] == "build" else student_side)
    ended = {"timeout": False, "status": None, "signal": None, "started": True}
    try:
        if task["mode"] in ("calls", "build"):
            pids = [_fork(out_dir, body, report_fd)]
        else:
            n = int(task["ranks"])
            read_fd, write_fd = os.pipe()
            server = _fork(out_dir, _rendezvous(n, write_fd), report_fd)
            os.close(write_fd)
            port = _read_port(read_fd, deadline)
            os.close(read_fd)
            pids = []
            for rank in range(n):
                os.environ.update(_rank_env(rank, n, port))
                try:
                    pids.append(_fork(out_dir, body, report_fd))
                finally:
                    for key in _rank_env(rank, n, port):
                        os.environ.pop(key, None)
    except OSError as err:            # fork failed: the kit's processes fill its sandbox
        ended.update(started=False, error=f"{type(err).__name__}: {err}"[:300],
                     seconds=time.monotonic() - start)
        return ended
    failed_at, told = None, False
    main = set(pids) | ({server} if task["mode"] == "ranks" else set())
    moved, idle_at = set(), 0.0
    idle = task["mode"] != "build" and os.path.exists(IDLE_PROCS)   # a build's compilers are its work
    detached, detached_at = set(), 0.0
    while True:
        waiter.poll()
        done = [p for p in pids if p in waiter.statuses]
        for pid in done:
            status, sig = _ended(waiter.statuses[pid])
            if (status or sig) and ended["status"] is None and ended["signal"] is None:
                ended["status"], ended["signal"] = status, sig
                failed_at = time.monotonic()
        if len(done) == len(pids):
            if ended["status"] is None and ended["signal"] is None:
                ended["status"] = 0
            break
        now = time.monotonic()
        if now >= deadline:
            ended["timeout"] = True
            break
        if idle and now - idle_at >= IDLE_EVERY_S:
            idle_the_rest(main, moved)
            idle_at = now
        if task["mode"] == "build" and now - detached_at >= DETACHED_EVERY_S:
            stop_the_detached(main, detached)
            detached_at = now
        if failed_at is not None and not told:
            told = True                 # one rank failed: the others stop, as under horovodrun
            for pid in pids:
                if pid not in waiter.statuses:
                    _signal(pid, signal.SIGTERM)
        if failed_at is not None and now - failed_at > RANK_GRACE_S:
            break
        time.sleep(0.02)
    ended["seconds"] = time.monotonic() - start
    if task["mode"] == "build":
        ended["left_behind"] = len(detached)
    return ended


def _read_port(fd, deadline):
    data = b""
    while not data.endswith(b"\n"):
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise OSError("the rendezvous server did not start")
        chunk = os.read(fd, 64)
        if not chunk:
            raise OSError("the rendezvous server ended before it started")
        data += chunk
    return int(data)


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def sweep(waiter):
    """Kill every process of the sandbox but this one, and reap them (only as the PID
    namespace's init: kill(-1) would reach far more anywhere else)."""
    if os.getpid() != 1:
        raise SystemExit("fork_server.py runs only as a sandbox's PID 1")
    for _ in range(500):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        waiter.poll()
        try:
            pid, status = os.waitpid(-1, 0)
            waiter.statuses[pid] = status
        except ChildProcessError:
            return


def _disk_full(folder="/out"):
    """The sandbox's disk (its tmpfs: /kit, /out, /tmp) is all but full, bytes or files."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20) or st.f_favail < 16


def idle_the_rest(main, moved):
    """Move every process of the sandbox this server did not start for the running task (it
    is PID 1; `main`: the task's process or ranks and the rendezvous server) into the sandbox's
    idle CPU group: whatever a kit's code forks on its own (a hog's busy setsid processes, a
    DataLoader's workers) then runs only on cycles no one else on the host wants, and the
    grader's runs keep the sandbox's share. Their children are born there."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == 1 or pid in main or pid in moved:
            continue
        moved.add(pid)
        try:
            with open(IDLE_PROCS, "w") as handle:
                handle.write(name)
        except OSError:
            pass                        # ended meanwhile, or a zombie


def stop_the_detached(main, stopped):
    """Kill every process of the sandbox whose parent has ended (orphans are this PID 1's
    children) but the task's own: during a build, a process whose starter is gone is one the
    kit's code left behind (a setup.py's double-forked sleeper), never the build's work (pip,
    make and the compilers wait for their children). Left alive, it would hold the pipe pip
    reads its setup.py's output from, or the build side reads pip's from, and keep the build
    waiting to its time limit (30 minutes) after its work ended; killed, the pipe closes and
    the build's result is read at once. Their pids go into `stopped` (the build's report counts
    them)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == 1 or pid in main:
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue                    # ended meanwhile
        if fields[0] != "Z" and fields[1] == "1":
            _signal(pid, signal.SIGKILL)
            stopped.add(pid)


def loopback_bytes():
    """Bytes sent so far on the loopback of this sandbox's network namespace (its /proc/net/dev
    lists this namespace's interfaces only), or None where it cannot be read. Read here, by
    PID 1, before a task starts and after its last process is gone: every byte a task's ranks
    sent each other is counted, and nothing a kit's process does can take one back."""
    try:
        with open("/proc/net/dev") as handle:
            for line in handle:
                name, _, fields = line.partition(":")
                if name.strip() == "lo":
                    return int(fields.split()[8])       # Transmit: bytes
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpu(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def main(plan_path):
    if os.getpid() != 1:
        sys.exit("fork_server.py runs only as a sandbox's PID 1")
    _not_dumpable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # no handler: no signal from inside reaches it
    report_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    with open(plan_path) as handle:
        plan = json.load(handle)
    if plan.get("warm_up"):
        warm_up()
    memo_data(plan.get("data", []))
    os.write(report_fd, b'{"ready": true}\n')    # started: whatever fails now is the kit's
    waiter = Waiter()
    built = {}
    for task in plan["tasks"]:
        if task.get("requires") and not built.get(task["requires"]):
            task = {**task, **task.get("unbuilt", {})}
        before, sent_before = _cpu(resource.RUSAGE_CHILDREN), loopback_bytes()
        ended = run_task(task, report_fd, waiter)
        ended["disk_full"] = _disk_full()
        sweep(waiter)
        if task["mode"] == "build":
            built[task["name"]] = ended["status"] == 0 and not ended["timeout"]
        sent_after = loopback_bytes()
        ended["loopback_bytes"] = (sent_after - sent_before if None not in (sent_before, sent_after)
                                   else None)
        ended["cpu_s"] = round(_cpu(resource.RUSAGE_CHILDREN) - before, 3)
        ended["server_cpu_s"] = round(_cpu(resource.RUSAGE_SELF), 3)
        os.write(report_fd, (json.dumps({"name": task["name"], **ended}) + "\n").encode())
    os.close(report_fd)
    os._exit(0)                     # no interpreter teardown: nothing is left to flush


if __name__ == "__main__":
    main(sys.argv[1])
