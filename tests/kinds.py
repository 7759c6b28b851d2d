"""The kind of every test, declared and checked (issue 23).

Each test carries exactly one kind marker, set in its module (`pytestmark = pytest.mark.unit`)
or on the test itself where a module mixes kinds:

    unit          one process, quick: no Python interpreter of its own (no `python` subprocess,
                  no console script), no Horovod job, no hvd.init() in the pytest process, no
                  network namespaces, no horovodrun / mpirun subprocess, nothing built (no
                  compiler, pip, venv or set-up script)
    interpreter   starts a Python interpreter of its own (a CLI, a script, a fresh import,
                  a sandboxed student process); no ranks, nothing built
    build         builds what a user's first use builds: the kernel (a compiler), a wheel or a
                  virtualenv (pip, venv), a set-up script's work (a classroom kit's); no ranks
    multiprocess  starts ranks: Horovod (horovodrun / mpirun) or a torch.distributed process
                  group (torchrun, or a process of its own), or runs Horovod at all
    netns         needs root and network namespaces (labs.netem)

A test with none or more than one fails its module's collection, named, so `pytest -m unit` can
be trusted to hold every one-process test and nothing else.  While a test runs, what it
launches is checked against its kind: a `unit` test that starts horovodrun / mpirun / a
labs.netem cluster / `ip netns` / a compiler / pip / venv / a Python interpreter, or calls
hvd.init(), fails with a clear error, and so does a `multiprocess` test that builds namespaces.
Each kind allows what the kinds before it allow (unit < interpreter < build < multiprocess <
netns).  The check sees the commands the test itself
starts (subprocess) and hvd.init() in the pytest process, not what those commands start in
turn: a test that runs a tool which launches ranks must say so with its marker.

tests/conftest.py imports the hooks; tests/test_kinds.py tests them.
"""
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from launch_guard import ALLOWED, KindError, _running, child_environ, install_guards  # noqa: F401

KINDS = ("unit", "interpreter", "build", "multiprocess", "netns")
MARKERS = {
    "unit": "one process: no Python interpreter of its own, no Horovod job, no network "
            "namespaces, nothing built (fast)",
    "interpreter": "starts a Python interpreter of its own (a CLI, a script, a fresh import); "
                   "no ranks, nothing built",
    "build": "compiles the kernel, builds a wheel or a virtualenv, runs a set-up script; no ranks",
    "multiprocess": "starts Horovod ranks under horovodrun / mpirun (Gloo and MPI), or runs "
                    "Horovod at all",
    "netns": "needs root and network namespaces (the emulated network)",
    "slow": "takes more than about a minute on its own",
}


def kinds_of(item):
    """The kind markers of a collected test as declared where it is declared nearest (the
    test's own override its class's, which override its module's; duplicates kept)."""
    for node in reversed(item.listchain()):
        kinds = [mark.name for mark in node.own_markers if mark.name in KINDS]
        if kinds:
            return kinds
    return []


def own_kinds_only(items):
    """Each test's kind as its own marker and none on the modules and classes above it, so
    that `-m unit` selects a test by the kind that kinds_of reads (pytest's -m reads every
    marker from the module down: a module's `unit` would select the test that overrides it)."""
    kinds = {item: kinds_of(item) for item in items}
    for item in items:
        for node in item.listchain()[:-1]:
            node.own_markers[:] = [m for m in node.own_markers if m.name not in KINDS]
    for item, found in kinds.items():
        if found and not any(m.name in KINDS for m in item.own_markers):
            item.add_marker(found[0])


def wrong_kinds(items):
    """'node id: what is wrong' for each test without exactly one kind marker."""
    wrong = []
    for item in items:
        kinds = kinds_of(item)
        if len(kinds) != 1:
            what = "no kind marker" if not kinds else "kind markers " + ", ".join(kinds)
            wrong.append(f"{item.nodeid}: {what}")
    return wrong


# ---- the hooks (tests/conftest.py imports them) ---------------------------------------------

def pytest_configure(config):
    known = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for name, text in MARKERS.items():
        if name not in known:                      # pytest.ini lists them; a bare run does not
            config.addinivalue_line("markers", f"{name}: {text}")
    install_guards()
    config._kinds_reports = Path(tempfile.mkdtemp(prefix="hvdc-kinds-"))
    config._kinds_seen = []


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_kinds_reports", ""), ignore_errors=True)


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
            "every test needs exactly one kind marker, unit, interpreter, build, multiprocess or "
            "netns, in its "
            "module (pytestmark = pytest.mark.unit) or on the test (tests/kinds.py):\n  "
            + "\n  ".join(wrong))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Before `-m` deselects anything (pytest's own hook runs after this one)."""
    own_kinds_only(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Holds the running test's kind for the launch checks, from before its fixtures are set up
    (a module-scoped fixture that launches ranks counts for the test that needs it first) until
    they are torn down; the Python processes it starts get it through their environment."""
    kinds = kinds_of(item)
    kind = kinds[0] if len(kinds) == 1 else None
    report = item.config._kinds_reports / f"{os.getpid()}-{len(item.config._kinds_seen)}.txt"
    item.config._kinds_seen.append(item.nodeid)
    changes = child_environ(kind, item.nodeid, report)
    outer = dict(_running)                        # tests/test_kinds.py nests a run
    outer_env = {name: os.environ.get(name) for name in changes}
    _running.update(kind=kind, test=item.nodeid, report=None)
    item._kinds_report = report
    os.environ.update(changes)
    try:
        yield
    finally:
        _running.update(outer)
        for name, value in outer_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _children_refused(item, outcome):
    """A refusal a child process of the test wrote (its KindError may have ended inside a
    launcher the test expected to fail) fails the phase that ran it."""
    report = getattr(item, "_kinds_report", None)
    if report is not None and report.exists():
        text = report.read_text().strip()
        report.unlink()
        if text and outcome.excinfo is None:
            outcome.force_exception(KindError(text))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    outcome = yield
    _children_refused(item, outcome)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    _children_refused(item, outcome)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    outcome = yield
    _children_refused(item, outcome)
