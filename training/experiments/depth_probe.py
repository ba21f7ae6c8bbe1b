"""Why does a deeper tree not accept more? Acceptance per depth and the trees built (issue 12, part 4).

    python -m training.experiments.depth_probe --heads clover/assets/smollm2-135m-instruct/clover \\
        --depths 1,2,3 --budget 8 --prompts 6 --output docs/results/bench-heads5/probe.json

Greedy decoding, one sequence at a time, fixed tree (``TreeConfig(budget, depth,
adaptive=False)``) on MT-bench first turns. For every decode step it keeps the
tree the drafter built (the heads alone: no suffix candidates) and checks it
against the greedy output (the target's own tokens, so they are what
verification must accept):

* ``accepted``: draft tokens the decoder accepted;
* ``best``: the longest tree path that matches the output: what a correct
  verifier accepts. ``accepted == best`` at every step means verification is
  right and acceptance is limited by the tree's content (the heads);
* per depth d: steps whose tree reached d, steps that accepted a token at d, and
  steps where the tree held the correct token at d under a correct parent;
* ``teacher_forced``: the same heads run by the training forward
  (``training/train.py``) over the very prompt + output sequences: per head the
  share of positions whose top-1/top-5 holds the output's token given the true
  earlier tokens. If head 2 is right there but never in the trees, the decode
  loop feeds the heads wrongly; if it is rarely right there either, the heads are
  the limit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def record_trees(decoder) -> list[tuple]:
    """Every decode step's (tree tokens, parents, depths, accepted depth) of ``decoder``'s one sequence, kept as
    its proposer observes the step (the :class:`clover.proposers.Proposer` protocol's ``observe``)."""
    proposer, steps = decoder.proposer, []
    observe = proposer.observe

    def observed(batch, accepted):
        tree = batch.trees()[0]
        steps.append((list(tree.tokens), list(tree.parents), list(tree.depths), len(accepted[0].path) - 1))
        return observe(batch, accepted)

    proposer.observe = observed
    return steps


def best_path(tokens: list[int], parents: list[int], output: list[int], root_at: int) -> int:
    """Length of the longest tree path whose tokens equal ``output[root_at + 1:]``."""
    best, frontier, depth = 0, [0], 0
    while frontier:
        depth += 1
        if root_at + depth >= len(output):
            break
        frontier = [i for i, p in enumerate(parents) if p in frontier and tokens[i] == output[root_at + depth]]
        if frontier:
            best = depth
    return best


def analyse(steps: list[tuple], output: list[int], max_depth: int) -> dict:
    """Per-step checks of one sequence's trees against its greedy output (see the module docstring)."""
    reached, accepted_at, correct_at = [0] * max_depth, [0] * max_depth, [0] * max_depth
    mismatches, root_at, rows = 0, 0, []
    for tokens, parents, depths, accepted in steps:
        best = best_path(tokens, parents, output, root_at)
        mismatches += best != accepted and root_at + accepted + 1 < len(output)
        for d in range(1, max(depths) + 1):
            reached[d - 1] += 1
            accepted_at[d - 1] += accepted >= d
            correct_at[d - 1] += best >= d
        rows.append({"root_at": root_at, "nodes": len(tokens) - 1, "max_depth": max(depths), "accepted": accepted,
                     "best": best})
        root_at += accepted + 1
    return {"steps": len(steps), "accepted": sum(r["accepted"] for r in rows), "verifier_mismatches": mismatches,
            "depth_reached": reached, "depth_accepted": accepted_at, "depth_correct_in_tree": correct_at, "rows": rows}


def probe(engine, tokenizer, records: list[dict], depths: list[int], budget: int, max_new_tokens: int,
          drafter=None, target=None) -> dict:
    """Decode ``records`` at every depth; pooled checks per depth plus the first trees built (as text)."""
    from clover import decode as decode_module
    from clover.config import TreeConfig
    from training.evaluate import prompt_ids_of

    out = {}
    for depth in depths:
        pooled = {"steps": 0, "accepted": 0, "verifier_mismatches": 0, "depth_reached": [0] * depth,
                  "depth_accepted": [0] * depth, "depth_correct_in_tree": [0] * depth}
        examples, sequences = [], []
        for record in records:
            tree = TreeConfig(budget=budget, depth=depth, adaptive=False, proposer="none")  # the heads alone
            decoder = decode_module.SpeculativeDecoder(engine, engine.spec.default_method, tree, tokenizer)
            steps = record_trees(decoder)
            result = decoder.generate([decode_module.GenerationRequest(prompt_ids_of(record, tokenizer),
                                                                       max_new_tokens=max_new_tokens)])[0]
            one = analyse(steps, list(result.token_ids), depth)
            sequences.append((prompt_ids_of(record, tokenizer), list(result.token_ids)))
            for key in pooled:
                pooled[key] = [a + b for a, b in zip(pooled[key], one[key])] if isinstance(pooled[key], list) \
                    else pooled[key] + one[key]
            examples += [_tree_text(tokenizer, *s) for s in steps[:3]] if not examples else []
        pooled["tokens_per_step"] = 1 + pooled["accepted"] / max(1, pooled["steps"])
        pooled["first_trees"] = examples
        out[str(depth)] = pooled
    if drafter is not None:
        out["teacher_forced"] = teacher_forced_on_outputs(drafter, target, sequences)
    return out


def teacher_forced_on_outputs(drafter, target, sequences: list[tuple[list[int], list[int]]]) -> dict:
    """Per-head top-1/top-5 of the training forward on (prompt ids, greedy output) pairs."""
    import torch

    from training.hidden_cache import target_hidden_states
    from training.batches import Batch
    from training.forward import head_weights, run_batch

    num_heads = drafter.config.num_heads
    count, hits = [0] * num_heads, {1: [0] * num_heads, 5: [0] * num_heads}
    for prompt, output in sequences:
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            last_input, last_hidden = target_hidden_states(target, ids)
            mask = torch.arange(ids.shape[1])[None] >= len(prompt)
            batch = Batch(last_input, last_hidden, ids, mask, torch.tensor([ids.shape[1]]), ["mtbench"])
            stats = run_batch(drafter, target, target.lm_head.weight.float(), batch, row_chunk=1024,
                              weights=head_weights(num_heads, 1.0), train=False, topk=(1, 5))
        for i in range(num_heads):
            count[i] += stats["count"][i]
            for k in hits:
                hits[k][i] += stats["hits"][k][i]
    return {"count": count, **{f"top{k}": [h / c if c else 0.0 for h, c in zip(hits[k], count)] for k in hits}}


def _tree_text(tokenizer, tokens, parents, depths, accepted) -> dict:
    return {"accepted": accepted, "nodes": [{"token": tokenizer.decode([t]), "parent": p, "depth": d}
                                            for t, p, d in zip(tokens, parents, depths)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="clover/assets/smollm2-135m-instruct/clover")
    parser.add_argument("--target", default="demo")
    parser.add_argument("--depths", default="1,2,3")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=6, help="MT-bench first turns, round-robin over categories")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    from clover.backends.torch import TorchEngine
    from clover.demo import resolve_target
    from clover.drafters import load_drafter
    from clover.target import load_target, load_tokenizer
    from training.evaluate import mtbench_records

    target_dir = resolve_target(args.target)
    target, tokenizer = load_target(target_dir), load_tokenizer(target_dir)
    drafter = load_drafter(args.heads, target).float().eval()
    engine = TorchEngine(target, drafter, max_seq_len=1024)
    records = mtbench_records(None, args.prompts)
    result = probe(engine, tokenizer, records, [int(d) for d in args.depths.split(",")], args.budget,
                   args.max_new_tokens, drafter=drafter, target=target)
    report = {"heads": args.heads, "budget": args.budget, "prompts": len(records),
              "max_new_tokens": args.max_new_tokens, "by_depth": result}
    report["teacher_forced_on_outputs"] = result.pop("teacher_forced", {})
    print("teacher-forced on the outputs:", json.dumps(report["teacher_forced_on_outputs"]))
    for depth, r in result.items():
        print(f"depth {depth}: tokens/step {r['tokens_per_step']:.3f}, reached {r['depth_reached']}, "
              f"accepted {r['depth_accepted']}, correct in tree {r['depth_correct_in_tree']}, "
              f"verifier mismatches {r['verifier_mismatches']}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
