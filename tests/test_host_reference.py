"""The batched host work of a decode step against frozen copies of its per-sequence Python versions.

The references below are ``batch_trees``, ``greedy_accept`` and ``KVCache.commit`` as they were before they were
batched over the sequences (docs/trees.md#host-work-per-step), and ``build_trees`` from tests/test_tree_reference.py.
On random trees, logits (with ties) and caches, the current code must give the same buffers, the same accepted
paths and the same cache, bit for bit.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from clover.attention import pack_mask
from clover.config import TreeConfig
from clover.engine_contract import DraftResult
from clover.host_ops import argmax_last, take_rows
from clover.kv_cache import KVCache
from clover.tree import TokenTree, batch_trees, draft_tree_batch, root_batch
from clover.verify import greedy_accept
from tests.test_tree_reference import random_case, random_draft, reference_build_trees

# -- frozen references -----------------------------------------------------------------------------------


def reference_ancestor_mask(tree: TokenTree) -> torch.Tensor:
    size = len(tree)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for i, parent in enumerate(tree.parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def reference_batch_trees(trees: list[TokenTree]) -> dict[str, torch.Tensor]:
    batch, size = len(trees), max(len(t) for t in trees)
    input_ids = torch.zeros(batch, size, dtype=torch.long)
    offsets = torch.zeros(batch, size, dtype=torch.long)
    parents = torch.full((batch, size), -1, dtype=torch.long)
    valid = torch.zeros(batch, size, dtype=torch.bool)
    ancestors = torch.eye(size, dtype=torch.bool).repeat(batch, 1, 1)
    for b, tree in enumerate(trees):
        n = len(tree)
        input_ids[b, :n] = torch.tensor(tree.tokens)
        offsets[b, :n] = torch.tensor(tree.depths)
        parents[b, :n] = torch.tensor(tree.parents)
        valid[b, :n] = True
        ancestors[b, :n, :n] = reference_ancestor_mask(tree)
    return {"input_ids": input_ids, "position_offsets": offsets, "packed_mask": pack_mask(ancestors),
            "ancestors": ancestors, "parents": parents, "valid": valid}


def reference_greedy_accept(logits: torch.Tensor, batch) -> list[tuple[list[int], list[int]]]:
    """(path, tokens) per sequence."""
    predicted = logits.argmax(-1)
    parent_prediction = predicted.gather(1, batch.parents.clamp(min=0))
    matches = (batch.input_ids == parent_prediction) | (batch.parents < 0)
    matches &= batch.valid
    accepted = ~(batch.ancestors & ~matches[:, None, :]).any(-1)
    depth = batch.position_offsets.masked_fill(~accepted, -1)
    deepest = depth.argmax(-1)
    results = []
    for b in range(logits.shape[0]):
        path = torch.nonzero(batch.ancestors[b, deepest[b]]).flatten().tolist()
        tokens = batch.input_ids[b, path[1:]].tolist() + [int(predicted[b, deepest[b]])]
        results.append((path, tokens))
    return results


def reference_commit(cache: KVCache, present_keys, present_values, source_index, counts, rows=None) -> None:
    rows = rows or slice(0, cache.num_rows)
    first_row = rows.start or 0
    lengths = cache._lengths[rows]
    if int((lengths + counts.to(torch.int32)).max()) > cache.max_seq_len:
        raise RuntimeError("KV cache overflow: a sequence is longer than max_seq_len")
    counts_list, starts = counts.tolist(), lengths.tolist()
    for tensor, presents in ((cache._keys, present_keys), (cache._values, present_values)):
        new = torch.stack(presents)
        for i, (start, count) in enumerate(zip(starts, counts_list)):
            if count:
                tensor[:, first_row + i, :, start : start + count] = new[:, i].index_select(2, source_index[i, :count])
    cache._lengths[rows] += counts.to(torch.int32)


# -- random inputs ---------------------------------------------------------------------------------------


def random_tree(rng: random.Random, vocab: int) -> TokenTree:
    """A tree in level order, up to 12 nodes and depth 5. Drafted siblings have distinct tokens; a quarter of
    the trees repeat some (then two nodes of one depth can both be accepted: the first one wins)."""
    tree = TokenTree.root(rng.randrange(vocab))
    frontier, repeats = [0], rng.random() < 0.25
    while frontier and len(tree) < rng.randint(1, 12):
        parent = frontier.pop(0)
        if tree.depths[parent] >= 5:
            continue
        count = rng.randint(0, min(3, vocab))
        tokens = rng.choices(range(vocab), k=count) if repeats else rng.sample(range(vocab), count)
        for token in tokens:
            frontier.append(tree.add(parent, token))
    return tree


def logits_for(rng: random.Random, batch, vocab: int, coarse: bool) -> torch.Tensor:
    """Logits ``[B, T, V]`` that often predict the trees' own tokens, so that paths of every depth get accepted;
    ``coarse`` makes ties between the top logits."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(*batch.input_ids.shape, vocab, generator=gen)
    if coarse:
        logits = logits.round()
    for b, t in zip(*torch.nonzero(batch.valid, as_tuple=True)):
        parent = int(batch.parents[b, t])
        if parent >= 0 and rng.random() < 0.7:
            logits[b, parent, int(batch.input_ids[b, t])] = logits[b, parent].max() + (0 if coarse else 1)
    return logits


