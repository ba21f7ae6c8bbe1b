"""``python -m clover.export ARGS``: the same build as ``clover build ARGS`` (:mod:`clover.export.command`)."""

import sys

from clover.export.command import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m clover.export"))
