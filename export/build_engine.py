#!/usr/bin/env python
"""``python export/build_engine.py ARGS`` in a checkout: the same build as ``clover build ARGS``.

The build lives in the installed package (:mod:`clover.export.command`); this script only keeps the
checkout's old entry point working.
"""

import sys
from pathlib import Path

# the checkout's own package, also where another clover is installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clover.export.command import main, parse_args  # noqa: F401  (parse_args: for callers of the old script)

if __name__ == "__main__":
    sys.exit(main(prog="python export/build_engine.py"))
