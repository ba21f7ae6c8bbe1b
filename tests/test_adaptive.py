"""Adaptive speculation: the budget chooser, the cost model, calibration, and lossless adaptive decoding."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from clover.adaptive import (AcceptanceModel, AdaptiveBudget, CostModel, calibrate, choose_budget,
                             expected_throughput, token_counts)
from clover.backends.torch import TorchEngine
from clover.config import ConfigError, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.tree import build_trees
from tests.conftest import make_drafter, make_target
from tests.helpers import OracleEngine, hf_greedy, random_prompts, vanilla_greedy

MAX_NEW = 20

# verification nearly free up to 256 tokens in flight (memory-bound), cheap draft steps
FLAT = CostModel(target=[[1, 0.010], [256, 0.0102]], draft=[[1, 0.0005], [256, 0.0006]])
# every token in flight costs the same (compute-bound from the first token), draft steps not free
LINEAR = CostModel(target=[[1, 0.010], [64, 0.640]], draft=[[1, 0.003], [64, 0.004]])
# the paper's Figure 2 shape: flat up to 16 tokens in flight, then linear
ROOFLINE = CostModel(target=[[1, 0.010], [16, 0.011], [256, 0.176]], draft=[[1, 0.001], [256, 0.002]])
HIGH = {b: 1.0 + 0.9 * min(b, 3) + 0.02 * b for b in range(1, 33)}  # a good drafter
LOW = {b: 1.0 + 0.05 * min(b, 3) for b in range(1, 33)}  # a useless one


def _generate(engine, method, prompts, tree, cost_model=None, batch_size=8, max_new=MAX_NEW):
    # these cost models stand for machines (compute-bound, a roofline): the tiny engine's own step times must
    # not correct them
    decoder = SpeculativeDecoder(engine, method, tree, max_batch_size=batch_size, cost_model=cost_model,
                                 step_timing=False)
    results = decoder.generate([GenerationRequest(p, max_new_tokens=max_new + i % 3, stop_token_ids=())
                                for i, p in enumerate(prompts)])
    return decoder, results


class CountingEngine:
    """Counts draft_step calls of the wrapped engine."""

    def __init__(self, inner) -> None:
        self.inner, self.spec, self.draft_calls = inner, inner.spec, 0

    def target(self, *args):
        return self.inner.target(*args)

    def draft_step(self, *args):
        self.draft_calls += 1
        return self.inner.draft_step(*args)


# -- the chooser ------------------------------------------------------------------


def test_expensive_verification_and_low_acceptance_choose_vanilla():
    for batch in (1, 4, 32):
        assert choose_budget(batch, LINEAR, LOW) == 0
        assert choose_budget(batch, LINEAR, AcceptanceModel().expected) == 0
        assert choose_budget(batch, FLAT, LOW) < 4 or batch == 1  # sanity: low acceptance never wants big trees


def test_cheap_verification_and_high_acceptance_choose_a_large_budget():
    assert choose_budget(1, FLAT, HIGH) >= 16
    assert choose_budget(4, FLAT, HIGH) >= 8
    # the choice really maximises the objective among the candidates
    best = choose_budget(1, FLAT, HIGH, budgets=range(33))
    rates = {b: expected_throughput(1, b, FLAT, HIGH.get(b, 1.0), 3) for b in range(33)}
    assert rates[best] == max(rates.values())


def test_budget_shrinks_with_batch_on_a_roofline():
    chosen = [choose_budget(b, ROOFLINE, HIGH) for b in (1, 2, 4, 8, 16, 32)]
    assert chosen[0] >= 3
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[-1] == 0  # 32 sequences already fill the compute: vanilla
    assert choose_budget(1, ROOFLINE, HIGH, max_budget=2) <= 2


def test_budget_zero_is_vanilla_throughput():
    assert expected_throughput(8, 0, LINEAR, 1.0, 3) == pytest.approx(8 / LINEAR.target_time(8))
    assert LINEAR.draft_time(8, 0, 3) == 0.0


def test_cost_model_interpolation_and_json_round_trip(tmp_path):
    assert ROOFLINE.target_time(16) == pytest.approx(0.011)
    assert ROOFLINE.target_time(136) == pytest.approx(0.011 + 0.165 / 2)
    assert ROOFLINE.target_time(512) > ROOFLINE.target_time(256)  # extrapolated along the last slope
    assert 0 < ROOFLINE.target_time(0.5) < ROOFLINE.target_time(1)
    noisy = CostModel(target=[[1, 0.02], [2, 0.01], [4, 0.03]])  # a noisy dip never makes more tokens cheaper
    assert noisy.target_time(2) >= noisy.target_time(1)
    path = tmp_path / "cost.json"
    ROOFLINE.save(path)
    assert CostModel.load(path) == ROOFLINE
    assert CostModel.from_dict(json.loads(json.dumps(FLAT.to_dict()))) == FLAT
    with pytest.raises(ConfigError):
        CostModel.from_dict({"target": [[1, 0.1]], "bogus": 1})
    with pytest.raises(ConfigError):
        CostModel(target=[])
    tree = TreeConfig(budget=16, adaptive=True)
    assert TreeConfig.from_dict(json.loads(json.dumps(tree.to_dict()))) == tree
    with pytest.raises(ConfigError):
        TreeConfig(adaptive=True, static_choices=[[0]])


def test_acceptance_updates_online_and_moves_the_choice():
    acceptance = AcceptanceModel(depth=3)
    # before any observation: the prior 1 + (1 - 0.8^min(b, 12)) * 1.2 tokens/step, and by hand on ROOFLINE
    # at batch 1 (target 0.010 s + 0.001 s * b / 15 up to 16 tokens, then 0.165 s per 240 tokens; draft steps
    # over 1, min(b, 8), min(b, 64) nodes at 0.001 s + 0.001 s * (n - 1) / 255) budget 12 is the best:
    # b=8: 1.9987 / 0.013588 = 147.1 tokens/s, b=12: 2.1175 / 0.013871 = 152.7, b=16: 2.1175 / 0.014774 = 143.3
    rates = {}
    for b in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        tokens = 1 + (1 - 0.8 ** min(b, 12)) * 1.2 if b else 1.0
        verify = 0.010 + 0.001 * b / 15 if b <= 15 else 0.011 + 0.165 * (b + 1 - 16) / 240
        draft = sum(0.001 + 0.001 * (min(b, 8**level) - 1) / 255 for level in range(min(3, b)))
        rates[b] = tokens / (verify + draft)
    assert max(rates, key=rates.get) == 12
    assert choose_budget(1, ROOFLINE, acceptance.expected) == 12
    before = acceptance.expected(8)
    for _ in range(50):
        acceptance.observe(4, 3.5, weight=4)
    assert acceptance.expected(4) == pytest.approx(3.5, abs=0.05)
    assert acceptance.expected(8) > before  # unobserved budgets borrow the observed ratio
    for _ in range(50):
        acceptance.observe(4, 1.0, weight=4)
    assert acceptance.expected(4) == pytest.approx(1.0, abs=0.05)
    # a measured useless drafter on a linear cost: vanilla
    assert choose_budget(1, LINEAR, acceptance.expected) == 0


def test_adaptive_budget_explores_when_vanilla():
    chooser = AdaptiveBudget(LINEAR, depth=3, top_k=8, max_budget=8, explore_every=4)
    chosen = [chooser.choose(2) for _ in range(8)]
    assert chosen.count(0) == 6 and all(0 < b <= 8 for b in chosen if b)
    assert chooser.history == [(2, b) for b in chosen]


# -- decoding --------------------------------------------------------------------


def test_budget_zero_tree_calls_no_draft_step(tiny_engine):
    counting = CountingEngine(tiny_engine)
    hidden = torch.zeros(2, tiny_engine.spec.hidden_size)
    trees = build_trees(counting.draft_step, hidden, [1, 2], TreeConfig(budget=0), 3)
    assert counting.draft_calls == 0 and [len(t) for t in trees] == [1, 1]


def test_adaptive_needs_a_cost_model(tiny_engine):
    with pytest.raises(ConfigError, match="cost model"):
        SpeculativeDecoder(tiny_engine, "clover", TreeConfig(adaptive=True))
    SpeculativeDecoder(tiny_engine, "vanilla", TreeConfig(adaptive=True))  # vanilla never drafts


@pytest.mark.parametrize("cost", ["flat", "linear", "roofline"])
@pytest.mark.parametrize("method", ["clover", "medusa"])
def test_adaptive_equals_vanilla_torch(cost, method):
    target = make_target(seed=3)
    engine = CountingEngine(TorchEngine(target, make_drafter(target, method=method, num_heads=3, seed=4),
                                        max_seq_len=128))
    prompts = random_prompts(3, 5, target.config.vocab_size, 1, 16)
    expected = [hf_greedy(target, [p], MAX_NEW + i % 3)[0] for i, p in enumerate(prompts)]
    assert [vanilla_greedy(engine, [p], MAX_NEW + i % 3)[0] for i, p in enumerate(prompts)] == expected
    model = {"flat": FLAT, "linear": LINEAR, "roofline": ROOFLINE}[cost]
    engine.draft_calls = 0
    decoder, results = _generate(engine, method, prompts, TreeConfig(budget=16, adaptive=True), model, batch_size=3)
    assert [r.token_ids for r in results] == expected
    budgets = [b for _, b in decoder.adaptive.history]
    if cost == "flat":  # speculation looks worth it from the prior: it drafts (until it measures the random heads)
        assert budgets[0] >= 8 and engine.draft_calls > 0
    elif cost == "linear":  # never pays (exploration steps aside): almost no draft steps
        assert budgets.count(0) >= len(budgets) - len(budgets) // 64 - 1
        assert engine.draft_calls <= 3 * sum(b > 0 for b in budgets)  # vanilla steps call no draft step
    else:  # the live batch shrinks from 3 to 1 as requests finish and others join
        assert max(budgets) <= 16


def test_adaptive_oracle_speculates_and_stays_lossless():
    target = make_target(seed=7)
    inner = TorchEngine(target, None, max_seq_len=128)
    prompts = random_prompts(9, 4, target.config.vocab_size, 3, 12)
    expected = hf_greedy(target, prompts, 24)
    oracle = OracleEngine(inner, prompts, expected, num_heads=3)
    decoder = SpeculativeDecoder(oracle, "clover", TreeConfig(budget=8, adaptive=True), cost_model=ROOFLINE,
                                 step_timing=False)
    results = decoder.generate([GenerationRequest(p, max_new_tokens=24, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == expected
    budgets = [b for _, b in decoder.adaptive.history]
    assert min(budgets) >= 3  # roofline + perfect acceptance: trees every step, deep enough for all heads
    assert decoder.adaptive.acceptance.expected(budgets[-1]) > 3.0  # learned online
    assert all(r.tokens_per_step > 3.0 for r in results)


def test_adaptive_moves_to_vanilla_for_a_useless_drafter():
    """Random heads accept almost nothing: once measured, a roofline at batch 4 no longer pays for trees."""
    target = make_target(seed=11)
    engine = TorchEngine(target, make_drafter(target, num_heads=3, seed=12), max_seq_len=256)
    prompts = random_prompts(11, 4, target.config.vocab_size, 2, 8)
    steep = CostModel(target=[[1, 0.010], [16, 0.011], [64, 0.160]], draft=[[1, 0.002], [64, 0.003]])
    acceptance = AcceptanceModel(depth=3, prior={b: 1.0 + 0.9 * min(b, 3) for b in range(1, 33)})
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=8, adaptive=True), cost_model=steep,
                                 step_timing=False)
    decoder.adaptive.acceptance = acceptance  # an optimistic prior, corrected by measurement
    results = decoder.generate([GenerationRequest(p, max_new_tokens=40, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, 40)
    budgets = [b for n, b in decoder.adaptive.history if n == 4]  # while all four run (one may finish early)
    assert budgets[0] > 0 and budgets[-1] == 0


# -- calibration -----------------------------------------------------------------


class FakeClock:
    """Stands in for ``time`` in clover.adaptive: it advances only when the timed engine says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class TimedEngine:
    """The tiny torch engine, each call taking a known time on the fake clock (an injected cost model)."""

    def __init__(self, inner, clock: FakeClock, slow_calls: range = range(0)) -> None:
        self.inner, self.spec, self.clock, self.calls = inner, inner.spec, clock, []
        self.slow_calls = slow_calls  # these calls (by index) take 1 s more: a burst of load on a shared machine

    def _advance(self, seconds: float) -> None:
        self.clock.now += seconds + (1.0 if len(self.calls) - 1 in self.slow_calls else 0.0)

    @staticmethod
    def target_seconds(tokens: int) -> float:
        return 0.004 + 0.0005 * tokens

    @staticmethod
    def draft_seconds(nodes: int) -> float:
        return 0.001 + 0.0001 * nodes

    def target(self, input_ids, *args):
        tokens = input_ids.numel()
        self.calls.append(("target", tokens))
        self._advance(self.target_seconds(tokens))
        return self.inner.target(input_ids, *args)

    def draft_step(self, hidden, token, head):
        self.calls.append(("draft", token.numel()))
        self._advance(self.draft_seconds(token.numel()))
        return self.inner.draft_step(hidden, token, head)


