"""``python -m swe_flush_sync``: the ``swe-flush`` command line."""

import sys

from ._cli.main import main

sys.exit(main())