def assert_buffers_equal(batch, expected: dict[str, torch.Tensor], context) -> None:
    for name, tensor in expected.items():
        actual = getattr(batch, name)
        assert actual.dtype == tensor.dtype and torch.equal(actual, tensor), (name, context)


# -- tests -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first_seed", range(0, 600, 200))
def test_batch_trees_and_greedy_accept_match_references(first_seed):
    for seed in range(first_seed, first_seed + 200):
        rng = random.Random(seed)
        vocab = rng.choice([3, 8, 50])
        trees = [random_tree(rng, vocab) for _ in range(rng.randint(1, 6))]
        batch = batch_trees(trees)
        assert_buffers_equal(batch, reference_batch_trees(trees), seed)
        assert [(t.tokens, t.parents, t.depths) for t in batch.trees()] == \
            [(t.tokens, t.parents, t.depths) for t in trees]
        logits = logits_for(rng, batch, vocab, coarse=rng.random() < 0.5)
        accepted = greedy_accept(logits, batch)
        assert [(a.path, a.tokens) for a in accepted] == reference_greedy_accept(logits, batch), seed


def test_greedy_accept_sees_deep_paths():
    """The random cases above are not all trivial: some accept 3 or more draft tokens."""
    depths = []
    for seed in range(200):
        rng = random.Random(seed)
        trees = [random_tree(rng, 50) for _ in range(4)]
        batch = batch_trees(trees)
        depths += [len(a.path) - 1 for a in greedy_accept(logits_for(rng, batch, 50, False), batch)]
    assert max(depths) >= 3 and min(depths) == 0


@pytest.mark.parametrize("first_seed", range(0, 400, 100))
def test_draft_tree_batch_matches_reference_buffers(first_seed):
    """The batched tree builder's buffers equal the reference builder's trees run through the reference buffers."""
    for seed in range(first_seed, first_seed + 100):
        config, num_heads, roots, hidden, draft_args = random_case(seed)
        draft, _ = random_draft(*draft_args)
        batch = draft_tree_batch(draft, hidden, roots, config, num_heads)
        reference_draft, _ = random_draft(*draft_args)
        expected = [TokenTree(*t) for t in reference_build_trees(reference_draft, hidden, roots, config, num_heads)]
        assert_buffers_equal(batch, reference_batch_trees(expected), (seed, config))
        assert batch.sizes.tolist() == [len(t) for t in expected]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_argmax_last_picks_the_first_maximum_as_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    for coarse in (False, True):
        logits = torch.randn(3, 7, 1000, generator=gen) * 4
        logits = (logits.round() if coarse else logits).to(dtype)  # coarse: many ties for the maximum
        assert torch.equal(argmax_last(logits), logits.argmax(-1))
        assert torch.equal(argmax_last(logits[1, 2]), logits[1, 2].argmax(-1))
    assert argmax_last(torch.zeros(4, 9)).tolist() == [0] * 4  # all tied: the first


