"""`python -m hvd_compress.auto`: the planner's command line (cli.py)."""
import sys

from .cli import main

sys.exit(main())
