"""Write the heads of an unfinished training run's last checkpoint, to evaluate or try them mid-run.

    python -m training.experiments.snapshot_heads outputs/runs/sharegpt-clover2 outputs/snapshots/clover2-step40

``train.py`` saves the final heads only when a run finishes; its checkpoint
(``train_state.pt``, written every ``--save-every`` steps) holds the weights
so far. This writes them as a drafter directory (``config.json`` and fp16
``model.safetensors``, as ``train.py`` would) plus ``snapshot.json`` with the
step and tokens they were taken at. The run itself is not touched: run it
again to go on training.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from clover.config import ConfigError
from clover.drafters import save_drafter
from training.run_dir import RUN_CONFIG_FILE, STATE_FILE
from training.train import build_drafter
from training.train_config import TrainConfig


def snapshot(run_dir: Path, output: Path, target=None) -> dict:
    """Save the checkpoint's heads into ``output``; returns what ``snapshot.json`` records.

    ``target``: the run's target model if already loaded (default: load the run's ``--target``).
    """
    from clover.demo import resolve_target
    from clover.target import load_target

    state_path, config_path = run_dir / STATE_FILE, run_dir / RUN_CONFIG_FILE
    if not state_path.exists() or not config_path.exists():
        raise ConfigError(f"{run_dir}: no {STATE_FILE} and {RUN_CONFIG_FILE} (not a train.py run with a checkpoint)")
    fields = json.loads(config_path.read_text())["config"]
    known = {k: v for k, v in fields.items() if k in TrainConfig.__dataclass_fields__}
    cfg = TrainConfig(**known)
    target = target if target is not None else load_target(resolve_target(cfg.target, None))
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    drafter = build_drafter(cfg, target)
    drafter.load_state_dict(state["drafter"])
    save_drafter(drafter.eval(), output, dtype=torch.float16)
    info = {"run": str(run_dir), "step": state["step"], "tokens": state["tokens"], "method": cfg.method}
    (output / "snapshot.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a train.py output directory with train_state.pt")
    parser.add_argument("output", type=Path, help="directory for the heads (created; files in it are replaced)")
    args = parser.parse_args(argv)
    try:
        info = snapshot(args.run, args.output)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: {info['method']} heads at step {info['step']} ({info['tokens']} assistant tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
