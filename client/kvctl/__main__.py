"""``python -m kvctl ...`` is ``kvctl ...``."""

import sys

from kvctl.cli import main

sys.exit(main())
