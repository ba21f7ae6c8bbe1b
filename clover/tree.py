"""Token trees (docs/trees.md#building-a-tree): building them from draft steps, and their buffers.

Everything here is a pure function of its arguments. A tree is built per
sequence per decode step, for the whole batch at once; node 0 is the root,
the last accepted token, whose K/V is not yet in the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from clover.attention import pack_mask
from clover.config import TreeConfig
from clover.engine_contract import DraftResult
from clover.host_ops import as_numpy, take_rows


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


@dataclasses.dataclass(frozen=True)
class StaticTreeShape:
    """What a static tree's choices fix, whatever the draft scores: built once per set of choices.

    ``depth``: the longest path; ``child_ranks``: per rank path, the ranks of
    the children to keep, ascending. (The node order, and so the masks, still
    depend on the scores: each level is sorted by score across parents.)
    The same as tables over path ids (0: the root's empty path):
    ``child_rank_table`` / ``child_id_table`` int64 ``[paths, max children]``,
    each path's children's ranks (ascending) and path ids, -1 where a path has
    fewer children.
    """

    depth: int
    child_ranks: Mapping[tuple[int, ...], tuple[int, ...]]  # read-only: the cache shares it
    child_rank_table: np.ndarray  # read-only, as above
    child_id_table: np.ndarray


@functools.lru_cache(maxsize=32)
def static_tree_shape(paths: tuple[tuple[int, ...], ...]) -> StaticTreeShape:
    """The shape of ``TreeConfig.static_choices``, given as a tuple of tuples (hashable, for the cache)."""
    children: dict[tuple[int, ...], set[int]] = {}
    for path in paths:
        if path:
            children.setdefault(path[:-1], set()).add(path[-1])
    child_ranks = {prefix: tuple(sorted(ranks)) for prefix, ranks in children.items()}
    ids = {(): 0}
    for path in sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p)):  # parents get ids first
        ids.setdefault(path, len(ids))
    width = max((len(ranks) for ranks in child_ranks.values()), default=0)
    rank_table = np.full((len(ids), max(width, 1)), -1, dtype=np.int64)
    id_table = np.full_like(rank_table, -1)
    for prefix, ranks in child_ranks.items():
        rank_table[ids[prefix], : len(ranks)] = ranks
        id_table[ids[prefix], : len(ranks)] = [ids[prefix + (rank,)] for rank in ranks]
    rank_table.flags.writeable = id_table.flags.writeable = False
    return StaticTreeShape(max((len(p) for p in paths), default=0), MappingProxyType(child_ranks),
                           rank_table, id_table)


# Trees are built for the whole batch at once (docs/trees.md#host-work-per-step): NumPy arrays hold the
# candidates, since each of these small index operations costs about 1 us there and 5-10 us as a torch op on
# CPU. torch.topk picks each sequence's children, as it always did: its order among tied scores is part of the
# tree, and a batched call orders each row exactly as a call on that row alone.

@dataclasses.dataclass
class _Pools:
    """Every sequence's candidates (its pool), as ``[B, P]`` arrays; slot 0 is the root, ``size [B]`` slots used.

    score: joint log-probability of the path from the root (0 for the root), float32 for dynamic trees and
    float64 for static ones (the precision each always had: see _choose_dynamic and _choose_static); parent: the
    parent's slot (-1 for the root); token. Unused slots hold score -inf and depth 0.
    """

    score: np.ndarray
    depth: np.ndarray
    parent: np.ndarray
    token: np.ndarray
    size: np.ndarray
    used: np.ndarray  # bool [B, P]: the slots of drafted candidates (the root excluded)

    @classmethod
    def start(cls, roots: np.ndarray, capacity: int, score_dtype: type) -> "_Pools":
        batch = len(roots)
        pools = cls(np.full((batch, capacity), -np.inf, dtype=score_dtype), np.zeros((batch, capacity), np.int64),
                    np.full((batch, capacity), -1, np.int64), np.zeros((batch, capacity), np.int64),
                    np.ones(batch, np.int64), np.zeros((batch, capacity), bool))
        pools.score[:, 0], pools.token[:, 0] = 0.0, roots
        return pools


@dataclasses.dataclass
class _Frontier:
    """The nodes expanded by one draft step, one row each, grouped by sequence (ascending).

    seq, slot int64 ``[N]``: sequence and pool slot; score float32 ``[N]``; path int64 ``[N]``: static path id.
    """

    seq: np.ndarray
    slot: np.ndarray
    score: np.ndarray
    path: np.ndarray


@dataclasses.dataclass
class _Chosen:
    """The children picked at one level, in next-frontier order (by sequence, then by decreasing score):
    ``row``/``rank``: the draft row and candidate rank they come from."""

    seq: np.ndarray
    row: np.ndarray
    rank: np.ndarray
    score: np.ndarray
    path: np.ndarray


def draft_tree_batch(draft_step: DraftFn | None, root_hidden: torch.Tensor | None, root_tokens, tree: TreeConfig,
                     num_heads: int, merge: "TreeMerge | None" = None) -> "TreeBatch":
    """:func:`build_trees` as the batch's buffers (:class:`TreeBatch`), without per-sequence Python objects.

    ``root_tokens``: B ints (a list or an int64 tensor). ``merge``: model-free candidates to merge into the
    heads' trees (:class:`TreeMerge`); with ``num_heads`` 0 (or budget 0) the trees are theirs alone and
    ``draft_step`` / ``root_hidden`` may be None.
    """
    static = None
    if tree.static_choices is not None:
        static = static_tree_shape(tuple(tuple(path) for path in tree.static_choices))
    roots = np.asarray(root_tokens.tolist() if isinstance(root_tokens, torch.Tensor) else root_tokens,
                       dtype=np.int64).reshape(-1)
    depth_limit = _depth_limit(tree, num_heads, static)
    if static is None:  # each level adds at most `budget` children per sequence, the merge its candidates
        extra = merge.max_candidates() if merge is not None else 0
        pools = _Pools.start(roots, 1 + depth_limit * tree.budget + extra, np.float32)
    else:  # one slot per path
        pools = _Pools.start(roots, len(static.child_rank_table), np.float64)
    batch = len(roots)
    frontier = _Frontier(np.arange(batch), np.zeros(batch, np.int64), pools.score[:, 0].copy(),
                         np.zeros(batch, np.int64))
    hidden, tokens = root_hidden, torch.from_numpy(roots.copy())  # [N, H], [N]
    for depth in range(depth_limit):
        result = draft_step(hidden, tokens, depth)
        width = min(tree.top_k, result.topk_ids.shape[1])
        logprobs = as_numpy(result.topk_logprobs[:, :width].float())  # [N, width]
        ids = as_numpy(result.topk_ids)[:, :width]
        if static is not None:
            chosen, useful = _choose_static(frontier, logprobs, static), True
        else:
            chosen, useful = _choose_dynamic(frontier, logprobs, pools, tree.budget, tree.prune_ratio)
        frontier = _add_children(pools, frontier, chosen, ids[chosen.row, chosen.rank], depth + 1)
        if not useful or len(chosen.row) == 0:
            break
        hidden = take_rows(result.next_hidden, chosen.row)
        tokens = torch.from_numpy(pools.token[frontier.seq, frontier.slot])
    if merge is not None and static is None:
        return _merge_candidates(pools, merge)
    return _pools_to_batch(pools, None if static is not None else tree.budget)


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
        One :class:`TokenTree` per sequence, in level order, siblings by score
        (:func:`draft_tree_batch` gives the same trees as buffers).
    """
    return draft_tree_batch(draft_step, root_hidden, root_tokens, tree, num_heads).trees()


def _depth_limit(tree: TreeConfig, num_heads: int, static: StaticTreeShape | None) -> int:
    limit = min(tree.depth or num_heads, num_heads)
    if static is not None:
        return min(limit, static.depth)
    return 0 if tree.budget == 0 else limit


def _segments(seq: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows grouped by sequence: (rows per sequence ``[B]``, first row per sequence ``[B]``, the sequences
    that have rows, ascending)."""
    counts = np.bincount(seq, minlength=batch)
    return counts, counts.cumsum() - counts, counts.nonzero()[0]


def _choose_dynamic(frontier: _Frontier, logprobs: np.ndarray, pools: _Pools, budget: int,
                    prune_ratio: float) -> tuple[_Chosen, bool]:
    """Each sequence's ``budget`` best children of its frontier rows (``logprobs [N, width]``), over
    ``prune_ratio`` times its best; and whether a deeper level could still enter some tree.
    Scores add up in float32 (the draft's precision)."""
    width = logprobs.shape[1]
    scores = frontier.score[:, None] + logprobs  # [N, width] float32
    counts, first, live = _segments(frontier.seq, len(pools.size))
    best = np.maximum.reduceat(scores.max(1), first[live])  # [len(live)]
    # the threshold as the float32 comparison with a Python float did it: rounded from float64
    log_prune = math.log(prune_ratio) if prune_ratio > 0 else -math.inf
    threshold = (best.astype(np.float64) + log_prune).astype(np.float32)
    over = (scores >= np.repeat(threshold, counts[live])[:, None]).sum(1)
    take = np.zeros_like(counts)
    take[live] = np.minimum(np.add.reduceat(over, first[live]), budget)
    # deeper levels only matter while some sequence's best here could still enter its tree
    entered = ((pools.score[live] >= best[:, None]) & pools.used[live]).sum(1)
    still_useful = bool((entered < budget).any())
    return _top_children(scores, counts, first, take), still_useful


def _top_children(scores: np.ndarray, counts: np.ndarray, first: np.ndarray, take: np.ndarray) -> _Chosen:
    """The ``take[b]`` best of sequence b's candidates ``scores[first[b] : first[b] + counts[b]]`` (flattened).

    Sequences with as many rows and children share one ``torch.topk`` call.
    """
    width = scores.shape[1]
    flat = scores.reshape(-1)
    offsets = take.cumsum() - take  # where each sequence's children start in the output
    total = int(take.sum())
    seq, row, rank = (np.empty(total, np.int64) for _ in range(3))
    out_scores = np.empty(total, np.float32)
    live = take.nonzero()[0]
    keys = counts[live] * (int(take.max()) + 1) + take[live]
    groups = [live] if keys.min() == keys.max() else [live[keys == key] for key in np.unique(keys)]
    for members in groups:
        rows, k = int(counts[members[0]]), int(take[members[0]])
        candidates = flat[(first[members] * width)[:, None] + np.arange(rows * width)]  # [G, rows * width]
        values, index = torch.topk(torch.from_numpy(candidates), k)
        index = index.numpy()
        dest = offsets[members][:, None] + np.arange(k)
        seq[dest], out_scores[dest] = members[:, None], values.numpy()
        row[dest], rank[dest] = first[members][:, None] + index // width, index % width
    return _Chosen(seq, row, rank, out_scores, np.zeros(total, np.int64))


def _choose_static(frontier: _Frontier, logprobs: np.ndarray, static: StaticTreeShape) -> _Chosen:
    """The children of the frontier rows whose rank path is a choice, each sequence's by decreasing score
    (ties: in frontier-row order, then by rank). Scores add up in float64, as Python floats always did here."""
    ranks = static.child_rank_table[frontier.path]  # [N, children]
    row, column = np.nonzero((ranks >= 0) & (ranks < logprobs.shape[1]))  # row-major: by row, then by rank
    rank = ranks[row, column]
    scores = frontier.score[row] + logprobs[row, rank].astype(np.float64)
    seq = frontier.seq[row]
    order = np.lexsort((-scores, seq))  # stable: by sequence, then by decreasing score
    return _Chosen(seq[order], row[order], rank[order], scores[order],
                   static.child_id_table[frontier.path[row], column][order])


def _add_children(pools: _Pools, frontier: _Frontier, chosen: _Chosen, tokens: np.ndarray, depth: int) -> _Frontier:
    """Append the chosen children to their pools; they are the next frontier."""
    counts, first, _ = _segments(chosen.seq, len(pools.size))
    slot = pools.size[chosen.seq] + np.arange(len(chosen.seq)) - first[chosen.seq]
    pools.score[chosen.seq, slot] = chosen.score
    pools.depth[chosen.seq, slot] = depth
    pools.parent[chosen.seq, slot] = frontier.slot[chosen.row]
    pools.token[chosen.seq, slot] = tokens
    pools.used[chosen.seq, slot] = True
    pools.size += counts
    return _Frontier(chosen.seq, slot, chosen.score, chosen.path)


def _pools_to_batch(pools: _Pools, budget: int | None, sources: "_SourceSlots | None" = None) -> "TreeBatch":
    """The trees of the pools: all of each (static), or its ``budget`` best candidates (dynamic); nodes in level
    order, siblings by score. ``sources``: which source proposed each slot, carried to the nodes."""
    used = pools.used.copy()
    seq = np.arange(len(used))[:, None]
    neg_score = -pools.score + np.float32(0.0)  # + 0: -0.0 ties with 0.0, as in Python
    if budget is not None:  # best `budget` by score; ties go to the shallower node (parents first), then the slot
        order = np.lexsort((pools.depth, neg_score, ~used), axis=-1)
        used[seq, order[:, budget:]] = False
    order = np.lexsort((neg_score, pools.depth, ~used), axis=-1)  # level order, siblings by score, then slot
    sizes = 1 + used.sum(1)
    size = int(sizes.max())
    nodes = np.concatenate([np.zeros((len(sizes), 1), np.int64), order[:, : size - 1]], axis=1)  # [B, T] slots
    real = np.arange(size)[None] < sizes[:, None]
    position = np.full(pools.parent.shape, -1, np.int64)  # slot -> node index
    b, i = np.nonzero(real)
    position[b, nodes[b, i]] = i
    parents = np.where(real, position[seq, pools.parent[seq, nodes].clip(0)], -1)
    parents[:, 0] = -1
    tokens = np.where(real, pools.token[seq, nodes], 0)
    depths = np.where(real, pools.depth[seq, nodes], 0)
    batch = _tree_batch(tokens, parents, depths, sizes)
    if sources is not None:
        batch.sources = CandidateSources(np.where(real, sources.bits[seq, nodes], 0),
                                         np.where(real[..., None], sources.raw[seq, nodes], 0.0), sources.keys)
    return batch


@dataclasses.dataclass
class TreeBatch:
    """Trees of a batch padded to T = the largest tree.

    input_ids, position_offsets int64 ``[B, T]`` (offset = depth);
    packed_mask int32 ``[B, T, ceil(T/32)]``; ancestors bool ``[B, T, T]``;
    parents int64 ``[B, T]`` (-1 for roots and padding); valid bool ``[B, T]``;
    sizes int64 ``[B]``: nodes per tree. Padding rows see only themselves.
    """

    input_ids: torch.Tensor
    position_offsets: torch.Tensor
    packed_mask: torch.Tensor
    ancestors: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    sizes: torch.Tensor | None = None  # None: counted from ``valid``
    sources: "CandidateSources | None" = None  # set when model-free candidates were merged in

    def tree_sizes(self) -> torch.Tensor:
        """int64 ``[B]``: nodes per tree."""
        return self.sizes if self.sizes is not None else self.valid.sum(1)

    def trees(self) -> list[TokenTree]:
        """One :class:`TokenTree` per sequence (the buffers without their padding)."""
        sizes = self.tree_sizes().tolist()
        tokens, parents, depths = self.input_ids.tolist(), self.parents.tolist(), self.position_offsets.tolist()
        return [TokenTree(t[:n], p[:n], d[:n]) for t, p, d, n in zip(tokens, parents, depths, sizes)]


def ancestor_masks(parents: np.ndarray) -> np.ndarray:
    """bool ``[B, T, T]`` from parents int64 ``[B, T]`` (-1: none; a parent precedes its child): row i has its
    own bit and its ancestors' bits. One step per tree level."""
    batch, size = parents.shape
    mask = np.broadcast_to(np.eye(size, dtype=bool), (batch, size, size)).copy()
    ancestor = parents
    while True:
        b, i = np.nonzero(ancestor >= 0)
        if len(b) == 0:
            return mask
        mask[b, i, ancestor[b, i]] = True
        ancestor = np.where(ancestor >= 0, np.take_along_axis(parents, ancestor.clip(0), 1), -1)


def _tree_batch(tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, sizes: np.ndarray) -> TreeBatch:
    """The buffers of trees given as padded int64 ``[B, T]`` arrays and ``sizes [B]``."""
    ancestors = torch.from_numpy(ancestor_masks(parents))
    valid = np.arange(tokens.shape[1])[None] < sizes[:, None]
    return TreeBatch(torch.from_numpy(tokens), torch.from_numpy(depths), pack_mask(ancestors), ancestors,
                     torch.from_numpy(parents), torch.from_numpy(valid), torch.from_numpy(sizes))


def root_batch(root_tokens) -> TreeBatch:
    """The buffers of root-only trees (a vanilla step) for B root tokens (a list or an int64 tensor).

    Everything but the tokens is the same for every such step of B sequences: built once per B and shared
    (read-only by contract, as all buffers are).
    """
    tokens = torch.as_tensor(root_tokens, dtype=torch.long).reshape(-1, 1)  # [B, 1]
    return dataclasses.replace(_root_buffers(len(tokens)), input_ids=tokens)


@functools.lru_cache(maxsize=8)
def _root_buffers(batch: int) -> TreeBatch:
    zeros = np.zeros((batch, 1), np.int64)
    return _tree_batch(zeros, np.full((batch, 1), -1, np.int64), zeros, np.ones(batch, np.int64))


def batch_trees(trees: list[TokenTree]) -> TreeBatch:
    """The buffers of a batch of trees (:class:`TreeBatch`)."""
    sizes = np.fromiter((len(tree) for tree in trees), np.int64, len(trees))
    real = np.arange(int(sizes.max()))[None] < sizes[:, None]  # [B, T]

    def padded(field: str, fill: int) -> np.ndarray:
        out = np.full(real.shape, fill, np.int64)
        out[real] = list(itertools.chain.from_iterable(getattr(tree, field) for tree in trees))
        return out

    return _tree_batch(padded("tokens", 0), padded("parents", -1), padded("depths", 0), sizes)


# -- model-free candidates merged into the heads' trees (docs/trees.md#model-free-candidates) --------------------

SOURCE_HEADS, SOURCE_SUFFIX = 1, 2  # bits of CandidateSources.bits
SUFFIX_MATCH_ROWS = 4  # calibration rows of suffix candidates: matched suffix of 1, 2, 3, >= 4 tokens


def suffix_calibration_row(match_length: int) -> int:
    """The calibration row of suffix candidates (row 0: the heads): longer matched suffixes are more reliable,
    so their candidates are calibrated apart."""
    return min(max(match_length, 1), SUFFIX_MATCH_ROWS)


@dataclasses.dataclass(frozen=True)
class TreeMerge:
    """One step's model-free candidates and how to merge them with the heads' (docs/trees.md#model-free-candidates).

    proposals: one per sequence, a :class:`clover.suffix.SuffixProposal` or None (no candidates): nodes in level
    order with ``tokens``, ``parents`` (-1: the root's child), ``depths``, ``counts`` and ``total``.
    budget: draft nodes per tree at most, both sources together.
    factors: float ``[1 + SUFFIX_MATCH_ROWS, D + 1]``, measured ÷ predicted acceptance per calibration row and
    depth (:class:`clover.adaptive.SourceCalibration`); a node's calibrated probability is its source's raw
    probability (the heads' joint path probability, the suffix's count ÷ total) times its factor.
    step_seconds: with a cost model, the modelled step time when every tree is padded to k draft nodes,
    k = 0..budget (:meth:`clover.adaptive.AdaptiveBudget.tree_step_seconds`): the trees are then cut to the k
    that maximises expected tokens per second, never below ``min_nodes`` (the heads' budget of the step).
    None: every tree keeps up to ``budget`` nodes.
    """

    proposals: Sequence[Any]
    budget: int
    factors: np.ndarray
    step_seconds: np.ndarray | None = None
    min_nodes: int = 0

    def max_candidates(self) -> int:
        return max((len(p.tokens) for p in self.proposals if p is not None), default=0)


@dataclasses.dataclass
class CandidateSources:
    """Where a merged tree's nodes come from: bits uint8 ``[B, T]`` (SOURCE_HEADS | SOURCE_SUFFIX, 0 for the root
    and padding); raw float64 ``[B, T, 2]``: each source's raw probability of the node (0: not proposed by it);
    keys int64 ``[B]``: each sequence's suffix calibration row."""

    bits: np.ndarray
    raw: np.ndarray
    keys: np.ndarray


@dataclasses.dataclass
class _SourceSlots:
    """:class:`CandidateSources` per pool slot (``[B, P]``, ``[B, P, 2]``, ``[B]``)."""

    bits: np.ndarray
    raw: np.ndarray
    keys: np.ndarray


def _merge_candidates(pools: _Pools, merge: TreeMerge) -> "TreeBatch":
    """Add each sequence's proposal to its pool (a candidate the heads also drafted is one node), score every
    slot by its calibrated acceptance probability, and keep each tree's best nodes: ``merge.budget`` of them, or
    as many as pay for their verification (:func:`_paying_width`)."""
    heads_raw = np.where(pools.used, np.exp(pools.score.astype(np.float64)), 0.0)  # [B, P]
    suffix_raw = np.zeros_like(heads_raw)
    keys = np.zeros(len(pools.size), np.int64)
    for b, proposal in enumerate(merge.proposals):
        if proposal is not None and len(proposal.tokens):
            _add_proposal(pools, b, proposal, suffix_raw[b])
            keys[b] = suffix_calibration_row(proposal.match_length)
    depth = pools.depth.clip(0, merge.factors.shape[1] - 1)
    value = np.maximum(heads_raw * merge.factors[0][depth], suffix_raw * merge.factors[keys[:, None], depth])
    value = np.minimum(value, 1.0)
    value[:, 0] = 1.0  # the root
    for level in range(1, int(pools.depth.max()) + 1):  # a child is never worth more than its parent, so the
        b, slot = np.nonzero((pools.depth == level) & pools.used)  # best nodes always include their ancestors
        value[b, slot] = np.minimum(value[b, slot], value[b, pools.parent[b, slot]])
    with np.errstate(divide="ignore"):
        pools.score = np.log(value).astype(np.float32)
    bits = (heads_raw > 0) * SOURCE_HEADS | (suffix_raw > 0) * SOURCE_SUFFIX
    nodes = merge.budget if merge.step_seconds is None else _paying_width(value, pools.used, merge)
    return _pools_to_batch(pools, nodes, _SourceSlots(bits.astype(np.uint8), np.stack([heads_raw, suffix_raw], -1),
                                                      keys))


def _paying_width(value: np.ndarray, used: np.ndarray, merge: TreeMerge) -> int:
    """The draft nodes per tree, k in [min_nodes, budget], that maximise the batch's expected tokens per second.

    A tree of its k best nodes yields 1 + (the sum of their calibrated probabilities) tokens, expected (each is
    the probability that its whole path is accepted); the step takes ``step_seconds[k]``, since every sequence is
    verified at the batch's widest tree. value, used ``[B, P]`` (slot 0: the root)."""
    candidates = np.where(used, value, 0.0)[:, 1:]  # [B, P - 1]
    best_first = -np.sort(-candidates, axis=1)[:, : merge.budget]
    gained = np.concatenate([[0.0], best_first.sum(0).cumsum()])  # [budget + 1]: expected draft tokens at k
    gained = np.pad(gained, (0, merge.budget + 1 - len(gained)), mode="edge")
    rate = (len(value) + gained) / merge.step_seconds[: merge.budget + 1]
    return merge.min_nodes + int(np.argmax(rate[merge.min_nodes:]))


def _add_proposal(pools: _Pools, b: int, proposal, suffix_raw: np.ndarray) -> None:
    """Append sequence b's proposed nodes to its pool, merging each into the heads' node of the same parent and
    token; ``suffix_raw [P]`` gets each node's count ÷ total. A handful of nodes: a Python loop is cheapest."""
    size = int(pools.size[b])
    parent_row, token_row = pools.parent[b].tolist(), pools.token[b].tolist()
    child_slot = {(parent_row[s], token_row[s]): s for s in range(1, size)}
    slots: list[int] = []
    total = float(proposal.total)
    for token, parent, depth, count in zip(proposal.tokens.tolist(), proposal.parents.tolist(),
                                           proposal.depths.tolist(), proposal.counts.tolist()):
        key = (0 if parent < 0 else slots[parent], token)
        slot = child_slot.get(key)
        if slot is None:
            slot, size = size, size + 1
            child_slot[key] = slot
            pools.parent[b, slot], pools.token[b, slot], pools.depth[b, slot] = key[0], token, depth
            pools.used[b, slot] = True
        slots.append(slot)
        suffix_raw[slot] = count / total
    pools.size[b] = size
