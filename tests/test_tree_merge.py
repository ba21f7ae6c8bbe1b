"""Model-free candidates merged into the heads' trees (docs/trees.md#model-free-candidates): one tree builder,
one budget, scores on one calibrated scale."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from clover.adaptive import AdaptiveBudget, CostModel, SourceCalibration
from clover.config import ConfigError, TreeConfig
from clover.tree import SOURCE_HEADS, SOURCE_SUFFIX, TreeMerge, draft_tree_batch, suffix_calibration_row
from tests.test_tree import fixed_draft


@dataclasses.dataclass
class Proposal:
    """A hand-written proposal with the fields :class:`clover.suffix.SuffixProposal` has."""

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    counts: np.ndarray
    total: int
    match_length: int = 4


def proposal(paths: dict[tuple[int, ...], int], total: int, match_length: int = 4) -> Proposal:
    """Nodes from {token path: count}, in level order."""
    order = sorted(paths, key=lambda p: (len(p), -paths[p]))
    index = {p: i for i, p in enumerate(order)}
    return Proposal(np.array([p[-1] for p in order]), np.array([index.get(p[:-1], -1) for p in order]),
                    np.array([len(p) for p in order]), np.array([paths[p] for p in order]), total, match_length)


def ones(depth: int = 8) -> np.ndarray:
    return np.ones((5, depth + 1))


def tree_paths(batch, row: int = 0) -> dict[tuple[int, ...], int]:
    """{token path from the root's child: source bits} of one tree of a TreeBatch."""
    tree = batch.trees()[row]
    paths, out = {0: ()}, {}
    for node in range(1, len(tree)):
        paths[node] = paths[tree.parents[node]] + (tree.tokens[node],)
        out[paths[node]] = int(batch.sources.bits[row, node]) if batch.sources is not None else SOURCE_HEADS
    return out


def test_a_candidate_both_sources_propose_is_one_node_with_both_sources():
    draft = fixed_draft([[0.6, 0.3], [0.8, 0.2]])  # the heads: tokens 10/11 at depth 1, 20/21 at depth 2
    merge = TreeMerge([proposal({(10,): 3, (10, 20): 3, (10, 20, 7): 2}, 4)], budget=8, factors=ones())
    batch = draft_tree_batch(draft, torch.zeros(1, 4), [5], TreeConfig(budget=4, top_k=2, prune_ratio=0.0), 2, merge)
    paths = tree_paths(batch)
    assert paths[(10,)] == paths[(10, 20)] == SOURCE_HEADS | SOURCE_SUFFIX
    assert paths[(10, 20, 7)] == SOURCE_SUFFIX and paths[(11,)] == SOURCE_HEADS
    tree = batch.trees()[0]
    for node in range(len(tree)):  # no two siblings carry the same token
        siblings = [tree.tokens[c] for c in tree.children(node)]
        assert len(siblings) == len(set(siblings))


def test_the_budget_is_shared_and_the_best_calibrated_nodes_win():
    draft = fixed_draft([[0.5, 0.2], [0.5, 0.2]])  # heads: 10 .5, 11 .2, (10,20) .25, (10,21) .1, (11,20) .1 ...
    suffix = proposal({(30,): 9, (30, 31): 9, (30, 31, 32): 9, (40,): 1}, 10)  # .9 .9 .9 .1
    merge = TreeMerge([suffix], budget=4, factors=ones())
    batch = draft_tree_batch(draft, torch.zeros(1, 4), [5], TreeConfig(budget=4, top_k=2, prune_ratio=0.0), 2, merge)
    assert set(tree_paths(batch)) == {(30,), (30, 31), (30, 31, 32), (10,)}
    # calibration scales a source: suffix candidates judged 4x less reliable lose their place to the heads'
    factors = ones()
    factors[suffix_calibration_row(4)] = 0.25
    merge = TreeMerge([suffix], budget=4, factors=factors)
    batch = draft_tree_batch(draft, torch.zeros(1, 4), [5], TreeConfig(budget=4, top_k=2, prune_ratio=0.0), 2, merge)
    assert set(tree_paths(batch)) == {(10,), (10, 20), (30,), (30, 31)}  # .5 .25 .225 .225 beat .2 and .225's child


def test_trees_stay_closed_under_ancestors_when_a_child_is_rated_above_its_parent():
    factors = ones()
    factors[suffix_calibration_row(2), 2] = 50.0  # depth 2 rated far above depth 1
    merge = TreeMerge([proposal({(7,): 1, (7, 8): 1, (9,): 1}, 2, match_length=2)], budget=1, factors=factors)
    batch = draft_tree_batch(None, None, [5], TreeConfig(budget=0), 0, merge)
    assert set(tree_paths(batch)) == {(7,)}  # (7, 8) alone would be a node without its parent


def test_the_trees_keep_as_many_nodes_as_pay_for_the_batchs_widest_pass():
    # calibrated values (count / total, factors 1): sequence 0 .75, .75, .25; sequence 1 .5
    proposals = [proposal({(7,): 3, (7, 8): 3, (9,): 1}, 4), proposal({(4,): 1}, 2)]
    # expected tokens at k nodes per tree: 2 + (0, 1.25, 2.0, 2.25); a node per tree costing 0.1 ms, all 3 pay
    flat = np.array([0.0100, 0.0101, 0.0102, 0.0103])
    steep = np.array([0.010, 0.015, 0.025, 0.035])  # only the first: 3.25 / 15 ms > 2 / 10 ms > 4 / 25 ms
    for seconds, size in ((flat, 3), (steep, 1)):
        merge = TreeMerge(proposals, budget=3, factors=ones(), step_seconds=seconds)
        batch = draft_tree_batch(None, None, [5, 6], TreeConfig(budget=0), 0, merge)
        assert batch.tree_sizes().tolist() == [1 + size, 2]
    assert set(tree_paths(batch, 0)) == {(7,)} and set(tree_paths(batch, 1)) == {(4,)}  # each tree's best node
    # nothing pays: root-only trees (a vanilla step), unless the heads' budget of the step says otherwise
    merge = TreeMerge(proposals, budget=3, factors=ones(), step_seconds=np.array([0.01, 0.03, 0.05, 0.07]))
    assert draft_tree_batch(None, None, [5, 6], TreeConfig(budget=0), 0, merge).tree_sizes().tolist() == [1, 1]
    merge = dataclasses.replace(merge, min_nodes=2)
    assert draft_tree_batch(None, None, [5, 6], TreeConfig(budget=0), 0, merge).tree_sizes().tolist() == [3, 2]


def test_without_a_cost_model_the_trees_fill_the_budget_and_proposals_alone_build_them():
    merge = TreeMerge([proposal({(7,): 3, (7, 8): 3, (9,): 1}, 4), None], budget=8, factors=ones())
    batch = draft_tree_batch(None, None, [5, 6], TreeConfig(budget=0), 0, merge)
    assert set(tree_paths(batch, 0)) == {(7,), (7, 8), (9,)}
    assert batch.tree_sizes().tolist() == [4, 1]  # the sequence without a proposal: its root alone
    # level order, siblings by score
    assert batch.input_ids[0].tolist() == [5, 7, 9, 8] and batch.position_offsets[0].tolist() == [0, 1, 1, 2]


def test_calibration_learns_each_source_per_depth():
    calibration = SourceCalibration(max_depth=3, decay=0.5, prior=(1.0, 0.5, 0.5, 0.5, 0.5), prior_weight=1.0)
    depths = np.array([[0, 1, 2, 1]])
    bits = np.array([[0, SOURCE_HEADS, SOURCE_HEADS | SOURCE_SUFFIX, SOURCE_SUFFIX]], np.uint8)
    raw = np.zeros((1, 4, 2))
    raw[0, 1, 0], raw[0, 2, 0], raw[0, 2, 1], raw[0, 3, 1] = 0.5, 0.4, 1.0, 1.0
    on_path = np.array([[False, True, True, False]])
    for _ in range(30):
        calibration.observe(depths, bits, raw, np.array([2]), on_path)
    factors = calibration.factors()
    assert factors[0, 1] == pytest.approx(1 / 0.5, rel=1e-3)  # heads: accepted 1 of .5 predicted at depth 1
    assert factors[0, 2] == pytest.approx(1 / 0.4, rel=1e-3)
    assert factors[2, 1] == pytest.approx(0.0, abs=1e-6)  # suffix, row 2: its depth-1 node never accepted
    assert factors[2, 2] == pytest.approx(1.0, rel=1e-3)
    assert factors[1, 1] == pytest.approx(0.5)  # a row never observed keeps its prior


def test_tree_step_seconds_follow_the_pass_curve_at_the_batchs_width():
    cost = CostModel(target=[[1, 0.010], [2, 0.011], [4, 0.013], [8, 0.030]], draft=[[1, 0.001], [8, 0.001]])
    chooser = AdaptiveBudget(cost, depth=1, top_k=2, max_budget=1, step_timing=False)
    # batch 1 without heads: the pass over 1 + k tokens
    assert chooser.tree_step_seconds(1, 0, 3) == pytest.approx([0.010, 0.011, 0.012, 0.013])
    # batch 4: the pass over 4 (1 + k) tokens
    assert chooser.tree_step_seconds(4, 0, 1) == pytest.approx([0.013, 0.030])
    # the heads draft at budget 1: one draft step (1 ms) on top of every width
    assert chooser.tree_step_seconds(1, 1, 2) == pytest.approx([0.011, 0.012, 0.013])


@pytest.mark.parametrize("bad", [{"proposer": "ngram"}, {"proposer_depth": 0},
                                 {"proposer": "suffix", "static_choices": [[0]]}])
def test_bad_proposer_settings_are_refused(bad):
    with pytest.raises(ConfigError, match="proposer"):
        TreeConfig(**bad)


def test_build_engine_refuses_an_unknown_proposer_before_building(tmp_path):
    from clover.export.builder import BuildOptions

    with pytest.raises(ConfigError, match="unknown proposer 'ngram'"):
        BuildOptions(proposer="ngram").validated()


def test_the_serving_parameter_and_the_cli_refuse_an_unknown_proposer(capsys):
    from clover.cli import main
    from clover.serving.served_engine import load_serving_engine

    with pytest.raises(ConfigError, match="proposer='ngram': choose auto, suffix, none"):
        load_serving_engine("no-such-engine", proposer="ngram")  # refused before the engine is even looked at
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--proposer", "ngram"])
    assert "invalid choice: 'ngram'" in capsys.readouterr().err
