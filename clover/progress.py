"""Progress bars drawn only on a terminal: redrawn into a log file (output piped, nohup, a CI job) a bar leaves
one line per update there (issue 62)."""

from __future__ import annotations

import sys


def progress_bar(iterable=None, *, enabled: bool = True, **options):
    """A tqdm bar on stderr (or ``file=``): drawn when ``enabled`` and that stream is a terminal, else a silent
    bar that still counts (tqdm's ``disable=None``)."""
    from tqdm import tqdm  # here: a module that makes bars need not load tqdm before it draws one

    options.setdefault("file", sys.stderr)
    return tqdm(iterable, disable=None if enabled else True, **options)
