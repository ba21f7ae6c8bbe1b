"""The files of a run directory and how they are written (docs/drafter.md#training).

``run_config.json`` claims the directory for one set of settings; ``train_state.pt`` is the
checkpoint (weights, optimizer, RNG, step), written atomically; ``train_log.jsonl`` and
``eval_log.jsonl`` are cut back to the checkpoint on resume, so a resumed run writes the same lines;
``training_summary.json`` marks a completed run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from clover.config import ConfigError
from training.distributed import Distributed
from training.train_config import TrainConfig

STATE_FILE, RUN_CONFIG_FILE, LOG_FILE, SUMMARY_FILE = "train_state.pt", "run_config.json", "train_log.jsonl", \
    "training_summary.json"
EVAL_LOG_FILE = "eval_log.jsonl"


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file, flushed to disk, then renamed over ``path``: a kill at any moment
    leaves the previous checkpoint or the new one, never a torn file."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointClock:
    """When a run writes its checkpoint: every ``every_steps`` steps, at the last step, and whenever
    ``every_seconds`` (0: never) have passed since the last write, so a kill, or the end of a session, loses at
    most that much work however long a step takes. Where the checkpoints fall never changes the weights: a
    checkpoint holds all a step depends on (docs/drafter.md#training)."""

    def __init__(self, every_steps: int, every_seconds: float, clock=None) -> None:
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.clock = clock or time.monotonic  # looked up here, so a test may replace this module's clock
        self.last = self.clock()

    def due(self, step: int, total_steps: int) -> bool:
        if step == total_steps or (self.every_steps and step % self.every_steps == 0):
            return True
        return bool(self.every_seconds) and self.clock() - self.last >= self.every_seconds

    def written(self) -> None:
        self.last = self.clock()


@dataclasses.dataclass
class Progress:
    """Where a run stands; saved in ``train_state.pt`` and restored on resume."""

    step: int = 0
    tokens_seen: int = 0    # assistant tokens of the batches done
    elapsed: float = 0.0    # training seconds of the earlier sessions of this run


def claim_output_on_main(cfg: TrainConfig, out: Path, dist: Distributed) -> dict | None:
    """:func:`claim_output` on rank 0; every rank gets its result, or raises its ConfigError."""
    claim = None
    if dist.is_main:
        try:
            claim = ("ok", claim_output(cfg, out))
        except ConfigError as exc:
            claim = ("error", str(exc))
    kind, value = dist.broadcast(claim)
    if kind == "error":
        raise ConfigError(value)
    return value


def claim_output(cfg: TrainConfig, out: Path) -> dict | None:
    """Record this run's settings in ``out``; the summary instead when the same run already completed there.

    Raises ConfigError when ``out`` holds a run with other settings.
    """
    run_config_path = out / RUN_CONFIG_FILE
    if run_config_path.exists():
        previous = json.loads(run_config_path.read_text())
        if previous.get("resume_key") != json.loads(json.dumps(cfg.resume_key())):
            changed = sorted(k for k in cfg.resume_key() if previous.get("resume_key", {}).get(k) != cfg.resume_key()[k])
            raise ConfigError(f"{out} holds a run with other settings ({', '.join(changed)}); "
                              "use another --output or delete it")
    summary_path = out / SUMMARY_FILE
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        if summary.get("complete"):
            return summary
    run_config_path.write_text(json.dumps({"resume_key": cfg.resume_key(), "config": dataclasses.asdict(cfg)},
                                          indent=2) + "\n")
    return None


def drop_log_lines_after(log_path: Path, step: int) -> None:
    """Drop log lines past the checkpoint: the resumed run writes them again, identically."""
    if log_path.exists():
        kept = [line for line in log_path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        log_path.write_text("".join(line + "\n" for line in kept))


def append_json_line(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run_digest(directory: str | Path) -> str:
    """sha256 of a saved drafter's tensors (names, dtypes, shapes, bytes), for comparing runs.

    Not of the file: safetensors writes its metadata in a random order."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(str(Path(directory) / "model.safetensors")).items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
