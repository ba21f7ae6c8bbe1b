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