def _random_cache(rng: random.Random, gen: torch.Generator, rows: int, max_seq: int) -> KVCache:
    cache = KVCache(num_layers=3, num_kv_heads=2, head_dim=4, max_seq_len=max_seq, capacity=rows)
    cache.add_rows(rows)
    cache._keys.copy_(torch.randn(cache._keys.shape, generator=gen))
    cache._values.copy_(torch.randn(cache._values.shape, generator=gen))
    cache._lengths[:rows] = torch.tensor([rng.randint(0, max_seq - 6) for _ in range(rows)], dtype=torch.int32)
    return cache


def _clone(cache: KVCache) -> KVCache:
    copy = KVCache(3, 2, 4, cache.max_seq_len, capacity=cache._capacity)
    copy.add_rows(cache.num_rows)
    copy._keys.copy_(cache._keys)
    copy._values.copy_(cache._values)
    copy._lengths.copy_(cache._lengths)
    return copy


@pytest.mark.parametrize("first_seed", range(0, 300, 100))
def test_commit_matches_reference(first_seed):
    """Random accepted paths (any order of tree nodes, counts 0..T, expanded prefill indices), row ranges."""
    for seed in range(first_seed, first_seed + 100):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        num_rows, tokens = rng.randint(1, 6), rng.randint(1, 6)
        cache = _random_cache(rng, gen, num_rows, max_seq=rng.choice([8, 12, 40]))
        first = rng.randrange(num_rows)
        rows = rng.choice([None, slice(first, rng.randint(first + 1, num_rows))])
        n = num_rows if rows is None else rows.stop - rows.start
        presents = [[torch.randn(n, 2, tokens, 4, generator=gen) for _ in range(3)] for _ in range(2)]
        if rng.random() < 0.3:  # prefill: every token, in order, as an expanded index
            source = torch.arange(tokens).expand(n, -1)
            counts = torch.tensor([rng.randint(0, tokens) for _ in range(n)])
        else:
            width = rng.randint(1, tokens)
            source = torch.stack([torch.randperm(tokens, generator=gen)[:width] for _ in range(n)])
            counts = torch.tensor([rng.randint(0, width) for _ in range(n)])
        expected = _clone(cache)
        reference_commit(expected, *presents, source, counts, rows=rows)
        cache.commit(*presents, source, counts, rows=rows)
        for name in ("_keys", "_values", "_lengths"):
            assert torch.equal(getattr(cache, name), getattr(expected, name)), (seed, name)


def test_commit_refuses_overflow_and_bad_indices():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_seq_len=4, capacity=1)
    cache.add_rows(1)
    presents = [torch.zeros(1, 1, 3, 2)]
    with pytest.raises(RuntimeError, match="overflow"):
        cache.commit(presents, presents, torch.tensor([[0, 1, 2]]), torch.tensor([3]))
        cache.commit(presents, presents, torch.tensor([[0, 1, 2]]), torch.tensor([3]))
    assert int(cache.lengths[0]) == 3  # the refused commit wrote nothing
    with pytest.raises(IndexError):
        cache.commit(presents, presents, torch.tensor([[3]]), torch.tensor([1]))
    cache.commit(presents, presents, torch.tensor([[2, -1]]), torch.tensor([1]))  # entries past the count: unread
    assert int(cache.lengths[0]) == 4


