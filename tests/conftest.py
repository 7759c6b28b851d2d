"""Fixtures shared by the test files: the lab as a module, the MNIST files, script loading."""
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The real MNIST test set (t10k-*.gz), beside the checkout; the only place tests look for it.
MNIST_DIR = (ROOT / ".." / "shared" / "data" / "mnist").resolve()
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


# ---- markers (registered in pytest.ini): every test gets one by its module -------------------
# netns: needs root and network namespaces; multiprocess: starts Horovod ranks (horovodrun,
# mpirun); unit: one process. slow: also takes minutes on its own. Modules not named are unit.
NETNS = {"test_netem", "test_gloo_patch", "test_lab_matrix_netem", "test_bench_collectives",
         "test_link_faults"}
MULTIPROCESS = {"test_exchange_multiprocess", "test_robustness_multiprocess", "test_course_patch",
                "test_lab", "test_lab_cli", "test_lab_course_route", "test_lab_failures",
                "test_grad_views", "test_powersgd", "test_topk", "test_quantizers", "test_elastic"}
SLOW = {"test_exchange_multiprocess", "test_lab_failures", "test_lab_course_route", "test_netem",
        "test_elastic", "test_link_faults"}


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        kind = "netns" if module in NETNS else "multiprocess" if module in MULTIPROCESS else "unit"
        item.add_marker(getattr(pytest.mark, kind))
        if module in SLOW:
            item.add_marker(pytest.mark.slow)
