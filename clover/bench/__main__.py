"""``python -m clover.bench``: see :mod:`clover.bench.sweeps`."""

import sys

from clover.bench.sweeps import main

sys.exit(main())
