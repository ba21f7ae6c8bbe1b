"""Progress bars are drawn on a terminal only (issue 62): into a log file a redrawn bar leaves a line per update."""

from __future__ import annotations

import os
import re
import select
from pathlib import Path

from clover.progress import progress_bar

ROOT = Path(__file__).resolve().parents[1]


def _draw(stream, enabled: bool = True) -> int:
    with progress_bar(range(50), file=stream, enabled=enabled, mininterval=0) as bar:
        total = sum(1 for _ in bar)
    return total


def test_a_bar_into_a_file_writes_nothing_and_still_iterates(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as stream:
        assert _draw(stream) == 50
    assert log.read_text() == ""


def _read_all(fd: int) -> str:
    """Everything written to the terminal so far: one read of a pty returns what one write put there, not all."""
    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_a_bar_on_a_terminal_is_drawn_unless_disabled():
    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as terminal:
            assert _draw(terminal, enabled=False) == 50
            assert _draw(terminal) == 50
        drawn = _read_all(leader)
    finally:
        os.close(leader)
        os.close(follower)
    assert drawn.count(" 0/50 ") == 1 and "50/50" in drawn, drawn  # one bar drawn, start to end: the enabled one


def test_every_bar_goes_through_the_helper():
    """A direct tqdm(...) call would draw into log files again."""
    direct = [f"{path.relative_to(ROOT)}:{number}"
              for folder in ("clover", "training", "benchmarks", "scripts")
              for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "progress.py"
              for number, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\btqdm\(", line)]
    assert not direct, direct
