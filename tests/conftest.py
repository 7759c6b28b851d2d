"""Fixtures shared by the test files: the lab as a module, the MNIST files, script loading;
and the check of every test's kind marker (tests/kinds.py)."""
import importlib
import importlib.util
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# pytest caches each test module's assertion rewrite as bytecode beside it, unless bytecode
# writing is off (PYTHONDONTWRITEBYTECODE, set on some machines): then every run rewrites and
# compiles all the test modules again. The cache lives in the clone's ignored __pycache__
# folders; only this process writes it, not the ranks and sandboxes the tests start.
sys.dont_write_bytecode = False

ROOT = Path(__file__).resolve().parents[1]

# The real MNIST test set (t10k-*.gz, 1.6 MB), shipped with the tests: every clone runs the
# whole suite on real digits (tests/data/mnist/README.md).
MNIST_DIR = ROOT / "tests" / "data" / "mnist"
# No test contacts a public host: MNIST's download mirrors are off for the whole session, in
# this process and every one it starts (the download tests serve their files on 127.0.0.1).
os.environ["HVD_COMPRESS_MNIST_MIRRORS"] = ""
# How many shared runs train at once on this machine (SharedRuns.get_all): measured on 2 cores,
# see docs/testing.md.
SIDE_BY_SIDE = int(os.environ.get("HVD_COMPRESS_SIDE_BY_SIDE", "2"))


@pytest.fixture
def e2m1():
    """docs/examples/e2m1_example.py imported as a plugin is (it registers itself), and its
    registry entry taken out again after."""
    from hvd_compress import registry
    saved = dict(registry.SCHEMES)
    examples = str(ROOT / "docs" / "examples")
    sys.path.insert(0, examples)
    try:
        yield importlib.import_module("e2m1_example")
    finally:
        sys.path.remove(examples)
        sys.modules.pop("e2m1_example", None)
        registry.SCHEMES.clear()
        registry.SCHEMES.update(saved)


@pytest.fixture(scope="session")
def mnist_dir():
    """MNIST_DIR: the real MNIST test set."""
    return MNIST_DIR


class SharedRuns:
    """Run folders that tests of several modules read, each made once a session: the first
    test to ask trains it (tests/test_lab.py's runs, tests/test_lab_course_route.py). What a
    make returned (a launch's exit code and output, for the tests that assert on them) is kept
    beside its folder: `output(name)`."""

    def __init__(self, base, side_by_side=SIDE_BY_SIDE):
        self.base, self.folders, self.outputs, self.failures = base, {}, {}, {}
        self.side_by_side = side_by_side

    def get(self, name, make):
        """The folder `name`, made by make(folder) the first time it is asked for."""
        return self.get_all({name: make})[name]

    def get_all(self, makes, raise_failures=True):
        """{name: folder} for each name of {name: make}; the ones not made (or tried) yet are
        made side by side, `side_by_side` at a time, in the order given (a run is a
        subprocess: its launch and start-up leave the cores idle part of the time). A make's
        error is kept: raised (the first of those asked for) once all have ended, and again
        whenever its name is asked for; with raise_failures=False, only the folders made."""
        missing = {name: make for name, make in makes.items()
                   if name not in self.folders and name not in self.failures}
        if missing:
            with ThreadPoolExecutor(max_workers=min(self.side_by_side, len(missing))) as pool:
                done = {name: pool.submit(make, self.base / name)
                        for name, make in missing.items()}
            for name, future in done.items():
                if future.exception() is not None:
                    self.failures[name] = future.exception()
                else:
                    self.folders[name], self.outputs[name] = self.base / name, future.result()
        failed = [name for name in makes if name in self.failures]
        if failed and raise_failures:
            raise self.failures[failed[0]]
        return {name: self.folders[name] for name in makes if name in self.folders}

    def output(self, name):
        """What make(folder) returned for the run `name` (made already)."""
        return self.outputs[name]


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    return SharedRuns(tmp_path_factory.mktemp("shared-runs"))


@pytest.fixture(scope="session")
def emulated_network():
    """labs.netem's capabilities, probed (a namespace made and removed) when a netns test first
    asks, never while collecting: `pytest -m unit` touches no namespace. Skips, saying what is
    missing, where namespaces or the tbf qdisc cannot be had."""
    from labs import netem
    caps = netem.probe_capabilities()
    if not (caps.netns and caps.tbf):
        pytest.skip(f"cannot emulate a network here: {caps.problem or 'no tbf qdisc in this kernel'}")
    return caps


def load_script(path, name):
    """Import a script that is not in a package (scripts/*.py) without running its main."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lab():
    """labs/mnist.py as a module (argparse checks run in-process, before Horovod starts)."""
    return importlib.import_module("labs.mnist")


# ---- kinds: every test declares unit, interpreter, build, multiprocess or netns; checked
# (tests/kinds.py)
from kinds import (pytest_collection_modifyitems, pytest_configure,  # noqa: E402,F401
                   pytest_make_collect_report, pytest_runtest_call, pytest_runtest_protocol,
                   pytest_runtest_setup, pytest_runtest_teardown, pytest_unconfigure)
