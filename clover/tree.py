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
    depth_limit = min(tree.depth or num_heads, num_heads)
    static = {tuple(p) for p in tree.static_choices} if tree.static_choices is not None else None
    if static is not None:
        depth_limit = min(depth_limit, max((len(p) for p in static), default=0))
    elif tree.budget == 0:
        depth_limit = 0
    log_prune = math.log(tree.prune_ratio) if tree.prune_ratio > 0 else -math.inf

    # candidate pool per sequence: (score, depth, parent index in pool, token, rank path); entry 0 is the root
    pools = [[(0.0, 0, -1, int(t), ())] for t in root_tokens]
    frontier = [(b, 0) for b in range(len(pools))]  # (sequence, pool index)
    hidden = root_hidden
    tokens = torch.tensor([int(t) for t in root_tokens], dtype=torch.long)

    for depth in range(depth_limit):
        if not frontier:
            break
        result = draft_step(hidden, tokens, depth)
        width = min(tree.top_k, result.topk_ids.shape[1])
        logprobs, ids = result.topk_logprobs[:, :width].float(), result.topk_ids[:, :width]
        rows_of: dict[int, list[int]] = {}
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
                # deeper levels only matter while this level's best could still enter the tree
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
        if static is None:  # best `budget` by score; ties go to the shallower node, so parents come first
            keep = sorted(keep, key=lambda i: (-pool[i][0], pool[i][1]))[: tree.budget]
        keep.sort(key=lambda i: (pool[i][1], -pool[i][0]))  # level order, siblings by score
        out, index_of = TokenTree.root(pool[0][3]), {0: 0}
        for i in keep:
            index_of[i] = out.add(index_of[pool[i][2]], pool[i][3])
        trees.append(out)
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