def test_calibrate_measures_each_token_count(tiny_engine, monkeypatch):
    """Deterministic: calibrate times exactly the engine calls, on a fake clock (no wall-clock flakiness)."""
    import clover.timing as timing  # the median timer calibrate uses

    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    engine = TimedEngine(tiny_engine, clock)
    model = calibrate(engine, max_tokens=256, repeats=2)
    counts = token_counts(256)
    assert counts == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert model.target == [[n, pytest.approx(TimedEngine.target_seconds(n))] for n in counts]
    assert model.draft == [[n, pytest.approx(TimedEngine.draft_seconds(n))] for n in counts]
    # one warm-up call per job, then two rounds of all jobs, the second in an order rotated by one
    jobs = [("target", n) for n in counts] + [("draft", n) for n in counts]
    assert engine.calls == jobs + jobs + jobs[1:] + jobs[:1]
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_calibration_spreads_a_burst_of_load_over_many_points(tiny_engine, monkeypatch):
    """Five consecutive calls slowed by a burst: interleaved rounds give each point at most one slow sample,
    which the median of five drops; timed point by point, one point would have had all five."""
    import clover.timing as timing  # the median timer calibrate uses

    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    counts = token_counts(16)
    first_timed_round = 2 * len(counts)  # after the warm-up calls
    engine = TimedEngine(tiny_engine, clock, slow_calls=range(first_timed_round + 3, first_timed_round + 8))
    model = calibrate(engine, max_tokens=16, repeats=5)
    assert model.target == [[n, pytest.approx(TimedEngine.target_seconds(n))] for n in counts]
    assert model.draft == [[n, pytest.approx(TimedEngine.draft_seconds(n))] for n in counts]


