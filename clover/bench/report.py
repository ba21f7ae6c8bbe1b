"""The benchmark's report: medians and ranges of the samples, the aims as paired ratios, bench.md and the PNGs."""

from __future__ import annotations

import statistics
from pathlib import Path

VANILLA_LINE = "vanilla"  # the line (sample "method") of plain decoding: the baseline of the speed ratios
# what each sweep reports per configuration (median and min–max over repeats)
METRICS = {"batch": ("tokens_per_s", "tokens_per_step", "target_ms", "draft_ms", "host_ms"),
           "budget": ("tokens_per_s", "tokens_per_step"),
           "heads": ("tokens_per_s", "tokens_per_step", "tree_depth"),
           "hf": ("tokens_per_s", "tokens_per_step"),
           "llamacpp": ("tokens_per_s", "tokens_per_step", "target_ms", "draft_ms", "host_ms"),
           "peers": ("tokens_per_s", "tokens_per_step"),
           "passes": ("target_ms",),
           "triton": ("tokens_per_s", "tokens_per_step", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}
METRIC_TITLES = {"tokens_per_s": "tokens/s", "tokens_per_step": "tokens/step",
                 "tree_depth": "tree depth reached (mean deepest level per step)",
                 "target_ms": "target pass (ms per step)", "draft_ms": "draft steps (ms per step)",
                 "host_ms": "host work: all but onnxruntime's runs (ms per step)",
                 "ttft_p50_ms": "time to first token p50 (ms)", "ttft_p99_ms": "time to first token p99 (ms)",
                 "itl_p50_ms": "inter-token latency p50 (ms)", "itl_p99_ms": "inter-token latency p99 (ms)"}


def summarize(samples: list[dict], key: str) -> dict | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def step_costs(cost_model, batch_sizes: list[int], budget: int, depth: int, top_k: int) -> list[dict]:
    """Where a speculative step's time goes, from the cost model (measured at calibration on this engine).

    Per batch size B: one vanilla step (a target pass over B tokens), one speculative step at ``budget``
    (a target pass over B(1+budget) tokens plus the draft steps, plus for Clover-2 its ``draft_prefill``
    over at least one accepted position per sequence), and their ratio: the tokens/step a
    speculative step must reach just to match vanilla tokens/s (a lower bound for Clover-2, whose prefill
    grows with the accepted tokens).
    """
    rows = []
    for batch in batch_sizes:
        vanilla = cost_model.target_time(batch)
        verify = cost_model.target_time(batch * (1 + budget))
        draft = cost_model.draft_time(batch, budget, depth, top_k)
        prefill = cost_model.draft_prefill_time(batch)  # 0 without draft_prefill
        rows.append({"batch": batch, "vanilla_ms": 1000 * vanilla, "verify_ms": 1000 * verify,
                     "draft_ms": 1000 * draft, "draft_prefill_ms": 1000 * prefill,
                     "break_even_tokens_per_step": (verify + draft + prefill) / vanilla})
    return rows


def paired_ratio(samples: list[dict], sweep: str, num: str, den: str, x) -> dict | None:
    """``num``'s tokens/s ÷ ``den``'s, one ratio per repeat, as :func:`summarize` gives them. A repeat runs every
    configuration of the sweep back to back on the same prompts, so the pair shares both: the ratio drops the
    prompts' and the machine's drift that the medians of each line keep."""
    rates = {(s["method"], s["repeat"]): s["tokens_per_s"] for s in samples
             if s["sweep"] == sweep and s["x"] == x and s.get("tokens_per_s")}
    ratios = [{"ratio": rate / rates[den, repeat]} for (method, repeat), rate in rates.items()
              if method == num and (den, repeat) in rates]
    return summarize(ratios, "ratio")


def aims(samples: list[dict]) -> list[dict]:
    """The issue's aims as measured ratios, paired per repeat (None where the run has no data for one)."""
    out = []

    def ratio(name, sweep, num, den, x, goal):
        stat = paired_ratio(samples, sweep, num, den, x)
        value = stat["median"] if stat else None
        out.append({"aim": name, "ratio": value, "min": stat and stat["min"], "max": stat and stat["max"],
                    "goal": goal, "met": None if value is None else value >= goal})

    ratio("default clover / vanilla tokens/s, batch 1", "batch", "default-clover", VANILLA_LINE, 1, 2.0)
    ratio("clover (fixed budget) / vanilla tokens/s, batch 1", "batch", "clover", VANILLA_LINE, 1, 2.0)
    ratio("clover / transformers generate() greedy, batch 1", "hf", "clover", "hf-greedy", 1, 5.0)
    # docs/trees.md#model-free-candidates: the proposer alone, as `--method suffix` runs it
    ratio("default suffix / vanilla tokens/s, batch 1", "batch", "default-suffix", VANILLA_LINE, 1, 1.15)
    # docs/quantized-target.md: against llama.cpp on the same GGUF, and the quantized engine against fp32
    ratio("vanilla / fp32 engine's vanilla (--vanilla-engine fp32=DIR), batch 1", "llamacpp", VANILLA_LINE,
          "vanilla-fp32", 1, 2.0)
    ratio("default clover / llama.cpp greedy, batch 1", "llamacpp", "default-clover", "llamacpp-greedy", 1, 1.0)
    ratio("default clover / llama.cpp prompt lookup, batch 1", "llamacpp", "default-clover",
          "llamacpp-prompt-lookup", 1, 1.0)
    # docs/results/lean-graph: against ONNX Runtime's own LLM runtime and llama.cpp, and the pass itself
    ratio("vanilla / onnxruntime-genai greedy, batch 1", "peers", VANILLA_LINE, "genai-greedy", 1, 1.0)
    ratio("default clover / onnxruntime-genai greedy, batch 1", "peers", "default-clover", "genai-greedy", 1, 1.3)
    ratio("default clover / llama.cpp greedy, batch 1 (peers sweep)", "peers", "default-clover", "llamacpp-greedy", 1,
          2.0)
    for tokens in (1, 8):  # within 1.1x of the builder graph's pass time: its speed at least 1/1.1 of it
        ratio(f"target pass speed / builder graph's, T = {tokens}", "passes", "clover", "genai-graph", tokens, 1 / 1.1)
    for x in sorted({s["x"] for s in samples if s["sweep"] == "batch" and s["method"] == VANILLA_LINE}):
        ratio(f"default clover / vanilla tokens/s, batch {x}", "batch", "default-clover", VANILLA_LINE, x, 0.95)
        ratio(f"adaptive clover / vanilla tokens/s, batch {x}", "batch", "adaptive-clover", VANILLA_LINE, x, 1.0)
    return out


# -- report -------------------------------------------------------------------


def _cell(stat: dict | None, digits: int = 1) -> str:
    if not stat:
        return "–"
    return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}–{stat['max']:.{digits}f})"


