"""Batches of conversations: the run's data order (:func:`make_plan`) and padding (:func:`collate`).

The plan depends only on the data, the seed, the epochs and the token budget, never on the
method or the number of processes, so two runs with the same flags see the same batches in the
same order and a resumed run continues the plan at its step (docs/drafter.md#training).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import torch

from training.hidden_cache import HiddenCache


@dataclasses.dataclass
class Batch:
    """Padded conversations. x_in / x_last ``[B, T, H]`` (None when not needed; x_in ``[B, T, k*H]`` with
    multi-layer features),
    tokens int64 ``[B, T]``, assistant bool ``[B, T]``, lengths int64 ``[B]``."""

    x_in: torch.Tensor | None
    x_last: torch.Tensor | None
    tokens: torch.Tensor
    assistant: torch.Tensor
    lengths: torch.Tensor
    categories: list[str]


def assistant_tokens(conv: dict) -> int:
    return conv["length"] - conv["num_prompt"]


def make_plan(conversations: list[dict], batch_tokens: int, epochs: int, seed: int, bucket_size: int = 256,
              max_tokens: int | None = None) -> list[list[int]]:
    """Batches of conversation indices: per epoch a seeded shuffle, buckets of ``bucket_size``
    sorted by length, greedy packing under ``batch_tokens`` padded tokens, shuffled batch order.
    Cut after the batch that reaches ``max_tokens`` assistant tokens."""
    return plan_epochs(conversations, batch_tokens, epochs, seed, bucket_size, max_tokens)[0]


def plan_epochs(conversations: list[dict], batch_tokens: int, epochs: int, seed: int, bucket_size: int = 256,
                max_tokens: int | None = None) -> tuple[list[list[int]], list[int]]:
    """:func:`make_plan`, and the step that ends each epoch it reaches (the held-out curve is measured there)."""
    lengths = np.array([c["length"] for c in conversations])
    plan: list[list[int]] = []
    epoch_ends: list[int] = []
    seen = 0
    for epoch in range(epochs):
        for batch in _epoch_batches(lengths, bucket_size, batch_tokens, np.random.default_rng([seed, epoch])):
            plan.append(batch)
            seen += sum(assistant_tokens(conversations[i]) for i in batch)
            if max_tokens is not None and seen >= max_tokens:
                return plan, epoch_ends + [len(plan)]
        epoch_ends.append(len(plan))
    return plan, epoch_ends


def _epoch_batches(lengths: np.ndarray, bucket_size: int, batch_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """One epoch's batches in their (shuffled) order."""
    order = rng.permutation(len(lengths))
    batches = []
    for start in range(0, len(order), bucket_size):
        bucket = sorted(order[start: start + bucket_size].tolist(), key=lambda i: (lengths[i], i))
        current: list[int] = []
        for i in bucket:
            if current and (len(current) + 1) * max(lengths[i], lengths[current[-1]]) > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    return [batches[k] for k in rng.permutation(len(batches))]


def plan_digest(plan: list[list[int]]) -> str:
    """sha256 of a batch plan: a checkpoint records it, so a run never resumes onto other data or another order."""
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()


def collate(cache: HiddenCache, indices: list[int], need_input: bool, need_last: bool,
            device: torch.device | str = "cpu") -> Batch:
    """Pad conversations ``indices`` into a :class:`Batch`; with neither hidden state needed, only their tokens
    are read (``--features online`` then fills them: :func:`training.features.online_hidden_states`)."""
    convs = [cache.conversation(i) if need_input or need_last else cache.tokens(i) for i in indices]
    lengths = torch.tensor([len(c["tokens"]) for c in convs])
    batch, width, hidden = len(convs), int(lengths.max()), cache.hidden_size
    tokens = torch.zeros(batch, width, dtype=torch.long)
    assistant = torch.zeros(batch, width, dtype=torch.bool)
    features = convs[0]["last_layer_input"].shape[-1] if need_input else 0  # H, or k*H: multi-layer features
    x_in = torch.zeros(batch, width, features) if need_input else None
    x_last = torch.zeros(batch, width, hidden) if need_last else None
    for row, c in enumerate(convs):
        n = len(c["tokens"])
        tokens[row, :n] = torch.from_numpy(c["tokens"].astype(np.int64))
        assistant[row, :n] = torch.from_numpy(c["assistant_mask"].astype(bool))
        if need_input:
            x_in[row, :n] = torch.from_numpy(np.array(c["last_layer_input"], dtype=np.float32))  # a writable copy
        if need_last:
            x_last[row, :n] = torch.from_numpy(np.array(c["last_hidden"], dtype=np.float32))  # a writable copy
    move = (lambda t: t.to(device) if t is not None else None)
    return Batch(move(x_in), move(x_last), tokens.to(device), assistant.to(device), lengths.to(device),
                 [cache.conversations[i].get("category", "") for i in indices])
