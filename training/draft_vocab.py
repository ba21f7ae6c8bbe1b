"""Frequency-ranked draft vocabulary for a set of heads (FR-Spec, arXiv 2502.14856; docs/drafter.md#draft-vocabulary).

    python -m training.draft_vocab --data outputs/data/sharegpt/teacher_train.jsonl \\
        --heads outputs/runs/clover --size 16384 --eval outputs/data/sharegpt/teacher_eval.jsonl
    python -m training.draft_vocab --data outputs/data/distill/train.jsonl --output outputs/data/draft-vocab
    # then: training/train.py --draft-vocab outputs/data/draft-vocab (heads trained over V')

Counts how often each token id occurs in the training answers, then writes the
most frequent ones (int64, most frequent first, with their counts) as
``draft_vocab.safetensors`` into the heads directory and sets the heads'
``draft_vocab_size`` in ``config.json``. Engines built from the heads then
score only those V' rows of the LM head in every draft step (V' << V cuts the
draft step's LM-head cost in proportion); ``clover build --draft-vocab N``
picks another prefix of the ranking. Only the proposals change: verification
uses the target's full LM head, so decoding stays lossless.

``--data`` (repeatable) takes:

* JSONL records with ``response_ids`` (``training/sharegpt.py``'s
  ``teacher_*.jsonl``, ``training/distill.py``'s output): the answers' ids are
  counted, the prompts' ids too with ``--count-prompts``;
* JSONL records without ids (``prompts_*.jsonl``): their ``messages`` are
  tokenised with the ``--target`` tokenizer; assistant turns count as answers,
  the other turns as prompts;
* hidden-state cache directories (``training/hidden_cache.py``): the tokens
  under the assistant mask (all tokens with ``--count-prompts``).

Never count evaluation data (MT-bench, the eval split) into the ranking:
``--eval`` only reports how much of it the chosen sizes cover. Counting takes
seconds per million tokens; rerunning rewrites the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

REPORT_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


class _Tokenizer:
    """The ``--target`` tokenizer, loaded on first use (only records without ids need it)."""

    def __init__(self, target: str) -> None:
        self.target, self._tokenizer = target, None

    def __call__(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from clover.demo import resolve_target
            from clover.target import load_tokenizer

            self._tokenizer = load_tokenizer(resolve_target(self.target))
        return self._tokenizer.encode(text, add_special_tokens=False)


def _record_ids(record: dict, count_prompts: bool, tokenize: _Tokenizer) -> Iterator[list[int]]:
    """The token id lists of one JSONL record that count."""
    if "response_ids" in record:
        yield record["response_ids"]
        if count_prompts:
            yield record.get("prompt_ids", [])
        return
    for message in record.get("messages", []):
        if message.get("role") == "assistant" or count_prompts:
            yield tokenize(message.get("content", ""))


def _jsonl_ids(path: Path, count_prompts: bool, tokenize: _Tokenizer) -> Iterator[list[int]]:
    from clover.progress import progress_bar

    with open(path, "rb") as f, progress_bar(total=path.stat().st_size, unit="B", unit_scale=True,
                                             desc=path.name) as bar:
        for number, line in enumerate(f, 1):
            bar.update(len(line))
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON record ({exc})") from exc
            yield from _record_ids(record, count_prompts, tokenize)


def _cache_ids(directory: Path, count_prompts: bool) -> Iterator[np.ndarray]:
    from clover.progress import progress_bar

    from training.hidden_cache import HiddenCache

    cache = HiddenCache(directory)
    tokens, mask = cache.arrays["tokens"], cache.arrays["assistant_mask"]
    for item in progress_bar(cache.conversations, desc=directory.name, unit="conv"):
        rows = slice(item["offset"], item["offset"] + item["length"])
        ids = np.asarray(tokens[rows])
        yield ids if count_prompts else ids[np.asarray(mask[rows]).astype(bool)]


def count_tokens(paths: list[str | Path], vocab_size: int, count_prompts: bool = False,
                 target: str = "demo") -> np.ndarray:
    """Occurrences of each token id ``[vocab_size]`` (int64) in ``paths`` (JSONL files or cache directories)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    tokenize = _Tokenizer(target)
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        lists = _cache_ids(path, count_prompts) if path.is_dir() else _jsonl_ids(path, count_prompts, tokenize)
        pending: list[np.ndarray] = []
        for ids in lists:
            pending.append(np.asarray(ids, dtype=np.int64))
            if sum(map(len, pending)) >= 1 << 20 or len(pending) >= 4096:  # one bincount per ~1M ids
                _add_counts(counts, pending, path)
        _add_counts(counts, pending, path)
    return counts


def _add_counts(counts: np.ndarray, pending: list[np.ndarray], path: Path) -> None:
    ids = np.concatenate(pending) if pending else np.zeros(0, dtype=np.int64)
    pending.clear()
    if len(ids) and (ids.min() < 0 or ids.max() >= len(counts)):
        raise ValueError(f"{path}: token id {int(ids.max())} outside the heads' vocabulary of {len(counts)}")
    counts += np.bincount(ids, minlength=len(counts))


