#!/usr/bin/env python
"""``python export/build_engine.py ARGS`` in a checkout: the same build as ``clover build ARGS``.

The build lives in the installed package (:mod:`clover.export.command`); this script only keeps the
checkout's old entry point working. It edits no ``sys.path``: it runs the Clover that Python imports, which in
a checkout installed as the README says (``pip install -e .``) is the checkout's own.
"""

import sys

try:
    from clover.export.command import main, parse_args  # noqa: F401  (parse_args: for callers of the old script)
except ModuleNotFoundError as exc:
    if exc.name != "clover":
        raise
    sys.exit("python export/build_engine.py: error: Clover is not installed in this Python; in the checkout run "
             "pip install -e . (README.md), then this script or clover build")

if __name__ == "__main__":
    sys.exit(main(prog="python export/build_engine.py"))
