#!/usr/bin/env python3
"""`python scripts/plot_bench.py ...` = `python -m labs.netem.plots ...`:
the benchmark's plot (labs/netem/plots.py).

Kept as a path because scripts/bench_step.py, the tests and the docs call this file."""
import sys

from labs.netem.plots import main

if __name__ == "__main__":
    sys.exit(main())
