"""The kind of every test, declared and checked (issue 23).

Each test carries exactly one kind marker, set in its module (`pytestmark = pytest.mark.unit`)
or on the test itself where a module mixes kinds:

    unit          one process: no Horovod job, no hvd.init() in the pytest process, no network
                  namespaces, no horovodrun / mpirun subprocess
    multiprocess  starts Horovod ranks (horovodrun / mpirun), or runs Horovod at all
    netns         needs root and network namespaces (labs.netem)

A test with none or more than one fails its module's collection, named, so `pytest -m unit` can
be trusted to hold every one-process test and nothing else.  While a test runs, what it
launches is checked against its kind: a `unit` test that starts horovodrun / mpirun / a
labs.netem cluster / `ip netns`, or calls hvd.init(), fails with a clear error, and so does a
`multiprocess` test that builds namespaces.  The check sees the commands the test itself
starts (subprocess) and hvd.init() in the pytest process, not what those commands start in
turn: a test that runs a tool which launches ranks must say so with its marker.

tests/conftest.py imports the hooks; tests/test_kinds.py tests them.
"""
import os
import re
import shlex
import subprocess

import pytest

KINDS = ("unit", "multiprocess", "netns")
MARKERS = {
    "unit": "one process, no Horovod job, no network namespaces (fast)",
    "multiprocess": "starts Horovod ranks under horovodrun / mpirun (Gloo and MPI), or runs "
                    "Horovod at all",
    "netns": "needs root and network namespaces (the emulated network)",
    "slow": "takes more than about a minute on its own",
}
RANK_LAUNCHERS = {"horovodrun", "mpirun", "mpiexec", "orterun", "prterun", "gloorun"}
INFO_FLAGS = {"--version", "-V", "--help", "-h"}      # `mpirun --version` starts no rank
WRAPPERS = {"env", "nice", "nohup", "setsid", "timeout", "stdbuf", "sudo", "exec"}
# labs.netem subcommands that build nothing: `commands` prints the ip/tc lines it would run.
NETEM_READ_ONLY = {"commands", "-h", "--help"}


class KindError(RuntimeError):
    """A test did what its kind marker rules out."""


def kinds_of(item):
    """The kind markers of a collected test, as declared (duplicates kept)."""
    return [mark.name for mark in item.iter_markers() if mark.name in KINDS]


def wrong_kinds(items):
    """'node id: what is wrong' for each test without exactly one kind marker."""
    wrong = []
    for item in items:
        kinds = kinds_of(item)
        if len(kinds) != 1:
            what = "no kind marker" if not kinds else "kind markers " + ", ".join(kinds)
            wrong.append(f"{item.nodeid}: {what}")
    return wrong


# ---- what a command does, read from its argv ------------------------------------------------

def _argv(args):
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        try:
            return shlex.split(text)
        except ValueError:
            return text.split()
    return [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]


def _netem_subcommand(argv):
    """The labs.netem subcommand `argv` runs (`python -m labs.netem X`, scripts/netem.py X),
    or None when it runs no labs.netem."""
    for i, word in enumerate(argv):
        if word == "-m" and i + 1 < len(argv) and argv[i + 1] in ("labs.netem", "labs.netem.cli"):
            rest = argv[i + 2:]
            return rest[0] if rest else ""
        if word.endswith(("scripts/netem.py", "labs/netem/__main__.py", "labs/netem/cli.py")):
            rest = argv[i + 1:]
            return rest[0] if rest else ""
    return None


def _script_kind(script):
    """launch_kind of the first command of a shell line that has one."""
    for part in re.split(r"&&|\|\||[;|&\n]", script):
        found = launch_kind(part.strip())
        if found:
            return found
    return None


