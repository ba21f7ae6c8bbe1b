"""Paired per-question comparison of two heads' MT-bench tau (issue 35's ablations).

    python -m training.experiments.paired_tau outputs/ablation35/eval-last/mtbench_rows/last \\
        outputs/ablation35/eval-eagle3/mtbench_rows/eagle3 --budgets 2,4,8,32

Each argument is a ``training/evaluate.py`` rows prefix: ``PREFIX-b{budget}.jsonl`` holds one row per question.
Decoding is greedy and lossless, so both heads decode the very same tokens for a question and its tau differs
only by the drafter: a per-question sign test (scipy's exact binomial test over the questions where the two
differ) says whether a small difference in the pooled tau is more than chance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def question_tau(prefix: str, budget: int) -> dict[int, float]:
    """tau (new tokens per target step) per question id, from one rows file."""
    path = Path(f"{prefix}-b{budget}.jsonl")
    if not path.exists():
        raise SystemExit(f"{path}: no such rows file (run training/evaluate.py --mtbench --budgets {budget})")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["id"]: row["new_tokens"] / row["steps"] for row in rows}


def compare(a: dict[int, float], b: dict[int, float]) -> dict:
    """B against A over the questions both hold: wins, losses, ties, mean difference, sign-test p-value."""
    from scipy.stats import binomtest

    shared = sorted(a.keys() & b.keys())
    if not shared:
        raise SystemExit("the two rows files share no question")
    diffs = [b[q] - a[q] for q in shared]
    wins, losses = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    p = binomtest(wins, wins + losses).pvalue if wins + losses else 1.0
    return {"questions": len(shared), "b_better": wins, "b_worse": losses, "ties": len(shared) - wins - losses,
            "mean_difference": sum(diffs) / len(diffs), "sign_test_p": p}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="rows prefix of heads A (the baseline)")
    parser.add_argument("b", help="rows prefix of heads B")
    parser.add_argument("--budgets", default="2,4,8,32", help="tree budgets to compare (comma-separated)")
    args = parser.parse_args(argv)
    print("| budget | questions | B better | B worse | ties | mean tau difference (B - A) | sign test p |")
    print("|---|---|---|---|---|---|---|")
    for budget in (int(x) for x in args.budgets.split(",")):
        r = compare(question_tau(args.a, budget), question_tau(args.b, budget))
        print(f"| {budget} | {r['questions']} | {r['b_better']} | {r['b_worse']} | {r['ties']} | "
              f"{r['mean_difference']:+.4f} | {r['sign_test_p']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
