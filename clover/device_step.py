"""The decode step as tensor ops on the device: propose → verify → accept → commit → emit (docs/gpu-engine.md).

The host loop (:mod:`clover.decode`) builds trees and accepts tokens with NumPy, which is right on a CPU. On a GPU
every value that crosses to the host stalls the device, so this module writes the same step with static shapes and
no value leaving the device: the whole step can be captured in one CUDA graph (the draft loop included, as
TensorRT-LLM's one-model speculative decoding does), and the host reads back one small tensor per step.

* :func:`propose_tree`: a dynamic tree from the heads' draft steps, EAGLE-2's expansion as tensor ops: each level
  expands the ``width`` best frontier nodes by their top-k, and the ``budget`` best candidates of all levels by
  joint log-probability form the tree.
* :func:`verify`: one target pass over the tree, writing its K/V into the static cache
  (:class:`clover.attention.InPlaceAttention`).
* :func:`accept_greedy`: the longest path whose every token is the target's argmax after its parent.
* :func:`commit`: the accepted path's K/V moved to consecutive positions, in place.
* :func:`emit`: the accepted tokens and counts as one int64 tensor, the step's single device-to-host copy.
* :class:`DeviceCalibration`: the candidate sources' calibration (:class:`clover.adaptive.SourceCalibration`'s
  rule) kept on the device: it scores the heads' and the given candidates on one scale, and each step with given
  candidates updates it in place from the accepted nodes.

Greedy acceptance makes the output exactly the target's greedy decoding whatever the tree, so this tree builder
may differ from the host's (:mod:`clover.tree`) without changing a token.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from clover.attention import InPlaceAttention
from clover.engine_contract import DraftResult
from clover.tree import SUFFIX_MATCH_ROWS, suffix_calibration_row

# A child scores strictly below its parent, so the best-N set of candidates always holds each node's ancestors
# (a head's log-probability can be 0, and -inf would tie).
_CHILD_PENALTY = 1e-3
_MIN_LOGPROB = -1e4
_ABSENT = float("-inf")  # the log raw probability of a source that did not propose a node

DeviceDraftFn = Callable[[torch.Tensor, torch.Tensor, int], DraftResult]
# (input_ids [B, T], position_ids [B, T], attention) -> (logits [B, T, V], h0 [B, T, H]); writes the cache
DeviceTargetFn = Callable[[torch.Tensor, torch.Tensor, InPlaceAttention], tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class DeviceTree:
    """Trees of a batch as device tensors, every tree ``T`` nodes, node 0 the root, parents before children.

    tokens, depths int64 ``[B, T]``; parents int64 ``[B, T]`` (-1 for the root); ancestors bool ``[B, T, T]``
    (a node's ancestors and itself). ``max_depth``: the deepest a node can be (static, for the path width).
    Where the nodes came from, as the host's :class:`clover.tree.CandidateSources` (None for trees not built by
    :func:`propose_tree`): lograw float32 ``[B, T, 2]``, the log of each source's raw probability of the node
    (column 0 the heads': the joint path probability; column 1 the given candidates': the suffix's count ÷
    total; -inf where that source did not propose it; a path both proposed is one node with both); keys int64
    ``[B]``: each row's calibration row of given candidates (1..SUFFIX_MATCH_ROWS).
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    ancestors: torch.Tensor
    max_depth: int
    lograw: torch.Tensor | None = None
    keys: torch.Tensor | None = None


@dataclasses.dataclass
class StepShape:
    """What fixes a step's tensor shapes, and so one CUDA graph: live rows (padded), heads' budget, heads used
    (depth), the draft top-k, the frontier width, and the cache positions attention reads."""

    batch: int
    budget: int
    depth: int
    top_k: int
    width: int
    kv_len: int
    given: int = 0  # candidates given per row (the suffix proposer's), 0 for none
    given_depth: int = 0  # the deepest of them
    sampling: bool = False  # some row samples (tree speculative sampling); False: greedy acceptance

    @property
    def tree_tokens(self) -> int:
        """Nodes per tree: the root and the budget, or fewer where the candidates are fewer."""
        if not self.budget:
            return 1
        drafted = self.top_k + (self.depth - 1) * self.width * self.top_k if self.depth else 0
        return 1 + min(self.budget, drafted + self.given)

    @property
    def max_depth(self) -> int:
        return max(self.depth, self.given_depth) if self.budget else 0

    @property
    def path_width(self) -> int:
        """Tokens a step can accept: the tree's deepest node plus the bonus token."""
        return 1 + min(self.max_depth, self.tree_tokens - 1)