def test_calibrated_onnx_engine(tmp_path):
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.engine_dir import read_engine_meta
    from clover.export.builder import build_engine
    from tests.conftest import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    engine_dir = build_engine(tmp_path / "engine", str(checkpoint), None, max_seq=128, calibrate=True,
                              calibrate_max_tokens=128, progress=lambda m: None)
    meta = read_engine_meta(engine_dir)
    assert [p[0] for p in meta.cost_model.target] == token_counts(128)
    engine = OnnxRuntimeEngine(engine_dir)
    assert engine.cost_model == meta.cost_model
    assert [p[0] for p in engine.cost_model.draft] == token_counts(128)  # (times: see the fake-clock test)
    prompts = random_prompts(1, 3, engine.spec.vocab_size, 2, 10)
    expected = [hf_greedy(checkpoint, [p], MAX_NEW + i % 3)[0] for i, p in enumerate(prompts)]
    assert [vanilla_greedy(engine, [p], MAX_NEW + i % 3)[0] for i, p in enumerate(prompts)] == expected
    decoder, results = _generate(engine, "clover", prompts, TreeConfig(budget=8, adaptive=True))  # engine's model
    assert [r.token_ids for r in results] == expected
    assert decoder.adaptive.cost is engine.cost_model
    from clover.cli import main as clover_main

    summary = tmp_path / "summary.json"
    assert clover_main(["generate", "--engine", str(engine_dir), "--prompt", "hi", "--adaptive", "--tree-budget", "8",
                        "--max-new-tokens", "6", "--summary", str(summary)]) == 0
    assert json.loads(summary.read_text())["new_tokens"] == 6


