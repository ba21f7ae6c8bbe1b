"""Learning curves and a recipe table from training runs' ``eval_log.jsonl`` (issue 12).

    python -m training.curves --run hard=outputs/runs/ablation-hard --run soft=outputs/runs/ablation-soft \\
        --output docs/results/heads-sharegpt

Per run: the last curve point (held-out teacher-forced top-1, top-5 and
``agree1``, the head's top-1 equal to the target's, per head), the assistant
tokens trained on and the wall time (``training_summary.json``). Writes
``curves.md`` and, with matplotlib, ``learning_curve.png`` (head-1 ``agree1``
and top-1 against training tokens; ``train.py --eval-every`` makes the points).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_run(directory: Path) -> dict:
    curve_path, summary_path = directory / "eval_log.jsonl", directory / "training_summary.json"
    curve = [json.loads(line) for line in curve_path.read_text().splitlines() if line] if curve_path.exists() else []
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if not summary and (directory / "run_config.json").exists():  # a run still under way: its settings only
        summary = {"config": json.loads((directory / "run_config.json").read_text())["config"]}
    return {"curve": curve, "summary": summary}


def table(runs: dict[str, dict]) -> str:
    lines = ["| run | labels | regression | tokens | wall s | head agree1 (target's top-1) | head top-1 (text) | "
             "head top-5 (text) |", "|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        last, cfg = (run["curve"] or [{}])[-1], run["summary"].get("config", {})
        fmt = (lambda key: "/".join(f"{v:.3f}" for v in last.get(key, [])) or "–")  # noqa: E731
        lines.append(f"| {name} | {cfg.get('labels', 'hard')} | {cfg.get('regression_weight', 0)} | "
                     f"{run['summary'].get('assistant_tokens', last.get('tokens', '–'))} | "
                     f"{run['summary'].get('wall_time_s', '–')} | {fmt('agree1')} | {fmt('top1')} | {fmt('top5')} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, key in zip(axes, ("agree1", "top1")):
        for name, run in runs.items():
            points = [p for p in run["curve"] if key in p]
            ax.plot([p["tokens"] for p in points], [p[key][0] for p in points], "o-", label=name)
        ax.set_xlabel("assistant tokens trained on")
        ax.set_title(f"head 1 {key}, held-out ShareGPT (teacher-forced)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, help="NAME=RUN_DIR (repeatable)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    runs = {item.partition("=")[0]: load_run(Path(item.partition("=")[2])) for item in args.run}
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    text = table(runs)
    (out / "curves.md").write_text(text)
    try:
        plot(runs, out / "learning_curve.png")
    except ImportError:
        print("matplotlib is not installed: no figure", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
