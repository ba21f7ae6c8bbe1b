"""``python -m clover.bench``'s command line (issue 62): its help states every option's default, reads as plain text,
and answers without importing torch (counted in a subprocess, not timed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from clover.bench.cli import build_parser, plain_text

ROOT = Path(__file__).resolve().parents[1]
OPTION_START = re.compile(r"^  -")


def option_entries(help_text: str) -> dict[str, str]:
    """Each option's entry of the options section (its first flag -> its lines, joined)."""
    section = help_text.split("\noptions:\n", 1)[1]
    entries: dict[str, str] = {}
    for line in section.splitlines():
        if OPTION_START.match(line):
            name = line.split()[0].rstrip(",")
            entries[name] = line
        elif entries and line.startswith("   "):
            entries[name] += " " + line.strip()
    return entries


def test_every_option_states_its_default():
    parser = build_parser()
    entries = option_entries(parser.format_help())
    flags = {action.option_strings[0] for action in parser._actions}  # noqa: SLF001 (argparse's own list)
    assert set(entries) == flags and len(flags) > 20, (sorted(flags - set(entries)), sorted(set(entries) - flags))
    missing = [name for name, entry in entries.items()
               if name != "-h" and "default" not in entry and "required" not in entry]
    assert not missing, f"options whose help states no default: {missing}"


def test_help_has_no_restructuredtext_markup():
    text = build_parser().format_help()
    assert "sweeps" in text and "``" not in text and not re.search(r":\w+:`", text), text[:400]
    assert plain_text("``a`` and :mod:`clover.bench.genai`") == "a and clover.bench.genai"


def test_help_imports_no_torch():
    code = ("import runpy, sys\nsys.argv = ['clover.bench', '--help']\ntry:\n"
            "    runpy.run_module('clover.bench', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('loaded:', *sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text, _, loaded = out.stdout.rpartition("loaded:")
    assert text.startswith("usage: python -m clover.bench"), text[:200]
    assert not loaded.split(), f"--help imports {loaded.split()[:5]}"
