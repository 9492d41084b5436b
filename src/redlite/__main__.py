"""``python -m redlite ...``: the same as the ``redlite`` console script."""

import sys

from redlite.cli import main

sys.exit(main())
