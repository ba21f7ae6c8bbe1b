"""build_trees against a frozen copy of its first implementation, on random drafts and configs.

The reference below is the tree builder as it was before it was split into
per-level functions and the static-tree shape was cached; the current one must
give the same trees, node for node, and make the same draft calls.
"""

import math
import random

import pytest
import torch

from clover.config import TreeConfig
from clover.engine_contract import DraftResult
from clover.tree import build_trees, static_tree_shape


def reference_build_trees(draft_step, root_hidden, root_tokens, tree, num_heads):
    """Frozen reference: returns (tokens, parents, depths) per sequence."""
    depth_limit = min(tree.depth or num_heads, num_heads)
    static = {tuple(p) for p in tree.static_choices} if tree.static_choices is not None else None
    if static is not None:
        depth_limit = min(depth_limit, max((len(p) for p in static), default=0))
    elif tree.budget == 0:
        depth_limit = 0
    log_prune = math.log(tree.prune_ratio) if tree.prune_ratio > 0 else -math.inf

    # candidate pool per sequence: (score, depth, parent index in pool, token, rank path); entry 0 is the root
    pools = [[(0.0, 0, -1, int(t), ())] for t in root_tokens]
    frontier = [(b, 0) for b in range(len(pools))]
    hidden = root_hidden
    tokens = torch.tensor([int(t) for t in root_tokens], dtype=torch.long)

    for depth in range(depth_limit):
        if not frontier:
            break
        result = draft_step(hidden, tokens, depth)
        width = min(tree.top_k, result.topk_ids.shape[1])
        logprobs, ids = result.topk_logprobs[:, :width].float(), result.topk_ids[:, :width]
        rows_of = {}
        for row, (b, _) in enumerate(frontier):
            rows_of.setdefault(b, []).append(row)
        next_frontier, parent_rows, still_useful = [], [], False
        for b, rows in rows_of.items():
            pool = pools[b]
            if static is not None:
                chosen = [(pool[frontier[r][1]][0] + float(logprobs[r, k]), r, k) for r in rows for k in range(width)
                          if pool[frontier[r][1]][4] + (k,) in static]
            else:
                parent_scores = torch.tensor([pool[frontier[r][1]][0] for r in rows])
                cand = (parent_scores[:, None] + logprobs[torch.tensor(rows)]).flatten()
                best = float(cand.max())
                keep = int((cand >= best + log_prune).sum())
                top = torch.topk(cand, min(tree.budget, keep))
                chosen = [(float(s), rows[int(i) // width], int(i) % width) for s, i in zip(top.values, top.indices)]
                still_useful |= sum(node[0] >= best for node in pool[1:]) < tree.budget
            for score, row, rank in sorted(chosen, key=lambda c: -c[0]):
                parent = frontier[row][1]
                pool.append((score, depth + 1, parent, int(ids[row, rank]), pool[parent][4] + (rank,)))
                next_frontier.append((b, len(pool) - 1))
                parent_rows.append(row)
        frontier = next_frontier if (static is not None or still_useful) else []
        if frontier:
            hidden = result.next_hidden[torch.tensor(parent_rows)]
            tokens = torch.tensor([pools[b][i][3] for b, i in frontier], dtype=torch.long)

    trees = []
    for pool in pools:
        keep = list(range(1, len(pool)))
        if static is None:
            keep = sorted(keep, key=lambda i: (-pool[i][0], pool[i][1]))[: tree.budget]
        keep.sort(key=lambda i: (pool[i][1], -pool[i][0]))
        out_tokens, out_parents, out_depths, index_of = [pool[0][3]], [-1], [0], {0: 0}
        for i in keep:
            parent = index_of[pool[i][2]]
            out_tokens.append(pool[i][3])
            out_parents.append(parent)
            out_depths.append(out_depths[parent] + 1)
            index_of[i] = len(out_tokens) - 1
        trees.append((out_tokens, out_parents, out_depths))
    return trees


def random_draft(seed: int, engine_top_k: int, vocab: int, coarse: bool):
    """A seeded draft step; ``coarse`` rounds the logits so that scores tie. Records its calls."""
    gen = torch.Generator().manual_seed(seed)
    calls = []

    def draft(hidden, token, head):
        logits = torch.randn(hidden.shape[0], vocab, generator=gen) * 3
        if coarse:
            logits = logits.round()
        logprobs, ids = torch.topk(torch.log_softmax(logits, -1), engine_top_k)
        calls.append((hidden.clone(), token.tolist(), head))
        return DraftResult(hidden + torch.randn(hidden.shape, generator=gen), logprobs, ids)

    return draft, calls


def random_case(seed: int):
    rng = random.Random(seed)
    top_k, engine_top_k = rng.randint(1, 6), rng.randint(1, 8)
    settings = {"top_k": top_k, "depth": rng.choice([None, 1, 2, 3, 6])}
    if rng.random() < 0.4:
        paths = set()
        for _ in range(rng.randint(0, 20)):
            path = ()
            for _ in range(rng.randint(1, 6)):
                path += (rng.randrange(min(top_k, engine_top_k)),)
                paths.add(path)
        settings["static_choices"] = [list(p) for p in sorted(paths, key=lambda p: rng.random())]
    else:
        settings["budget"] = rng.choice([0, 1, 2, 3, 4, 7, 12, 30])
        settings["prune_ratio"] = rng.choice([0.0, 0.001, 0.02, 0.1, 0.5, 1.0])
    batch = rng.randint(1, 4)
    roots = [rng.randrange(100) for _ in range(batch)]
    hidden = torch.randn(batch, 4, generator=torch.Generator().manual_seed(seed))
    draft_args = (seed, engine_top_k, rng.choice([engine_top_k, 16, 50]), rng.random() < 0.4)
    return TreeConfig(**settings), rng.randint(1, 5), roots, hidden, draft_args


@pytest.mark.parametrize("first_seed", range(0, 400, 100))
def test_build_trees_matches_reference(first_seed):
    for seed in range(first_seed, first_seed + 100):
        config, num_heads, roots, hidden, draft_args = random_case(seed)
        draft, calls = random_draft(*draft_args)
        trees = build_trees(draft, hidden, roots, config, num_heads)
        reference_draft, reference_calls = random_draft(*draft_args)
        expected = reference_build_trees(reference_draft, hidden, roots, config, num_heads)
        assert [(t.tokens, t.parents, t.depths) for t in trees] == expected, (seed, config)
        assert len(calls) == len(reference_calls), (seed, config)
        for (h, tok, head), (ref_h, ref_tok, ref_head) in zip(calls, reference_calls):
            assert torch.equal(h, ref_h) and tok == ref_tok and head == ref_head, (seed, config)


def test_static_tree_shape_is_built_once_per_choices():
    static_tree_shape.cache_clear()
    draft, _ = random_draft(0, 4, 16, False)
    config = TreeConfig(static_choices=[[0], [1], [0, 0], [0, 2], [1, 0]], top_k=4)
    for _ in range(5):
        build_trees(draft, torch.zeros(2, 4), [1, 2], config, num_heads=3)
    info = static_tree_shape.cache_info()
    assert (info.misses, info.hits) == (1, 4)
    shape = static_tree_shape(((0,), (1,), (0, 0), (0, 2), (1, 0)))
    assert shape.depth == 2
    assert dict(shape.child_ranks) == {(): (0, 1), (0,): (0, 2), (1,): (0,)}
