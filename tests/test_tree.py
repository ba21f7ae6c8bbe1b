import pytest
import torch

from clover.attention import unpack_mask
from clover.config import ConfigError, TreeConfig
from clover.engine_contract import DraftResult
from clover.tree import TokenTree, batch_trees, build_trees


def fixed_draft(probs_per_depth, calls=None):
    """A draft step whose top-k log-probs depend only on the depth; token ids encode (depth, rank)."""

    def draft(hidden, token, head):
        if calls is not None:
            calls.append((hidden.shape[0], head))
        probs = torch.tensor(probs_per_depth[head])
        n, k = hidden.shape[0], len(probs)
        ids = torch.arange(k).repeat(n, 1) + 10 * (head + 1)
        return DraftResult(hidden + 1, probs.log().repeat(n, 1), ids)

    return draft


def test_dynamic_tree_keeps_best_joint_probabilities_within_budget():
    calls = []
    draft = fixed_draft([[0.6, 0.3, 0.1], [0.8, 0.15, 0.05], [0.55, 0.3, 0.15]], calls)
    trees = build_trees(draft, torch.zeros(2, 4), [5, 6], TreeConfig(budget=4, top_k=3, prune_ratio=0.0), num_heads=3)
    for tree, root in zip(trees, [5, 6]):
        # joint probabilities: a .6, aa .48, b .3, aaa .264 beat ba .24, c .1, ab .09, ...
        assert tree.tokens == [root, 10, 11, 20, 30]
        assert tree.parents == [-1, 0, 0, 1, 3]
        assert tree.depths == [0, 1, 1, 2, 3]
    # one batched draft step per level over both sequences: 1 root, 3 children, best 4 grandchildren each
    assert calls == [(2, 0), (6, 1), (8, 2)]


def test_expansion_stops_when_deeper_nodes_cannot_enter():
    calls = []
    draft = fixed_draft([[0.5, 0.5], [0.01, 0.01], [0.5, 0.5]], calls)
    tree = build_trees(draft, torch.zeros(1, 4), [0], TreeConfig(budget=2, top_k=2, prune_ratio=0.0), num_heads=3)[0]
    assert tree.depths == [0, 1, 1]
    assert len(calls) == 2  # level 2 (scores .005) could not beat the two .5 nodes: no third step


def test_pruning_drops_children_below_fraction_of_best():
    draft = fixed_draft([[0.9, 0.09, 0.01]])
    tree = build_trees(draft, torch.zeros(1, 4), [0], TreeConfig(budget=3, top_k=3, prune_ratio=0.05), num_heads=1)[0]
    assert tree.tokens == [0, 10, 11]  # 0.01 < 0.05 * 0.9


def test_depth_is_limited_by_heads_and_setting():
    draft = fixed_draft([[1.0]] * 5)
    tree = build_trees(draft, torch.zeros(1, 4), [0], TreeConfig(budget=10, top_k=1), num_heads=3)[0]
    assert max(tree.depths) == 3
    tree = build_trees(draft, torch.zeros(1, 4), [0], TreeConfig(budget=10, top_k=1, depth=2), num_heads=3)[0]
    assert max(tree.depths) == 2
    tree = build_trees(draft, torch.zeros(1, 4), [0], TreeConfig(budget=0), num_heads=3)[0]
    assert len(tree) == 1


def test_children_continue_from_parent_step_hidden():
    seen = []

    def draft(hidden, token, head):
        seen.append((hidden[:, 0].tolist(), token.tolist()))
        n = hidden.shape[0]
        return DraftResult(hidden + 1, torch.log(torch.tensor([[0.7, 0.3]] * n)), torch.tensor([[1, 2]] * n))

    build_trees(draft, torch.tensor([[5.0, 0.0]]), [9], TreeConfig(budget=4, top_k=2, prune_ratio=0), num_heads=2)
    assert seen[0] == ([5.0], [9])
    assert seen[1][0] == [6.0, 6.0] and seen[1][1] == [1, 2]


def test_static_tree_follows_choices():
    draft = fixed_draft([[0.5, 0.3, 0.2]] * 3)
    choices = [[0], [1], [0, 0], [0, 2], [0, 0, 1]]
    tree = build_trees(draft, torch.zeros(1, 4), [7], TreeConfig(static_choices=choices, top_k=3), num_heads=3)[0]
    assert tree.tokens == [7, 10, 11, 20, 22, 31]
    assert tree.parents == [-1, 0, 0, 1, 1, 3]
    with pytest.raises(ConfigError, match="has no parent"):
        TreeConfig(static_choices=[[0, 1]])


def test_tree_buffers():
    tree = TokenTree.root(4)
    a = tree.add(0, 10)
    tree.add(0, 11)
    tree.add(a, 20)
    batch = batch_trees([tree, TokenTree.root(9)])
    assert batch.input_ids.tolist() == [[4, 10, 11, 20], [9, 0, 0, 0]]
    assert batch.position_offsets.tolist() == [[0, 1, 1, 2], [0, 0, 0, 0]]
    assert batch.packed_mask[0].flatten().tolist() == [1, 3, 5, 11]
    assert batch.packed_mask[1].flatten().tolist() == [1, 2, 4, 8]  # padding rows see only themselves
    assert torch.equal(unpack_mask(batch.packed_mask, 4), batch.ancestors)
    assert batch.valid.tolist() == [[True] * 4, [True, False, False, False]]
