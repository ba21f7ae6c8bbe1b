"""Before/after tokens/s of the same bench lines: per (batch, line), all samples of every round of a tree pooled;
ratio after ÷ before of medians, and per round pairs (round i of before against round i of after)."""
import json, statistics, sys
from collections import defaultdict

def load(prefix, rounds):
    per = defaultdict(list)
    per_round = defaultdict(dict)
    for r in rounds:
        try:
            d = json.load(open(f"{prefix}-{r}/bench.json"))
        except FileNotFoundError:
            continue
        by = defaultdict(list)
        for s in d["samples"]:
            key = (s["batch"], s["method"])
            per[key].append(s["tokens_per_s"])
            by[key].append(s["tokens_per_s"])
        for key, v in by.items():
            per_round[key][r] = statistics.median(v)
    return per, per_round

for name, rounds in (("", (1, 2)), ("fixed-", (1, 2, 3))):
    before, before_r = load(f"{name}before", rounds)
    after, after_r = load(f"{name}after", rounds)
    print(f"## {name or 'defaults-'}lines")
    print("| batch | line | before tok/s median (min–max) | after | after ÷ before (median of per-round ratios, min–max) |")
    print("|---|---|---|---|---|")
    for key in sorted(before):
        b, a = before[key], after[key]
        ratios = [after_r[key][r] / before_r[key][r] for r in rounds if r in after_r[key] and r in before_r[key]]
        print(f"| {key[0]} | {key[1]} | {statistics.median(b):.1f} ({min(b):.1f}–{max(b):.1f}) | "
              f"{statistics.median(a):.1f} ({min(a):.1f}–{max(a):.1f}) | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}–{max(ratios):.3f}) |")
    print()
