"""Proposers: what a decode step verifies, behind one protocol (docs/architecture.md#the-decode-step).

A :class:`Proposer` returns each step's :class:`~clover.tree.TreeBatch` for the live sequences
(:meth:`Proposer.propose`) and learns from what the target accepted (:meth:`Proposer.observe`). Its hooks
follow a sequence's life (:meth:`~Proposer.start` after its prompt, :meth:`~Proposer.emitted` per kept token
run, :meth:`~Proposer.finished` when it leaves the batch), for the state a proposer keeps per request.

* :class:`VanillaProposer`: root-only trees (plain decoding).
* :class:`HeadsProposer`: the trained heads' draft (:func:`~clover.tree.draft_tree_batch`).
* :class:`SuffixProposer`: model-free candidates alone (:mod:`clover.suffix`).
* :class:`MergedProposer`: the heads' draft with the suffix candidates merged in, calibrated per source.

Clover-2's heads draft from the drafter's own KV cache, :class:`Clover2Cache`, which its proposer owns and keeps
in step with the target cache's rows (:meth:`~Proposer.prefilled`, :meth:`~Proposer.stepped`,
:meth:`~Proposer.rows_removed`).

:func:`make_proposer` is the one place that maps a method's name to its proposer, and
:func:`~clover.methods.method_traits` (in :mod:`clover.methods`, which imports no torch, so the command line's
``--help`` loads none) the one that says what a method does: other modules ask it, never compare names. A sequence
is any object with ``seq_id``, ``request.prompt_ids``, ``generated``, ``finish_reason``, ``root_token``,
``root_hidden`` and ``suffix_context()`` (the decoder's own sequences).
"""

from __future__ import annotations

import time
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from clover.adaptive import AdaptiveBudget, SourceCalibration
from clover.attention import causal_packed_mask
from clover.config import ConfigError, TreeConfig
from clover.engine_contract import Engine
from clover.host_ops import as_numpy, take_rows
from clover.kv_cache import KVCache
from clover.methods import check_method, method_traits, suffix_candidates_on, tree_nodes, uses_heads
from clover.suffix import SharedSuffixIndex, SuffixIndex, SuffixProposal
from clover.tree import SOURCE_HEADS, TreeBatch, TreeMerge, draft_tree_batch, root_batch
from clover.verify import Accepted


class Proposer(Protocol):
    """What a decode step verifies, and what it learns from the target's answer."""

    suffix_on: bool  # it offers suffix proposals (a step on the device merges them itself)
    drafter_cache: Clover2Cache | None  # clover2's second cache, owned here

    def propose(self, seqs: Sequence[Any], tree: TreeConfig) -> TreeBatch:
        """The step's trees for the live sequences (row i: ``seqs[i]``), at this step's ``tree`` settings (the
        adaptive chooser's heads' budget in ``tree.budget``)."""

    def max_draft_nodes(self, tree: TreeConfig) -> int:
        """Draft nodes a tree of ``tree``'s settings may hold at most (the cache room a step needs beyond its root)."""

    def observe(self, batch: TreeBatch, accepted: list[Accepted]) -> list[int]:
        """Fold the step's accepted paths back; returns each sequence's accepted draft tokens that the heads
        proposed (what the heads' budget chooser learns)."""

    def start(self, seq: Any) -> None:
        """A sequence's prompt is in the cache; its first token is emitted next."""

    def emitted(self, seq: Any, tokens: list[int]) -> None:
        """Tokens the sequence kept this step (cut at its stop conditions)."""

    def finished(self, seq: Any) -> None:
        """The sequence leaves the batch (``seq.finish_reason`` says why)."""

    def suffix_proposals(self, seqs: Sequence[Any], depth: int) -> list[SuffixProposal]:
        """Each sequence's suffix candidates up to ``depth`` (empty without ``suffix_on``), for a step on the
        device, which merges them into its trees itself."""

    # Clover-2's draft cache (``drafter_cache``, None for the other methods) follows the target cache's rows:

    def prefilled(self, seqs: Sequence[Any], rows: slice, h0: torch.Tensor, input_ids: torch.Tensor,
                  lengths: torch.Tensor) -> None:
        """The prompts' pass ran on the host (target cache ``rows``): h0, input_ids ``[n, W]``, lengths ``[n]``."""

    def stepped(self, seqs: Sequence[Any], h0: torch.Tensor, accepted: list[Accepted]) -> None:
        """A host step committed each sequence's accepted path (h0 ``[n, T, H]`` of its tree pass)."""

    def rows_removed(self, rows: list[int]) -> None:
        """The target cache dropped ``rows`` and compacted the rest."""


