"""Train Clover / Medusa / ablation heads on a hidden-state cache (docs/drafter.md#training).

    python training/train.py --method clover --cache data/cache/train --output runs/clover \\
        --max-tokens 600000

The target is frozen; only the drafter learns. What one step computes, for each
conversation in the batch (shapes: B conversations padded to T tokens):

* ``h0 [B, T, H]``: the Augmenting Block run causally over the cached input of
  the target's last layer (a fork beside it), or the cached last hidden state
  when the method has no Augmenting Block (Medusa, ``clover-no-augment``).
* Roots: every position t whose next token t+1 is an assistant token. At
  inference t is the last accepted position, ``h0[t]`` the root hidden state and
  token t+1 the target's own next token ``tok0``.
* Head i (0-based) at root t predicts token t+i+2, teacher-forced: the chain is
  ``drafter.step(h_i, token[t+i+1], i, W_lm)`` with ``h_0 = h0[t]``, exactly the
  call the decode loop's tree builder makes (:func:`head_logits`).
* Loss = sum over heads of ``head_decay ** i`` times the mean cross-entropy, over
  the roots whose label is an assistant token inside the conversation. The label
  is that token (``--labels hard``) or the target's own distribution for it
  (``--labels soft``): ``softmax(W_lm norm(last_hidden[t+i+1]))``, recomputed
  from the cached last hidden state through the frozen final norm and LM head, so
  no logits are stored. ``--regression-weight w`` adds ``w`` times Clover-2's
  SmoothL1 regression of the head's feature onto that same ``last_hidden[t+i+1]``
  (the state from which the target predicts token t+i+2; docs/drafter.md#training).

``--cache`` takes one or more caches separated by commas (ShareGPT plus the
8-category data), or a distilled JSONL, whose hidden states are then computed on
the fly (:class:`training.hidden_cache.LiveFeatures`; no disk). ``--eval-cache``
with ``--eval-every N`` measures teacher-forced top-1 on held-out data every N
steps into ``eval_log.jsonl``: the learning curve against training tokens.

Batches are buckets of conversations of similar length within ``--batch-tokens``
padded tokens; the batch plan depends only on the cache, the seed, the epochs
and ``--max-tokens`` (assistant tokens), never on the method, so Clover and
Medusa trained with the same flags see the same data in the same order.

AdamW (0.9, 0.999), lr 1e-3, short linear warmup then cosine decay, gradient
clipping, 1 epoch by default. ``train_state.pt`` (weights, optimizer, RNG, step)
is written atomically every ``--save-every`` steps; rerunning the same command
resumes and ends with the same weights as an uninterrupted run. The final heads
are saved with :func:`clover.drafters.save_drafter` (fp16) next to
``training_summary.json``.

``--features online`` runs the frozen target inside the training step instead of
reading a cache (:mod:`training.features`): the same hidden states, loss and data
order, no disk. Under ``torchrun --nproc_per_node N`` each process takes its share
of every batch and the gradients are summed over processes
(:mod:`training.distributed`); ``--grad-accum K`` splits each process's share into
K micro-batches. The weights after a step do not depend on N or K (to float
rounding), so a run may resume with another N.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clover.attention import causal_packed_mask  # noqa: E402
from clover.config import DRAFTER_METHODS, TOKEN_PATHS, ConfigError, DrafterConfig  # noqa: E402
from clover.drafters import (DRAFT_VOCAB_FILE, Drafter, calibrate_token_scale, draft_vocab_of,  # noqa: E402
                             load_drafter, read_draft_vocab, save_drafter, set_draft_vocab)
from training.distributed import Distributed  # noqa: E402
from training.features import (FEATURE_SOURCES, enable_gradient_checkpointing, online_hidden_states,  # noqa: E402
                               online_target_dtype, peak_memory_mb, stored_dtype)
from training.hidden_cache import HiddenCache, open_training_data  # noqa: E402

STATE_FILE, RUN_CONFIG_FILE, LOG_FILE, SUMMARY_FILE = "train_state.pt", "run_config.json", "train_log.jsonl", \
    "training_summary.json"
EVAL_LOG_FILE = "eval_log.jsonl"
LABELS = ("hard", "soft")
STATE_VERSION = 1


@dataclasses.dataclass
class TrainConfig:
    method: str
    cache: str
    output: str
    target: str = "demo"
    num_heads: int = 3
    decoder_heads: int | None = None      # Attention Decoder heads; None: the target's attention heads
    init_noise_std: float = 0.01
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    warmup_steps: int | None = None       # None: 3% of the steps, at least 1, at most 100
    min_lr_ratio: float = 0.0
    epochs: int = 1
    max_tokens: int | None = None         # assistant-token budget; None: all epochs
    batch_tokens: int = 4096              # padded tokens per batch
    bucket_size: int = 256                # conversations sorted by length together
    row_chunk: int = 1024                 # roots per LM-head chunk (memory bound)
    grad_clip: float = 1.0
    head_decay: float = 1.0               # loss weight of head i: head_decay ** i
    labels: str = "hard"                  # "soft": the target's distribution (recomputed from last_hidden)
    regression_weight: float = 0.0        # Clover-2 SmoothL1 feature regression, relative to the CE's weight 1
    topk_weight: float = 0.0              # HASS top-K distillation beside the CE, relative to the CE's weight 1
    topk_tokens: int = 10                 # K of the top-K distillation loss
    autocast: str | None = None           # "bf16": mixed precision (fp32 weights, bf16 matmuls; fast on AMX/GPU)
    seed: int = 0
    save_every: int = 20
    log_every: int = 10
    device: str = "auto"
    threads: int | None = None
    progress: bool = True
    eval_cache: str | None = None         # held-out cache for the learning curve (eval_log.jsonl)
    eval_every: int = 0                   # steps between curve points; 0: none
    eval_conversations: int = 200         # held-out conversations per curve point
    features: str = "cache"               # "online": the target runs inside the step (training/features.py)
    target_dtype: str = "auto"            # online: auto = fp32 on CPU, the checkpoint's bf16/fp16 on GPU
    grad_accum: int = 1                   # micro-batches per process per step (same weights, less memory)
    grad_checkpoint: bool = False         # recompute the Augmenting Block in the backward pass
    draft_vocab: str | None = None        # heads directory whose draft_vocab.safetensors the heads score (FR-Spec)
    draft_vocab_size: int = 16384         # V': that many most frequent ids of it
    init: str | None = None               # heads directory to start from (fine-tuning) instead of a fresh init
    token_path: str = "residual"          # how the regressive step mixes in its token (DrafterConfig.token_path)

    # fields that may differ between a run and its resumption (none changes the weights beyond float rounding)
    RESUME_FREE = ("save_every", "log_every", "device", "threads", "progress", "output", "cache", "target",
                   "eval_cache", "eval_every", "eval_conversations", "features", "target_dtype", "grad_accum",
                   "grad_checkpoint")

    @property
    def needs_target_hidden(self) -> bool:
        """Whether the loss reads the target's last hidden state at the label positions."""
        return self.labels == "soft" or self.regression_weight > 0 or self.topk_weight > 0

    def resume_key(self) -> dict:
        key = {k: v for k, v in dataclasses.asdict(self).items() if k not in self.RESUME_FREE}
        if self.draft_vocab is None:  # full vocabulary: the key of runs from before --draft-vocab existed
            del key["draft_vocab"], key["draft_vocab_size"]
        if self.init is None:  # likewise for runs from before --init
            del key["init"]
        if self.token_path == "residual":  # likewise for runs from before --token-path
            del key["token_path"]
        if not self.topk_weight:  # likewise for runs from before --topk-weight
            del key["topk_weight"], key["topk_tokens"]
        return key


