"""training/experiments/bf16_agreement.py's measures, on hand-made outputs."""

from __future__ import annotations

import pytest

from training.experiments import bf16_agreement as experiment


def test_shared_prefix_counts_the_leading_tokens_two_outputs_share():
    assert experiment.shared_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert experiment.shared_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert experiment.shared_prefix([4], [5]) == 0
    assert experiment.shared_prefix([1, 2], [1, 2, 3]) == 2


def _rows(outputs: dict[int, list[int]], steps: int = 2) -> dict[int, dict]:
    return {q: {"token_ids": ids, "steps": steps, "new_tokens": len(ids)} for q, ids in outputs.items()}


def test_a_run_is_measured_against_fp32_and_paired_against_bf16_vanilla():
    reference = _rows({1: [1, 2, 3, 4], 2: [5, 6, 7, 8], 3: [9, 9, 9, 9]})
    vanilla = _rows({1: [1, 2, 3, 4], 2: [5, 0, 0, 0], 3: [9, 9, 0, 0]})
    clover = _rows({1: [1, 2, 0, 0], 2: [5, 6, 7, 8], 3: [9, 9, 9, 9]}, steps=1)
    summary = experiment.summarize("clover", clover, reference, vanilla)
    assert summary["questions"] == 3 and summary["equal_to_fp32"] == 2 and summary["equal_to_bf16_vanilla"] == 0
    assert summary["mean_shared_prefix"] == pytest.approx((2 + 4 + 4) / 3)
    assert summary["tau"] == pytest.approx(12 / 3)
    paired = summary["paired_against_bf16_vanilla"]  # shared with fp32: vanilla 4, 1, 2; clover 2, 4, 4
    assert (paired["b_better"], paired["b_worse"], paired["ties"]) == (2, 1, 0)
