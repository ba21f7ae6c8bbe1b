"""``python -m clover.bench``: parsed by :mod:`clover.bench.cli` before the measuring code (and torch) loads."""

import sys

from clover.bench.cli import parse_args

args = parse_args()
from clover.bench.sweeps import run_command  # noqa: E402  (after parsing: --help needs no torch)

sys.exit(run_command(args))
