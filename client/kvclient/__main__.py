"""``python -m kvclient ...`` is ``kvctl ...``."""

import sys

from kvclient.cli import main

sys.exit(main())