def test_root_batch_and_static_tree_batch():
    """Vanilla steps (root-only trees) and a static tree through the batched builder."""
    for roots in ([5, 7], [3], [5, 7]):  # the second [5, 7] reuses the buffers built for two roots
        expected = reference_batch_trees([TokenTree.root(t) for t in roots])
        assert_buffers_equal(root_batch(roots), expected, roots)
        assert_buffers_equal(root_batch(torch.tensor(roots)), expected, roots)
        assert_buffers_equal(batch_trees([TokenTree.root(t) for t in roots]), expected, roots)
    assert root_batch([5, 7]).packed_mask.tolist() == [[[1]], [[1]]]

    def draft(hidden, token, head):  # ranks 0, 1, 2 with probabilities .5, .3, .2; ids encode (head, rank)
        n = hidden.shape[0]
        return DraftResult(hidden + 1, torch.tensor([[0.5, 0.3, 0.2]] * n).log(),
                           torch.arange(3).repeat(n, 1) + 10 * (head + 1))

    config = TreeConfig(static_choices=[[0], [1], [0, 0], [0, 2], [0, 0, 1]], top_k=3)
    batch = draft_tree_batch(draft, torch.zeros(2, 4), [7, 8], config, num_heads=3)
    assert batch.input_ids.tolist() == [[7, 10, 11, 20, 22, 31], [8, 10, 11, 20, 22, 31]]
    assert batch.parents.tolist() == [[-1, 0, 0, 1, 1, 3]] * 2


def test_pruning_threshold_rounds_as_the_reference():
    """Children scored right at the pruning threshold: kept or dropped exactly as the reference does (its
    threshold is a float64 sum compared in float32), over many such boundaries."""
    log_prune, kept_counts = math.log(0.02), set()
    gen = torch.Generator().manual_seed(0)
    for best in (-torch.rand(300, generator=gen) * 3).tolist():
        best = float(torch.tensor(best, dtype=torch.float32))
        edge = torch.tensor(best + log_prune, dtype=torch.float32)
        for child in (edge, torch.nextafter(edge, torch.tensor(0.0)), torch.nextafter(edge, torch.tensor(-9.0))):
            logprobs = torch.tensor([[best, float(child)]])

            def draft(hidden, token, head):
                n = hidden.shape[0]
                return DraftResult(hidden, logprobs.expand(n, -1), torch.tensor([[1, 2]]).expand(n, -1))

            config = TreeConfig(budget=2, top_k=2, prune_ratio=0.02)
            batch = draft_tree_batch(draft, torch.zeros(1, 4), [0], config, num_heads=1)
            expected = reference_build_trees(draft, torch.zeros(1, 4), [0], config, num_heads=1)[0]
            assert batch.input_ids[0].tolist() == expected[0], (best, float(child))
            kept_counts.add(len(expected[0]))
    assert kept_counts == {2, 3}  # both sides of the threshold were exercised


def reference_pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Frozen: ``clover.attention.pack_mask`` in torch ops, as it was before its NumPy path."""
    *lead, rows, cols = mask.shape
    words = -(-cols // 32)
    padded = torch.zeros(*lead, rows, words * 32, dtype=torch.int64)
    padded[..., :cols] = mask.to(torch.int64)
    bit_values = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64), torch.arange(32))
    unsigned = (padded.view(*lead, rows, words, 32) * bit_values).sum(-1)
    return torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32)


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 5), (2, 31, 31), (2, 32, 32), (2, 33, 33), (1, 70, 70), (4, 7),
                                   (2, 3, 3, 40)])
def test_pack_mask_matches_reference(shape):
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    for density in (0.0, 0.5, 1.0):
        mask = torch.rand(shape, generator=gen) < density
        assert torch.equal(pack_mask(mask), reference_pack_mask(mask)), (shape, density)
        assert pack_mask(mask).dtype == torch.int32
    assert torch.equal(pack_mask(mask[..., ::2, :]), reference_pack_mask(mask[..., ::2, :]))  # a strided view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_take_rows_equals_index_select(dtype):
    table = (torch.randn(7, 3, 2, generator=torch.Generator().manual_seed(1)) * 10).to(dtype)
    for rows in ([], [0], [6, 0, 6, 2], list(range(7))):
        expected = table.index_select(0, torch.tensor(rows, dtype=torch.long))
        for given in (rows, torch.tensor(rows, dtype=torch.long), np.array(rows, dtype=np.int64)):
            got = take_rows(table, given)
            assert got.dtype == dtype and torch.equal(got, expected)
