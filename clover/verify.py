"""Verification of a token tree against the target's logits (docs/trees.md#verification).

Greedy acceptance keeps the longest path whose every token equals the
target's argmax after its parent: the output equals vanilla greedy decoding.
Tree speculative sampling tries a node's children in order, accepting child x
with probability ``p(x)`` of the residual target distribution and removing x
from it on rejection (the one-hot-proposal case of multi-draft speculative
sampling), so every emitted token is distributed exactly as the target's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from clover.config import SamplingConfig
from clover.host_ops import argmax_last, as_numpy
from clover.tree import TokenTree, TreeBatch


@dataclasses.dataclass
class Accepted:
    """path: accepted node indices from the root (the root included);
    tokens: the accepted draft tokens followed by the bonus token from the target."""

    path: list[int]
    tokens: list[int]


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Sampling distribution ``[..., V]`` (float64) after temperature, top-k and top-p."""
    scaled = logits.double() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token from logits ``[V]``: argmax when greedy, else from :func:`target_probs`."""
    if sampling.greedy:
        return int(argmax_last(logits))
    return int(torch.multinomial(target_probs(logits, sampling), 1, generator=generator))


def greedy_accept(logits: torch.Tensor, batch: TreeBatch) -> list[Accepted]:
    """Longest greedy-matching path per sequence, for the whole batch at once (NumPy on the host:
    docs/trees.md#host-work-per-step).

    Args:
        logits: ``[B, T, V]`` target logits for the tree tokens.
        batch: the trees' buffers.
    """
    predicted = as_numpy(argmax_last(logits))  # [B, T]: target's next token after each node
    ids, parents, ancestors = as_numpy(batch.input_ids), as_numpy(batch.parents), as_numpy(batch.ancestors)
    rows = np.arange(len(ids))
    matches = (ids == predicted[rows[:, None], parents.clip(0)]) | (parents < 0)
    matches &= as_numpy(batch.valid)
    # a node is accepted when it and all its ancestors match
    accepted = ~(ancestors & ~matches[:, None, :]).any(-1)  # [B, T]
    deepest = np.where(accepted, as_numpy(batch.position_offsets), -1).argmax(-1)  # [B]
    on_path = ancestors[rows, deepest]  # [B, T]
    size = on_path.shape[1]
    # the path's nodes first, ascending (ancestors precede children), then T for the rest
    path = np.sort(np.where(on_path, np.arange(size), size), axis=1)  # [B, T]
    tokens = ids[rows[:, None], path.clip(max=size - 1)]  # [B, T]
    lengths, paths, tokens = on_path.sum(1).tolist(), path.tolist(), tokens.tolist()
    bonus = predicted[rows, deepest].tolist()
    return [Accepted(p[:n], t[1:n] + [extra]) for p, t, n, extra in zip(paths, tokens, lengths, bonus)]


def sampling_accept(logits: torch.Tensor, tree: TokenTree, sampling: SamplingConfig,
                    generator: torch.Generator | None) -> Accepted:
    """Tree speculative sampling for one sequence; logits ``[T, V]`` (padding rows ignored)."""
    node, path, tokens = 0, [0], []
    while True:
        probs = target_probs(logits[node], sampling)
        chosen = None
        for child in tree.children(node):
            token = tree.tokens[child]
            total = float(probs.sum())
            if total > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) * total < float(probs[token]):
                chosen = child
                break
            probs[token] = 0.0  # residual of a one-hot proposal: max(p - q, 0) renormalised
        if chosen is None:
            if float(probs.sum()) <= 0:  # every candidate with mass was tried; cannot happen exactly
                probs = target_probs(logits[node], sampling)
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
            return Accepted(path, tokens)
        path.append(chosen)
        tokens.append(tree.tokens[chosen])
        node = chosen
