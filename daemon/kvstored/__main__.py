"""``python -m kvstored``: the same as the ``kvstored`` console script."""

import sys

from kvstored.main import main

sys.exit(main())