@dataclasses.dataclass
class GivenCandidates:
    """Candidates proposed off the device (the suffix proposer's), merged into the heads' trees as given token ids
    (docs/gpu-engine.md#suffix-candidates): each ``[B, S]``, padded with score ``PADDING_SCORE``.

    tokens, depths int64; parents int64 (-1: a child of the root, else the index of the parent among these);
    scores float32: the log of the raw probability the proposer gives the path (the tree scores it on the heads'
    scale with ``keys`` and a :class:`DeviceCalibration`, and below its parent's); keys int64 ``[B]``: each row's
    calibration row, 1..SUFFIX_MATCH_ROWS by the matched suffix's length (None: row 1).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    keys: torch.Tensor | None = None


PADDING_SCORE = -1e9  # below any drafted candidate (clamped at _MIN_LOGPROB per level): chosen only to fill
GIVEN_ROWS = 5  # given_arrays' rows: tokens, parents, depths, scores, keys


def given_arrays(proposals, width: int) -> np.ndarray:
    """Suffix proposals (:class:`clover.suffix.SuffixProposal`, or None) as one float64 ``[5, B, width]`` array:
    tokens, parents, depths, scores and keys, padded (what :class:`GivenCandidates` holds once on the device).

    A node's score is the log of its raw probability, the share of matches that continue with its path (the
    tree calibrates it and puts each child below its parent); a row's key, repeated along the row, is its
    calibration row (:func:`clover.tree.suffix_calibration_row` of the matched suffix's length).
    """
    out = np.zeros((GIVEN_ROWS, len(proposals), width))
    out[1], out[3] = -1, PADDING_SCORE
    for row, proposal in enumerate(proposals):
        count = 0 if proposal is None else min(width, len(proposal.tokens))
        out[4, row] = suffix_calibration_row(proposal.match_length if count else 0)
        if count:
            out[0, row, :count] = proposal.tokens[:count]
            out[1, row, :count] = proposal.parents[:count]
            out[2, row, :count] = proposal.depths[:count]
            out[3, row, :count] = np.log(proposal.counts[:count] / proposal.total)
    return out


@dataclasses.dataclass
class DeviceCalibration:
    """:class:`clover.adaptive.SourceCalibration` on the device (docs/gpu-engine.md#suffix-candidates): predicted,
    accepted float32 ``[1 + SUFFIX_MATCH_ROWS, D + 1]`` per calibration row and depth, updated in place by the
    steps with given candidates (a CUDA graph replays the update on the same buffers); factor = accepted ÷
    predicted; ``decay`` per step."""

    predicted: torch.Tensor
    accepted: torch.Tensor
    decay: float

    @classmethod
    def of(cls, host, device: torch.device | str = "cpu") -> "DeviceCalibration":
        """The device copy of a host :class:`clover.adaptive.SourceCalibration` (its priors, or what it measured)."""
        if host.predicted.shape[0] != 1 + SUFFIX_MATCH_ROWS:
            raise ValueError(f"a calibration of {host.predicted.shape[0]} rows, not 1 + {SUFFIX_MATCH_ROWS}")
        return cls(torch.tensor(host.predicted, dtype=torch.float32, device=device),
                   torch.tensor(host.accepted, dtype=torch.float32, device=device), float(host.decay))

    def log_factors(self) -> torch.Tensor:
        """float32 ``[rows, D + 1]``: log(accepted ÷ predicted), at least ``_MIN_LOGPROB`` (never -inf)."""
        return torch.log(self.accepted / self.predicted).clamp(min=_MIN_LOGPROB)

    def observe(self, tree: DeviceTree, matched: torch.Tensor, live: torch.Tensor) -> None:
        """:meth:`clover.adaptive.SourceCalibration.observe`'s rule from one step's trees: each drafted node
        (depth > 0) of a ``live`` row (bool ``[B]``) adds, for each source that proposed it, its raw probability
        to the predicted cell of (that source's row, its depth) and, if ``matched`` (:func:`matched_nodes`), 1 to
        the accepted cell; only the cells seen decay. A path both sources proposed counts for both."""
        rows, width = self.predicted.shape
        depth = tree.depths.clamp(0, width - 1)
        predicted = torch.zeros(rows * width, device=depth.device)
        accepted = torch.zeros(rows * width, device=depth.device)
        for column, source_row in enumerate((torch.zeros_like(tree.keys), tree.keys)):
            raw = tree.lograw[..., column].exp()
            counted = (tree.depths > 0) & (raw > 0) & live[:, None]
            cells = (source_row.clamp(0, rows - 1)[:, None] * width + depth).flatten()
            predicted.index_add_(0, cells, torch.where(counted, raw, 0.0).flatten())
            accepted.index_add_(0, cells, (counted & matched).float().flatten())
        predicted, accepted = predicted.view(rows, width), accepted.view(rows, width)
        seen = predicted > 0
        self.predicted.copy_(torch.where(seen, self.decay * self.predicted + predicted, self.predicted))
        self.accepted.copy_(torch.where(seen, self.decay * self.accepted + accepted, self.accepted))


def root_tree(root_tokens: torch.Tensor) -> DeviceTree:
    """Root-only trees (vanilla decoding)."""
    batch = root_tokens.shape[0]
    zeros = torch.zeros(batch, 1, dtype=torch.int64, device=root_tokens.device)
    ancestors = torch.ones(batch, 1, 1, dtype=torch.bool, device=root_tokens.device)
    return DeviceTree(root_tokens[:, None].to(torch.int64), zeros, zeros - 1, ancestors, 0)


def propose_tree(draft: DeviceDraftFn | None, root_hidden: torch.Tensor, root_tokens: torch.Tensor,
                 shape: StepShape, given: GivenCandidates | None = None,
                 log_factors: torch.Tensor | None = None) -> DeviceTree:
    """Each row's tree of ``1 + shape.budget`` nodes from ``shape.depth`` draft steps (one per head) and the
    ``given`` candidates, the best by score.

    root_hidden ``[B, H]``: h0 at each row's last accepted position; root_tokens int64 ``[B]``.
    log_factors: :meth:`DeviceCalibration.log_factors` to score both sources on one scale (None: raw scores).
    """
    if shape.tree_tokens == 1:
        return root_tree(root_tokens)
    pool = _CandidatePool(root_tokens)
    if draft is not None and shape.depth:
        _draft_levels(draft, root_hidden, root_tokens, shape, pool)
    if given is not None and shape.given:
        pool.add_given(given, shape.given_depth)
    return pool.best_tree(shape.budget, shape.max_depth, log_factors)


def _draft_levels(draft: DeviceDraftFn, root_hidden: torch.Tensor, root_tokens: torch.Tensor, shape: StepShape,
                  pool: "_CandidatePool") -> None:
    """The heads' candidates, level by level, into ``pool``."""
    hidden, tokens = root_hidden[:, None, :], root_tokens[:, None].to(torch.int64)  # the frontier [B, F, ...]
    score = torch.zeros(root_tokens.shape[0], 1, device=root_tokens.device)
    index = torch.zeros_like(tokens)  # the frontier nodes' pool slots
    for head in range(shape.depth):
        batch, frontier = tokens.shape
        result = draft(hidden.reshape(batch * frontier, -1), tokens.reshape(-1), head)
        k = min(shape.top_k, result.topk_ids.shape[1])
        logprobs = result.topk_logprobs[:, :k].float().clamp(min=_MIN_LOGPROB).view(batch, frontier * k)
        child_score = score.repeat_interleave(k, 1) + logprobs  # [B, F*k]: joint log-probabilities
        child_tokens = result.topk_ids[:, :k].reshape(batch, frontier * k)
        parents = index.repeat_interleave(k, 1)
        first = pool.add(child_tokens, parents, child_score, torch.full_like(parents, head + 1))
        if head + 1 == shape.depth:
            break
        best = torch.topk(child_score, min(shape.width, frontier * k), dim=1).indices  # [B, W]
        next_hidden = result.next_hidden.view(batch, frontier, -1)
        hidden = next_hidden.gather(1, (best // k)[..., None].expand(-1, -1, next_hidden.shape[-1]))
        tokens, score, index = child_tokens.gather(1, best), child_score.gather(1, best), first + best


class _CandidatePool:
    """Every candidate of a step's levels, ``[B, P]`` per field; slot 0 is the root. ``lograw``: the log of each
    source's raw probability of the candidate (``[B, P]`` per source: the heads', the given candidates'; -inf
    where that source did not propose it); ``keys``: each row's calibration row of given candidates."""

    def __init__(self, root_tokens: torch.Tensor) -> None:
        batch, device = root_tokens.shape[0], root_tokens.device
        self.tokens = [root_tokens[:, None].to(torch.int64)]
        self.parents = [torch.full((batch, 1), -1, dtype=torch.int64, device=device)]
        self.depths = [torch.zeros(batch, 1, dtype=torch.int64, device=device)]
        self.lograw = [[torch.zeros(batch, 1, device=device)], [torch.full((batch, 1), _ABSENT, device=device)]]
        self.keys = torch.ones(batch, dtype=torch.int64, device=device)
        self.size = 1

    def add(self, tokens, parents, lograw, depths) -> int:
        """Append the heads' candidates ``[B, n]`` (parents: pool slots); returns the first one's slot."""
        first = self.size
        self.tokens.append(tokens.to(torch.int64))
        self.parents.append(parents)
        self.depths.append(depths)
        self.lograw[0].append(lograw.float())
        self.lograw[1].append(torch.full_like(self.lograw[0][-1], _ABSENT))
        self.size += tokens.shape[1]
        return first

    def add_given(self, given: GivenCandidates, given_depth: int) -> None:
        """Append the given candidates, merging each into the heads' candidate of the same parent and token, as
        the host merges them (:func:`clover.tree.draft_tree_batch`): that candidate takes the given score as its
        second source's, the given's children hang under it, and the given's own slot becomes padding."""
        heads_tokens, heads_parents = torch.cat(self.tokens, 1), torch.cat(self.parents, 1)
        merged, parent_slots = self._merged_slots(given, heads_tokens, heads_parents, given_depth)
        duplicate = merged > 0
        given_scores = given.scores.float()
        heads_given = torch.full_like(heads_tokens, _ABSENT, dtype=torch.float32).scatter_reduce(
            1, merged, torch.where(duplicate, given_scores, _ABSENT), "amax")  # slot 0 gets only -inf
        self.lograw[1] = [torch.maximum(torch.cat(self.lograw[1], 1), heads_given)]
        self.lograw[0] = [torch.cat(self.lograw[0], 1)]
        self.tokens = [heads_tokens, torch.where(duplicate, 0, given.tokens.to(torch.int64))]
        self.parents = [heads_parents, torch.where(duplicate, 0, parent_slots)]
        self.depths = [torch.cat(self.depths, 1), torch.where(duplicate, 0, given.depths)]
        self.lograw[0].append(torch.full_like(given_scores, _ABSENT))
        self.lograw[1].append(torch.where(duplicate, PADDING_SCORE, given_scores))
        if given.keys is not None:
            self.keys = given.keys.to(torch.int64)
        self.size += given.tokens.shape[1]

    def _merged_slots(self, given: GivenCandidates, heads_tokens: torch.Tensor, heads_parents: torch.Tensor,
                      given_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[B, S]`` each: the heads' slot each given candidate merges into (0: none), and the pool slot of
        its parent (the merged one where its given parent merged). ``given_depth`` rounds, one level each: a
        static count, as for :func:`ancestor_masks`."""
        own = self.size + torch.arange(given.tokens.shape[1], device=given.tokens.device).expand_as(given.tokens)
        is_root_child, valid = given.parents < 0, given.scores > PADDING_SCORE / 2
        slots, merged, parent_slots = own, torch.zeros_like(own), torch.zeros_like(own)
        for _ in range(max(given_depth, 1)):
            parent_slots = torch.where(is_root_child, 0, slots.gather(1, given.parents.clamp(min=0)))
            same = (heads_parents[:, None, :] == parent_slots[..., None]) & (
                heads_tokens[:, None, :] == given.tokens[..., None].to(torch.int64))
            same[..., 0] = False  # the root is nobody's duplicate
            merged = torch.where(same.any(-1) & valid, same.to(torch.int8).argmax(-1), 0)
            slots = torch.where(merged > 0, merged, own)
        return merged, parent_slots

    def scores(self, max_depth: int, log_factors: torch.Tensor | None) -> torch.Tensor:
        """float32 ``[B, P]``: each candidate's calibrated log-probability (the larger of its sources' raw one
        times that source's row and depth factor, as the host's merge), cut to ``_CHILD_PENALTY`` below its
        parent's: a child then always scores strictly below its parent, so the best-N set holds each node's
        ancestors, whatever the factors (a later level's factor may be larger than an earlier one's). One level
        per pass, ``max_depth`` passes: a static count."""
        parents, depths = torch.cat(self.parents, 1), torch.cat(self.depths, 1)
        heads, given = torch.cat(self.lograw[0], 1), torch.cat(self.lograw[1], 1)
        if log_factors is not None:
            depth = depths.clamp(0, log_factors.shape[1] - 1)
            heads = heads + log_factors[0][depth]
            given = given + log_factors[self.keys[:, None], depth]
        scores = torch.maximum(heads, given)
        has_parent = parents >= 0
        for _ in range(max_depth):
            below = scores.gather(1, parents.clamp(min=0)) - _CHILD_PENALTY
            scores = torch.where(has_parent, torch.minimum(scores, below), scores)
        return scores

    def best_tree(self, budget: int, max_depth: int, log_factors: torch.Tensor | None = None) -> DeviceTree:
        """The root and the ``budget`` best candidates by :meth:`scores`, in slot order (parents first)."""
        tokens, parents = torch.cat(self.tokens, 1), torch.cat(self.parents, 1)
        depths, scores = torch.cat(self.depths, 1), self.scores(max_depth, log_factors)
        chosen = torch.topk(scores[:, 1:], min(budget, self.size - 1), dim=1).indices + 1
        slots = torch.cat([torch.zeros_like(chosen[:, :1]), chosen.sort(dim=1).values], 1)  # [B, T]
        node_of_slot = torch.full_like(tokens, -1).scatter_(1, slots, torch.arange(
            slots.shape[1], device=slots.device).expand_as(slots).contiguous())
        parent_slots = parents.gather(1, slots)
        tree_parents = torch.where(parent_slots >= 0, node_of_slot.gather(1, parent_slots.clamp(min=0)), -1)
        lograw = torch.stack([torch.cat(column, 1).gather(1, slots) for column in self.lograw], -1)
        return DeviceTree(tokens.gather(1, slots), depths.gather(1, slots), tree_parents,
                          ancestor_masks(tree_parents, max_depth), max_depth, lograw, self.keys)


def ancestor_masks(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """bool ``[B, T, T]`` from parents int64 ``[B, T]`` (-1: none): a node's ancestors and itself; ``max_depth``
    steps up, a static count (no value read back to decide when to stop)."""
    batch, size = parents.shape
    mask = torch.eye(size, dtype=torch.bool, device=parents.device).expand(batch, size, size).clone()
    ancestor = parents
    for _ in range(max_depth):
        has = ancestor >= 0
        mask |= (ancestor[..., None] == torch.arange(size, device=parents.device)) & has[..., None]
        ancestor = torch.where(has, parents.gather(1, ancestor.clamp(min=0)), -1)
    return mask


def verify(target: DeviceTargetFn, tree: DeviceTree, past_lengths: torch.Tensor, kv_len: int):
    """One target pass over the trees (their K/V written at ``[past, past + T)`` of each row); (logits, h0)."""
    attention = InPlaceAttention(past_lengths, tree.ancestors, kv_len)
    return target(tree.tokens, past_lengths[:, None].to(torch.int64) + tree.depths, attention)


@dataclasses.dataclass
class DeviceAccepted:
    """path int64 ``[B, A]``: the accepted nodes by depth (slots past the end repeat their own index, so a commit
    moves nothing there); tokens int64 ``[B, A]``: the accepted draft tokens then the bonus token; counts int64
    ``[B]``: tokens accepted (the path's nodes); deepest int64 ``[B]``: the path's last node."""

    path: torch.Tensor
    tokens: torch.Tensor
    counts: torch.Tensor
    deepest: torch.Tensor


def accept_greedy(logits: torch.Tensor, tree: DeviceTree, path_width: int) -> DeviceAccepted:
    """The longest path of each tree whose every token is the target's argmax after its parent."""
    predicted = logits.argmax(-1)  # [B, T]: the target's token after each node
    matches = (tree.tokens == predicted.gather(1, tree.parents.clamp(min=0))) | (tree.parents < 0)
    accepted = ~(tree.ancestors & ~matches[:, None, :]).any(-1)  # a node and all its ancestors match
    deepest = torch.where(accepted, tree.depths, -1).argmax(-1)  # [B]
    on_path = tree.ancestors.gather(1, deepest[:, None, None].expand(-1, 1, tree.tokens.shape[1]))[:, 0]
    slot = torch.where(on_path, tree.depths, path_width)  # off-path nodes go to a slot that is dropped
    path = torch.arange(path_width + 1, device=logits.device).expand(logits.shape[0], -1).contiguous()
    nodes = torch.arange(tree.tokens.shape[1], device=logits.device).expand_as(slot)
    path = path.scatter(1, slot, nodes)[:, :path_width]
    counts = on_path.sum(-1)
    # the token after path node j is the target's argmax there: accepted draft tokens, then the bonus token
    return DeviceAccepted(path, predicted.gather(1, path.clamp(max=tree.tokens.shape[1] - 1)), counts, deepest)


@dataclasses.dataclass
class DeviceSampling:
    """Each row's sampling settings as device tensors ``[B]``: temperature float32 (0: greedy), top_k int64 (0: no
    filter), top_p float32; and what seeds its draws: the request's seed as two 32-bit halves (int64) and the
    tokens it has generated so far (docs/gpu-engine.md#sampling-seeds)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed_low: torch.Tensor
    seed_high: torch.Tensor
    generated: torch.Tensor


_MASK32 = 0xFFFFFFFF


def sampling_arrays(settings, seeds: list[int], generated: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The host's side of :class:`DeviceSampling` for rows with ``settings`` (:class:`clover.config.SamplingConfig`),
    request ``seeds`` (up to 64 bits) and tokens ``generated`` so far: float32 ``[3, n]`` (temperature, top-k,
    top-p) and int64 ``[3, n]`` (seed's low and high 32 bits, generated)."""
    floats = np.array([[x.temperature for x in settings], [x.top_k for x in settings], [x.top_p for x in settings]],
                      dtype=np.float32)
    ints = np.array([[seed & _MASK32 for seed in seeds], [(seed >> 32) & _MASK32 for seed in seeds], generated],
                    dtype=np.int64)
    return floats, ints


def _times(x: torch.Tensor, multiplier: int) -> torch.Tensor:
    """``x * multiplier mod 2**32`` for ``x < 2**32`` in int64 without overflow: the multiplier in 16-bit halves."""
    low = x * (multiplier & 0xFFFF)
    high = ((x * (multiplier >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32: good avalanche for a counter-based generator) as int64 ops."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_draws(sampling: DeviceSampling, offset: int = 0) -> torch.Tensor:
    """float32 ``[B]`` in [0, 1): the uniform number of each row's output position ``generated + offset``, a hash
    of (seed, position). Counter-based, so a CUDA graph replays fresh numbers, and a request's draws depend on its
    seed alone: not on the batch it shares, its tree or the step that reaches a position."""
    position = (sampling.generated + offset) & _MASK32
    state = _mix32(_mix32(_mix32(sampling.seed_low & _MASK32) ^ (sampling.seed_high & _MASK32)) ^ position)
    return (state >> 8).to(torch.float32) / float(1 << 24)  # 24 bits: float32 holds them exactly, below 1


def sample_rows(logits: torch.Tensor, sampling: DeviceSampling, offset: int = 0) -> torch.Tensor:
    """One token per row from logits ``[B, V]`` after temperature, top-k and top-p (the filters of
    :func:`clover.verify.target_probs`); the argmax for greedy rows. The row's uniform number of output position
    ``generated + offset`` (:func:`uniform_draws`) picks the token by inverse CDF over the sorted distribution."""
    greedy = sampling.temperature <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, sampling.temperature)[:, None]
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    keep = (sampling.top_k[:, None] <= 0) | (rank < sampling.top_k[:, None])
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    probs = probs.masked_fill(before >= sampling.top_p[:, None], 0.0)
    cumulative = probs.cumsum(-1)
    uniform = uniform_draws(sampling, offset)[:, None] * cumulative[:, -1:]
    picked = (cumulative <= uniform).sum(-1).clamp(max=logits.shape[-1] - 1)  # the first index past the draw
    sampled = order.gather(1, picked[:, None])[:, 0]
    return torch.where(greedy, logits.argmax(-1), sampled)


def accept_sampled(logits: torch.Tensor, tree: DeviceTree, sampling: DeviceSampling,
                   path_width: int) -> DeviceAccepted:
    """Tree speculative sampling as a walk down the tree: at the current node draw a token from the target's
    distribution; a child carrying it is accepted and the walk goes on from there, else the token is the bonus.

    For one-token drafts this is the same distribution as trying the children in turn against the residual
    (:func:`clover.verify.sampling_accept`): child i is accepted with probability p(x_i), and the token emitted
    when none is, is distributed as the residual; so every emitted token follows the target's distribution.
    Greedy rows draw the argmax, which makes this greedy acceptance. The token at depth d is drawn with the
    row's uniform number of its output position (``offset=d``), so a seeded request emits the tokens its vanilla
    decoding would, whatever the tree.
    """
    batch = tree.tokens.shape[0]
    device = logits.device
    rows = torch.arange(batch, device=device)
    current = torch.zeros(batch, dtype=torch.int64, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    path = torch.arange(path_width, device=device).expand(batch, -1).contiguous()
    tokens = torch.zeros(batch, path_width, dtype=torch.int64, device=device)
    counts = torch.ones(batch, dtype=torch.int64, device=device)
    for depth in range(path_width):
        drawn = sample_rows(logits[rows, current], sampling, offset=depth)
        tokens[:, depth] = torch.where(alive, drawn, tokens[:, depth])
        if depth + 1 == path_width:
            break
        match = (tree.parents == current[:, None]) & (tree.tokens == drawn[:, None]) & alive[:, None]
        found = match.any(-1)
        child = match.to(torch.int8).argmax(-1)  # the first child carrying the token
        path[:, depth + 1] = torch.where(found, child, path[:, depth + 1])
        counts += found
        current = torch.where(found, child, current)
        alive &= found
    return DeviceAccepted(path, tokens, counts, current)


def commit(keys: torch.Tensor, values: torch.Tensor, past_lengths: torch.Tensor, path: torch.Tensor) -> None:
    """Move each row's accepted nodes' K/V (written at ``past + node``) to ``past + depth``, for all layers at once.

    keys, values ``[L, B, Hkv, S, D]`` (the live rows of the static cache); path int64 ``[B, A]``.
    """
    layers, batch, heads, _, head_dim = keys.shape
    past = past_lengths.to(torch.int64)[:, None]
    source = (past + path)[None, :, None, :, None].expand(layers, batch, heads, path.shape[1], head_dim)
    target = (past + torch.arange(path.shape[1], device=path.device))[None, :, None, :, None].expand_as(source)
    for cache in (keys, values):
        cache.scatter_(3, target, cache.gather(3, source))


def matched_nodes(tree: DeviceTree, accepted: DeviceAccepted) -> torch.Tensor:
    """bool ``[B, T]``: the nodes whose token path is a prefix of the accepted tokens (the root and the depth-0
    padding included). No two nodes of :func:`propose_tree`'s trees share a token path (a path both sources
    proposed is one node), so the drafted ones are the accepted path's nodes."""
    width = accepted.tokens.shape[1]
    drafted = accepted.tokens.gather(1, (tree.depths - 1).clamp(0, width - 1))  # the accepted token at that depth
    token_ok = (tree.depths == 0) | ((tree.depths < accepted.counts[:, None]) & (tree.tokens == drafted))
    return ~(tree.ancestors & ~token_ok[:, None, :]).any(-1)


def heads_run(tree: DeviceTree, accepted: DeviceAccepted, matched: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: the accepted draft tokens that the heads proposed, the leading run of heads' nodes on the
    accepted path (what :meth:`clover.proposers.SuffixProposer.observe` returns): the heads' nodes form a tree
    of their own, one node per token path, so the matched ones are that run."""
    if tree.lograw is None:
        return accepted.counts - 1
    return (matched & (tree.lograw[..., 0] > _ABSENT) & (tree.depths > 0)).sum(-1)


def emit(accepted: DeviceAccepted, tree: DeviceTree, heads_accepted: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[B, A + 3]``: the accepted tokens, their count, the tree's depth (for the statistics), and the
    accepted draft tokens the heads proposed (:func:`heads_run`; default: all of them)."""
    heads = accepted.counts - 1 if heads_accepted is None else heads_accepted
    return torch.cat([accepted.tokens, accepted.counts[:, None], tree.depths.max(1, keepdim=True).values,
                      heads[:, None]], 1)


def decode_step(target: DeviceTargetFn, draft: DeviceDraftFn | None, keys: torch.Tensor, values: torch.Tensor,
                past_lengths: torch.Tensor, root_tokens: torch.Tensor, root_hidden: torch.Tensor,
                shape: StepShape, given: GivenCandidates | None = None,
                sampling: DeviceSampling | None = None, calibration: DeviceCalibration | None = None) -> torch.Tensor:
    """One whole step for rows ``[0, shape.batch)``: propose → verify → accept → commit → emit.

    keys, values ``[L, B, Hkv, S, D]``; past_lengths ``[B]`` (read only: the host advances its own copy by the
    counts; rows of length 0 are padding); root_tokens int64 ``[B]``; root_hidden ``[B, H]`` (overwritten with
    the next roots' states); given: candidates to merge into the trees (None: the heads' alone); sampling: rows'
    settings when some row samples (None: greedy for all, the cheaper acceptance); calibration: the sources'
    calibration, which scores a step with given candidates and learns from its live rows' accepted nodes (None,
    or no given candidates: raw scores, nothing learnt, as the host's heads-only trees).
    Returns :func:`emit`'s tensor; the next root tokens are its last accepted tokens.
    """
    calibrated = calibration is not None and given is not None and shape.given > 0 and shape.tree_tokens > 1
    tree = propose_tree(draft, root_hidden, root_tokens, shape, given,
                        calibration.log_factors() if calibrated else None)
    logits, h0 = verify(target, tree, past_lengths, shape.kv_len)
    if sampling is None:
        accepted = accept_greedy(logits, tree, shape.path_width)
    else:
        accepted = accept_sampled(logits, tree, sampling, shape.path_width)
    commit(keys, values, past_lengths, accepted.path)
    root_hidden.copy_(h0.gather(1, accepted.deepest[:, None, None].expand(-1, 1, h0.shape[-1]))[:, 0])
    matched = matched_nodes(tree, accepted)
    if calibrated:
        calibration.observe(tree, matched, past_lengths > 0)
    return emit(accepted, tree, heads_run(tree, accepted, matched))
