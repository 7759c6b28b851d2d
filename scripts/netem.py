#!/usr/bin/env python3
"""`python scripts/netem.py ...` = `python -m labs.netem ...`: the network emulator (labs/netem/).

Kept as a path because scripts/bench_step.py, the tests and the docs call this file."""
import sys

from labs.netem.cli import main

if __name__ == "__main__":
    sys.exit(main())
