"""Fixtures shared by the lab's test files."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(path, name):
    """Import a script (labs/mnist.py, scripts/*.py) as a module, without running its main."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lab():
    """labs/mnist.py as a module (argparse checks run in-process, before Horovod starts)."""
    return load_script(ROOT / "labs" / "mnist.py", "lab_mnist")
