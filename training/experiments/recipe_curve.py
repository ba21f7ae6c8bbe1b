"""Teacher-forced agreement against training tokens, one line per recipe, on the same axes (issue 28).

    python -m training.experiments.recipe_curve \\
        --point residual=40k:outputs/h28/eval-tf/eval.json:residual \\
        --point residual=330k:outputs/h28/eval-full/eval.json:residual \\
        --point concat-topk=40k:... --output docs/results/heads-token-path

Each ``--point RECIPE=TOKENS:EVAL_JSON:RUN`` takes run RUN of a ``training/evaluate.py`` report (its
teacher-forced ``agree1``: the head's top-1 equals the target's top-1, on the report's held-out cache) and
places it at TOKENS loss positions trained on (``k`` and ``M`` suffixes allowed). Points of one recipe are
joined in token order. Writes ``recipe_curve.png`` (one panel per head) and ``recipe_curve.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SUFFIXES = {"k": 1e3, "M": 1e6}


def parse_tokens(text: str) -> float:
    scale = SUFFIXES.get(text[-1:], 1.0)
    return float(text[:-1] if text[-1:] in SUFFIXES else text) * scale


def parse_point(text: str) -> tuple[str, float, Path, str]:
    try:
        recipe, rest = text.split("=", 1)
        tokens, report, run = rest.split(":")
        return recipe, parse_tokens(tokens), Path(report), run
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RECIPE=TOKENS:EVAL_JSON:RUN, got {text!r}") from None


def agreement(report: Path, run: str) -> list[float]:
    runs = json.loads(report.read_text())["runs"]
    if run not in runs:
        raise SystemExit(f"{report}: no run {run!r} (it has {', '.join(runs)})")
    return runs[run]["teacher_forced"]["overall"]["agree1"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", type=parse_point, action="append", required=True,
                        help="RECIPE=TOKENS:EVAL_JSON:RUN (repeatable)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    curves: dict[str, list[tuple[float, list[float]]]] = {}
    for recipe, tokens, report, run in args.point:
        curves.setdefault(recipe, []).append((tokens, agreement(report, run)))
    args.output.mkdir(parents=True, exist_ok=True)
    lines = ["| recipe | loss positions trained on | agreement, head 1 | head 2 | head 3 |", "|---|---|---|---|---|"]
    for recipe, points in curves.items():
        points.sort()
        lines += [f"| {recipe} | {tokens:,.0f} | " + " | ".join(f"{a:.3f}" for a in agree) + " |"
                  for tokens, agree in points]
    (args.output / "recipe_curve.md").write_text("\n".join(lines) + "\n")
    _plot(curves, args.output / "recipe_curve.png")
    print("\n".join(lines))
    return 0


def _plot(curves: dict[str, list[tuple[float, list[float]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = max(len(agree) for points in curves.values() for _, agree in points)
    fig, axes = plt.subplots(1, heads, figsize=(4 * heads, 3.4), sharey=True)
    for head, axis in enumerate(axes):
        for recipe, points in curves.items():
            axis.plot([t for t, _ in points], [a[head] for _, a in points], marker="o", label=recipe)
        axis.set_xscale("log")
        axis.set_title(f"head {head + 1}")
        axis.set_xlabel("loss positions trained on")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("agreement with the target's top-1")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
