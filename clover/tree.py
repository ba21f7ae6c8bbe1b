"""Token trees (DESIGN §2): building them from draft steps, and their buffers.

Everything here is a pure function of its arguments. A tree is built per
sequence per decode step; node 0 is the root, the last accepted token, whose
K/V is not yet in the cache.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from clover.attention import pack_mask
from clover.config import TreeConfig
from clover.engine import DraftResult


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

    def retrieve_indices(self) -> torch.Tensor:
        """int64 ``[num_leaves, max_depth + 1]``: node indices from root to each leaf, -1 padded."""
        leaves = [i for i in range(len(self)) if not self.children(i)]
        width = max(self.depths) + 1
        out = torch.full((len(leaves), width), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            node = leaf
            while node >= 0:
                out[row, self.depths[node]] = node
                node = self.parents[node]
        return out


DraftFn = Callable[[torch.Tensor, torch.Tensor, int], DraftResult]


def build_trees(draft_step: DraftFn, root_hidden: torch.Tensor, root_tokens: list[int],
                tree: TreeConfig, num_heads: int) -> list[TokenTree]:
    """Expand a tree per sequence, level by level, one batched draft step per level.

    Dynamic trees score each candidate child by the joint log-probability of its
    path, drop those under ``prune_ratio`` times the level's best, and keep the
    best until ``budget`` nodes exist. Static trees keep the children whose rank
    path is listed in ``tree.static_choices``.

    Args:
        draft_step: the engine's ``draft_step(hidden [N, H], token [N], head)``.
        root_hidden: ``[B, H]``, h0 at each sequence's last accepted position.
        root_tokens: B root tokens (the last accepted token of each sequence).
        num_heads: heads the drafter has; the tree is at most that deep.
    """
    depth_limit = min(tree.depth or num_heads, num_heads)
    static = {tuple(p) for p in tree.static_choices} if tree.static_choices is not None else None
    if static is not None:
        depth_limit = min(depth_limit, max((len(p) for p in static), default=0))
    elif tree.budget == 0:
        depth_limit = 0
    log_prune = math.log(tree.prune_ratio) if tree.prune_ratio > 0 else -math.inf

    trees = [TokenTree.root(t) for t in root_tokens]
    scores = [[0.0] for _ in trees]  # path log-probability per node
    rank_paths: list[list[tuple[int, ...]]] = [[()] for _ in trees]
    frontier = [(b, 0) for b in range(len(trees))]  # (sequence, node)
    hidden = root_hidden
    tokens = torch.tensor([int(t) for t in root_tokens], dtype=torch.long)

    for depth in range(depth_limit):
        if not frontier:
            break
        result = draft_step(hidden, tokens, depth)
        logprobs, ids = result.topk_logprobs.float(), result.topk_ids
        by_sequence: dict[int, list[int]] = {}
        for row, (b, _) in enumerate(frontier):
            by_sequence.setdefault(b, []).append(row)
        next_frontier, parent_rows = [], []
        for b, rows in by_sequence.items():
            # candidates: (score, row, rank) of every child of this sequence's frontier
            if static is not None:
                chosen = [(scores[b][frontier[r][1]] + float(logprobs[r, k]), r, k)
                          for r in rows for k in range(ids.shape[1])
                          if rank_paths[b][frontier[r][1]] + (k,) in static]
            else:
                room = tree.budget - (len(trees[b]) - 1)
                if room <= 0:
                    continue
                row_index = torch.tensor(rows)
                parent_scores = torch.tensor([scores[b][frontier[r][1]] for r in rows])
                cand = (parent_scores[:, None] + logprobs[row_index]).flatten()
                keep = int((cand >= cand.max() + log_prune).sum())
                top = torch.topk(cand, min(room, keep))
                width = logprobs.shape[1]
                chosen = [(float(s), rows[int(i) // width], int(i) % width) for s, i in zip(top.values, top.indices)]
            chosen.sort(key=lambda c: -c[0])
            for score, row, rank in chosen:
                parent = frontier[row][1]
                node = trees[b].add(parent, int(ids[row, rank]))
                scores[b].append(score)
                rank_paths[b].append(rank_paths[b][parent] + (rank,))
                next_frontier.append((b, node))
                parent_rows.append(row)
        frontier = next_frontier
        if frontier:
            hidden = result.next_hidden[torch.tensor(parent_rows)]
            tokens = torch.tensor([trees[b].tokens[n] for b, n in frontier], dtype=torch.long)
    return trees


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