class VanillaProposer:
    """Root-only trees: each step verifies just the next token. The base of the others: no per-sequence state,
    and every accepted draft token counts for the heads."""

    suffix_on = False
    drafter_cache: "Clover2Cache | None" = None  # set by make_proposer for clover2

    def propose(self, seqs: Sequence[Any], tree: TreeConfig) -> TreeBatch:
        return root_batch([s.root_token for s in seqs])

    def max_draft_nodes(self, tree: TreeConfig) -> int:
        return 0

    def observe(self, batch: TreeBatch, accepted: list[Accepted]) -> list[int]:
        return [len(a.path) - 1 for a in accepted]

    def start(self, seq: Any) -> None:
        pass

    def emitted(self, seq: Any, tokens: list[int]) -> None:
        pass

    def finished(self, seq: Any) -> None:
        pass

    def suffix_proposals(self, seqs: Sequence[Any], depth: int) -> list[SuffixProposal]:
        return []

    def prefilled(self, seqs: Sequence[Any], rows: slice, h0: torch.Tensor, input_ids: torch.Tensor,
                  lengths: torch.Tensor) -> None:
        if self.drafter_cache is not None:
            self.drafter_cache.after_prefill(seqs, rows, h0, input_ids, lengths)

    def stepped(self, seqs: Sequence[Any], h0: torch.Tensor, accepted: list[Accepted]) -> None:
        if self.drafter_cache is not None:
            self.drafter_cache.after_step(seqs, h0, accepted)

    def rows_removed(self, rows: list[int]) -> None:
        if self.drafter_cache is not None:
            self.drafter_cache.kv.remove_rows(rows)


