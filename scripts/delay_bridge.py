#!/usr/bin/env python3
"""`python scripts/delay_bridge.py ...` = `python -m labs.netem.bridge ...`:
the delay bridge (labs/netem/bridge.py).

Kept as a path because scripts/bench_step.py, the tests and the docs call this file."""
import sys

from labs.netem.bridge import main

if __name__ == "__main__":
    sys.exit(main())