class Interrupted(Exception):
    """Raised by a step callback to stop a run (tests simulate a kill with it)."""


# ---------------------------------------------------------------------------
# batches


@dataclasses.dataclass
class Batch:
    """Padded conversations. x_in / x_last ``[B, T, H]`` (None when not needed),
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
    lengths = np.array([c["length"] for c in conversations])
    plan: list[list[int]] = []
    seen = 0
    for epoch in range(epochs):
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(len(conversations))
        epoch_batches = []
        for start in range(0, len(order), bucket_size):
            bucket = sorted(order[start: start + bucket_size].tolist(), key=lambda i: (lengths[i], i))
            current: list[int] = []
            for i in bucket:
                if current and (len(current) + 1) * max(lengths[i], lengths[current[-1]]) > batch_tokens:
                    epoch_batches.append(current)
                    current = []
                current.append(i)
            if current:
                epoch_batches.append(current)
        for k in rng.permutation(len(epoch_batches)):
            plan.append(epoch_batches[k])
            seen += sum(assistant_tokens(conversations[i]) for i in epoch_batches[k])
            if max_tokens is not None and seen >= max_tokens:
                return plan
    return plan


def collate(cache: HiddenCache, indices: list[int], need_input: bool, need_last: bool,
            device: torch.device | str = "cpu") -> Batch:
    """Pad conversations ``indices`` into a :class:`Batch`; with neither hidden state needed, only their tokens
    are read (``--features online`` then fills them: :func:`training.features.online_hidden_states`)."""
    convs = [cache.conversation(i) if need_input or need_last else cache.tokens(i) for i in indices]
    lengths = torch.tensor([len(c["tokens"]) for c in convs])
    batch, width, hidden = len(convs), int(lengths.max()), cache.hidden_size
    tokens = torch.zeros(batch, width, dtype=torch.long)
    assistant = torch.zeros(batch, width, dtype=torch.bool)
    x_in = torch.zeros(batch, width, hidden) if need_input else None
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


# ---------------------------------------------------------------------------
# the training forward (shared with evaluate.py)


def compute_h0(drafter: Drafter, target, batch: Batch) -> torch.Tensor:
    """h0 ``[B, T, H]``: the Augmenting Block over the whole (causal) sequence, else the last hidden state.

    Clover-2's block runs in ``draft_prefill`` at inference, on the last hidden state and the token after
    each position: here the same call over the whole sequence (a padded last position reads token 0; it
    is never a root, see :func:`find_roots`).
    """
    if drafter.has_draft_prefill:
        return _clover2_states(drafter, target, batch)
    if drafter.augment is None:
        return batch.x_last
    x = batch.x_in
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


# ---------------------------------------------------------------------------
# the loop


def lr_at(step: int, total: int, base: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_drafter(cfg: TrainConfig, target) -> Drafter:
    tc = target.config
    decoder_heads = cfg.decoder_heads or tc.num_heads
    if tc.hidden_size % decoder_heads:
        decoder_heads = 1
    config = DrafterConfig(method=cfg.method, num_heads=cfg.num_heads, hidden_size=tc.hidden_size,
                           vocab_size=tc.vocab_size, target_num_layers=tc.num_layers,
                           num_attention_heads=decoder_heads, init_noise_std=cfg.init_noise_std,
                           target_architecture=tc.architecture, token_path=cfg.token_path)
    drafter = Drafter.from_target(config, target, seed=cfg.seed).float()
    if cfg.init:
        _load_init_weights(drafter, cfg.init, target)
    if cfg.draft_vocab:
        set_draft_vocab(drafter, read_draft_vocab(cfg.draft_vocab, cfg.draft_vocab_size))
    return drafter


def _load_init_weights(drafter: Drafter, directory: str, target) -> None:
    """Start from trained heads (``--init``): same method and shape, checked against the target's fingerprint.

    Only the weights are taken; the draft vocabulary is the run's own (``--draft-vocab``), since the heads'
    parameters do not depend on it (their LM head is the target's, docs/drafter.md#draft-vocabulary).
    """
    start = load_drafter(directory, target, draft_vocab_size=0)
    if (start.config.method, start.config.num_heads) != (drafter.config.method, drafter.config.num_heads):
        raise ConfigError(f"--init {directory}: {start.config.num_heads} {start.config.method} heads, but this run "
                          f"trains {drafter.config.num_heads} {drafter.config.method} heads")
    try:
        drafter.load_state_dict({k: v.float() for k, v in start.state_dict().items()})
    except RuntimeError as exc:
        raise ConfigError(f"--init {directory}: its weights do not fit this run's heads ({exc})") from exc


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


@dataclasses.dataclass
class _Progress:
    """Where a run stands; saved in ``train_state.pt`` and restored on resume."""

    step: int = 0
    tokens_seen: int = 0    # assistant tokens of the batches done
    elapsed: float = 0.0    # training seconds of the earlier sessions of this run


class _Trainer:
    """The drafter, its optimizer and the frozen pieces that one training step needs."""

    def __init__(self, cfg: TrainConfig, target, device: torch.device, dist: Distributed | None = None) -> None:
        self.cfg, self.target, self.device, self.dist = cfg, target, device, dist or Distributed()
        self.drafter = build_drafter(cfg, target).to(device)
        self.drafter.train()
        if cfg.grad_checkpoint:
            enable_gradient_checkpointing(self.drafter)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay)
        self.lm_head_weight = target.lm_head.weight.detach().float().to(device)  # [V, H], frozen
        self.weights = head_weights(cfg.num_heads, cfg.head_decay)

    def step(self, batches: list[Batch], lr: float, prepare=None) -> tuple[dict, float]:
        """One optimizer step at learning rate ``lr`` over this process's micro-batches of one plan batch.

        run_batch divides head i's loss by its label count; each micro-batch's head-i weight is scaled by
        its share of the head-i labels of the whole batch on every process, so the summed gradient is the
        one of a single process on the whole batch (training/distributed.py). ``prepare(batch)`` fills a
        micro-batch's hidden states just before it runs (online features). Returns the whole batch's
        loss, label counts and top-1 hits per head, and the gradient norm.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        k = self.cfg.num_heads
        local = [find_roots(batch, k).valid.sum(0).tolist() for batch in batches]  # [micro][head]
        total = self.dist.sum(torch.tensor([sum(c[i] for c in local) for i in range(k)], dtype=torch.float64,
                                           device=self.device)).tolist()
        summed = torch.zeros(1 + 2 * k, dtype=torch.float64)
        for batch, counts in zip(batches, local):
            shares = [w * (c / t) if t else 0.0 for w, c, t in zip(self.weights, counts, total)]
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.autocast == "bf16"):
                part = run_batch(self.drafter, self.target, self.lm_head_weight, prepare(batch) if prepare else batch,
                                 row_chunk=self.cfg.row_chunk, weights=shares, train=True, labels=self.cfg.labels,
                                 regression_weight=self.cfg.regression_weight, topk_weight=self.cfg.topk_weight,
                                 topk_tokens=self.cfg.topk_tokens)
            summed += torch.tensor([part["loss"], *part["count"], *part["hits"][1]], dtype=torch.float64)
        summed = self.dist.sum(summed.to(self.device)).cpu()
        self.dist.sum_gradients(self.params)
        stats = {"loss": float(summed[0]), "count": [int(x) for x in summed[1: 1 + k]],
                 "hits": {1: [int(x) for x in summed[1 + k:]]}}
        grad_norm = float("nan")  # not measured without clipping
        if self.cfg.grad_clip:
            grad_norm = float(nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        self.optimizer.step()
        return stats, grad_norm

    def save_state(self, path: Path, progress: _Progress, elapsed: float) -> None:
        _save_atomic({"version": STATE_VERSION, "resume_key": self.cfg.resume_key(), "step": progress.step,
                      "tokens": progress.tokens_seen, "elapsed": elapsed, "drafter": self.drafter.state_dict(),
                      "optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, path)

    def load_state(self, path: Path) -> _Progress:
        """Restore a checkpoint (weights, optimizer, RNG) if ``path`` holds one; the progress it had reached."""
        if not path.exists():
            return _Progress()
        state = torch.load(path, map_location="cpu", weights_only=False)  # RNG state must stay on CPU
        if state.get("version") != STATE_VERSION or state.get("resume_key") != self.cfg.resume_key():
            raise ConfigError(f"{path} belongs to another run; use another --output or delete it")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        return _Progress(state["step"], state["tokens"], state["elapsed"])


def train(cfg: TrainConfig, target=None, on_step=None) -> dict:
    """Run (or resume) training; returns the summary dict. ``on_step(step)`` runs after each step.

    Under torchrun (``WORLD_SIZE`` > 1), or in a process group the caller made, this is one rank of a
    data-parallel job (:mod:`training.distributed`); rank 0 writes every file. With ``--features
    online`` a given ``target`` is moved to the device and dtype online features run in.
    """
    _check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg.device)
    dist = Distributed.from_env(device.type)
    try:
        summary = _train_rank(cfg, target, on_step, out, dist, dist.device(device))
        # no rank tears the group down while another is still in the last collective (gloo aborted the
        # process then, under load: "terminate called without an active exception")
        dist.barrier()
        return summary
    finally:
        dist.close()


def _check_config(cfg: TrainConfig) -> None:
    if cfg.method not in DRAFTER_METHODS:
        raise ConfigError(f"unknown method {cfg.method!r}; choose one of {', '.join(DRAFTER_METHODS)}")
    if cfg.autocast not in (None, "bf16"):
        raise ConfigError(f"autocast {cfg.autocast!r}: use bf16 or leave it unset")
    if cfg.labels not in LABELS:
        raise ConfigError(f"labels {cfg.labels!r}: use one of {', '.join(LABELS)}")
    if cfg.features not in FEATURE_SOURCES:
        raise ConfigError(f"features {cfg.features!r}: use one of {', '.join(FEATURE_SOURCES)}")
    if cfg.grad_accum < 1:
        raise ConfigError("--grad-accum must be at least 1")


def _train_rank(cfg: TrainConfig, target, on_step, out: Path, dist: Distributed, device: torch.device) -> dict:
    online = cfg.features == "online"
    if target is None:
        from clover.demo import resolve_target
        from clover.target import load_target

        directory = resolve_target(cfg.target)
        target = load_target(directory, dtype=online_target_dtype(cfg.target_dtype, device, stored_dtype(directory))
                             if online else torch.float32)
    cache = open_training_data(cfg.cache, target)
    cache.check_target(target)
    if online:  # the frozen target runs in the step: on this rank's device (a no-op for a target loaded above)
        dtype = online_target_dtype(cfg.target_dtype, device, target.lm_head.weight.dtype)
        target = target.to(device=device, dtype=dtype)
    else:  # the rest stays on the CPU; soft labels and the regression target read the final norm on the device
        target.norm.to(device)
    finished = _claim_output_on_main(cfg, out, dist)
    if finished is not None:
        return finished

    plan = make_plan(cache.conversations, cfg.batch_tokens, cfg.epochs, cfg.seed, cfg.bucket_size, cfg.max_tokens)
    trainer = _Trainer(cfg, target, device, dist)
    if cfg.token_path == "scaled" and not cfg.init:  # the learned token scale starts at the data's root-state norm
        calibrate_token_scale(trainer.drafter, _root_state_sample(cache))
    progress = trainer.load_state(out / STATE_FILE)
    if dist.is_main:
        _drop_log_lines_after(out / LOG_FILE, progress.step)
        _drop_log_lines_after(out / EVAL_LOG_FILE, progress.step)
    _run_steps(trainer, cache, plan, progress, out, on_step)
    summary = None
    if dist.is_main:
        save_drafter(trainer.drafter.cpu().eval(), out, dtype=torch.float16)
        if cfg.draft_vocab:  # the whole ranking, counts and provenance: the heads use its first draft_vocab_size ids
            shutil.copyfile(Path(cfg.draft_vocab) / DRAFT_VOCAB_FILE, out / DRAFT_VOCAB_FILE)
        summary = _summary(cfg, cache, plan, progress, device, out / LOG_FILE, dist.world_size)
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return dist.broadcast(summary)


def _root_state_sample(cache, conversations: int = 8) -> torch.Tensor:
    """The target's last hidden states ``[N, H]`` at the answer positions of the first conversations: the
    root states h0 at initialisation (the Augmenting Block starts as a copy of the last layer)."""
    states = []
    for i in range(min(conversations, len(cache.conversations))):
        conv = cache.conversation(i)
        mask = np.asarray(conv["assistant_mask"], dtype=bool)
        states.append(torch.from_numpy(np.array(conv["last_hidden"], dtype=np.float32)[mask]))
    return torch.cat(states)


def _claim_output_on_main(cfg: TrainConfig, out: Path, dist: Distributed) -> dict | None:
    """:func:`_claim_output` on rank 0; every rank gets its result, or raises its ConfigError."""
    claim = None
    if dist.is_main:
        try:
            claim = ("ok", _claim_output(cfg, out))
        except ConfigError as exc:
            claim = ("error", str(exc))
    kind, value = dist.broadcast(claim)
    if kind == "error":
        raise ConfigError(value)
    return value


def _claim_output(cfg: TrainConfig, out: Path) -> dict | None:
    """Record this run's settings in ``out``; the summary instead when the same run already completed there.

    Raises ConfigError when ``out`` holds a run with other settings.
    """
    run_config_path = out / RUN_CONFIG_FILE
    if run_config_path.exists():
        previous = json.loads(run_config_path.read_text())
        if previous.get("resume_key") != json.loads(json.dumps(cfg.resume_key())):
            changed = sorted(k for k in cfg.resume_key() if previous.get("resume_key", {}).get(k) != cfg.resume_key()[k])
            raise ConfigError(f"{out} holds a run with other settings ({', '.join(changed)}); "
                              "use another --output or delete it")
    summary_path = out / SUMMARY_FILE
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        if summary.get("complete"):
            return summary
    run_config_path.write_text(json.dumps({"resume_key": cfg.resume_key(), "config": dataclasses.asdict(cfg)},
                                          indent=2) + "\n")
    return None


def _drop_log_lines_after(log_path: Path, step: int) -> None:
    """Drop log lines past the checkpoint: the resumed run writes them again, identically."""
    if log_path.exists():
        kept = [line for line in log_path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        log_path.write_text("".join(line + "\n" for line in kept))


def _run_steps(trainer: _Trainer, cache: HiddenCache, plan: list[list[int]], progress: _Progress, out: Path,
               on_step) -> None:
    """Train from ``progress.step`` to the end of ``plan``: log, checkpoint and show progress as configured.

    Every rank runs every step on its share of the batch; only rank 0 writes (log, checkpoint, curve).
    """
    from tqdm import tqdm

    cfg, total_steps, main = trainer.cfg, len(plan), trainer.dist.is_main
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, min(100, round(0.03 * total_steps)))
    feeder = _Feeder(cfg, cache, trainer)
    curve = _LearningCurve(cfg, trainer, out)
    window: list[dict] = []  # the last 20 steps, for the progress bar
    bar = tqdm(total=total_steps, initial=progress.step, unit="step", disable=not (cfg.progress and main),
               dynamic_ncols=True, desc=cfg.method)
    t0, memory = time.monotonic(), 0.0  # memory: peak MB since the last log line
    while progress.step < total_steps:
        lr = lr_at(progress.step, total_steps, cfg.lr, warmup, cfg.min_lr_ratio)
        stats, grad_norm = trainer.step(feeder.micro_batches(plan[progress.step]), lr, feeder.prepare)
        memory = max(memory, peak_memory_mb(trainer.device))
        progress.step += 1
        progress.tokens_seen += int(sum(assistant_tokens(cache.conversations[i]) for i in plan[progress.step - 1]))
        top1 = [h / c if c else 0.0 for h, c in zip(stats["hits"][1], stats["count"])]
        window = (window + [{"loss": stats["loss"], "top1": top1}])[-20:]
        _show_progress(bar, window, cfg.num_heads, progress.tokens_seen)
        step, elapsed = progress.step, progress.elapsed + (time.monotonic() - t0)
        if step % cfg.log_every == 0 or step == total_steps:
            memory = trainer.dist.max(memory, trainer.device)  # the largest rank's
            if main:
                _append_json_line(out / LOG_FILE, {"step": step, "tokens": progress.tokens_seen, "lr": lr,
                                                   "loss": stats["loss"], "top1": top1, "grad_norm": grad_norm,
                                                   "max_memory_mb": memory, "elapsed_s": round(elapsed, 2)})
            memory = 0.0
        if main and (step % cfg.save_every == 0 or step == total_steps):
            trainer.save_state(out / STATE_FILE, progress, progress.elapsed + (time.monotonic() - t0))
        curve.maybe_measure(step, total_steps, progress.tokens_seen)
        if on_step is not None:
            on_step(step)
    bar.close()
    progress.elapsed += time.monotonic() - t0


def _append_json_line(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class _Feeder:
    """This process's micro-batches of one plan batch (:meth:`Distributed.micro_batches`), with the hidden
    states the drafter needs: read from the cache by :func:`collate`, or computed by the target in
    :meth:`prepare` just before the micro-batch runs (``--features online``)."""

    def __init__(self, cfg: TrainConfig, cache: HiddenCache, trainer: _Trainer) -> None:
        self.cfg, self.cache, self.trainer = cfg, cache, trainer
        self.need_input = trainer.drafter.augment is not None  # the Augmenting Block runs on the last layer's input
        self.need_last = not self.need_input or cfg.needs_target_hidden
        self.online = cfg.features == "online"

    def micro_batches(self, indices: list[int]) -> list[Batch]:
        read = not self.online
        return [collate(self.cache, share, self.need_input and read, self.need_last and read, self.trainer.device)
                for share in self.trainer.dist.micro_batches(indices, self.cfg.grad_accum) if share]

    def prepare(self, batch: Batch) -> Batch:
        if not self.online:
            return batch
        x_in, x_last = online_hidden_states(self.trainer.target, batch.tokens, self.need_input, self.need_last)
        return dataclasses.replace(batch, x_in=x_in, x_last=x_last)


class _LearningCurve:
    """Teacher-forced accuracy on held-out data every ``eval_every`` steps, into ``eval_log.jsonl``.

    The proxy for tokens per step against training tokens (training/README.md#learning-curve).
    It reads the weights and changes nothing, so a resumed run still ends bit for bit the same.
    """

    def __init__(self, cfg: TrainConfig, trainer: "_Trainer", out: Path) -> None:
        self.cfg, self.trainer, self.path = cfg, trainer, out / EVAL_LOG_FILE
        wanted = cfg.eval_cache and cfg.eval_every > 0 and trainer.dist.is_main
        self.cache = HiddenCache(cfg.eval_cache) if wanted else None

    def maybe_measure(self, step: int, total_steps: int, tokens: int) -> None:
        if self.cache is None or not (step % self.cfg.eval_every == 0 or step == total_steps):
            return
        from training.evaluate import teacher_forced

        drafter = self.trainer.drafter
        result = teacher_forced(drafter, self.trainer.target, self.cache, device=self.trainer.device,
                                max_conversations=self.cfg.eval_conversations, row_chunk=self.cfg.row_chunk)
        drafter.train()
        line = {"step": step, "tokens": tokens, **{k: result["overall"][k] for k in ("top1", "top5", "agree1")
                                                   if k in result["overall"]}}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _show_progress(bar, window: list[dict], num_heads: int, tokens_seen: int) -> None:
    mean_top1 = [sum(w["top1"][i] for w in window) / len(window) for i in range(num_heads)]
    bar.update(1)
    bar.set_postfix(loss=f"{sum(w['loss'] for w in window) / len(window):.3f}",
                    top1="/".join(f"{a:.2f}" for a in mean_top1), tok=tokens_seen)


def _summary(cfg: TrainConfig, cache: HiddenCache, plan: list[list[int]], progress: _Progress, device: torch.device,
             log_path: Path, world_size: int = 1) -> dict:
    """``training_summary.json`` of a completed run; final loss and top-1 are means over its last 10 log lines."""
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line]
    recent = lines[-10:]
    return {
        "complete": True,
        "method": cfg.method,
        "num_heads": cfg.num_heads,
        "steps": len(plan),
        "assistant_tokens": progress.tokens_seen,
        "planned_assistant_tokens": sum(assistant_tokens(cache.conversations[i]) for batch in plan for i in batch),
        "max_tokens": cfg.max_tokens,
        "epochs": cfg.epochs,
        "wall_time_s": round(progress.elapsed, 1),
        "hardware": _hardware(device),
        "processes": world_size,
        "max_memory_mb": max((r.get("max_memory_mb", 0.0) for r in lines), default=None),  # of any rank
        "torch": torch.__version__,
        "final_loss": sum(r["loss"] for r in recent) / len(recent) if recent else None,
        "final_top1": [sum(r["top1"][i] for r in recent) / len(recent) for i in range(cfg.num_heads)] if recent else None,
        "cache": {"path": str(cfg.cache), "conversations": len(cache), "tokens": cache.index["num_tokens"],
                  "source": cache.index.get("source", "")},
        "target_fingerprint": cache.index["target_fingerprint"],
        "config": dataclasses.asdict(cfg),
        "command": "python training/train.py " + " ".join(sys.argv[1:]) if sys.argv and "train.py" in sys.argv[0] else None,
    }


def run_digest(directory: str | Path) -> str:
    """sha256 of a saved drafter's tensors (names, dtypes, shapes, bytes), for comparing runs.

    Not of the file: safetensors writes its metadata in a random order."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(str(Path(directory) / "model.safetensors")).items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[pre])
    parser.add_argument("--method", choices=DRAFTER_METHODS, required=True)
    parser.add_argument("--cache", required=True,
                        help="hidden-state cache directory (train split); several separated by commas; a distilled "
                             ".jsonl computes the hidden states on the fly instead (no disk); with --features online "
                             "only its tokens are read")
    parser.add_argument("--output", required=True, help="run directory: checkpoints, then the final heads")
    parser.add_argument("--target", default="demo", help="checkpoint directory or 'demo' (only its LM head and shape are used)")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name in ("num_heads", "decoder_heads", "save_every", "log_every", "epochs", "max_tokens", "batch_tokens",
                 "bucket_size", "row_chunk", "seed", "warmup_steps", "threads", "topk_tokens"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=fields[name].default)
    for name in ("lr", "beta1", "beta2", "weight_decay", "min_lr_ratio", "grad_clip", "head_decay", "init_noise_std",
                 "regression_weight", "topk_weight"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=fields[name].default)
    parser.add_argument("--eval-every", type=int, default=0, help="steps between learning-curve points (eval_log.jsonl)")
    parser.add_argument("--eval-conversations", type=int, default=200, help="held-out conversations per curve point")
    parser.add_argument("--eval-cache", default=None, help="held-out hidden-state cache for the learning curve")
    parser.add_argument("--labels", choices=LABELS, default="hard",
                        help="hard: the text's next token; soft: the target's distribution (from the cached last "
                             "hidden state through the frozen norm and LM head)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (GPU when present)")
    parser.add_argument("--autocast", choices=("bf16",), default=None,
                        help="bf16 mixed precision (fp32 weights and loss, bf16 matmuls): several times faster "
                             "on GPUs and on CPUs with AMX or AVX512-BF16, slow on other CPUs")
    parser.add_argument("--features", choices=FEATURE_SOURCES, default="cache",
                        help="cache: read the target's hidden states from --cache; online: run the frozen target in "
                             "each step on the batch's tokens (inference mode; bf16/fp16 on GPU, fp32 on CPU), the "
                             "same loss and data order with no cache on disk (give --cache a distilled .jsonl)")
    parser.add_argument("--target-dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                        help="--features online: the target's dtype; auto: fp32 on CPU, on GPU the checkpoint's "
                             "own bf16/fp16")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per process per step: each step is still one batch of --batch-tokens "
                             "(the global batch, over all torchrun processes), in less memory")
    parser.add_argument("--grad-checkpoint", action="store_true",
                        help="recompute the Augmenting Block in the backward pass instead of storing its "
                             "activations (less memory, one more block forward)")
    parser.add_argument("--draft-vocab", metavar="DIR", default=None,
                        help="score only a draft vocabulary V' in the heads' LM head, as the engine's draft step "
                             "does (FR-Spec): the --draft-vocab-size most frequent ids of DIR's "
                             "draft_vocab.safetensors (training/draft_vocab.py writes one). The soft label is then "
                             "the target's distribution over V'; about V/V' times less LM-head work per step. "
                             "The heads are saved with that vocabulary. Default: the full vocabulary")
    parser.add_argument("--draft-vocab-size", type=int, default=fields["draft_vocab_size"].default,
                        help="V' with --draft-vocab (default %(default)s)")
    parser.add_argument("--init", metavar="DIR", default=None,
                        help="start from these trained heads (a directory save_drafter or a run wrote, e.g. "
                             "clover/assets/smollm2-135m-instruct/clover) instead of a fresh initialisation: "
                             "fine-tuning on new data. Same method and number of heads; the run's own "
                             "--draft-vocab applies. Default: a fresh initialisation")
    parser.add_argument("--token-path", choices=TOKEN_PATHS, default="residual",
                        help="how the regressive step mixes its given token into the state (docs/drafter.md#token-"
                             "path): residual (the paper's: h + gate * Wv e, e unit-norm), normed (the same on the "
                             "RMS-normalised state, e at RMS 1), scaled (residual with e times a learned scalar "
                             "initialised to the median root-state norm), concat (EAGLE-style FC([norm(h); e]))")
    parser.add_argument("--no-progress", action="store_true")
    if known.config:
        defaults = json.loads(Path(known.config).read_text())
        unknown = sorted(set(defaults) - set(fields))
        if unknown:
            parser.error(f"{known.config}: unknown keys {unknown}")
        parser.set_defaults(**defaults)
        for action in parser._actions:  # a config file may supply required options
            if action.dest in defaults:
                action.required = False
    args = parser.parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["progress"] = not args.no_progress
    return TrainConfig(**values)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        summary = train(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted; rerun the same command to resume from the last checkpoint in {cfg.output}",
              file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") == "0":  # torchrun: one summary line, from rank 0
        print(json.dumps({k: summary[k] for k in ("method", "steps", "assistant_tokens", "wall_time_s", "final_loss",
                                                  "final_top1")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
