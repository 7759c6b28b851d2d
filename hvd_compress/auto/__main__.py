"""`python -m hvd_compress.auto`, the same as `hvd-compress-plan`: the planner's command line
(cli.py)."""
import sys

from .cli import main

sys.exit(main())
