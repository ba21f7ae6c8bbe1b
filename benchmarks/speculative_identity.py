"""Speculative decoding against the same engine's vanilla decoding, answer by answer (docs/quantized-target.md).

    python -m benchmarks.speculative_identity --engine engines/demo --batch-sizes 1,8 --max-new-tokens 128 \\
        --output docs/results/exact-int8/identity.json

Decodes MT-bench's first turns (chat template, greedy, at most ``--max-new-tokens``, stopping at EOS) with the
engine's defaults (``clover generate``'s: the heads' method, the engine's tree defaults) and with vanilla, at
each batch size, and counts the answers that are token for token the same; for the others, where they part.
Lossless decoding means all of them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clover.backends import load_engine
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.progress import progress_bar
from clover.prompts import encode_prompt, mtbench_first_turns
from clover.target import load_tokenizer


def decode_all(engine, method: str, prompts: list[list[int]], batch: int, max_new: int, what: str) -> list[list[int]]:
    """Greedy answers, ``batch`` requests in flight at a time (they join as others finish)."""
    decoder = SpeculativeDecoder(engine, method, engine.meta.tree_defaults, max_batch_size=batch)
    requests = [GenerationRequest(p, max_new_tokens=max_new) for p in prompts]
    with progress_bar(total=len(requests), desc=what, unit="answer") as bar:
        results = decoder.generate(requests, on_event=lambda event: bar.update(int(event.finished)))
    return [r.token_ids for r in results]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="engine directory (clover build)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (default: 1,8)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="MT-bench first turns to use (default: all 80)")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    p.add_argument("--output", type=Path, required=True, help="JSON results")
    args = p.parse_args()
    engine = load_engine(args.engine, threads=args.threads)
    tokenizer = load_tokenizer(args.engine)
    questions = mtbench_first_turns(limit=args.num_prompts)
    prompts = [encode_prompt(tokenizer, q["prompt"]) for q in questions]
    method = engine.spec.default_method
    report = {"engine": str(args.engine), "method": method, "max_new_tokens": args.max_new_tokens,
              "questions": len(prompts), "target_quantization": engine.meta.target_quantization, "batches": {}}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        vanilla = decode_all(engine, "vanilla", prompts, batch, args.max_new_tokens, f"vanilla, batch {batch}")
        ours = decode_all(engine, method, prompts, batch, args.max_new_tokens, f"{method}, batch {batch}")
        parted = {questions[i]["id"]: first_difference(a, b) for i, (a, b) in enumerate(zip(ours, vanilla)) if a != b}
        report["batches"][str(batch)] = {"identical": len(prompts) - len(parted), "of": len(prompts),
                                         "first_difference": parted,
                                         "tokens": sum(len(a) for a in vanilla)}
        print(f"batch {batch}: {len(prompts) - len(parted)} of {len(prompts)} answers identical to vanilla")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