def launch_kind(args, shell=False):
    """'multiprocess' if the command starts Horovod ranks, 'netns' if it builds or enters
    network namespaces, None otherwise.  `shell`: args is a shell line (Popen's shell=True)."""
    if shell:
        return _script_kind(os.fsdecode(args) if not isinstance(args, (list, tuple))
                            else " ".join(map(str, args)))
    argv = _argv(args)
    while argv and (os.path.basename(argv[0]) in WRAPPERS or "=" in argv[0]
                    or argv[0].startswith("-") or argv[0].replace(".", "").isdigit()):
        argv = argv[1:]                     # env A=1 ..., timeout 60 ..., nice -n 5 ...
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program in ("ip",) and ("netns" in argv or "-n" in argv or "-netns" in argv):
        return "netns"
    if program in ("nsenter", "unshare") or (program == "tc" and "-n" in argv):
        return "netns"
    netem = _netem_subcommand(argv)
    if netem is not None and netem not in NETEM_READ_ONLY:
        return "netns"
    if program in RANK_LAUNCHERS and not set(argv[1:]) <= INFO_FLAGS:
        return "multiprocess"
    if any(a == "-m" and b.startswith("horovod.runner") for a, b in zip(argv, argv[1:])):
        return "multiprocess"
    if program in ("sh", "bash", "dash") and "-c" in argv[:-1]:
        return _script_kind(argv[argv.index("-c") + 1])
    return None


ALLOWED = {"unit": set(), "multiprocess": {"multiprocess"}, "netns": {"multiprocess", "netns"}}
_running = {"kind": None, "test": None}       # the test now running, set by the guard fixture


def _refuse(what, needs):
    kind, test = _running["kind"], _running["test"]
    raise KindError(f"{test} is marked `{kind}` but {what}: mark it "
                    f"`@pytest.mark.{needs}` (tests/kinds.py)")


def _guarded_popen_init(original):
    def __init__(self, args, *rest, **kwargs):
        kind = _running["kind"]
        if kind is not None:
            needs = launch_kind(args, shell=kwargs.get("shell", False))
            if needs and needs not in ALLOWED[kind]:
                line = args if isinstance(args, str) else shlex.join(_argv(args))
                _refuse(f"starts {line[:200]!r}", needs)
        original(self, args, *rest, **kwargs)
    __init__.__wrapped__ = original
    return __init__


def _guarded_hvd_init(original):
    def init(self, *args, **kwargs):
        if _running["kind"] == "unit":
            _refuse("calls hvd.init() in the pytest process", "multiprocess")
        return original(self, *args, **kwargs)
    init.__wrapped__ = original
    return init


def install_guards():
    """Wrap subprocess.Popen and Horovod's init once, before any test module imports
    horovod.torch (which binds `hvd.init` to HorovodBasics.init when it is first imported).
    The wrappers do nothing while no test runs."""
    if not hasattr(subprocess.Popen.__init__, "__wrapped__"):
        subprocess.Popen.__init__ = _guarded_popen_init(subprocess.Popen.__init__)
    try:
        from horovod.common.basics import HorovodBasics
    except ImportError:          # no Horovod here: nothing can call its init either
        return
    if not hasattr(HorovodBasics.init, "__wrapped__"):
        HorovodBasics.init = _guarded_hvd_init(HorovodBasics.init)


# ---- the hooks (tests/conftest.py imports them) ---------------------------------------------

def pytest_configure(config):
    known = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for name, text in MARKERS.items():
        if name not in known:                      # pytest.ini lists them; a bare run does not
            config.addinivalue_line("markers", f"{name}: {text}")
    install_guards()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module (or class) whose tests lack exactly one kind fails to collect, naming them: the
    run stops before `-m` deselects anything, under pytest-xdist too."""
    outcome = yield
    report = outcome.get_result()
    if report.outcome != "passed":
        return
    wrong = wrong_kinds([node for node in report.result if isinstance(node, pytest.Item)])
    if wrong:
        report.outcome, report.result = "failed", []
        report.longrepr = (
            "every test needs exactly one kind marker, unit, multiprocess or netns, in its "
            "module (pytestmark = pytest.mark.unit) or on the test (tests/kinds.py):\n  "
            + "\n  ".join(wrong))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Holds the running test's kind for the launch checks above, from before its fixtures
    are set up (a module-scoped fixture that launches ranks counts for the test that needs
    it first) until they are torn down."""
    kinds = kinds_of(item)
    outer = dict(_running)             # a test that runs pytest itself (tests/test_kinds.py)
    _running.update(kind=kinds[0] if len(kinds) == 1 else None, test=item.nodeid)
    try:
        yield
    finally:
        _running.update(outer)
