"""The training forward, shared by training (:mod:`training.train`) and evaluation (:mod:`training.evaluate`).

One batch: the Augmenting Block over the conversations (:func:`compute_h0`), the roots whose
chains the heads continue (:func:`find_roots`), the teacher-forced regressive chain through the
very ``drafter.step`` calls of inference (:func:`head_outputs`) and the loss (:func:`head_loss`;
docs/drafter.md#training). :func:`run_batch` puts them together, with or without the backward pass.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from clover.attention import causal_packed_mask
from clover.drafters import Drafter, draft_vocab_of
from training.batches import Batch


def compute_h0(drafter: Drafter, target, batch: Batch) -> torch.Tensor:
    """h0 ``[B, T, H]``: the Augmenting Block over the whole (causal) sequence, else the last hidden state.
    The block reads ``batch.x_in``: the last layer's input, or the heads' multi-layer features fused.

    Clover-2's block runs in ``draft_prefill`` at inference, on the last hidden state and the token after
    each position: here the same call over the whole sequence (a padded last position reads token 0; it
    is never a root, see :func:`find_roots`).
    """
    if drafter.has_draft_prefill:
        return _clover2_states(drafter, target, batch)
    if drafter.augment is None:
        return batch.x_last
    x = drafter.augment_input(batch.x_in)
    bsz, length, _ = x.shape
    cfg = target.config
    position_ids = torch.arange(length, device=x.device).expand(bsz, -1)
    cos, sin = target.rope(position_ids)
    empty = torch.zeros(bsz, cfg.num_kv_heads, 0, cfg.head_dim, dtype=x.dtype, device=x.device)
    h0, _, _ = drafter.augment(x, cos.to(x.dtype), sin.to(x.dtype), torch.zeros(bsz, dtype=torch.int32, device=x.device),
                               causal_packed_mask(bsz, length, x.device), empty, empty)
    return h0


def _clover2_states(drafter, target, batch: Batch) -> torch.Tensor:
    x = batch.x_last
    bsz, length, _ = x.shape
    cfg = target.config
    next_token = torch.cat([batch.tokens[:, 1:], torch.zeros_like(batch.tokens[:, :1])], dim=1)
    position_ids = torch.arange(length, device=x.device).expand(bsz, -1)
    empty = [torch.zeros(bsz, cfg.num_kv_heads, 0, cfg.head_dim, dtype=x.dtype, device=x.device)] * drafter.num_kv_layers
    state, _, _ = drafter.prefill(x, next_token, position_ids, torch.zeros(bsz, dtype=torch.int32, device=x.device),
                                  causal_packed_mask(bsz, length, x.device), empty, empty,
                                  target.lm_head.weight.to(device=x.device, dtype=x.dtype))
    return state


@dataclasses.dataclass
class Roots:
    """Root positions and their teacher-forced chains (N roots, K heads).

    b, t: int64 ``[N]``; tok_in, labels: int64 ``[N, K]`` (token t+i+1 fed to head i,
    token t+i+2 it must predict); valid: bool ``[N, K]`` (nested: valid[:, i+1] implies valid[:, i])."""

    b: torch.Tensor
    t: torch.Tensor
    tok_in: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor


def find_roots(batch: Batch, num_heads: int) -> Roots:
    tokens, assistant, lengths = batch.tokens, batch.assistant, batch.lengths
    bsz, width = tokens.shape
    pos = torch.arange(width, device=tokens.device)
    offsets = torch.arange(num_heads, device=tokens.device)
    label_pos = pos[:, None] + 2 + offsets[None, :]                      # [T, K]
    inside = label_pos[None] < lengths[:, None, None]                     # [B, T, K]
    label_clamped = label_pos.clamp(max=width - 1)
    label_assistant = assistant[:, label_clamped]                          # [B, T, K]
    root_assistant = assistant[:, (pos + 1).clamp(max=width - 1)] & ((pos + 1)[None] < lengths[:, None])
    valid = inside & label_assistant & root_assistant[..., None]
    valid = valid.long().cumprod(dim=-1).bool()                                  # nested by construction
    b, t = valid[..., 0].nonzero(as_tuple=True)
    in_pos = (t[:, None] + 1 + offsets[None]).clamp(max=width - 1)
    lab_pos = (t[:, None] + 2 + offsets[None]).clamp(max=width - 1)
    return Roots(b, t, tokens[b[:, None], in_pos], tokens[b[:, None], lab_pos], valid[b, t])


@dataclasses.dataclass
class DraftRows:
    """The LM-head rows the heads score: the full vocabulary, or the drafter's draft vocabulary V'
    (FR-Spec; docs/drafter.md#draft-vocabulary), exactly as the engine's draft step scores them.

    ids: int64 ``[V']`` target ids (None: the full vocabulary); weight ``[V' or V, H]``;
    column: int64 ``[V]``, a target id's column in the heads' logits, -100 outside V'."""

    ids: torch.Tensor | None
    weight: torch.Tensor
    column: torch.Tensor | None

    @classmethod
    def of(cls, drafter: Drafter, lm_head_weight: torch.Tensor) -> "DraftRows":
        ids = draft_vocab_of(drafter)
        if ids is None:
            return cls(None, lm_head_weight, None)
        ids = ids.to(lm_head_weight.device)
        column = torch.full((lm_head_weight.shape[0],), -100, dtype=torch.long, device=ids.device)
        column[ids] = torch.arange(len(ids), device=ids.device)
        return cls(ids, lm_head_weight[ids], column)

    def to_target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Target token ids of logit columns (any shape)."""
        return columns if self.ids is None else self.ids[columns]

    def to_columns(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logit columns of target token ids; -100 (cross-entropy's ignore index) outside V'."""
        return token_ids if self.column is None else self.column[token_ids]


def head_outputs(drafter: Drafter, lm_head_weight: torch.Tensor, h_rows: torch.Tensor, tok_in: torch.Tensor,
                 valid: torch.Tensor, scored: torch.Tensor | None = None):
    """Teacher-forced regressive chain, the very ``drafter.step`` calls of inference.

    Args:
        h_rows ``[N, H]``: h0 at the roots; tok_in, valid ``[N, K]``; scored: the LM-head rows the heads
            score (:class:`DraftRows`), default all.
    Yields:
        (head i, row indices ``[n_i]`` into N, feature ``[n_i, H]``, logits ``[n_i, V or V']``) for the rows
        whose head-i label is valid (feature: :meth:`clover.drafters.Drafter.step_with_feature`).
    """
    rows = torch.arange(h_rows.shape[0], device=h_rows.device)
    hidden = h_rows
    for i in range(valid.shape[1]):
        keep = valid[rows, i]
        rows, hidden = rows[keep], hidden[keep]
        if rows.numel() == 0:
            return
        hidden, feature, logits = drafter.step_with_feature(hidden, tok_in[rows, i], i, lm_head_weight, scored)
        yield i, rows, feature, logits


def head_logits(drafter: Drafter, lm_head_weight: torch.Tensor, h_rows: torch.Tensor, tok_in: torch.Tensor,
                valid: torch.Tensor):
    """:func:`head_outputs` without the features: (head i, rows, logits)."""
    for i, rows, _, logits in head_outputs(drafter, lm_head_weight, h_rows, tok_in, valid):
        yield i, rows, logits


def label_source_positions(roots: Roots, rows: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch row, position) whose target last hidden state predicts head ``head``'s label.

    Head i at root t predicts token t+i+2; the target predicts that token from
    its state at t+i+1, so the soft label and the regression target both sit there.
    """
    return roots.b[rows], roots.t[rows] + head + 1


def target_logits(target, lm_head_weight: torch.Tensor, last_hidden: torch.Tensor) -> torch.Tensor:
    """The target's own logits from its last hidden state: the frozen final norm, then the LM head."""
    return target.norm(last_hidden.to(target.norm.weight.dtype)).to(lm_head_weight.dtype) @ lm_head_weight.T


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Summed ``-sum_v p(v) log q(v)`` over rows; equals the hard cross-entropy when ``p`` is one-hot."""
    return -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum()


def regression_target(drafter: Drafter, target, last_hidden: torch.Tensor) -> torch.Tensor:
    """What a head's feature regresses onto (Clover-2): the target's last hidden state, normed for Medusa,
    whose feature comes after its (frozen) norm (see :meth:`clover.drafters.Drafter.step_with_feature`)."""
    if drafter.is_medusa:
        return target.norm(last_hidden.to(target.norm.weight.dtype))
    return last_hidden


def head_weights(num_heads: int, decay: float) -> list[float]:
    return [decay ** i for i in range(num_heads)]


@dataclasses.dataclass
class LossSpec:
    """How one head's loss is formed (docs/drafter.md#training): ``weights[i] * (CE_i + regression_weight * reg_i)``,
    CE against the label token (``hard``) or the target's distribution (``soft``)."""

    weights: list[float]
    labels: str = "hard"
    regression_weight: float = 0.0
    topk_weight: float = 0.0  # HASS (arXiv 2408.15766) top-K distillation: -sum_{v in top-K of p} p(v) log q(v)
    topk_tokens: int = 10

    @property
    def needs_target_hidden(self) -> bool:
        return self.labels == "soft" or self.regression_weight > 0 or self.topk_weight > 0


class SoftLabels:
    """The target's distribution over the scored rows (:class:`DraftRows`) at the label source positions of a
    chunk of roots, computed once per position: root t's head i+1 and root t+1's head i read the same one, so
    per head it would be computed up to K times (most of a training step's LM-head work besides the heads').

    With a draft vocabulary V' it is the target's logits at those rows, renormalised (EAGLE-3's choice)."""

    def __init__(self, target, rows: DraftRows, x_last: torch.Tensor, roots: Roots, chunk: slice) -> None:
        self.width = x_last.shape[1]
        heads = torch.arange(roots.valid.shape[1], device=x_last.device)
        flat = self._flat(roots.b[chunk, None], roots.t[chunk, None] + heads + 1)  # [n, K]
        self.positions = torch.unique(flat[roots.valid[chunk]])  # sorted
        with torch.no_grad():
            logits = target_logits(target, rows.weight, x_last.flatten(0, 1)[self.positions])
            self.probs = torch.softmax(logits.float(), dim=-1)

    def _flat(self, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return b * self.width + t

    def at(self, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``[n, V']`` at the positions (b, t), which must be among the chunk's label source positions."""
        return self.probs[torch.searchsorted(self.positions, self._flat(b, t))]


def head_loss(drafter: Drafter, target, rows: DraftRows, feature: torch.Tensor, logits: torch.Tensor,
              labels: torch.Tensor, last_hidden: torch.Tensor | None, spec: LossSpec,
              target_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Summed loss of one head over its rows.

    ``labels``: target token ids ``[n]``; ``last_hidden`` ``[n, H]``: the target's last hidden state at the
    label source positions (:func:`label_source_positions`), or None when the loss does not read it;
    ``target_probs`` ``[n, V']``: the soft label there (:class:`SoftLabels`), needed when ``spec.labels`` is
    soft. A hard label outside the draft vocabulary counts no loss.
    """
    logits = logits.float()
    if spec.labels == "hard" or target_probs is None:
        loss = nn.functional.cross_entropy(logits, rows.to_columns(labels), reduction="sum", ignore_index=-100)
    else:
        loss = soft_cross_entropy(logits, target_probs)
    if spec.topk_weight and target_probs is not None:
        top = target_probs.topk(min(spec.topk_tokens, target_probs.shape[-1]), dim=-1)  # the target's K likeliest tokens
        log_q = torch.log_softmax(logits, dim=-1).gather(-1, top.indices)
        loss = loss - spec.topk_weight * (top.values * log_q).sum()
    if spec.regression_weight:
        goal = regression_target(drafter, target, last_hidden).float()
        loss = loss + spec.regression_weight * nn.functional.smooth_l1_loss(
            feature.float(), goal, reduction="none").mean(-1).sum()
    return loss


def target_top1(target, lm_head_weight: torch.Tensor, last_hidden: torch.Tensor) -> torch.Tensor:
    """The target's greedy token ``[n]`` over its full vocabulary: what verification accepts."""
    with torch.no_grad():
        return target_logits(target, lm_head_weight, last_hidden).argmax(-1)


def _count_hits(stats: dict, head: int, logits: torch.Tensor, labels: torch.Tensor,
                target_top: torch.Tensor | None, rows: DraftRows) -> None:
    """Add one head's top-k hits: against the label token, and against the target's top-1 (``agree``) if known.
    Both are target ids over the full vocabulary, so a token outside the draft vocabulary is a miss."""
    with torch.no_grad():
        top = rows.to_target_ids(logits.topk(max(stats["hits"]), dim=-1).indices)
        for k in stats["hits"]:
            stats["hits"][k][head] += int((top[:, :k] == labels[:, None]).any(-1).sum())
            if target_top is not None:
                stats["agree"][k][head] += int((top[:, :k] == target_top[:, None]).any(-1).sum())


def run_batch(drafter: Drafter, target, lm_head_weight: torch.Tensor, batch: Batch, *, row_chunk: int,
              weights: list[float], train: bool, topk: tuple[int, ...] = (1,), labels: str = "hard",
              regression_weight: float = 0.0, topk_weight: float = 0.0, topk_tokens: int = 10) -> dict:
    """Forward (and backward when ``train``) over one batch, LM head in chunks of roots.

    The loss is ``sum_i w_i * mean_i(CE + regression_weight * SmoothL1)`` (:func:`head_loss`).
    Chunks backpropagate into a detached copy of the roots' h0, whose gradient
    then flows through the Augmenting Block once, so memory is bounded by
    ``row_chunk x V`` per head. Returns loss, and per head the label count, the
    top-k hits and, when the target's hidden states are read, its top-1's hits (``agree``).
    """
    num_heads = drafter.config.num_heads
    spec = LossSpec(weights, labels, regression_weight, topk_weight, topk_tokens)
    roots = find_roots(batch, num_heads)
    counts = roots.valid.sum(0)
    read_target = batch.x_last is not None and (spec.needs_target_hidden or not train)
    stats = {"loss": 0.0, "count": counts.tolist(), "hits": {k: [0] * num_heads for k in topk},
             "agree": {k: [0] * num_heads for k in topk} if read_target else None, "categories": None}
    if roots.b.numel() == 0:
        return stats
    with torch.set_grad_enabled(train):
        h0 = compute_h0(drafter, target, batch)
        h_rows = h0[roots.b, roots.t]
    leaf = h_rows.detach().requires_grad_(True) if (train and h_rows.requires_grad) else h_rows
    scored = DraftRows.of(drafter, lm_head_weight)
    total = 0.0
    for start in range(0, h_rows.shape[0], row_chunk):
        sl = slice(start, start + row_chunk)
        with torch.set_grad_enabled(train):
            loss = leaf.new_zeros(())
            chunk_rows = torch.arange(h_rows.shape[0], device=h_rows.device)[sl]
            soft = (SoftLabels(target, scored, batch.x_last, roots, sl)
                    if read_target and (labels == "soft" or topk_weight) else None)
            for i, rows, feature, logits in head_outputs(drafter, lm_head_weight, leaf[sl], roots.tok_in[sl],
                                                         roots.valid[sl], scored.weight):
                label = roots.labels[sl][rows, i]
                source = label_source_positions(roots, chunk_rows[rows], i)
                last_hidden = batch.x_last[source] if read_target else None
                term = head_loss(drafter, target, scored, feature, logits, label, last_hidden, spec,
                                 soft.at(*source) if soft else None)
                loss = loss + weights[i] * term / counts[i]
                # training reads only the label hits: the target's own top-1 (a full-vocabulary pass) is for eval
                target_top = target_top1(target, lm_head_weight, last_hidden) if read_target and not train else None
                _count_hits(stats, i, logits, label, target_top, scored)
            if train and loss.requires_grad:
                loss.backward()
        total += float(loss.detach())
    if train and leaf is not h_rows and leaf.grad is not None:
        h_rows.backward(leaf.grad)
    stats["loss"] = total
    return stats



def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
