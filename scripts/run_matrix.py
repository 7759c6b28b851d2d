#!/usr/bin/env python
"""Run the course's table of trainings: `python -m labs.kit.matrix` (labs/kit/matrix.py)."""
import sys

from labs.kit.matrix import main

if __name__ == "__main__":
    sys.exit(main())
