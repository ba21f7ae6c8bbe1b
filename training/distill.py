"""Self-distillation: the target answers every prompt with the project's batched engine.

    python -m training.distill --prompts data/prompts/train.jsonl \\
        --engine engines/demo-vanilla --output data/distill/train.jsonl

Each prompt is rendered with the tokenizer's chat template and decoded by
:class:`clover.decode.SpeculativeDecoder` (method ``vanilla``, in-flight
batching) on an onnxruntime engine directory (``--engine``, the CPU speed path)
or on the torch reference (``--target``). Most prompts are answered greedily,
a deterministic ``--sample-fraction`` of them with temperature sampling (seeded
per prompt, so a rerun gives the same answer).

The run is resumable: every finished answer is appended and flushed at once,
and a rerun skips the ids already in the output (a half-written last line from a
kill is dropped). Prompts are processed in a fixed pseudo-random order
(hash of the id), so any prefix of the output, e.g. with ``--limit``, is a mix
of all categories.

Output, one JSON object per line: ``id, category, task, messages`` (the prompt
messages plus the assistant answer), ``prompt_ids`` and ``response_ids`` (the
exact token ids, stop token included when the model stopped: the hidden-state
cache uses these, never a re-tokenisation), ``finish_reason``, ``sampling``
and ``answer`` where the prompt has one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def done_ids(path: Path) -> set[str]:
    """Ids already written to ``path``; a trailing partial line (from a kill) is cut off first."""
    if not path.exists():
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            f.truncate(cut)
            data = data[:cut]
    ids = set()
    for line in data.decode("utf-8").splitlines():
        if line.strip():
            ids.add(json.loads(line)["id"])
    return ids


def order_key(record_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{record_id}".encode()).hexdigest()


def plan_sampling(record_id: str, seed: int, sample_fraction: float, temperature: float, top_p: float) -> dict:
    """Greedy or sampled, and the seed, as a pure function of the id."""
    digest = hashlib.sha256(f"sampling:{seed}:{record_id}".encode()).digest()
    sampled = int.from_bytes(digest[:8], "big") / 2**64 < sample_fraction
    return {"temperature": temperature if sampled else 0.0, "top_p": top_p if sampled else 1.0,
            "seed": int.from_bytes(digest[8:12], "big")}


def open_engine(engine_dir: str | None, target: str | None, threads: int | None, max_seq: int):
    """(engine, tokenizer): an onnxruntime engine directory, or the torch reference on a checkpoint."""
    from clover.target import load_tokenizer

    if engine_dir:
        from clover.backends.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(engine_dir, threads=threads), load_tokenizer(engine_dir)
    import torch

    from clover.backends.torch import TorchEngine
    from clover.demo import resolve_target
    from clover.target import load_target

    if threads:
        torch.set_num_threads(threads)
    directory = resolve_target(target)
    return TorchEngine(load_target(directory), None, max_seq_len=max_seq), load_tokenizer(directory)


def distill(prompts: list[dict], output: Path, engine, tokenizer, *, max_new_tokens: int = 256,
            sample_fraction: float = 0.25, temperature: float = 0.7, top_p: float = 0.95,
            batch_size: int = 16, max_prompt_tokens: int = 640, seed: int = 0, limit: int | None = None,
            length_window: int = 512, progress: bool = True) -> dict:
    """Answer every prompt not yet in ``output``; returns counts. See the module docstring."""
    from clover.progress import progress_bar

    from clover.config import SamplingConfig
    from clover.decode import GenerationRequest, SpeculativeDecoder

    output.parent.mkdir(parents=True, exist_ok=True)
    finished = done_ids(output)
    ordered = sorted(prompts, key=lambda r: order_key(r["id"], seed))
    if limit is not None:
        ordered = ordered[:limit]
    todo, skipped = _prompts_to_answer(ordered, finished, tokenizer,
                                       min(max_prompt_tokens, engine.spec.max_seq_len - 2), length_window)
    counts = {"total": len(ordered), "already_done": sum(r["id"] in finished for r in ordered),
              "skipped_too_long": len(skipped), "written": 0, "new_tokens": 0}
    if not todo:
        return counts

    decoder = SpeculativeDecoder(engine, "vanilla", tokenizer=tokenizer, max_batch_size=batch_size)
    by_seq: dict[int, tuple[dict, list[int], dict]] = {}
    for record, ids in todo:
        plan = plan_sampling(record["id"], seed, sample_fraction, temperature, top_p)
        request = GenerationRequest(ids, max_new_tokens=max_new_tokens, seed=plan["seed"], request_id=record["id"],
                                    sampling=SamplingConfig(temperature=plan["temperature"], top_p=plan["top_p"]))
        by_seq[decoder.submit(request)] = (record, ids, plan)
    generated: dict[int, list[int]] = {seq: [] for seq in by_seq}
    start = time.monotonic()
    bar = progress_bar(total=counts["total"], initial=counts["already_done"] + len(skipped), unit="answer",
               enabled=progress, dynamic_ncols=True, desc="distill")
    with open(output, "a", encoding="utf-8") as f:
        while decoder.has_work:
            for event in decoder.step():
                generated[event.seq_id].extend(event.new_token_ids)
                counts["new_tokens"] += len(event.new_token_ids)
                if not event.finished:
                    continue
                record, ids, plan = by_seq.pop(event.seq_id)
                response = generated.pop(event.seq_id)
                text = tokenizer.decode(response, skip_special_tokens=True).strip()
                out = _answered_record(record, ids, response, text, event.finish_reason, plan)
                f.write(json.dumps(out, ensure_ascii=False) + "\n")
                f.flush()
                counts["written"] += 1
                bar.update(1)
                bar.set_postfix(tok_s=f"{counts['new_tokens'] / max(time.monotonic() - start, 1e-9):.0f}",
                                live=decoder.num_running)
        os.fsync(f.fileno())
    bar.close()
    counts["seconds"] = round(time.monotonic() - start, 1)
    return counts


def _prompts_to_answer(ordered: list[dict], finished: set[str], tokenizer, max_prompt: int,
                       length_window: int) -> tuple[list[tuple[dict, list[int]]], list[str]]:
    """(record, prompt ids) of the prompts still to answer, in decode order; and the ids of those too long."""
    todo, skipped = [], []
    for record in ordered:
        if record["id"] in finished:
            continue
        ids = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, return_dict=False)
        if len(ids) > max_prompt:
            skipped.append(record["id"])
            continue
        todo.append((record, list(ids)))
    # Within windows of the fixed order, short prompts first: sequences decoded together then have similar
    # lengths, and a decode step's attention cost follows the longest live row. The set answered by any
    # prefix of windows stays category-mixed.
    for start in range(0, len(todo), length_window):
        todo[start : start + length_window] = sorted(todo[start : start + length_window], key=lambda t: len(t[1]))
    return todo, skipped


def _answered_record(record: dict, prompt_ids: list[int], response: list[int], text: str, finish_reason: str,
                     sampling: dict) -> dict:
    """One line of the output JSONL: the prompt record with the target's answer appended."""
    out = {"id": record["id"], "category": record["category"], "task": record.get("task"),
           "messages": record["messages"] + [{"role": "assistant", "content": text}],
           "prompt_ids": prompt_ids, "response_ids": response, "finish_reason": finish_reason, "sampling": sampling}
    if "answer" in record:
        out["answer"] = record["answer"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="prompt JSONL from training/data.py")
    parser.add_argument("--output", required=True, help="conversation JSONL (appended to; resumable)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--engine", help="onnxruntime engine directory (vanilla-only is enough)")
    source.add_argument("--target", help="checkpoint directory or 'demo': decode with the torch reference instead")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--sample-fraction", type=float, default=0.25, help="share of prompts answered by sampling")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--batch-size", type=int, default=16, help="live sequences (in-flight batching)")
    parser.add_argument("--max-prompt-tokens", type=int, default=640, help="longer prompts are skipped")
    parser.add_argument("--max-seq", type=int, default=1024, help="context limit for --target")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts of the fixed order")
    parser.add_argument("--length-window", type=int, default=512,
                        help="prompts are answered short-first within windows of this many (speed; 1: fixed order)")
    args = parser.parse_args(argv)
    if not args.engine and not args.target:
        parser.error("pass --engine ENGINE_DIR (onnxruntime) or --target DIR|demo (torch)")

    from clover.config import ConfigError

    try:
        engine, tokenizer = open_engine(args.engine, args.target, args.threads, args.max_seq)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = read_jsonl(args.prompts)
    try:
        counts = distill(prompts, Path(args.output), engine, tokenizer, max_new_tokens=args.max_new_tokens,
                         sample_fraction=args.sample_fraction, temperature=args.temperature, top_p=args.top_p,
                         batch_size=args.batch_size, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
                         limit=args.limit, length_window=args.length_window)
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished answers are in {args.output}. Rerun the same command to resume.",
              file=sys.stderr)
        return 130
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
