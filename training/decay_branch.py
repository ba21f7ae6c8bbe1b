"""Anneal a training run's checkpoint into shippable heads, without touching the run: a decay branch.

    python -m training.decay_branch outputs/runs/scale-clover-eagle3 --output outputs/branches/scale-250

A run on a long schedule is still near its peak learning rate midway, so heads taken from its checkpoint are
not the heads it would ship if it stopped there (docs/drafter.md#training-at-scale-and-exact-resume). A branch starts from the
run's checkpoint (weights, optimizer, RNG, step S), trains the next N batches of the same plan while the
learning rate anneals from the run's rate at S to the run's floor, and then finishes as a run does: the
heads, the draft vocabulary and ``training_summary.json`` in OUTPUT, ready for ``training/evaluate.py`` and
``training/ship_heads.py``. The run keeps its own checkpoint and schedule; rerun the same command to
continue an interrupted branch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from clover.config import ConfigError
from training.run_dir import RUN_CONFIG_FILE, STATE_FILE, save_atomic
from training.train import train
from training.train_config import TrainConfig

BRANCH_FILE = "branch.json"  # where the branch came from: run, step S and N, fixed when it starts


def default_steps(from_step: int) -> int:
    """N: a tenth of the steps so far (the share warmup-stable-decay schedules anneal over), at least 10."""
    return max(10, round(from_step / 10))


def branch_config(run_dir: Path, output: Path, from_step: int, steps: int) -> TrainConfig:
    """The run's own settings, with the branch's output, decay and stop (the plan, hence the batches, are the run's)."""
    fields = json.loads((run_dir / RUN_CONFIG_FILE).read_text())["config"]
    cfg = TrainConfig(**{k: v for k, v in fields.items() if k in TrainConfig.__dataclass_fields__})
    return dataclasses.replace(cfg, output=str(output), decay_from=from_step, decay_steps=steps, stop_at=None,
                               eval_every=0, eval_epochs=False)


def start(run_dir: Path, output: Path, steps: int | None) -> dict:
    """Fix the branch's origin and adopt the run's checkpoint as the branch's first state; the origin if it has one."""
    record = output / BRANCH_FILE
    if record.exists():
        return json.loads(record.read_text())
    if not (run_dir / STATE_FILE).exists() or not (run_dir / RUN_CONFIG_FILE).exists():
        raise ConfigError(f"{run_dir}: no {STATE_FILE} and {RUN_CONFIG_FILE} (not a train.py run with a checkpoint)")
    state = torch.load(run_dir / STATE_FILE, map_location="cpu", weights_only=False)  # read once: the run may go on
    origin = {"run": str(run_dir), "from_step": state["step"], "steps": steps or default_steps(state["step"])}
    cfg = branch_config(run_dir, output, origin["from_step"], origin["steps"])
    output.mkdir(parents=True, exist_ok=True)
    state["resume_key"] = cfg.resume_key()  # the same weights and plan position, now this branch's checkpoint
    save_atomic(state, output / STATE_FILE)
    record.write_text(json.dumps(origin, indent=2) + "\n")
    return origin


def branch(run_dir: Path, output: Path, steps: int | None = None, target=None, threads: int | None = None,
           progress: bool = True) -> dict:
    """Train (or continue) the branch until its heads are written; returns its ``training_summary.json``."""
    origin = start(run_dir, output, steps)
    cfg = branch_config(Path(origin["run"]), output, origin["from_step"], origin["steps"])
    cfg = dataclasses.replace(cfg, progress=progress, threads=threads or cfg.threads)
    return train(cfg, target=target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a train.py output directory with train_state.pt (paused or running)")
    parser.add_argument("--output", type=Path, required=True, help="the branch's directory: its checkpoint, then its heads")
    parser.add_argument("--steps", type=int, default=None,
                        help="N, the steps the learning rate anneals over (default: a tenth of the run's steps so "
                             "far, at least 10); fixed when the branch starts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the run's)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        info = branch(args.run, args.output, args.steps, threads=args.threads, progress=not args.no_progress)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = info["config"]
    print(f"{args.output}: {info['method']} heads annealed from step {cfg['decay_from']} over {cfg['decay_steps']} "
          f"steps, at step {info['steps']} of {info['planned_steps']} ({info['assistant_tokens']:,} assistant tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
