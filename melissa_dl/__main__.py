"""``python -m melissa_dl config.json``: the same as ``melissa-server config.json``."""

import sys

from melissa_dl.cli import main

sys.exit(main())
