"""Token trees (docs/trees.md#building-a-tree): building them from draft steps, and their buffers.

Everything here is a pure function of its arguments. A tree is built per
sequence per decode step; node 0 is the root, the last accepted token, whose
K/V is not yet in the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

import torch

from clover.attention import pack_mask
from clover.config import TreeConfig
from clover.engine_contract import DraftResult


@dataclasses.dataclass
class TokenTree:
    """One sequence's tree. Nodes are in level order: a parent precedes its children,
    and siblings are in decreasing draft score (the order verification tries them)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    @classmethod
    def root(cls, token: int) -> "TokenTree":
        return cls([int(token)], [-1], [0])

    def add(self, parent: int, token: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_mask(self) -> torch.Tensor:
        """bool ``[T, T]``: row i has its own bit and its ancestors' bits."""
        size = len(self)
        mask = torch.zeros(size, size, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask


DraftFn = Callable[[torch.Tensor, torch.Tensor, int], DraftResult]


class Candidate(NamedTuple):
    """A drafted token that may enter a sequence's tree (an entry of its candidate pool)."""

    score: float                  # joint log-probability of the path from the root (0 for the root)
    depth: int                    # 0 for the root
    parent: int                   # pool index of the parent; -1 for the root
    token: int
    rank_path: tuple[int, ...]    # the candidate rank chosen at each level, as in ``TreeConfig.static_choices``


class _Choice(NamedTuple):
    """A child picked at one level: draft row ``row`` of the level's batch, candidate ``rank`` of that row."""

    score: float
    row: int
    rank: int


@dataclasses.dataclass(frozen=True)
class StaticTreeShape:
    """What a static tree's choices fix, whatever the draft scores: built once per set of choices.

    ``depth``: the longest path; ``child_ranks``: per rank path, the ranks of
    the children to keep, ascending. (The node order, and so the masks, still
    depend on the scores: each level is sorted by score across parents.)
    """

    depth: int
    child_ranks: Mapping[tuple[int, ...], tuple[int, ...]]  # read-only: the cache shares it


@functools.lru_cache(maxsize=32)
def static_tree_shape(paths: tuple[tuple[int, ...], ...]) -> StaticTreeShape:
    """The shape of ``TreeConfig.static_choices``, given as a tuple of tuples (hashable, for the cache)."""
    children: dict[tuple[int, ...], set[int]] = {}
    for path in paths:
        if path:
            children.setdefault(path[:-1], set()).add(path[-1])
    return StaticTreeShape(max((len(p) for p in paths), default=0),
                           MappingProxyType({prefix: tuple(sorted(ranks)) for prefix, ranks in children.items()}))


def build_trees(draft_step: DraftFn, root_hidden: torch.Tensor, root_tokens: list[int],
                tree: TreeConfig, num_heads: int) -> list[TokenTree]:
    """Expand a tree per sequence, level by level, one batched draft step per level.

    Dynamic trees score each candidate by the joint log-probability of its
    path. At each level the ``budget`` best children (those over
    ``prune_ratio`` times the level's best) become the next frontier; at the
    end the ``budget`` best candidates of all levels form the tree. A child
    never scores above its parent, so that set always contains each node's
    ancestors. Expansion stops early once no deeper node could make the cut.
    Static trees keep the children whose rank path is in ``tree.static_choices``.

    Args:
        draft_step: the engine's ``draft_step(hidden [N, H], token [N], head)``.
        root_hidden: ``[B, H]``, h0 at each sequence's last accepted position.
        root_tokens: B root tokens (the last accepted token of each sequence).
        num_heads: heads the drafter has; the tree is at most that deep.
    Returns:
        One :class:`TokenTree` per sequence, in level order, siblings by score.
    """
    static = None
    if tree.static_choices is not None:
        static = static_tree_shape(tuple(tuple(path) for path in tree.static_choices))
    pools = [[Candidate(0.0, 0, -1, int(t), ())] for t in root_tokens]
    frontier = [(b, 0) for b in range(len(pools))]  # (sequence, pool index) of the nodes to expand next
    hidden = root_hidden  # [len(frontier), H]
    tokens = torch.tensor([int(t) for t in root_tokens], dtype=torch.long)  # [len(frontier)]
    for depth in range(_depth_limit(tree, num_heads, static)):
        if not frontier:
            break
        result = draft_step(hidden, tokens, depth)
        frontier, parent_rows = _expand_level(pools, frontier, result, depth, tree, static)
        if frontier:
            hidden = result.next_hidden[torch.tensor(parent_rows)]
            tokens = torch.tensor([pools[b][i].token for b, i in frontier], dtype=torch.long)
    return [_pool_to_tree(pool, None if static is not None else tree.budget) for pool in pools]


def _depth_limit(tree: TreeConfig, num_heads: int, static: StaticTreeShape | None) -> int:
    limit = min(tree.depth or num_heads, num_heads)
    if static is not None:
        return min(limit, static.depth)
    return 0 if tree.budget == 0 else limit


def _expand_level(pools: list[list[Candidate]], frontier: list[tuple[int, int]], result: DraftResult, depth: int,
                  tree: TreeConfig, static: StaticTreeShape | None) -> tuple[list[tuple[int, int]], list[int]]:
    """Add the chosen children of the frontier nodes (draft rows of ``result``) to the pools.

    Returns the next frontier, each sequence's children by decreasing score,
    and per next-frontier node its parent's row in ``result``. Both are empty
    when a dynamic tree can stop here.
    """
    width = min(tree.top_k, result.topk_ids.shape[1])
    logprobs, ids = result.topk_logprobs[:, :width].float(), result.topk_ids[:, :width]  # [N, width]
    log_prune = math.log(tree.prune_ratio) if tree.prune_ratio > 0 else -math.inf
    rows_of: dict[int, list[int]] = {}  # sequence -> its rows of the draft batch
    for row, (b, _) in enumerate(frontier):
        rows_of.setdefault(b, []).append(row)
    next_frontier, parent_rows, still_useful = [], [], static is not None
    for b, rows in rows_of.items():
        pool = pools[b]
        parents = [pool[frontier[row][1]] for row in rows]
        if static is not None:
            chosen = _choose_static(parents, rows, logprobs, static)
        else:
            chosen, useful = _choose_dynamic(pool, parents, rows, logprobs, tree.budget, log_prune)
            still_useful |= useful
        for score, row, rank in sorted(chosen, key=lambda c: -c.score):
            parent = frontier[row][1]
            pool.append(Candidate(score, depth + 1, parent, int(ids[row, rank]), pool[parent].rank_path + (rank,)))
            next_frontier.append((b, len(pool) - 1))
            parent_rows.append(row)
    return (next_frontier, parent_rows) if still_useful else ([], [])


def _choose_static(parents: list[Candidate], rows: list[int], logprobs: torch.Tensor,
                   static: StaticTreeShape) -> list[_Choice]:
    """The children of ``parents`` (at draft ``rows``; ``logprobs [N, width]``) whose rank path is a choice."""
    width = logprobs.shape[1]
    return [_Choice(parent.score + float(logprobs[row, rank]), row, rank)
            for parent, row in zip(parents, rows)
            for rank in static.child_ranks.get(parent.rank_path, ()) if rank < width]


def _choose_dynamic(pool: list[Candidate], parents: list[Candidate], rows: list[int], logprobs: torch.Tensor,
                    budget: int, log_prune: float) -> tuple[list[_Choice], bool]:
    """The ``budget`` best children of one sequence's ``parents`` (at draft ``rows``; ``logprobs [N, width]``).

    Returns them, and whether a deeper level could still enter the tree.
    """
    width = logprobs.shape[1]
    parent_scores = torch.tensor([parent.score for parent in parents])  # [n] float32, as the scores are
    scores = (parent_scores[:, None] + logprobs[torch.tensor(rows)]).flatten()  # [n * width]
    best = float(scores.max())
    kept = int((scores >= best + log_prune).sum())
    top = torch.topk(scores, min(budget, kept))
    chosen = [_Choice(float(s), rows[int(i) // width], int(i) % width) for s, i in zip(top.values, top.indices)]
    # deeper levels only matter while this level's best could still enter the tree
    still_useful = sum(node.score >= best for node in pool[1:]) < budget
    return chosen, still_useful


def _pool_to_tree(pool: list[Candidate], budget: int | None) -> TokenTree:
    """The tree of a pool: all of it (static), or its ``budget`` best candidates (dynamic)."""
    keep = list(range(1, len(pool)))
    if budget is not None:  # best `budget` by score; ties go to the shallower node, so parents come first
        keep = sorted(keep, key=lambda i: (-pool[i].score, pool[i].depth))[:budget]
    keep.sort(key=lambda i: (pool[i].depth, -pool[i].score))  # level order, siblings by score
    out, index_of = TokenTree.root(pool[0].token), {0: 0}
    for i in keep:
        index_of[i] = out.add(index_of[pool[i].parent], pool[i].token)
    return out


@dataclasses.dataclass
class TreeBatch:
    """Trees of a batch padded to T = the largest tree.

    input_ids, position_offsets int64 ``[B, T]`` (offset = depth);
    packed_mask int32 ``[B, T, ceil(T/32)]``; ancestors bool ``[B, T, T]``;
    parents int64 ``[B, T]`` (-1 for roots and padding); valid bool ``[B, T]``.
    Padding rows see only themselves.
    """

    input_ids: torch.Tensor
    position_offsets: torch.Tensor
    packed_mask: torch.Tensor
    ancestors: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor


def batch_trees(trees: list[TokenTree]) -> TreeBatch:
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
        ancestors[b, :n, :n] = tree.ancestor_mask()
    return TreeBatch(input_ids, offsets, pack_mask(ancestors), ancestors, parents, valid)
