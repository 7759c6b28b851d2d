"""Fixtures shared by the test files: the lab as a module, the MNIST files, script loading;
and the check of every test's kind marker (tests/kinds.py)."""
import importlib
import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The real MNIST test set (t10k-*.gz), beside the checkout, or where HVD_COMPRESS_MNIST_DIR
# says (a checkout that is not beside shared/, a git worktree); the only place tests look for it.
MNIST_DIR = Path(os.environ.get("HVD_COMPRESS_MNIST_DIR")
                 or ROOT / ".." / "shared" / "data" / "mnist").resolve()
MNIST_MISSING = (f"needs the MNIST test set (t10k-images-idx3-ubyte.gz, "
                 f"t10k-labels-idx1-ubyte.gz) in {MNIST_DIR}")
needs_mnist = pytest.mark.skipif(not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file(),
                                 reason=MNIST_MISSING)


@pytest.fixture(scope="session")
def mnist_dir():
    """MNIST_DIR, or a skip saying what is missing."""
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(MNIST_MISSING)
    return MNIST_DIR


class SharedRuns:
    """Run folders that tests of several modules read, each made once a session: the first
    test to ask trains it (tests/test_lab.py's runs, tests/test_lab_course_route.py)."""

    def __init__(self, base):
        self.base, self.folders = base, {}

    def get(self, name, make):
        """The folder `name`, made by make(folder) the first time it is asked for."""
        if name not in self.folders:
            make(self.base / name)
            self.folders[name] = self.base / name
        return self.folders[name]


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    return SharedRuns(tmp_path_factory.mktemp("shared-runs"))


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


# ---- kinds: every test declares unit, multiprocess or netns; checked (tests/kinds.py) --------
from kinds import (pytest_configure, pytest_make_collect_report,  # noqa: E402,F401
                   pytest_runtest_call, pytest_runtest_protocol, pytest_runtest_setup,
                   pytest_runtest_teardown, pytest_unconfigure)