def test_recalibrate_stores_a_cost_model_without_rebuilding(tmp_path):
    import importlib.util

    from clover.engine_dir import read_engine_meta
    from clover.export.builder import build_engine
    from tests.conftest import write_tiny_checkpoint

    spec = importlib.util.spec_from_file_location("build_engine_cli", Path(__file__).parent.parent / "export" / "build_engine.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    engine_dir = build_engine(tmp_path / "engine", str(write_tiny_checkpoint(tmp_path / "ckpt")), None, max_seq=128,
                              progress=lambda m: None)
    before = read_engine_meta(engine_dir)
    assert before.cost_model is None
    onnx_files = {p.name: p.stat().st_mtime_ns for p in engine_dir.glob("*.onnx")}
    assert cli.main(["--output", str(engine_dir), "--recalibrate", "--calibrate-max-tokens", "64"]) == 0
    after = read_engine_meta(engine_dir)
    assert [p[0] for p in after.cost_model.target] == token_counts(64)
    assert dataclasses.replace(after, cost_model=None) == before
    assert {p.name: p.stat().st_mtime_ns for p in engine_dir.glob("*.onnx")} == onnx_files  # nothing rebuilt
    assert cli.main(["--output", str(tmp_path / "nowhere"), "--recalibrate"]) == 2


