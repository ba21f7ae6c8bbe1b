#!/usr/bin/env python
"""Replay the adaptive tree-budget chooser on measured acceptance, without timing noise (issue 14).

    python -m benchmarks.chooser_replay --engine engines/demo --prompts 24 --new-tokens 128 \\
        --work outputs/chooser-replay --output docs/results/defaults/chooser-replay.json

At batch 1 the chooser decides between speculative steps that barely pay and vanilla steps, from an
acceptance estimate that one noisy step moves; whether its settings give up speed against the best fixed
budget is hard to see in a timed benchmark, where run-to-run noise is as large as the effect. This replays
it instead:

1. **Acceptance tables** (the engine; minutes, kept in ``--work`` and reused): greedy continuations of
   MT-bench first turns; one causal target pass over prompt + continuation gives h0 at every position;
   every position is then a root, whose draft tree at each budget is built with the decode loop's own
   :func:`clover.tree.draft_tree_batch` (all roots of a prompt in one batch). Its accepted length is read
   off the known continuation: greedy decoding is lossless, so the continuation, and what a decode step
   from that position accepts, are the same at every budget.
2. **Replay** (pure Python, seconds): each setting decodes every prompt on these tables at batch 1, a fresh
   chooser per prompt, with step times from the engine's cost model plus the host overheads measured in
   the decode loop (``--host-ms``), fed back through ``observe_time`` as the decode loop does. Reports
   modelled tokens/s against vanilla's, for each setting and each fixed budget.

Clover and Medusa engines (Clover-2 needs its ``draft_prefill`` states: not replayed here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from clover.adaptive import DEFAULT_BUDGETS, AcceptanceModel, AdaptiveBudget, CostModel
from clover.attention import causal_packed_mask
from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.config import ConfigError, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.host_ops import as_numpy
from clover.kv_cache import KVCache
from clover.progress import progress_bar
from clover.prompts import encode_prompt, mtbench_first_turns
from clover.tree import draft_tree_batch


# -- 1. acceptance tables -------------------------------------------------------


def greedy_continuations(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    decoder = SpeculativeDecoder(engine, method="vanilla")
    results = decoder.generate([GenerationRequest(p, max_new_tokens=new_tokens) for p in prompts])
    return [r.token_ids for r in results]


def root_states(engine, sequence: list[int]) -> torch.Tensor:
    """h0 ``[L, H]`` of one causal target pass over ``sequence`` (what each decode step's root reads)."""
    spec = engine.spec
    cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, spec.dtype)
    rows = cache.add_rows(1)
    keys, values = cache.views(slice(rows.start, rows.stop))
    length = len(sequence)
    result = engine.target(torch.tensor([sequence]), torch.arange(length)[None], torch.zeros(1, dtype=torch.int32),
                           causal_packed_mask(1, length), keys, values)
    return result.h0[0]


def accepted_lengths(engine, h0: torch.Tensor, sequence: list[int], first: int, budget: int) -> np.ndarray:
    """int ``[L - first]``: draft tokens a greedy decode step with root ``sequence[j]`` (j >= first) accepts at
    ``budget``; its root state is h0 at j - 1, and its depth-d nodes must equal ``sequence[j + d]``."""
    roots = np.arange(first, len(sequence))
    batch = draft_tree_batch(engine.draft_step, h0[roots - 1], [sequence[j] for j in roots],
                             TreeConfig(budget=budget), engine.spec.num_draft_heads)
    depth = as_numpy(batch.position_offsets)                            # [R, T]
    padded = np.asarray(sequence + [-1] * (int(depth.max()) + 1))       # past the end nothing matches
    expected = padded[roots[:, None] + depth]                           # [R, T]
    matches = (as_numpy(batch.input_ids) == expected) & as_numpy(batch.valid)
    accepted = ~(as_numpy(batch.ancestors) & ~matches[:, None, :]).any(-1)
    return np.where(accepted, depth, 0).max(-1)


def build_tables(engine, prompts: list[list[int]], new_tokens: int, budgets: list[int]) -> list[dict]:
    tables = []
    continuations = greedy_continuations(engine, prompts, new_tokens)
    for prompt, tokens in progress_bar(list(zip(prompts, continuations)), desc="acceptance tables", unit="prompt"):
        sequence = prompt + tokens
        with torch.no_grad():
            h0 = root_states(engine, sequence)
        # the first root is the first generated token; its tree continues from the prompt's last state
        tables.append({"new_tokens": len(tokens), "accepted": {
            b: accepted_lengths(engine, h0, sequence, len(prompt), b).tolist() for b in budgets}})
    return tables


# -- 2. replay ---------------------------------------------------------------


@dataclasses.dataclass
class Setting:
    label: str
    fixed_budget: int | None = None      # None: adaptive
    decay: float = 0.95                  # AcceptanceModel: EMA weight of the past per sequence-step
    explore_every: int = 64


def decode_steps(table: dict) -> int:
    """Vanilla decode steps after the prompt pass (which gives the first token)."""
    return table["new_tokens"] - 1


def step_seconds(cost: CostModel, budget: int, tokens: int, depth: int, top_k: int, host: dict[int, float]) -> float:
    """Modelled batch-1 step that accepts ``tokens``: the cost model's step, plus the decode loop's host work."""
    extra = host["vanilla"] if budget == 0 else host["speculative"]
    return cost.step_time(1, budget, tokens, depth, top_k) + extra


