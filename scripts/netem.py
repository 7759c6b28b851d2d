#!/usr/bin/env python3
"""`python scripts/netem.py ...` = `python -m labs.netem ...`: the network emulator (labs/netem/).

Kept as a path because run_matrix.py, the tests and older notes call this file."""
import sys

from labs.netem import parse_duration, parse_rate  # noqa: F401  (run_matrix.py imports these)
from labs.netem.cli import main

if __name__ == "__main__":
    sys.exit(main())