@pytest.mark.parametrize("tree_cost_per_node, keeps_drafting", [(0.0, True), (0.5, False)])
def test_measured_step_times_correct_a_cost_model_that_rates_trees_too_cheap(tree_cost_per_node, keeps_drafting):
    """The model says a tree costs what a vanilla step does; steps that really take 1 + b/2 vanilla steps for
    b nodes (as a batch of 8 can on a CPU) turn the chooser to vanilla steps at tau 1.4, steps as cheap as the
    model says do not."""
    cost = CostModel(target=[[1, 0.010], [64, 0.010]], draft=[[1, 1e-6], [64, 1e-6]])
    chooser = AdaptiveBudget(cost, depth=3, top_k=8, max_budget=4)
    chooser.acceptance.observe(4, 1.4, weight=100)
    assert chooser.choose(8) > 0
    for _ in range(20):
        budget = chooser.choose(8)
        chooser.observe_time(8, budget, 0.010 * (1 + tree_cost_per_node * budget))
    assert (chooser.choose(8) > 0) == keeps_drafting


def test_the_vanilla_yardstick_is_timed_again_while_trees_run_so_load_that_comes_later_is_seen():
    """Trees pay (tau 2 at the model's cost of one vanilla step): the chooser drafts, runs one vanilla step after
    VANILLA_PROBE_AFTER trees and then one every explore_every trees, never two in a row, so the yardstick the
    trees are weighed against is never older than explore_every steps. When load then slows vanilla steps 2x and
    trees 5x (a 2-thread pass stalls on a busy core more than a lone row), the chooser turns to vanilla, but for
    its exploring trees."""
    from clover.adaptive import VANILLA_PROBE_AFTER

    cost = CostModel(target=[[1, 0.010], [64, 0.010]], draft=[[1, 1e-6], [64, 1e-6]])
    chooser = AdaptiveBudget(cost, depth=3, top_k=8, max_budget=4, explore_every=8)
    chooser.acceptance.observe(4, 2.0, weight=1000)
    budgets = []
    for step in range(60):
        budget = chooser.choose(1)
        budgets.append(budget)
        load = (2.0 if budget == 0 else 5.0) if step >= 40 else 1.0
        chooser.observe_time(1, budget, 0.010 * load)
        chooser.acceptance.observe(4, 2.0, weight=1000)
    vanilla = [i for i, b in enumerate(budgets[:40]) if b == 0]
    assert vanilla[0] == VANILLA_PROBE_AFTER and all(b - a == 9 for a, b in zip(vanilla, vanilla[1:])), vanilla
    assert len(vanilla) >= 3
    assert budgets[50:].count(0) >= 8, budgets[40:]