def replay(table: dict, setting: Setting, cost: CostModel, depth: int, top_k: int, max_budget: int,
           host: dict) -> tuple[float, list[int]]:
    """Seconds to decode one prompt's continuation under ``setting``, and the budgets chosen."""
    chooser = None
    if setting.fixed_budget is None:
        chooser = AdaptiveBudget(cost, depth, top_k, max_budget, acceptance=AcceptanceModel(depth, decay=setting.decay),
                                 explore_every=setting.explore_every)
    accepted = table["accepted"]
    position, seconds, chosen = 0, 0.0, []
    while position < decode_steps(table):  # root `position`: the first generated token is position 0
        budget = chooser.choose(1) if chooser else setting.fixed_budget
        gained = accepted[budget][position] if budget else 0
        took = step_seconds(cost, budget, gained + 1, depth, top_k, host)
        if chooser:
            chooser.observe(budget, [gained])
            chooser.observe_time(1, budget, took, gained + 1)
        position += gained + 1
        seconds += took
        chosen.append(budget)
    return seconds, chosen


def summarize(tables: list[dict], settings: list[Setting], cost: CostModel, depth: int, top_k: int,
              max_budget: int, host: dict) -> list[dict]:
    vanilla = [decode_steps(t) * step_seconds(cost, 0, 1, depth, top_k, host) for t in tables]
    # the same prompts with useless heads (nothing ever accepted): what a setting loses where drafting never pays
    useless = [{**t, "accepted": {b: [0] * len(v) for b, v in t["accepted"].items()}} for t in tables]
    rows = []
    for setting in settings:
        runs = [replay(t, setting, cost, depth, top_k, max_budget, host) for t in tables]
        ratios = [v / s for v, (s, _) in zip(vanilla, runs)]
        steps = [b for _, chosen in runs for b in chosen]
        wasted = sum(replay(t, setting, cost, depth, top_k, max_budget, host)[0] for t in useless)
        rows.append({"setting": dataclasses.asdict(setting),
                     "speedup_total": sum(vanilla) / sum(s for s, _ in runs),
                     "speedup_useless_heads": sum(vanilla) / wasted,
                     "speedup_median_prompt": float(np.median(ratios)),
                     "speedup_min_prompt": min(ratios), "speedup_max_prompt": max(ratios),
                     "tokens_per_step": sum(decode_steps(t) for t in tables) / len(steps),
                     "vanilla_step_share": steps.count(0) / len(steps)})
    return rows


def default_settings(max_budget: int) -> list[Setting]:
    fixed = [Setting(f"fixed budget {b}", fixed_budget=b) for b in range(1, max_budget + 1)]
    adaptive = [Setting(f"adaptive, decay {d}, explore every {e}", decay=d, explore_every=e)
                for d in (0.9, 0.95, 0.97, 0.98) for e in (64, 16)]
    return fixed + adaptive


# -- command line -------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--engine", required=True, help="Clover or Medusa onnxruntime engine with a cost model")
    p.add_argument("--prompts", type=int, default=24, help="MT-bench first turns (3 per category for 24)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-budget", type=int, default=4, help="largest budget (clover generate's default: 4)")
    p.add_argument("--host-ms", type=float, nargs=2, default=(1.3, 3.6), metavar=("VANILLA", "SPECULATIVE"),
                   help="host work per batch-1 step outside onnxruntime, ms (clover.bench's host row)")
    p.add_argument("--work", required=True, help="directory for the acceptance tables (reused when present)")
    p.add_argument("--output", help="JSON with the tables' summary and every setting's result")
    args = p.parse_args(argv)

    engine = OnnxRuntimeEngine(args.engine)
    if engine.cost_model is None or not engine.spec.num_draft_heads or engine.spec.num_draft_kv_layers:
        raise ConfigError(f"{args.engine}: needs a Clover or Medusa engine with a cost model")
    spec, budgets = engine.spec, sorted({b for b in DEFAULT_BUDGETS if 0 < b <= args.max_budget})
    tables_file = Path(args.work) / f"tables-{args.prompts}x{args.new_tokens}-b{args.max_budget}.json"
    if tables_file.exists():
        tables = json.loads(tables_file.read_text())
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.engine)
        # round-robin over the categories, the questions training/evaluate.py --mtbench-limit takes
        prompts = [encode_prompt(tokenizer, row["prompt"]) for row in mtbench_first_turns(limit=args.prompts)]
        tables = build_tables(engine, prompts, args.new_tokens, budgets)
        tables_file.parent.mkdir(parents=True, exist_ok=True)
        tables_file.write_text(json.dumps(tables))
    for table in tables:
        table["accepted"] = {int(b): v for b, v in table["accepted"].items()}
    depth, top_k = spec.num_draft_heads, min(TreeConfig().top_k, spec.draft_top_k)
    host = {"vanilla": args.host_ms[0] / 1e3, "speculative": args.host_ms[1] / 1e3}
    rows = summarize(tables, default_settings(args.max_budget), engine.cost_model, depth, top_k, args.max_budget, host)
    for row in rows:
        print(f"{row['setting']['label']:40s} x{row['speedup_total']:.3f} (prompts {row['speedup_min_prompt']:.2f}-"
              f"{row['speedup_max_prompt']:.2f}), {row['tokens_per_step']:.2f} tokens/step, "
              f"{row['vanilla_step_share']:.0%} vanilla steps; useless heads x{row['speedup_useless_heads']:.3f}")
    if args.output:
        mean_tau = {b: 1 + float(np.mean([a for t in tables for a in t["accepted"][b]])) for b in budgets}
        Path(args.output).write_text(json.dumps({"command": " ".join(sys.argv), "engine": args.engine,
                                                 "prompts": len(tables), "host_ms": args.host_ms,
                                                 "tau_per_root": mean_tau, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
