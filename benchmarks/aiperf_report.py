"""Summarize benchmarks/aiperf_sweep.sh: a Markdown table and a plot from aiperf's per-level JSON exports.

    python -m benchmarks.aiperf_report docs/results/openai

Reads ``OUT/raw/<method>/c<N>/profile_export_aiperf.json`` (aiperf 0.13 ``profile_export_aiperf.json``: one
object per metric with avg, min, max, p50, p90, p99, ...), writes ``OUT/results.md`` (the table) and
``OUT/aiperf_sweep.png``.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LABELS = {"vanilla": "vanilla", "auto": "clover (default, adaptive)"}


def load(out: Path) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(out.glob("raw/*/c*/profile_export_aiperf.json")):
        method, level = path.parent.parent.name, int(re.sub(r"\D", "", path.parent.name))
        runs.setdefault(method, {})[level] = json.loads(path.read_text())
    return runs


def stat(run: dict, key: str, field: str) -> float:
    value = run.get(key, {}).get(field)
    return float("nan") if value is None else float(value)


def table(runs: dict[str, dict[int, dict]]) -> str:
    rows = ["| method | concurrency | requests (errors) | output tokens/request, min-max | output tok/s | "
            "TTFT p50 (min-max) ms | TTFT p99 ms | ITL p50 (min-max) ms | ITL p99 ms |",
            "|---|---|---|---|---|---|---|---|---|"]
    levels = sorted({c for per in runs.values() for c in per})
    for c in levels:
        for method in sorted(runs, key=lambda m: list(LABELS).index(m) if m in LABELS else 99):
            r = runs[method].get(c)
            if r is None:
                continue
            errors = r.get("error_summary") or []
            n_err = sum(int(e.get("count", 1)) for e in errors) if isinstance(errors, list) else 0
            rows.append(
                f"| {LABELS.get(method, method)} | {c} | {stat(r, 'request_count', 'avg'):.0f} ({n_err}) | "
                f"{stat(r, 'output_sequence_length', 'min'):.0f}-{stat(r, 'output_sequence_length', 'max'):.0f} | "
                f"{stat(r, 'output_token_throughput', 'avg'):.1f} | "
                f"{stat(r, 'time_to_first_token', 'p50'):.0f} ({stat(r, 'time_to_first_token', 'min'):.0f}-"
                f"{stat(r, 'time_to_first_token', 'max'):.0f}) | {stat(r, 'time_to_first_token', 'p99'):.0f} | "
                f"{stat(r, 'inter_token_latency', 'p50'):.1f} ({stat(r, 'inter_token_latency', 'min'):.1f}-"
                f"{stat(r, 'inter_token_latency', 'max'):.1f}) | {stat(r, 'inter_token_latency', 'p99'):.1f} |")
    return "\n".join(rows)


def plot(runs: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_token_throughput", "avg", "output tokens/s (all requests)"),
              ("time_to_first_token", "p50", "TTFT p50 / p99 (ms)"),
              ("inter_token_latency", "p50", "inter-token latency p50 / p99 (ms)")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, field, title) in zip(axes, panels):
        for i, method in enumerate(sorted(runs)):
            levels = sorted(runs[method])
            color = f"C{i}"
            ax.plot(levels, [stat(runs[method][c], key, field) for c in levels], "o-", color=color,
                    label=LABELS.get(method, method) + (" p50" if field == "p50" else ""))
            if field == "p50":
                ax.plot(levels, [stat(runs[method][c], key, "p99") for c in levels], "s--", color=color, alpha=0.6,
                        label=LABELS.get(method, method) + " p99")
        ax.set_xscale("log", base=2)
        if field == "p50":
            ax.set_yscale("log")
        ax.set_xticks(sorted({c for per in runs.values() for c in per}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent requests (aiperf --concurrency)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("OpenAI endpoint under aiperf, demo engine (2 shared CPU cores: noisy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/openai")
    runs = load(out)
    if not runs:
        sys.exit(f"no aiperf results under {out}/raw")
    text = table(runs)
    (out / "results.md").write_text(text + "\n")
    print(text)
    plot(runs, out / "aiperf_sweep.png")
    print(f"wrote {out / 'results.md'} and {out / 'aiperf_sweep.png'}")


if __name__ == "__main__":
    main()
