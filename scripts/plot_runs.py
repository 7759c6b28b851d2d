#!/usr/bin/env python
"""Plots of a run matrix: `python -m labs.kit.plots` (labs/kit/plots.py)."""
import sys

from labs.kit.plots import main

if __name__ == "__main__":
    sys.exit(main())
