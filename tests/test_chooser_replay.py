"""benchmarks/chooser_replay.py: its acceptance tables are what the decode loop accepts, step for step."""

import pytest
import torch

from benchmarks import chooser_replay as replay_mod
from clover.adaptive import CostModel
from clover.backends.torch import TorchEngine
from clover.config import TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from tests.conftest import make_drafter, make_target
from tests.helpers import OracleEngine, hf_greedy, random_prompts

NEW = 24


def _tables(engine, prompts, budget):
    continuations = replay_mod.greedy_continuations(engine, prompts, NEW)
    rows = []
    for prompt, tokens in zip(prompts, continuations):
        sequence = prompt + tokens
        with torch.no_grad():
            h0 = replay_mod.root_states(engine, sequence)
        rows.append(replay_mod.accepted_lengths(engine, h0, sequence, len(prompt), budget).tolist())
    return continuations, rows


def test_tables_equal_the_decode_loops_acceptance():
    """Random heads on a small vocabulary accept now and then: every step of a real fixed-budget decode accepts
    exactly what the table says for its root."""
    target = make_target(seed=3, vocab_size=23)
    engine = TorchEngine(target, make_drafter(target, num_heads=3, seed=4))
    prompts = random_prompts(5, 3, 23, 2, 8)
    continuations, tables = _tables(engine, prompts, budget=8)
    assert continuations == hf_greedy(target, prompts, NEW)
    # the replay models the heads' acceptance: the heads alone (no suffix candidates)
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=8, adaptive=False, proposer="none"))
    results = decoder.generate([GenerationRequest(p, NEW, stop_token_ids=()) for p in prompts])
    steps = 0
    for result, table in zip(results, tables):
        position = 0  # root index: the first generated token is root 0
        for accepted in result.stats.accepted_per_step:
            assert table[position] == accepted
            position += accepted + 1
            steps += 1
    assert sum(sum(t) for t in tables) > 0 and steps > 20  # not vacuous: some drafts were accepted


def test_oracle_heads_accept_every_level_and_the_replay_speeds_up():
    target = make_target(seed=6)
    prompts = random_prompts(7, 2, target.config.vocab_size, 2, 8)
    oracle = OracleEngine(TorchEngine(target), prompts, hf_greedy(target, prompts, NEW))
    _, tables = _tables(oracle, prompts, budget=4)
    for table in tables:  # 3 heads: 3 drafts per step, fewer only where the continuation ends
        assert table == [min(3, len(table) - 1 - j) for j in range(len(table))]
    cost = CostModel(target=[[1, 0.010], [16, 0.011]], draft=[[1, 0.001], [16, 0.001]])
    host = {"vanilla": 0.0, "speculative": 0.0}
    replay_tables = [{"new_tokens": NEW, "accepted": {4: t}} for t in tables]
    rows = replay_mod.summarize(replay_tables, [replay_mod.Setting("fixed 4", fixed_budget=4)], cost, 3, 4, 4, host)
    # by hand: a budget-4 step costs target(5 tokens) = 0.010 + 0.001 * 4 / 15, plus 3 draft levels of 0.001 s;
    # the 23 tokens after the first take 6 oracle steps (roots 0, 4, ..., 20, each 3 drafts + 1) against 23
    # vanilla steps of 0.010 s; useless heads take 23 budget-4 steps
    step = 0.010 + 0.001 * 4 / 15 + 3 * 0.001
    assert rows[0]["speedup_total"] == pytest.approx(23 * 0.010 / (6 * step))
    assert rows[0]["speedup_useless_heads"] == pytest.approx(0.010 / step)
