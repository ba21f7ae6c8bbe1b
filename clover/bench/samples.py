"""The samples of a benchmark run on disk, so a killed run resumes where it stopped (see :mod:`clover.bench.sweeps`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from clover.config import ConfigError


SAMPLES_FILE, PROGRESS_FILE = "samples.jsonl", "bench_progress.json"
# settings that change nothing measured: where the results go, what is printed, how the run starts; --quick
# only sets the defaults of other settings, which the key holds as resolved
NOT_IN_RUN_KEY = ("argv", "output", "silent", "fresh", "quick", "triton_startup_timeout")


def run_key(args) -> dict:
    """The settings that decide what a run measures (engine directories resolved): a resumed run must match."""
    key = {name: value for name, value in vars(args).items() if name not in NOT_IN_RUN_KEY}
    for name in ("engine", "medusa_engine"):
        if key.get(name):
            key[name] = str(Path(key[name]).resolve())
    key["extra_engine"] = [[label, str(Path(directory).resolve())] for label, directory in args.extra_engine]
    return json.loads(json.dumps(key))  # tuples as lists: compares equal to the copy read back from JSON


def sample_key(sample: dict) -> tuple:
    """What a sample measured: one per (sweep, configuration, x, repeat) in a run."""
    return sample["sweep"], sample["method"], sample["x"], sample["repeat"]


def _parse_sample(line: bytes) -> dict | None:
    try:
        sample = json.loads(line)
        sample_key(sample)
    except (ValueError, TypeError, KeyError):
        return None
    return sample


def _write_atomically(path: Path, text: str) -> None:
    """A kill leaves the old file or the new one, never half of one."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


class SampleStore:
    """The samples of a run in ``<output>/samples.jsonl``, one JSON line each, appended and flushed as each one
    is measured, and in ``<output>/bench_progress.json`` the run key they belong to (and a cost model
    calibrated by the run, so a resumed run's adaptive clover uses the same one).

    Opening it on a directory of another run (another key) raises :class:`ConfigError`; ``fresh`` discards
    what is there first.
    """

    def __init__(self, output: Path, key: dict, fresh: bool = False) -> None:
        output.mkdir(parents=True, exist_ok=True)
        self.path, self.progress_path = output / SAMPLES_FILE, output / PROGRESS_FILE
        if fresh:
            self.path.unlink(missing_ok=True)
            self.progress_path.unlink(missing_ok=True)
        self.progress = self._check_key(key)
        self.dropped = 0  # lines of samples.jsonl not read back: cut by a kill mid-write, or duplicates
        self.samples = self._load()

    def _check_key(self, key: dict) -> dict:
        retry = "pass --fresh to discard them and start over, or use another --output"
        if not self.progress_path.exists():
            if self.path.exists():
                raise ConfigError(f"{self.path} has samples but no {PROGRESS_FILE} saying what they measured; {retry}")
            progress = {"run_key": key}
            _write_atomically(self.progress_path, json.dumps(progress, indent=1) + "\n")
            return progress
        try:
            progress = json.loads(self.progress_path.read_text())
            stored = progress["run_key"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{self.progress_path} is unreadable; {retry}") from None
        if stored != key:
            changed = sorted(name for name in set(stored) | set(key) if stored.get(name) != key.get(name))
            raise ConfigError(f"{self.path.parent} holds samples of a run with other settings "
                              f"(different: {', '.join(changed)}); {retry}")
        return progress

    def _load(self) -> list[dict]:
        if not self.path.exists():
            return []
        *lines, cut = self.path.read_bytes().split(b"\n")  # cut: b"" unless a kill stopped a line mid-write
        samples, seen = [], set()
        for sample in filter(None, map(_parse_sample, lines)):
            if sample_key(sample) not in seen:
                seen.add(sample_key(sample))
                samples.append(sample)
        self.dropped = len(lines) - len(samples) + bool(cut)
        if self.dropped:  # rewritten, so the next sample does not start on the cut line
            _write_atomically(self.path, "".join(json.dumps(s) + "\n" for s in samples))
        return samples

    def add(self, sample: dict) -> None:
        """Appends ``sample`` and flushes it to disk before the next measurement starts."""
        with self.path.open("a") as f:
            f.write(json.dumps(sample) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.samples.append(sample)

    def remember(self, name: str, value) -> None:
        """Stores ``value`` with the run key (read back by a resumed run from :attr:`progress`)."""
        self.progress[name] = value
        _write_atomically(self.progress_path, json.dumps(self.progress, indent=1) + "\n")
