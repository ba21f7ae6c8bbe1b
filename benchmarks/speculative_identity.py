"""Speculative decoding against the same engine's vanilla decoding, answer by answer (docs/quantized-target.md).

    python -m benchmarks.speculative_identity --engine engines/demo --batch-sizes 1,8 --max-new-tokens 128 \\
        --output docs/results/exact-int8/identity.json

Decodes MT-bench's first turns (chat template, greedy, at most ``--max-new-tokens``, stopping at EOS) with the
engine's defaults (``clover generate``'s: the heads' method, the engine's tree defaults) and with vanilla, at
each batch size, and counts the answers that are token for token the same; for the others, where they part.
Lossless decoding means all of them. The defaults' adaptive budget may choose few trees on a machine where they
cost much; ``--fixed-budget N`` also decodes with every step a tree of N drafts (no adaptive budget), so that
the identity is shown for trees too. Each speculative run reports its draft tokens proposed and accepted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from clover.backends import load_engine
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.progress import progress_bar
from clover.prompts import encode_prompt, mtbench_first_turns
from clover.target import load_tokenizer


def decode_all(engine, method: str, tree, prompts: list[list[int]], batch: int, max_new: int, what: str):
    """Greedy answers, ``batch`` requests in flight at a time (they join as others finish), and the draft tokens
    (proposed, accepted) over all of them."""
    decoder = SpeculativeDecoder(engine, method, tree, max_batch_size=batch)
    requests = [GenerationRequest(p, max_new_tokens=max_new) for p in prompts]
    with progress_bar(total=len(requests), desc=what, unit="answer") as bar:
        results = decoder.generate(requests, on_event=lambda event: bar.update(int(event.finished)))
    drafts = (sum(r.stats.num_draft_tokens for r in results), sum(sum(r.stats.accepted_per_step) for r in results))
    return [r.token_ids for r in results], drafts


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="engine directory (clover build)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (default: 1,8)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="MT-bench first turns to use (default: all 80)")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    p.add_argument("--fixed-budget", type=int, default=None,
                   help="also decode with a tree of this many drafts every step (default: the defaults only)")
    p.add_argument("--output", type=Path, required=True, help="JSON results")
    args = p.parse_args()
    engine = load_engine(args.engine, threads=args.threads)
    tokenizer = load_tokenizer(args.engine)
    questions = mtbench_first_turns(limit=args.num_prompts)
    prompts = [encode_prompt(tokenizer, q["prompt"]) for q in questions]
    method = engine.spec.default_method
    report = {"engine": str(args.engine), "method": method, "max_new_tokens": args.max_new_tokens,
              "questions": len(prompts), "target_quantization": engine.meta.target_quantization, "batches": {}}
    trees = {"defaults": engine.meta.tree_defaults}
    if args.fixed_budget:
        trees[f"budget {args.fixed_budget}"] = dataclasses.replace(engine.meta.tree_defaults, budget=args.fixed_budget,
                                                                   adaptive=False)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        vanilla, _ = decode_all(engine, "vanilla", None, prompts, batch, args.max_new_tokens, f"vanilla, batch {batch}")
        for name, tree in trees.items():
            ours, (proposed, accepted) = decode_all(engine, method, tree, prompts, batch, args.max_new_tokens,
                                                    f"{method} {name}, batch {batch}")
            parted = {questions[i]["id"]: first_difference(a, b) for i, (a, b) in enumerate(zip(ours, vanilla))
                      if a != b}
            key = str(batch) if name == "defaults" else f"{batch}, {name}"
            report["batches"][key] = {"identical": len(prompts) - len(parted), "of": len(prompts),
                                      "first_difference": parted, "tokens": sum(len(a) for a in vanilla),
                                      "draft_tokens_proposed": proposed, "draft_tokens_accepted": accepted}
            print(f"batch {batch}, {name}: {len(prompts) - len(parted)} of {len(prompts)} answers identical to "
                  f"vanilla ({proposed} draft tokens proposed, {accepted} accepted)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
