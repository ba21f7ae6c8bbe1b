"""training/experiments/device_tree_tau.py on tiny random models: both tree builders decode the same tokens, the
device builder's steps all run on the device stepper (the host's none), and tau is at least 1."""

from __future__ import annotations

import pytest

from clover.backends.device import DeviceEngine
from clover.backends.torch import TorchEngine
from tests.random_models import make_drafter, make_target
from training.experiments import device_tree_tau as experiment


def tiny_engines() -> dict:
    """The host and device engines of one random target and its random heads (built twice from the same seeds)."""
    engines = {}
    for builder, engine_class in (("host", TorchEngine), ("device", DeviceEngine)):
        target = make_target(seed=5)
        engines[builder] = engine_class(target, make_drafter(target, num_heads=3, seed=15), max_seq_len=128)
    return engines


@pytest.mark.parametrize("variant", experiment.DEVICE_VARIANTS)
def test_both_builders_decode_the_same_tokens_and_the_device_one_on_the_device(variant):
    engines = tiny_engines()
    counters = {b: experiment.count_device_row_steps(engines[b]) for b in experiment.BUILDERS}
    # repeated phrases, so the suffix proposer has candidates to merge in
    prompts = [[7, 8, 9, 10] * 4, [20, 21, 22] * 5 + [20], [3, 40, 3, 41, 3, 40, 3]]
    records = [{"id": i, "category": "writing", "prompt_ids": p} for i, p in enumerate(prompts)]
    summary, rows = experiment.compare_builders(engines, counters, None, records, budget=4, variant=variant,
                                                max_new_tokens=16, batch_size=2)
    assert summary["tokens_differ"] == {} and summary["questions"] == 3
    host, device = summary["builders"]["host"], summary["builders"]["device"]
    assert host["device_row_steps"] == 0 and device["device_row_steps"] == device["steps"] > 0
    assert host["new_tokens"] == device["new_tokens"] == 3 * 16
    assert host["tau"] >= 1 and device["tau"] >= 1
    assert summary["paired"]["questions"] == 3
    assert len(rows) == 6 and {r["builder"] for r in rows} == set(experiment.BUILDERS)


def test_first_difference():
    assert experiment.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert experiment.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert experiment.first_difference([1, 2], [1, 2, 3]) == 2
