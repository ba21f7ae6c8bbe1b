"""How often bf16 decoding, vanilla and speculative, keeps the fp32 reference's tokens (issue 44's precision policy).

    python -m training.experiments.bf16_agreement --output outputs/bf16_agreement    # all 80 MT-bench first turns
    python -m training.experiments.bf16_agreement --questions 2 --max-new-tokens 8   # a smoke run

In bf16 a token's logits move slightly with the shape of the pass, so speculative decoding (a pass over a tree) need
not emit vanilla bf16's tokens, nor the fp32 reference's. The policy (docs/gpu-engine.md#precision): Clover in bf16
must agree with fp32 no less often than vanilla bf16 does, within the noise. This decodes the demo target
(SmolLM2-135M-Instruct) with its shipped Clover heads on the device engine (``--device``: the CPU's bf16 kernels
here, a GPU's there; the arithmetic, hence the figures, differ between them) greedily on MT-bench first turns:
fp32 vanilla (the reference), bf16 vanilla, and bf16 Clover at fixed budgets, heads alone and with suffix
candidates. Per bf16 run: the share of questions whose tokens equal the reference's, the mean number of leading
tokens shared with it, tau; and per Clover run, paired against bf16 vanilla per question (the leading tokens shared
with fp32: better / worse / tied, sign test). Writes ``bf16_agreement.json`` (raw rows with token ids) and
``bf16_agreement.md`` to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from training.experiments import doc_parser

REFERENCE, VANILLA = "fp32 vanilla", "bf16 vanilla"


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def decode(engine, tokenizer, records: list[dict], budget: int, variant: str, args) -> dict[int, dict]:
    """``training/evaluate.py``'s rows with token ids, by question id."""
    from training.evaluate import decode_rows

    rows = decode_rows(engine, tokenizer, records, tree_budget=budget, max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size, progress=not args.no_progress, variant=variant, keep_tokens=True)
    return {row["id"]: row for row in rows}


def summarize(name: str, rows: dict[int, dict], reference: dict[int, dict], vanilla: dict[int, dict]) -> dict:
    """One bf16 run against the fp32 reference, and (paired per question) against bf16 vanilla's agreement."""
    from training.experiments.paired_tau import compare

    questions = sorted(rows.keys() & reference.keys() & vanilla.keys())
    prefix = {q: shared_prefix(rows[q]["token_ids"], reference[q]["token_ids"]) for q in questions}
    vanilla_prefix = {q: shared_prefix(vanilla[q]["token_ids"], reference[q]["token_ids"]) for q in questions}
    steps = sum(rows[q]["steps"] for q in questions)
    return {"run": name, "questions": len(questions),
            "equal_to_fp32": sum(rows[q]["token_ids"] == reference[q]["token_ids"] for q in questions),
            "equal_to_bf16_vanilla": sum(rows[q]["token_ids"] == vanilla[q]["token_ids"] for q in questions),
            "mean_shared_prefix": sum(prefix.values()) / len(questions),
            "tau": sum(rows[q]["new_tokens"] for q in questions) / steps if steps else 0.0,
            "paired_against_bf16_vanilla": compare(vanilla_prefix, prefix)}


def markdown(summaries: list[dict], settings: dict) -> str:
    lines = [f"{settings['questions_decoded']} MT-bench first turns, {settings['max_new_tokens']} new tokens, greedy, "
             f"batches of {settings['batch_size']}, on {settings['device']}\n",
             "| run | = fp32 (questions) | = bf16 vanilla | mean leading tokens = fp32 | tau | shared prefix vs "
             "bf16 vanilla: better / worse / tied | sign test p |", "|---|---|---|---|---|---|---|"]
    for s in summaries:
        paired = s["paired_against_bf16_vanilla"]
        lines.append(f"| {s['run']} | {s['equal_to_fp32']}/{s['questions']} | {s['equal_to_bf16_vanilla']}/"
                     f"{s['questions']} | {s['mean_shared_prefix']:.1f} | {s['tau']:.3f} | {paired['b_better']} / "
                     f"{paired['b_worse']} / {paired['ties']} | {paired['sign_test_p']:.3f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = doc_parser(__doc__)
    parser.add_argument("--questions", type=int, default=None, help="first N MT-bench questions (default: all 80)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per question (default 128)")
    parser.add_argument("--budgets", default="8,32", help="Clover's fixed tree budgets, comma-separated (default 8,32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences decoded together (default 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--output", default="outputs/bf16_agreement", help="directory for the JSON and Markdown")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (one per decode)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from clover.backends.device import DeviceEngine
    from clover.target import load_tokenizer
    from training.evaluate import mtbench_records

    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {dtype: DeviceEngine.from_checkpoint("demo", None, "clover", max_seq_len=1024, device=args.device,
                                                   dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    tokenizer = load_tokenizer(engines[torch.float32].checkpoint_dir)
    records = mtbench_records(None, args.questions)
    runs = {REFERENCE: decode(engines[torch.float32], tokenizer, records, 0, "heads", args),
            VANILLA: decode(engines[torch.bfloat16], tokenizer, records, 0, "heads", args)}
    for budget in (int(b) for b in args.budgets.split(",")):
        for variant in ("heads", "heads+suffix"):
            runs[f"bf16 Clover, budget {budget}, {variant}"] = decode(engines[torch.bfloat16], tokenizer, records,
                                                                      budget, variant, args)
    summaries = [summarize(name, rows, runs[REFERENCE], runs[VANILLA]) for name, rows in runs.items()
                 if name != REFERENCE]
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "no_progress")}
    settings.update(questions_decoded=len(runs[REFERENCE]), torch=torch.__version__)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": settings, "summaries": summaries, "runs": {k: list(v.values()) for k, v in runs.items()}}
    (out / "bf16_agreement.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "bf16_agreement.md").write_text(markdown(summaries, settings))
    print(markdown(summaries, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
