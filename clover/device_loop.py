"""The decoder's steps on an engine's device stepper (docs/gpu-engine.md).

:class:`~clover.decode.SpeculativeDecoder` runs a step on the host (any engine) or, where the engine has a device
stepper (:class:`clover.backends.device.DeviceEngine`) and the method's steps can run there, through this loop:
the whole step (draft levels, tree, target pass, acceptance, KV commit) runs on the device and one small tensor
comes back. Both return a :class:`~clover.stats.StepOutcome`, which the decoder emits and observes the same way:
the two differ only in where the step runs.

A sequence is the decoder's own: ``request`` (sampling, seed), ``generated``, ``root_token`` and ``root_hidden``
(the root state the host holds, None while the device holds it).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from clover.adaptive import CostModel
from clover.config import TreeConfig
from clover.device_step import given_arrays, sampling_arrays
from clover.engine_contract import Engine
from clover.kv_cache import KVCache
from clover.methods import method_traits, uses_heads
from clover.proposers import Proposer
from clover.stats import StepOutcome


class DeviceLoop:
    """A decoder's steps on ``stepper`` (a :class:`clover.backends.device.DeviceStepper`): ``depth`` heads a step
    drafts with (0 for vanilla), their ``top_k``, and the suffix candidates' width and depth (0, 0 without)."""

    def __init__(self, stepper, depth: int, top_k: int, given_shape: tuple[int, int]) -> None:
        self.stepper, self.depth, self.top_k, self.given_shape = stepper, depth, top_k, given_shape

    @classmethod
    def create(cls, engine: Engine, method: str, tree: TreeConfig, cache: KVCache, max_batch_size: int,
               suffix_on: bool) -> "DeviceLoop | None":
        """The loop where ``engine`` has a device stepper and ``method``'s steps can run there (heads' dynamic
        trees, with the suffix proposer's candidates merged in, or vanilla; not suffix alone, not clover2's
        second cache, not static trees); None elsewhere. Captures the step's CUDA graphs (on a GPU)."""
        factory = getattr(engine, "device_stepper", None)  # a capability of the engine, not every backend's
        if factory is None or not method_traits(method).runs_on_device_stepper or tree.static_choices is not None:
            return None
        spec, heads = engine.spec, uses_heads(method)
        stepper = factory(cache, max_batch_size, tree.budget if heads else 0,
                          max_depth=max(tree.proposer_depth, spec.num_draft_heads))  # the host's calibration
        depth = min(tree.depth or spec.num_draft_heads, spec.num_draft_heads) if heads else 0
        # what clover.proposers.SuffixProposer.suffix_proposals offers: twice the budget, to proposer_depth
        given_shape = (2 * tree.budget, tree.proposer_depth) if suffix_on else (0, 0)
        loop = cls(stepper, depth, min(tree.top_k, spec.draft_top_k), given_shape)
        stepper.capture_ahead(loop.depth, loop.top_k, *given_shape)
        return loop

    def cost_model(self, tree: TreeConfig) -> CostModel | None:
        """Steps on a GPU timed at load for the adaptive budget where the tree may adapt and heads draft
        (docs/gpu-engine.md#adaptive-budget); None elsewhere (on a CPU the step runs eagerly, and the engine's
        own calibration prices it)."""
        if not self.stepper.graphs or tree.adaptive is False or not self.depth:
            return None
        return self.stepper.calibrate(self.depth, self.top_k)

    def prefill(self, rows: slice, input_ids: torch.Tensor, lengths: torch.Tensor, seqs: Sequence[Any]) -> list[int]:
        """The prompts' pass on the device; each first token (their K/V and root states stay there)."""
        return self.stepper.prefill(rows, input_ids, lengths, sampling_rows(seqs))

    def step(self, seqs: Sequence[Any], tree: TreeConfig, proposer: Proposer) -> StepOutcome | None:
        """One step for every live sequence; None where it cannot run here (no batch bucket holds the batch)."""
        sampling = sampling_rows(seqs)  # None: greedy acceptance, else tree speculative sampling
        proposals = proposer.suffix_proposals(seqs, tree.proposer_depth) if self.given_shape[0] else []
        given, given_depth = self.given_shape if any(len(p.tokens) for p in proposals) else (0, 0)
        shape = self.stepper.shape(len(seqs), tree.budget if self.depth else 0, self.depth, self.top_k, given,
                                   given_depth, sampling is not None)
        if shape is None:
            return None
        for row, seq in enumerate(seqs):  # a root state the host holds (after a prefill or a host step)
            if seq.root_hidden is not None:
                self.stepper.load_root(row, seq.root_hidden)
                seq.root_hidden = None
        rows = self.stepper.step(shape, [s.root_token for s in seqs],
                                 given_arrays(proposals, given) if shape.given else None, sampling)
        width = shape.path_width
        counts = rows[:, width].tolist()
        self.stepper.cache.advance(counts)
        tokens = [row[:count] for row, count in zip(rows.tolist(), counts)]
        for seq, row_tokens in zip(seqs, tokens):
            seq.root_token = row_tokens[-1]
        # with suffix candidates in the trees the chooser learns from the heads' accepted run alone
        heads_accepted = rows[:, width + 2].tolist() if shape.given else [count - 1 for count in counts]
        # the budget the step ran: the stepper rounds to its graphs' budgets
        return StepOutcome(shape.budget, shape.tree_tokens, [shape.tree_tokens] * len(seqs),
                           rows[:, width + 1].tolist(), tokens, heads_accepted)

    def roots_to_host(self, seqs: Sequence[Any]) -> None:
        """Root states the device holds, back on the host for a step the host runs."""
        for row, seq in enumerate(seqs):
            if seq.root_hidden is None:
                seq.root_hidden = self.stepper.root_of(row)

    def reorder(self, order: list[int]) -> None:
        """The cache compacted its rows: the root states follow."""
        self.stepper.reorder(order)


def sampling_rows(seqs: Sequence[Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """The sequences' sampling settings, seeds and output lengths for a step on the device
    (:func:`clover.device_step.sampling_arrays`); None when every sequence decodes greedily."""
    settings = [s.request.sampling for s in seqs]
    if all(setting.greedy for setting in settings):
        return None
    return sampling_arrays(settings, [s.request.seed for s in seqs], [len(s.generated) for s in seqs])