class HeadsProposer(VanillaProposer):
    """The trained heads' draft from each sequence's root state; root-only trees at a heads' budget of 0 (the
    adaptive chooser's "no draft steps")."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def propose(self, seqs: Sequence[Any], tree: TreeConfig) -> TreeBatch:
        if not self.drafts(tree):
            return super().propose(seqs, tree)
        return draft_tree_batch(self.engine.draft_step, torch.stack([s.root_hidden for s in seqs]),
                                [s.root_token for s in seqs], tree, self.engine.spec.num_draft_heads, None)

    def max_draft_nodes(self, tree: TreeConfig) -> int:
        return tree_nodes(tree)

    @staticmethod
    def drafts(tree: TreeConfig) -> bool:
        """Whether the heads draft this step: a budget to fill, or a static tree."""
        return tree.budget > 0 or tree.static_choices is not None


class SuffixProposer(VanillaProposer):
    """Suffix candidates alone: each sequence's own suffix index over its prompt and output, or the index shared
    across finished requests' outputs where that matched a longer suffix (docs/trees.md#model-free-candidates).

    Its trees carry each node's source, so :meth:`observe` calibrates the suffix's raw probabilities against their
    measured acceptance (``calibration``). ``source_counts``: draft nodes proposed and accepted per source, over
    the steps with candidates (reports, benchmarks); ``proposer_seconds``: host time of the proposals.
    ``adaptive``: the budget chooser, whose cost model cuts each tree to the candidates that pay.
    """

    suffix_on = True
    heads = False  # the merged proposer's heads draft in the same trees

    def __init__(self, tree: TreeConfig, engine: Engine, adaptive: AdaptiveBudget | None = None) -> None:
        self.tree, self.engine, self.adaptive = tree, engine, adaptive
        self.calibration = SourceCalibration(max(tree.proposer_depth, engine.spec.num_draft_heads))
        self.shared_suffix = SharedSuffixIndex(tree.shared_suffix_tokens) if tree.shared_suffix_tokens else None
        self.source_counts = {"heads": [0, 0], "suffix": [0, 0]}
        self.proposer_seconds = 0.0
        self._indexes: dict[int, SuffixIndex] = {}  # seq_id -> its suffix index over prompt and output

    # -- a sequence's life: its own index follows its output; finished outputs feed the shared index --

    def start(self, seq: Any) -> None:
        self._indexes[seq.seq_id] = SuffixIndex(seq.request.prompt_ids)

    def emitted(self, seq: Any, tokens: list[int]) -> None:
        index = self._indexes.get(seq.seq_id)
        if index is not None:
            index.extend(tokens)

    def finished(self, seq: Any) -> None:
        self._indexes.pop(seq.seq_id, None)
        if self.shared_suffix is not None and seq.finish_reason in ("stop", "length"):  # not a cancelled one
            self.shared_suffix.add(seq.generated)

    # -- the step --

    def propose(self, seqs: Sequence[Any], tree: TreeConfig) -> TreeBatch:
        """Every sequence's tree at once, as buffers (docs/trees.md#host-work-per-step): the heads' draft at
        ``tree.budget`` (0: none) with the suffix candidates merged in; root-only trees when neither proposes."""
        heads = self.heads and HeadsProposer.drafts(tree)
        merge = self._merge(seqs, tree) if self._may_pay(seqs, tree) else None
        if not heads and merge is None:
            return root_batch([s.root_token for s in seqs])
        root_hidden = torch.stack([s.root_hidden for s in seqs]) if heads else None
        return draft_tree_batch(self.engine.draft_step if heads else None, root_hidden, [s.root_token for s in seqs],
                                tree, self.engine.spec.num_draft_heads if heads else 0, merge)

    def max_draft_nodes(self, tree: TreeConfig) -> int:
        return tree_nodes(tree)

    def _may_pay(self, seqs: Sequence[Any], tree: TreeConfig) -> bool:
        """Suffix candidates alone always may (see :meth:`MergedProposer._may_pay`)."""
        return True

    def _merge(self, seqs: Sequence[Any], tree: TreeConfig) -> TreeMerge | None:
        """This step's suffix candidates (None when no sequence has any), sharing the largest tree budget with the
        heads' ``tree.budget``; with a cost model, only candidates whose calibrated acceptance pays for them."""
        started = time.perf_counter()
        proposals = self.suffix_proposals(seqs, tree.proposer_depth)
        self.proposer_seconds += time.perf_counter() - started
        if not any(len(p.tokens) for p in proposals):
            return None
        seconds = (self.adaptive.tree_step_seconds(len(seqs), tree.budget, self.tree.budget)
                   if self.adaptive is not None else None)
        return TreeMerge(proposals, self.tree.budget, self.calibration.factors(), seconds, min_nodes=tree.budget)

    def suffix_proposals(self, seqs: Sequence[Any], depth: int) -> list[SuffixProposal]:
        """Each sequence's suffix proposal (also what a step on the device merges into its trees)."""
        return [self._propose(seq, depth) for seq in seqs]

    def _propose(self, seq: Any, depth: int) -> SuffixProposal:
        """The sequence's own suffix proposal, or the shared index's where that matched a longer suffix. Each
        offers twice the tree budget, so that the merge's calibrated scores, not the index's counts alone, pick
        the nodes (on MT-bench at budget 8 this moved τ by 0.01 at most: docs/results/suffix-tree)."""
        proposal = self._indexes[seq.seq_id].propose(depth, 2 * self.tree.budget)
        if self.shared_suffix is not None:
            shared = self.shared_suffix.propose(seq.suffix_context(), depth, 2 * self.tree.budget)
            if shared.match_length > proposal.match_length:
                return shared
        return proposal

    def observe(self, batch: TreeBatch, accepted: list[Accepted]) -> list[int]:
        """Fold a step's acceptance into each source's calibration; returns each sequence's accepted draft tokens
        that the heads proposed (the leading run of heads' nodes on its path), what the heads' chooser learns."""
        if batch.sources is None:  # no candidates this step: a heads-only or root-only tree
            return super().observe(batch, accepted)
        sources = batch.sources
        on_path = np.zeros(sources.bits.shape, dtype=bool)
        for i, acc in enumerate(accepted):
            on_path[i, acc.path[1:]] = True
        self.calibration.observe(as_numpy(batch.position_offsets), sources.bits, sources.raw, sources.keys, on_path)
        for column, name in enumerate(("heads", "suffix")):
            proposed = ((sources.bits >> column) & 1).astype(bool)
            self.source_counts[name][0] += int(proposed.sum())
            self.source_counts[name][1] += int((proposed & on_path).sum())
        by_heads = (sources.bits & SOURCE_HEADS).astype(bool)
        return [next((j for j, node in enumerate(acc.path[1:]) if not by_heads[i, node]), len(acc.path) - 1)
                for i, acc in enumerate(accepted)]


class MergedProposer(SuffixProposer):
    """The heads' draft with the suffix candidates merged into the same trees, each node scored by its source's
    calibrated acceptance (docs/trees.md#model-free-candidates)."""

    heads = True

    def _may_pay(self, seqs: Sequence[Any], tree: TreeConfig) -> bool:
        """False where the adaptive chooser stopped the heads' drafting for a batch of several sequences: a tree
        in any row then moves the whole batch to the costlier pass of several sequences' trees, which the
        suffix's few candidates did not pay for on a CPU (docs/trees.md#adaptive-tree-budget; 0.97x vanilla at
        batch 8 before this rule). One sequence alone keeps its suffix candidates."""
        return not (self.adaptive is not None and tree.budget == 0 and len(seqs) > 1)