def markdown(report: dict) -> str:
    lines = ["# Clover benchmark", "", f"Command: `{report['command']}`", ""]
    hw = report["hardware"]
    lines += [f"Hardware: {hw.get('cpu', hw['processor'])}, {hw['cpu_count']} CPUs; torch {hw['torch']}, "
              f"onnxruntime {hw['onnxruntime']}, Python {hw['python']}; exact int8 CPU target kernel: "
              f"{hw.get('cpu_target_kernel', 'not recorded')}.", "",
              *([f"<details><summary>lscpu</summary>", "", "```", hw["lscpu"].rstrip(), "```", "", "</details>", ""]
                if hw.get("lscpu") else []),
              f"Settings: {report['settings']['repeats']} repeats, {report['settings']['max_new_tokens']} new tokens "
              f"per sequence, interleaved; cells are median (min–max).", ""]
    for sweep, data in report["sweeps"].items():
        methods = list(data["methods"])
        xs = sorted({x for m in data["methods"].values() for x in m["x"]})
        for key in METRICS[sweep]:
            title, digits = METRIC_TITLES[key], 1 if key == "tokens_per_s" or key.endswith("_ms") else 2
            lines += [f"## {sweep}: {title}", "", f"| {data['x_label']} | " + " | ".join(methods) + " |",
                      "|---|" + "---|" * len(methods)]
            for x in xs:
                cells = []
                for m in methods:
                    entry = data["methods"][m]
                    cells.append(_cell(entry[key][entry["x"].index(x)], digits) if x in entry["x"] else "–")
                lines.append(f"| {x} | " + " | ".join(cells) + " |")
            lines.append("")
    adaptive = [s for s in report["samples"] if "budgets" in s]
    if adaptive:
        lines += ["## Budgets chosen by the adaptive lines (steps per budget, all repeats)", "",
                  "| line | batch | budgets |", "|---|---|---|"]
        for method, batch in sorted({(s["method"], s["batch"]) for s in adaptive}):
            counts: dict[str, int] = {}
            for s in adaptive:
                if (s["method"], s["batch"]) == (method, batch):
                    for b, n in s["budgets"].items():
                        counts[b] = counts.get(b, 0) + n
            chosen = ", ".join(f"{b}: {n}" for b, n in sorted(counts.items(), key=lambda kv: int(kv[0])))
            lines.append(f"| {method} | {batch} | {chosen} |")
        lines.append("")
    if report.get("step_costs"):
        batch = report["sweeps"].get("batch", {}).get("methods", {}).get("clover")
        lines += [f"## Step cost at tree budget {report['settings']['budget']} (from the engine's cost model)", "",
                  "A speculative step pays only where its tokens/step exceed the break-even ratio "
                  "(speculative step time / vanilla step time). The cost model was measured when the engine was "
                  "calibrated, on this machine; tree building is an upper bound (it may stop early).", "",
                  "| batch | vanilla step (ms) | verify pass (ms) | draft steps (ms) | break-even tokens/step "
                  "| clover tokens/step (measured) |", "|---|---|---|---|---|---|"]
        for row in report["step_costs"]:
            measured = "–"
            if batch and row["batch"] in batch["x"]:
                measured = _cell(batch["tokens_per_step"][batch["x"].index(row["batch"])], 2)
            draft = f"{row['draft_ms']:.1f}"
            if row.get("draft_prefill_ms"):  # Clover-2's draft_prefill, apart
                draft += f" + {row['draft_prefill_ms']:.1f} draft_prefill"
            lines.append(f"| {row['batch']} | {row['vanilla_ms']:.1f} | {row['verify_ms']:.1f} | {draft} "
                         f"| {row['break_even_tokens_per_step']:.2f} | {measured} |")
        lines.append("")
    lines += ["## Aims", "", "Ratios taken per repeat (both lines ran back to back on the same prompts), then their "
              "median (min–max).", "", "| aim | measured | goal | met |", "|---|---|---|---|"]
    for aim in report["aims"]:
        measured = "–" if aim["ratio"] is None else f"{aim['ratio']:.2f}× ({aim['min']:.2f}–{aim['max']:.2f})"
        met = "–" if aim["met"] is None else ("yes" if aim["met"] else "**no**")
        lines.append(f"| {aim['aim']} | {measured} | {aim['goal']:.3g}× | {met} |")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(lines)


