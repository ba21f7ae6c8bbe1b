"""clover.bench's split of a decode step: target and draft are the engine's own run time, host all the rest,
per decode step after the first."""

from __future__ import annotations

import time

import pytest
import torch

from clover.bench.sweeps import TimedEngine, step_split


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingEngine:
    """Each call advances the clock by its glue plus its run, and counts the run in ``run_seconds``."""

    spec = None

    def __init__(self, clock: FakeClock, counts_runs: bool = True) -> None:
        self.clock = clock
        if counts_runs:
            self.run_seconds = 0.0

    def _call(self, glue: float, run: float) -> None:
        self.clock.now += glue + run
        if hasattr(self, "run_seconds"):
            self.run_seconds += run

    def target(self, input_ids, position_ids, past_lengths, *rest):
        self._call(0.002, 0.008)

    def draft_step(self, hidden, token, head):
        self._call(0.001, 0.002)


def _decode(engine: TimedEngine, clock: FakeClock) -> tuple[tuple, tuple]:
    """A first step (a prompt pass and 100 ms of setup), then two decode steps of three draft calls each and
    2.5 ms of decode-loop work. Returns the totals after the first step and at the end."""
    engine.target(None, None, torch.zeros(2, dtype=torch.int32))
    clock.now += 0.1
    first_step = engine.totals()
    for _ in range(2):
        for head in range(3):
            engine.draft_step(None, None, head)
        engine.target(None, None, torch.tensor([5, 7], dtype=torch.int32))
        clock.now += 0.0025
    return first_step, engine.totals()


@pytest.mark.parametrize("counts_runs", [True, False])
def test_step_split_counts_decode_steps_and_engine_runs(monkeypatch, counts_runs):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    engine = TimedEngine(CountingEngine(clock, counts_runs))
    split = step_split(*_decode(engine, clock))
    assert engine.target_calls == 3
    if counts_runs:  # the glue (2 ms a target call, 1 ms a draft call) is host work
        assert split == pytest.approx({"target_ms": 8.0, "draft_ms": 6.0, "host_ms": 2.5 + 2.0 + 3.0})
    else:  # an engine that does not count its runs: whole calls
        assert split == pytest.approx({"target_ms": 10.0, "draft_ms": 9.0, "host_ms": 2.5})


@pytest.mark.parametrize("max_new", [1, 6])
def test_run_decode_reports_the_split(max_new):
    """On a tiny torch engine (no run_seconds: whole calls); one new token means no decode step after the
    first, and the split then covers the whole decode."""
    from clover.backends.torch import TorchEngine
    from clover.bench import Config, run_decode
    from clover.config import TreeConfig
    from tests.conftest import make_drafter, make_target

    target = make_target(seed=3)
    engine = TorchEngine(target, make_drafter(target, num_heads=2))
    config = Config("batch", 2, "clover", "clover", 2, TreeConfig(budget=2, adaptive=False))
    sample = run_decode(engine, config, [[1, 2, 3], [4, 5]], max_new)
    assert sample["tokens"] == 2 * max_new
    assert sample["target_ms"] > 0 and sample["host_ms"] > 0
    assert (sample["draft_ms"] > 0) == (max_new > 1)  # one token: the prompt pass gives it, no tree
