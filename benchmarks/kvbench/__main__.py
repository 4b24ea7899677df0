"""``python -m kvbench``: the same run as ``kvctl bench``."""

import sys

from kvbench.cli import main

sys.exit(main())