def plot(report: dict, output: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for sweep, data in report["sweeps"].items():
        keys = {"batch": ["tokens_per_s"], "hf": ["tokens_per_s"], "peers": ["tokens_per_s"], "passes": ["target_ms"],
                "triton": ["tokens_per_s", "ttft_p50_ms", "itl_p50_ms"]}.get(sweep, ["tokens_per_s", "tokens_per_step"])
        fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4.5), squeeze=False)
        for ax, key in zip(axes[0], keys):
            for i, (name, entry) in enumerate(data["methods"].items()):
                points = [(x, s) for x, s in zip(entry["x"], entry[key]) if s]
                if not points:
                    continue
                xs = [x for x, _ in points]
                med = [s["median"] for _, s in points]
                err = [[s["median"] - s["min"] for _, s in points], [s["max"] - s["median"] for _, s in points]]
                if sweep == "hf":
                    ax.bar([i], med, yerr=[[e] for e in (err[0][0], err[1][0])], capsize=4, label=name)
                else:
                    ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=name)
            if sweep == "hf":
                ax.set_xticks(range(len(data["methods"])), list(data["methods"]), rotation=20)
            else:
                ax.set_xscale("log", base=2)
                ax.set_xlabel(data["x_label"])
            ax.set_ylabel(METRIC_TITLES[key])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{sweep} sweep (median, min–max over {report['settings']['repeats']} repeats)")
        fig.tight_layout()
        path = output / f"{sweep}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
