"""The engine contract (docs/engine-contract.md), shared by every backend.

A backend implements two callables on named tensors (three for drafters with
their own KV cache, contract version 2: ``draft_prefill``); the decode loop in
:mod:`clover.decode` drives them and owns everything else (trees, acceptance,
KV bookkeeping, batching, stopping). Backends take and return torch CPU
tensors at this boundary; an engine that computes elsewhere (onnxruntime,
TensorRT) converts at its edge, zero-copy where it can.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import torch

from clover.config import decoding_method

CONTRACT_VERSION = 3  # 2 added draft_prefill, 3 a target that writes its KV cache in place; older engines run unchanged

TARGET_INPUTS = ("input_ids", "position_ids", "past_lengths", "spec_decoding_packed_mask")
TARGET_OUTPUTS = ("logits", "h0")
DRAFT_INPUTS = ("hidden", "token", "head")
DRAFT_OUTPUTS = ("next_hidden", "topk_logprobs", "topk_ids")
DRAFT_PREFILL_INPUTS = ("hidden", "next_token", "position_ids", "past_lengths", "spec_decoding_packed_mask")
DRAFT_PREFILL_OUTPUTS = ("state",)


def cache_input_names(num_kv_layers: int) -> list[str]:
    """``past_key_0, past_value_0, ...``: the KV-cache inputs of ``target``."""
    return [f"past_{kind}_{i}" for i in range(num_kv_layers) for kind in ("key", "value")]


def present_output_names(num_kv_layers: int) -> list[str]:
    """``present_key_0, present_value_0, ...``: new tokens' K/V outputs of ``target``."""
    return [f"present_{kind}_{i}" for i in range(num_kv_layers) for kind in ("key", "value")]


def draft_cache_input_names(num_draft_kv_layers: int) -> list[str]:
    """``draft_past_key_0, draft_past_value_0, ...``: the drafter's own KV-cache inputs of ``draft_prefill``."""
    return [f"draft_{name}" for name in cache_input_names(num_draft_kv_layers)]


def draft_present_output_names(num_draft_kv_layers: int) -> list[str]:
    """``draft_present_key_0, ...``: the new positions' K/V outputs of ``draft_prefill``."""
    return [f"draft_{name}" for name in present_output_names(num_draft_kv_layers)]


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Static facts the decode loop needs about an engine.

    ``num_kv_layers`` counts the target's layers plus the Augmenting Block
    when the drafter has one (it keeps its own KV cache).
    ``num_draft_heads`` is 0 when the engine has no drafter.
    ``num_draft_kv_layers`` counts the layers of a drafter's own KV cache
    (Clover-2's Augmenting Block, written by ``draft_prefill``); 0 for drafters
    without one (contract version 1).
    """

    num_kv_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_seq_len: int
    draft_top_k: int = 8
    num_draft_heads: int = 0
    drafter_method: str | None = None
    num_draft_kv_layers: int = 0
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # where the KV cache lives (the engine reads it there)

    @property
    def default_method(self) -> str:
        """The decoding method this engine's heads run (``vanilla`` when it has none)."""
        return decoding_method(self.drafter_method)


class TargetResult(NamedTuple):
    """logits ``[B, T, V]``, h0 ``[B, T, H]``, present keys/values one ``[B, Hkv, T, D]`` per KV layer, or None
    when the engine wrote them into the cache itself (contract v3: docs/engine-contract.md#in-place-kv)."""

    logits: torch.Tensor
    h0: torch.Tensor
    present_keys: list[torch.Tensor]
    present_values: list[torch.Tensor]


class DraftResult(NamedTuple):
    """next_hidden ``[N, H]``, topk_logprobs ``[N, k]`` (descending), topk_ids int64 ``[N, k]``."""

    next_hidden: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor


class DraftPrefillResult(NamedTuple):
    """state ``[B, T, H]`` (root state after each position), the new positions' draft K/V one ``[B, Hkv, T, D]``
    per draft KV layer."""

    state: torch.Tensor
    present_keys: list[torch.Tensor]
    present_values: list[torch.Tensor]


class Engine(Protocol):
    spec: EngineSpec

    def target(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_lengths: torch.Tensor,
        packed_mask: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> TargetResult:
        """Run the target plus Augmenting Block on T new tokens per sequence.

        input_ids, position_ids int64 ``[B, T]``; past_lengths int32 ``[B]``;
        packed_mask int32 ``[B, T, ceil(T/32)]``; caches one ``[B, Hkv, S_max, D]``
        per KV layer, read only, except by an engine that writes the new tokens' K/V at
        ``[past_lengths[b], past_lengths[b] + T)`` itself (contract v3) and returns no presents.
        """
        ...

    def draft_step(self, hidden: torch.Tensor, token: torch.Tensor, head: int) -> DraftResult:
        """One regressive draft step for N frontier nodes: hidden ``[N, H]``, token int64 ``[N]``."""
        ...

    # Contract version 2, only on engines with ``spec.num_draft_kv_layers > 0``:
    #
    # def draft_prefill(self, hidden, next_token, position_ids, past_lengths, packed_mask,
    #                   k_cache, v_cache) -> DraftPrefillResult:
    #     """Run the drafter's Augmenting Block over T newly accepted positions per sequence.
    #
    #     hidden ``[B, T, H]``: the target's ``h0`` there; next_token int64 ``[B, T]``: the token after each
    #     position; position_ids int64 ``[B, T]``, past_lengths int32 ``[B]``, packed_mask int32
    #     ``[B, T, ceil(T/32)]`` as in :meth:`target`; caches one ``[B, Hkv, S_max, D]`` per draft KV
    #     layer, read only (the decode loop commits the presents, as for the target).
    #     """
