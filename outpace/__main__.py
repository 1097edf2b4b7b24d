"""`python -m outpace ...`: the `outpace` command (entrypoints/cli.py)."""

import sys

from outpace.entrypoints.cli import main

sys.exit(main())
