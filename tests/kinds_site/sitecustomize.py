"""Run by every Python process a test starts (tests/launch_guard.py puts this folder first on
PYTHONPATH while a unit or multiprocess test runs): the same launch checks as in pytest, so a
unit test cannot start ranks through a tool either.  Then any sitecustomize it hides."""
import importlib.util
import os
import sys

import launch_guard

launch_guard.start_in_child()

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _candidate = os.path.join(_entry or os.getcwd(), "sitecustomize.py")
    if os.path.abspath(_entry or os.getcwd()) != _here and os.path.isfile(_candidate):
        _spec = importlib.util.spec_from_file_location("_hidden_sitecustomize", _candidate)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
