"""A tensor-parallel target: the Megatron layout on ``torch.distributed`` (docs/serving.md#tensor-parallel).

Each rank holds a slice of every decoder layer (the target's, the Augmenting Block's, Clover-2's block):

* q/k/v and gate/up split by output columns, o and down by input rows, each followed by one
  ``dist.all_reduce`` (:class:`RowParallelLinear`);
* the KV heads divided among the ranks with their query groups; where they do not divide evenly the first
  ranks take one more (SmolLM2-135M's 3 KV heads over 2 ranks: 2 + 1, so rank 0 holds 6 of the 9 query heads
  and its KV cache 2 heads; :func:`kv_head_counts`);
* the embedding and the LM head split over the vocabulary (:class:`VocabShard`): a lookup is masked to the
  rank's rows and all-reduced, logits are all-gathered, so every rank holds the full logits, bit for bit the
  same, and runs the same decode step on them.

The draft heads (small) stay whole on every rank; their token embeddings and logits go through the same
vocabulary shard (:func:`token_rows`, :func:`gather_logits`). No collective layer of our own: the
collectives are ``torch.distributed``'s (gloo on CPUs, nccl on GPUs), on the group :class:`Shard` names.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from clover.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Shard:
    """This process's place among ``world_size`` ranks; ``group``: the process group of the target's
    collectives (None: the default group)."""

    rank: int
    world_size: int
    group: object = None


def split_counts(total: int, parts: int) -> list[int]:
    """``total`` items over ``parts`` ranks, the first ranks taking one more where it does not divide."""
    base, extra = divmod(total, parts)
    return [base + (r < extra) for r in range(parts)]


def kv_head_counts(num_kv_heads: int, world_size: int) -> list[int]:
    """KV heads per rank (each with its query group). A rank needs one at least: no KV-head replication."""
    if world_size > num_kv_heads:
        raise ConfigError(f"tensor parallel {world_size} is more than the target's {num_kv_heads} KV heads; "
                          f"use at most {num_kv_heads} ranks")
    return split_counts(num_kv_heads, world_size)


def _span(counts: list[int], rank: int, unit: int = 1) -> slice:
    start = sum(counts[:rank])
    return slice(start * unit, (start + counts[rank]) * unit)


def _linear_rows(linear: nn.Linear, rows: slice) -> nn.Linear:
    """A column-parallel slice: the output features ``rows`` of ``linear`` (and its bias)."""
    weight = linear.weight.detach()[rows]
    part = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None,
                     device=weight.device, dtype=weight.dtype)
    part.weight = nn.Parameter(weight.clone(), requires_grad=False)
    if linear.bias is not None:
        part.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    return part


class RowParallelLinear(nn.Module):
    """The input features ``columns`` of a linear layer; the ranks' partial outputs are summed by one
    all-reduce, then the (whole) bias is added once."""

    def __init__(self, linear: nn.Linear, columns: slice, group=None) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(linear.weight.detach()[:, columns].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


def shard_decoder_layer(layer: nn.Module, shard: Shard) -> None:
    """Slice one :class:`~clover.target.DecoderLayer` in place (its norms stay whole)."""
    attn, mlp = layer.self_attn, layer.mlp
    kv = _span(kv_head_counts(attn.num_kv_heads, shard.world_size), shard.rank)
    group = attn.num_heads // attn.num_kv_heads  # query heads per KV head, kept together
    q = slice(kv.start * group, kv.stop * group)
    dim = attn.head_dim
    attn.q_proj = _linear_rows(attn.q_proj, slice(q.start * dim, q.stop * dim))
    attn.k_proj = _linear_rows(attn.k_proj, slice(kv.start * dim, kv.stop * dim))
    attn.v_proj = _linear_rows(attn.v_proj, slice(kv.start * dim, kv.stop * dim))
    attn.o_proj = RowParallelLinear(attn.o_proj, slice(q.start * dim, q.stop * dim), shard.group)
    attn.num_heads, attn.num_kv_heads = q.stop - q.start, kv.stop - kv.start
    hidden = _span(split_counts(mlp.gate_proj.out_features, shard.world_size), shard.rank)
    mlp.gate_proj = _linear_rows(mlp.gate_proj, hidden)
    mlp.up_proj = _linear_rows(mlp.up_proj, hidden)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, hidden, shard.group)


class VocabShard(nn.Module):
    """This rank's rows ``[start, start + rows)`` of a ``[V, H]`` vocabulary matrix, zero-padded to
    ``ceil(V / N)`` rows so the all-gather of logits takes equal parts (Megatron pads the vocabulary too)."""

    def __init__(self, weight: torch.Tensor, shard: Shard) -> None:
        super().__init__()
        self.group = shard.group
        self.vocab_size = weight.shape[0]
        rows = -(-self.vocab_size // shard.world_size)
        self.start = min(shard.rank * rows, self.vocab_size)
        part = weight.detach()[self.start: self.start + rows]
        padded = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        padded[: part.shape[0]] = part
        self.weight = nn.Parameter(padded, requires_grad=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole matrix's rows ``ids`` ``[...]`` -> ``[..., H]``: each rank looks up its own, one all-reduce."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = self.weight[local.masked_fill(outside, 0)].masked_fill(outside[..., None], 0)
        dist.all_reduce(out, group=self.group)
        return out

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        """``[..., rows]`` per rank -> the full ``[..., V]`` on every rank (one all-gather)."""
        parts = [torch.empty_like(local_logits) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local_logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


class VocabParallel(nn.Module):
    """A module over a :class:`VocabShard` (its ``weight`` is the shard's rows)."""

    def __init__(self, vocab: VocabShard) -> None:
        super().__init__()
        self.vocab = vocab

    @property
    def weight(self) -> nn.Parameter:
        return self.vocab.weight


class VocabParallelEmbedding(VocabParallel):
    """``embed_tokens`` over a :class:`VocabShard`."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab.rows(ids)


class VocabParallelLMHead(VocabParallel):
    """``lm_head`` over a :class:`VocabShard`: local logits, all-gathered."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vocab.gather(nn.functional.linear(x, self.vocab.weight))


def shard_target(target: nn.Module, shard: Shard, extra_layers: list[nn.Module] = ()) -> None:
    """Slice a :class:`~clover.target.LlamaTarget` in place, and ``extra_layers`` (decoder layers of the heads
    that share its KV cache layout: the Augmenting Block, Clover-2's block) with it."""
    for layer in [*target.layers, *extra_layers]:
        shard_decoder_layer(layer, shard)
    tied = target.lm_head.weight is target.embed_tokens.weight
    embedding = VocabShard(target.embed_tokens.weight, shard)
    head = embedding if tied else VocabShard(target.lm_head.weight, shard)
    target.embed_tokens, target.lm_head = VocabParallelEmbedding(embedding), VocabParallelLMHead(head)


def is_vocab_parallel(lm_head: nn.Module) -> bool:
    return isinstance(lm_head, VocabParallelLMHead)


def token_rows(lm_head: nn.Module, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the heads index for token embeddings (``W_lm[token]``): ``(W_lm, token)`` for a whole LM head;
    for a vocabulary-parallel one the gathered rows and their own indices, so the heads' code is unchanged."""
    if not is_vocab_parallel(lm_head):
        return lm_head.weight, token
    rows = lm_head.vocab.rows(token.reshape(-1))
    return rows, torch.arange(rows.shape[0], device=token.device).view(token.shape)


def vocab_rows(lm_head: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The LM head's rows ``ids`` ``[n]`` -> ``[n, H]``, whole or vocabulary-parallel."""
    return lm_head.vocab.rows(ids) if is_vocab_parallel(lm_head) else lm_head.weight.detach()[ids]


def gather_logits(lm_head: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Scores over this rank's vocabulary rows -> over the whole vocabulary (unchanged for a whole LM head)."""
    return lm_head.vocab.gather(logits) if is_vocab_parallel(lm_head) else logits


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters, shared ones (tied embeddings) counted once."""
    return sum(p.numel() * p.element_size() for p in module.parameters())
