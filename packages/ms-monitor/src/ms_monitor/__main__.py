"""``python -m ms_monitor``: the ms-monitor console script."""

import sys

from .cli import main

sys.exit(main())
