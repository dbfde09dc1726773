"""``python -m benchmarks [--quick]``."""

import sys

from .run import main

sys.exit(main())