def test_the_decode_loop_reports_every_step_time_to_the_chooser(monkeypatch):
    """Each decode step's batch size, budget and wall time reach AdaptiveBudget.observe_time (the default),
    and none do with step_timing=False."""
    target = make_target(seed=11)
    engine = TorchEngine(target, make_drafter(target, num_heads=3, seed=12), max_seq_len=256)
    prompts = random_prompts(13, 3, target.config.vocab_size, 2, 8)
    for step_timing in (True, False):
        seen = []
        monkeypatch.setattr(AdaptiveBudget, "observe_time",
                            lambda self, batch, budget, seconds, tokens, tree_tokens=None:
                            seen.append((batch, budget, seconds, tokens)))
        # the heads alone: with suffix candidates a step may accept more than its heads' budget allows
        decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=4, adaptive=True, proposer="none"),
                                     cost_model=ROOFLINE, step_timing=step_timing)
        results = decoder.generate([GenerationRequest(p, max_new_tokens=12, stop_token_ids=()) for p in prompts])
        assert [r.token_ids for r in results] == hf_greedy(target, prompts, 12)
        if step_timing:
            assert [(n, b) for n, b, _, _ in seen] == decoder.adaptive.history and all(s > 0 for _, _, s, _ in seen)
            # tokens per sequence this step: exactly 1 on vanilla steps, 1 to budget + 1 on trees
            assert all(t == 1 if b == 0 else 1 <= t <= b + 1 for _, b, _, t in seen)
        else:
            assert seen == [] and decoder.adaptive.history


def test_the_time_correction_counts_the_draft_prefill_like_the_chooser():
    """A step that took exactly what the cost model says, Clover-2's draft prefill over the accepted tokens
    included, needs no correction: with the prefill left out of the prediction (as before CostModel.step_time),
    the ratio came out above 1 and penalised the budgets that accept most."""
    cost = CostModel([[1, 0.010], [64, 0.040]], [[1, 0.001], [64, 0.004]], draft_prefill=[[1, 0.002], [64, 0.020]])
    chooser = AdaptiveBudget(cost, depth=3, top_k=8, max_budget=8, step_timing=True)
    for budget, tokens in ((0, 1.0), (4, 2.5), (8, 3.0)):
        chooser.observe_time(2, budget, cost.step_time(2, budget, tokens, 3, 8), tokens)
        assert chooser._ratio(2, budget) == pytest.approx(1.0)
    assert cost.step_time(2, 4, 2.5, 3) == pytest.approx(
        cost.target_time(10) + cost.draft_time(2, 4, 3) + cost.draft_prefill_time(5))


def test_where_the_chooser_stops_the_heads_for_a_batch_no_suffix_candidates_widen_its_pass():
    """Heads' drafts cost too much here (50 ms a draft step), so the chooser keeps the heads' budget at 0; the
    suffix proposer has candidates on a repeating prompt. With several sequences a tree in any row widens the whole
    batch's pass, so none is merged (on a CPU such steps ran at 0.92-0.98x vanilla); one sequence alone keeps its
    candidates. Either way the tokens are transformers generate()'s."""
    target = make_target(seed=2)
    engine = TorchEngine(target, make_drafter(target, num_heads=3, seed=12), max_seq_len=256)
    cost = CostModel(target=[[1, 0.010], [64, 0.011]], draft=[[1, 0.050], [64, 0.050]])
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8]
    drafted = {}
    for batch in (1, 2):
        decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=4, proposer="suffix"), max_batch_size=batch,
                                     cost_model=cost, step_timing=False)
        chosen = prompts[:batch]
        results = decoder.generate([GenerationRequest(p, max_new_tokens=24, stop_token_ids=()) for p in chosen])
        assert [r.token_ids for r in results] == hf_greedy(target, chosen, 24)
        assert {b for _, b in decoder.adaptive.history} == {0}  # the heads never drafted
        drafted[batch] = sum(r.stats.num_draft_tokens for r in results)
    assert drafted[1] > 0 and drafted[2] == 0, drafted
