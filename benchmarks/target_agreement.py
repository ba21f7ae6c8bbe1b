"""How often a quantized target's greedy tokens agree with the fp32 engine's (docs/quantized-target.md#agreement).

    python -m benchmarks.target_agreement --reference engines/qt-fp32 \\
        --engines engines/qt-q4-fp32,engines/qt-q4-int8,engines/qt-int8-int8 --llama-cpp \\
        --max-new-tokens 128 --output docs/results/quantized-target/agreement.json

Every engine decodes greedily (vanilla, batch 1) on MT-bench first turns (chat template, stop at EOS, at most
``--max-new-tokens``). Two rates per engine against the fp32 reference engine:

- ``teacher_forced``: one pass over prompt + the reference's continuation; the share of generated positions
  where the engine's argmax is the reference's token (each position judged on the same prefix, so one early
  difference does not count again for every token after it);
- ``prompts_without_difference``: questions where every teacher-forced position agrees;
- with ``--free-running``, ``identical``: the share of questions whose free-running greedy output is token for
  token the reference's; ``first_divergence`` lists where the others part.

Where they differ the reference's own top-2 logit gap at that position is recorded: differences at
near-ties are what a different rounding is expected to flip. ``--llama-cpp`` measures llama.cpp on the same
GGUF the same way (llama-cpp-python, optional extra ``llamacpp``), and ``--genai DIR`` onnxruntime-genai's model
builder graph of the reference engine's target, built into DIR (optional extra ``bench``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from clover.attention import causal_packed_mask
from clover.backends import load_engine
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.progress import progress_bar
from clover.prompts import encode_prompt, mtbench_first_turns
from clover.target import load_tokenizer


def full_pass_logits(engine, ids: list[int]) -> torch.Tensor:
    """``[L, V]`` logits of one causal pass over ``ids`` from an empty cache."""
    spec = engine.spec
    empty = [torch.zeros(1, spec.num_kv_heads, 0, spec.head_dim) for _ in range(spec.num_kv_layers)]
    return engine.target(torch.tensor([ids]), torch.arange(len(ids))[None], torch.zeros(1, dtype=torch.int32),
                         causal_packed_mask(1, len(ids)), empty, empty).logits[0].float()


def greedy(engine, prompt: list[int], max_new: int, eos: int) -> list[int]:
    request = GenerationRequest(prompt, max_new_tokens=max_new, stop_token_ids=(eos,))
    return SpeculativeDecoder(engine, "vanilla").generate([request])[0].token_ids


def compare(reference_tokens: list[int], reference_logits: torch.Tensor, logits: torch.Tensor, tokens: list[int],
            prompt_len: int) -> dict:
    """One question: teacher-forced matches (over the reference's continuation) and the free-running result."""
    positions = range(prompt_len - 1, prompt_len - 1 + len(reference_tokens))
    chosen = logits[list(positions)].argmax(-1).tolist()
    gaps = []
    for i, (want, got) in enumerate(zip(reference_tokens, chosen)):
        if want != got:
            row = reference_logits[prompt_len - 1 + i]
            gaps.append(round(float(row[want] - row[got]), 5))
    row = {"positions": len(reference_tokens), "matches": len(reference_tokens) - len(gaps), "gaps_at_differences": gaps}
    if tokens is not None:  # free running (--free-running)
        row["identical"] = tokens == reference_tokens
        row["first_divergence"] = next((i for i, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b),
                                       None if row["identical"] else min(len(tokens), len(reference_tokens)))
    return row


def summarize(rows: list[dict]) -> dict:
    positions, matches = sum(r["positions"] for r in rows), sum(r["matches"] for r in rows)
    gaps = [g for r in rows for g in r["gaps_at_differences"]]
    summary = {"questions": len(rows), "teacher_forced": matches / positions, "positions": positions,
               "teacher_forced_differences": positions - matches,
               "prompts_without_difference": sum(not r["gaps_at_differences"] for r in rows) / len(rows),
               "reference_gap_at_differences_median": statistics.median(gaps) if gaps else None,
               "reference_gap_at_differences_max": max(gaps) if gaps else None}
    if rows and "identical" in rows[0]:
        summary["identical"] = sum(r["identical"] for r in rows) / len(rows)
        summary["first_divergence"] = sorted(r["first_divergence"] for r in rows if r["first_divergence"] is not None)
    return summary


class LlamaCppGreedy:
    """llama.cpp on the demo GGUF through llama-cpp-python, with the same token ids in and out."""

    def __init__(self, threads: int) -> None:
        from clover.bench.llamacpp import load_llama

        self.llama = load_llama(threads=threads, logits_all=True)

    def logits(self, ids: list[int]) -> torch.Tensor:
        self.llama.reset()
        self.llama.eval(ids)
        return torch.tensor(self.llama.scores[: len(ids)]).float()

    def greedy(self, prompt: list[int], max_new: int, eos: int) -> list[int]:
        from clover.bench.llamacpp import llama_greedy

        return llama_greedy(self.llama, prompt, max_new, eos)


class GenaiGraph:
    """onnxruntime-genai's model builder graph (``clover.bench.genai``) of the reference's target checkpoint."""

    def __init__(self, checkpoint: str, model_dir: str, threads: int) -> None:
        from clover.bench.genai import BuilderGraphPass, build_genai_model, load_genai

        self.model_dir = build_genai_model(checkpoint, model_dir)
        self.graph = BuilderGraphPass(self.model_dir, threads)
        self.threads = threads

    def logits(self, ids: list[int]) -> torch.Tensor:
        return torch.from_numpy(self.graph.logits(ids)).float()

    def greedy(self, prompt: list[int], max_new: int, eos: int) -> list[int]:
        from clover.bench.genai import genai_greedy, load_genai

        tokens = genai_greedy(load_genai(self.model_dir, self.threads), prompt, max_new)
        return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def _resume(path: Path, names: list[str]) -> tuple[dict[str, list[dict]], set]:
    """The rows of the questions a killed run finished (``path``: one JSON line per question), and their ids."""
    rows: dict[str, list[dict]] = {name: [] for name in names}
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if set(entry["rows"]) == set(names):
                done.add(entry["id"])
                for name in names:
                    rows[name].append(entry["rows"][name])
    return rows, done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", required=True, help="the fp32 engine directory")
    p.add_argument("--engines", required=True, help="comma-separated engine directories to compare")
    p.add_argument("--llama-cpp", action="store_true", help="also llama.cpp on the demo GGUF (llama-cpp-python)")
    p.add_argument("--genai", metavar="DIR", default=None,
                   help="also onnxruntime-genai's builder graph (-p int4 -e cpu) of the reference's target, built in DIR")
    p.add_argument("--questions", type=int, default=80, help="MT-bench first turns (default: all 80)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--free-running", action="store_true",
                   help="also decode each engine freely and count identical outputs (slower: one decode per engine)")
    p.add_argument("--output", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    reference = load_engine(args.reference, threads=args.threads)
    tokenizer = load_tokenizer(args.reference)
    eos = tokenizer.eos_token_id
    others = {path: load_engine(path, threads=args.threads) for path in args.engines.split(",")}
    if args.llama_cpp:
        others["llama.cpp"] = LlamaCppGreedy(args.threads)
    if args.genai:
        others["onnxruntime-genai"] = GenaiGraph(reference.meta.source["target"], args.genai, args.threads)
    rows, done = _resume(Path(args.output).with_suffix(".jsonl"), list(others))
    questions = [q for q in mtbench_first_turns(limit=args.questions) if q["id"] not in done]
    for question in progress_bar(questions, desc="questions"):
        prompt = encode_prompt(tokenizer, question["prompt"])
        want = greedy(reference, prompt, args.max_new_tokens, eos)
        reference_logits = full_pass_logits(reference, prompt + want)
        for name, engine in others.items():
            llama = isinstance(engine, (LlamaCppGreedy, GenaiGraph))
            logits = engine.logits(prompt + want) if llama else full_pass_logits(engine, prompt + want)
            tokens = None
            if args.free_running:
                tokens = engine.greedy(prompt, args.max_new_tokens, eos) if llama else \
                    greedy(engine, prompt, args.max_new_tokens, eos)
            rows[name].append({"id": question["id"], **compare(want, reference_logits, logits, tokens, len(prompt))})
        with Path(args.output).with_suffix(".jsonl").open("a") as f:  # one line per question: a killed run resumes
            f.write(json.dumps({"id": question["id"], "rows": {name: r[-1] for name, r in rows.items()}}) + "\n")
    report = {"reference": args.reference, "max_new_tokens": args.max_new_tokens,
              "summary": {name: summarize(r) for name, r in rows.items()}, "questions": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    for name, summary in report["summary"].items():
        print(f"{name}: teacher-forced {summary['teacher_forced']:.4f} ({summary['teacher_forced_differences']} of "
              f"{summary['positions']} differ, median reference gap there {summary['reference_gap_at_differences_median']}), "
              f"prompts without a difference {summary['prompts_without_difference']:.3f}, "
              f"identical free-running outputs {summary.get('identical', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
