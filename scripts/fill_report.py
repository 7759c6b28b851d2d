#!/usr/bin/env python
"""Fill the lab report from a run matrix: `python -m labs.kit.report` (labs/kit/report.py)."""
import sys

from labs.kit.report import main

if __name__ == "__main__":
    sys.exit(main())
