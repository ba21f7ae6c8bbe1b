"""Training throughput over a grid of settings, to choose a GPU run's (issue 47: at least 50,000 answer tokens/s for
the demo target on one H200).

    python -m training.experiments.throughput_sweep --device cuda --output outputs/throughput   # about 2 minutes
    python -m training.experiments.throughput_sweep --dry-run --output /tmp/sweep               # CPU, tiny shape

Runs :func:`training.experiments.cost_probe.probe` (the target's forward for online features plus ``train.py``'s
own optimizer step) for every combination of ``--batch-tokens``, ``--autocast`` and ``--target-dtype``, each in
turn on the same device, and writes ``sweep.json`` and ``sweep.md`` with online and answer tokens/s (half of a
probe sequence is the answer, so answer tokens are half the positions) and peak memory. A setting that runs out of
memory is recorded as such and the sweep goes on. Throughput says nothing about quality: a bf16 setting's heads
must still be compared with fp32's at equal steps (training/README.md#gpu-runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from clover.progress import progress_bar
from training.experiments import cost_probe

DRY_RUN = dict(shape="tiny", device="cpu", batch_tokens="256,512", autocast="none", target_dtype="fp32",
               seq_len=128, repeats=1)


def settings(args) -> list[dict]:
    """Every combination of the grid, as cost_probe arguments."""
    grid = itertools.product([int(b) for b in args.batch_tokens.split(",")], args.autocast.split(","),
                             args.target_dtype.split(","))
    return [dict(batch_tokens=tokens, autocast=None if autocast == "none" else autocast, target_dtype=dtype)
            for tokens, autocast, dtype in grid]


def probe_args(args, setting: dict) -> argparse.Namespace:
    """cost_probe's arguments for one setting (its own defaults for the rest)."""
    probe_parser = cost_probe.build_parser()
    defaults = vars(probe_parser.parse_args([]))
    defaults.update(target=args.target, shape=args.shape, device=args.device, seq_len=args.seq_len,
                    repeats=args.repeats, method=args.method, **setting)
    return argparse.Namespace(**defaults)


def run_one(args, setting: dict) -> dict:
    """cost_probe's result for ``setting``, plus answer tokens/s; ``{"error": ...}`` where it ran out of memory."""
    try:
        result = cost_probe.probe(probe_args(args, setting))
    except torch.OutOfMemoryError as exc:
        return {**setting, "error": f"out of memory: {str(exc).splitlines()[0]}"}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {**setting, **result, "answer_tokens_per_s": round(result["online_tokens_per_s"] / 2, 1)}


def markdown(rows: list[dict], command: str) -> str:
    lines = ["# Training throughput sweep", "", f"`{command}`", "",
             "| batch tokens | autocast | target dtype | online tokens/s | answer tokens/s | peak MB (step) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['batch_tokens']} | {row['autocast'] or 'none'} | {row['target_dtype']} | {row['error']} "
                         "| | |")
            continue
        lines.append(f"| {row['batch_tokens']} | {row['autocast'] or 'none'} | {row['target_dtype']} | "
                     f"{row['online_tokens_per_s']:,.0f} | {row['answer_tokens_per_s']:,.0f} | "
                     f"{row['peak_memory_mb']['train_step']} |")
    best = max((r for r in rows if "error" not in r), key=lambda r: r["answer_tokens_per_s"], default=None)
    if best is not None:
        lines += ["", f"Fastest: batch tokens {best['batch_tokens']}, autocast {best['autocast'] or 'none'}, target "
                      f"{best['target_dtype']}: {best['answer_tokens_per_s']:,.0f} answer tokens/s."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="demo", help="checkpoint directory or 'demo' (as cost_probe)")
    parser.add_argument("--shape", default=None, help="a random-weight target of a cost_probe shape instead")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--method", default="clover", help="the heads' method (as train.py --method)")
    parser.add_argument("--batch-tokens", default="8192,32768,131072",
                        help="comma-separated tokens per step (train.py's batch_tokens)")
    parser.add_argument("--autocast", default="none,bf16", help="comma-separated: none, bf16")
    parser.add_argument("--target-dtype", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per probe sequence")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")
    parser.add_argument("--dry-run", action="store_true", help="a tiny random target on the CPU, two settings")
    parser.add_argument("--output", required=True, help="directory for sweep.json and sweep.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        vars(args).update(DRY_RUN)
    rows = [run_one(args, setting) for setting in progress_bar(settings(args), desc="settings", unit="setting")]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m training.experiments.throughput_sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "sweep.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    (out / "sweep.md").write_text(markdown(rows, command))
    print((out / "sweep.md").read_text())
    return 0 if any("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
