#!/usr/bin/env python3
"""`python scripts/bench_collectives.py ...` = `python -m labs.netem.bench ...`:
the collectives benchmark (labs/netem/bench.py).

Kept as a path because scripts/bench_step.py, the tests and the docs call this file."""
import sys

from labs.netem.bench import main

if __name__ == "__main__":
    sys.exit(main())