class Clover2Cache:
    """Clover-2's second KV cache, for the drafter's own layers (engine contract v2,
    docs/engine-contract.md#version-2-draft_prefill): its rows are added, committed and removed with the target
    cache's, so both always hold the same sequences and the same number of positions. It also sets each
    sequence's ``root_hidden``: the drafter's state, not the target's ``h0``."""

    def __init__(self, engine: Engine) -> None:
        spec = engine.spec
        if not spec.num_draft_kv_layers:
            raise ConfigError("method 'clover2' needs an engine with draft_prefill (engine contract v2, "
                              "num_draft_kv_layers > 0); rebuild the engine with the clover2 heads")
        self.engine = engine
        self.kv = KVCache(spec.num_draft_kv_layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, spec.dtype,
                          device=spec.device)

    def after_prefill(self, seqs: Sequence[Any], rows: slice, h0: torch.Tensor, input_ids: torch.Tensor,
                      lengths: torch.Tensor) -> None:
        """Add the new prompts' rows to the draft cache and run the drafter's block over the prompts.

        The token after prompt position t is prompt token t+1, and after the last one the first generated
        token (the root); each root state is the block's state at the prompt's last position.
        h0, input_ids ``[n, W]`` right-padded; lengths ``[n]``.
        """
        added = self.kv.add_rows(len(seqs))
        if (added.start, added.stop) != (rows.start, rows.stop):
            raise RuntimeError("the draft cache's rows are out of step with the target cache's")
        batch, width = input_ids.shape
        next_token = torch.zeros_like(input_ids)  # [n, W]; padded positions read 0 and are never committed
        next_token[:, :-1] = input_ids[:, 1:]
        last = lengths - 1
        next_token[torch.arange(batch), last] = torch.tensor([s.root_token for s in seqs])
        state = self._prefill(rows, h0, next_token, torch.arange(width).expand(batch, -1), lengths)
        for i, seq in enumerate(seqs):
            seq.root_hidden = state[i, last[i]].clone()

    def after_step(self, seqs: Sequence[Any], h0: torch.Tensor, accepted: list[Accepted]) -> None:
        """Run the drafter's block over each sequence's accepted path (vanilla steps too: the caches stay aligned).

        Path node j (depth j) is followed by ``accepted.tokens[j]`` (the next accepted draft token, last the
        bonus token); paths are right-padded to the longest and only each row's own length is committed.
        The root state is the block's state at the path's last node. h0 ``[n, T, H]`` of the tree pass.
        """
        batch, width = len(accepted), max(len(a.path) for a in accepted)
        paths = torch.tensor([a.path + [0] * (width - len(a.path)) for a in accepted])  # [n, A] tree node indices
        next_token = torch.tensor([a.tokens + [0] * (width - len(a.tokens)) for a in accepted])  # [n, A]
        counts = [len(a.path) for a in accepted]
        flat = (torch.arange(batch)[:, None] * h0.shape[1] + paths).flatten()  # rows of h0 [n*T, H]
        hidden = take_rows(h0.flatten(0, 1), flat).view(batch, width, -1)  # [n, A, H]
        position_ids = self.kv.lengths[:, None].long() + torch.arange(width)
        state = self._prefill(None, hidden, next_token, position_ids, torch.tensor(counts))
        for i, seq in enumerate(seqs):
            seq.root_hidden = state[i, counts[i] - 1].clone()

    def _prefill(self, rows: slice | None, hidden: torch.Tensor, next_token: torch.Tensor,
                       position_ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``engine.draft_prefill`` over T new causal positions of draft-cache ``rows`` (default: all live
        rows), then commit the first ``counts[r]`` positions of row r. Returns the states ``[n, T, H]``."""
        batch, width = next_token.shape
        past = self.kv.lengths[rows or slice(None)].clone()  # int32 [n]
        k_cache, v_cache = self.kv.views(rows)
        result = self.engine.draft_prefill(hidden, next_token, position_ids, past, causal_packed_mask(batch, width),
                                           k_cache, v_cache)
        self.kv.commit(result.present_keys, result.present_values, torch.arange(width).expand(batch, -1),
                                counts, rows=rows)
        return result.state


def make_proposer(method: str, tree: TreeConfig, engine: Engine,
                  adaptive: AdaptiveBudget | None = None) -> Proposer:
    """The proposer of ``method`` with ``tree``'s settings on ``engine``: the one place that maps method names to
    proposers. ``adaptive``: the heads' budget chooser, whose cost model the suffix candidates are priced with."""
    check_method(method)
    if suffix_candidates_on(method, tree):
        proposer = (MergedProposer if uses_heads(method) else SuffixProposer)(tree, engine, adaptive)
    else:
        proposer = HeadsProposer(engine) if uses_heads(method) else VanillaProposer()
    if method_traits(method).owns_draft_cache:  # its heads draft from the drafter's own cache
        proposer.drafter_cache = Clover2Cache(engine)
    return proposer
