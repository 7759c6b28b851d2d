"""`python -m labs.netem ...`: the emulator's command line (cli.py)."""
import sys

from .cli import main

sys.exit(main())