def rank_tokens(counts: np.ndarray) -> np.ndarray:
    """Token ids by descending count (ties: lower id first), int64 ``[V]``."""
    return np.argsort(-counts, kind="stable").astype(np.int64)


def coverage(ranking: np.ndarray, counts: np.ndarray, sizes) -> dict[int, float]:
    """Share of the counted tokens that each size's prefix of ``ranking`` holds."""
    total = max(int(counts.sum()), 1)
    cumulative = np.cumsum(counts[ranking])
    return {size: float(cumulative[min(size, len(ranking)) - 1]) / total for size in sizes}


def write_heads_vocab(heads: Path, ranking: np.ndarray, counts: np.ndarray, size: int, keep: int,
                      sources: list[str], has_config: bool = True) -> Path:
    """``draft_vocab.safetensors`` (the ``keep`` most frequent ids and their counts), and ``draft_vocab_size``
    in the heads' ``config.json`` when ``has_config`` (else ``heads`` is a plain directory: ``--output``)."""
    import torch

    from clover.config import DrafterConfig
    from clover.drafters import CONFIG_FILE, save_draft_vocab

    kept = ranking[:keep]
    heads.mkdir(parents=True, exist_ok=True)
    path = save_draft_vocab(heads, torch.from_numpy(kept), torch.from_numpy(counts[kept]),
                            {"sources": json.dumps(sources), "tokens_counted": str(int(counts.sum()))})
    if has_config:
        data = json.loads((heads / CONFIG_FILE).read_text())
        data["draft_vocab_size"] = size  # only this key changes: the rest of config.json stays as written
        DrafterConfig.from_dict(data)  # still a valid config
        (heads / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", action="append", required=True,
                   help="training text to count: a JSONL file or a hidden-state cache directory (repeatable)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--heads",
                       help="heads directory (config.json, model.safetensors): draft_vocab.safetensors is written "
                            "there and config.json's draft_vocab_size set")
    where.add_argument("--output",
                       help="a directory for draft_vocab.safetensors alone, before any heads exist: train.py "
                            "--draft-vocab DIR then trains heads over it (the vocabulary size comes from --target)")
    p.add_argument("--size", type=int, default=16384,
                   help="V': tokens the draft step scores by default, set as config.json's draft_vocab_size "
                        "(default: 16384, chosen for the demo target's 49,152 tokens in "
                        "docs/results/draft-cost/README.md; larger vocabularies may want more; 0 keeps the full "
                        "vocabulary as the default and only stores the ranking)")
    p.add_argument("--keep", type=int, default=None,
                   help="ids stored, most frequent first (default: --size, or every token seen for --size 0); "
                        "a larger ranking lets clover build --draft-vocab pick up to this many")
    p.add_argument("--count-prompts", action="store_true",
                   help="count prompt tokens too (default: only the answers, what the target writes)")
    p.add_argument("--eval", action="append", default=[],
                   help="held-out JSONL or cache: only reports how much of its answers each size covers (repeatable)")
    p.add_argument("--target", default="demo",
                   help="checkpoint directory or 'demo': its tokenizer, for records without token ids")
    args = p.parse_args(argv)
    if args.size < 0 or (args.keep is not None and args.keep < max(args.size, 1)):
        p.error("--size must be >= 0 and --keep >= max(--size, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from clover.config import ConfigError, DrafterConfig
    from clover.drafters import CONFIG_FILE

    heads = Path(args.heads or args.output)
    try:
        if args.heads:
            vocab_size = DrafterConfig.load(heads / CONFIG_FILE).vocab_size
        else:
            from clover.demo import resolve_target
            from clover.target import load_target_config

            vocab_size = load_target_config(resolve_target(args.target)).vocab_size
        if args.size > vocab_size:
            raise ConfigError(f"--size {args.size} exceeds the heads' vocabulary of {vocab_size}")
        counts = count_tokens(args.data, vocab_size, args.count_prompts, args.target)
        ranking = rank_tokens(counts)
        keep = min(args.keep or args.size or int((counts > 0).sum()) or 1, vocab_size)
        path = write_heads_vocab(heads, ranking, counts, args.size, keep, [str(d) for d in args.data],
                                 has_config=bool(args.heads))
        sizes = sorted({s for s in (*REPORT_SIZES, args.size) if 0 < s <= vocab_size})
        report = {"tokens_counted": int(counts.sum()), "distinct_tokens": int((counts > 0).sum()),
                  "stored": keep, "draft_vocab_size": args.size,
                  "train_coverage": coverage(ranking, counts, sizes)}
        if args.eval:
            held_out = count_tokens(args.eval, vocab_size, args.count_prompts, args.target)
            report["eval_coverage"] = coverage(ranking, held_out, sizes)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"draft_vocab: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1))
    print(f"wrote {path} ({keep} ids)" + (f"; {heads / CONFIG_FILE}: draft_vocab_size = {args.size}" if args.heads
                                          else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
