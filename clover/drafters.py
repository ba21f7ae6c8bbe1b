"""Draft heads: Clover, Clover-2, the Medusa baseline and the ablations (docs/drafter.md#medusa-baseline-and-ablations).

The shared, frozen LM head is never owned by a drafter: it is passed in as
``lm_head_weight [V, H]``. Head MLPs are stored stacked (``[K, H, H]``) so a
draft step can pick its head with a tensor index (this keeps the ONNX graph a
single graph for every depth).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from torch import nn

from clover.config import ConfigError, DrafterConfig, TargetConfig, drafter_has_draft_prefill
from clover.target import DecoderLayer, LlamaTarget, RMSNorm, rope_cos_sin, target_fingerprint

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # token ids, most frequent first (training/draft_vocab.py)


class StackedResBlocks(nn.Module):
    """K Medusa ResBlocks ``x + SiLU(W_i x + b_i)``, zero-initialised (identity at start)."""

    def __init__(self, num_heads: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))

    def forward(self, x: torch.Tensor, head: torch.Tensor | int) -> torch.Tensor:
        """x ``[N, H]``, head a scalar index -> ``[N, H]``."""
        return x + nn.functional.silu(x @ self.weight[head].transpose(0, 1) + self.bias[head])


class AttentionDecoder(nn.Module):
    """Regressive Attention Decoder: ``h_i = h_{i-1} + concat_h(cos(q_h, k_h) * v_h)``.

    ``q = Wq norm(h_{i-1})``, ``k = Wk e_{i-1}``, ``v = Wv e_{i-1}``. With one key
    a softmax would be identically 1, so the per-head weight is the cosine
    similarity of q and k (as in the public Clover-2 code): q and k get gradients.
    Init: Wq = Wk = I + noise, Wv = 0, so ``h_i = h_{i-1}`` at the start.

    Token paths (``DrafterConfig.token_path``, docs/drafter.md#token-path): ``normalize_input`` first
    RMS-normalises ``h_{i-1}`` (``input_norm``, weights ones), so the residual lives in the normalised space;
    ``learned_token_scale`` multiplies the embedding by a trained scalar (``token_scale``).
    """

    def __init__(self, hidden_size: int, num_heads: int, eps: float, normalize_input: bool = False,
                 learned_token_scale: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm = RMSNorm(hidden_size, eps)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.input_norm = RMSNorm(hidden_size, eps) if normalize_input else None
        self.token_scale = nn.Parameter(torch.ones(())) if learned_token_scale else None

    def reset_parameters(self, noise_std: float) -> None:
        size = self.q_proj.weight.shape[0]
        with torch.no_grad():
            for proj in (self.q_proj, self.k_proj):
                proj.weight.copy_(torch.eye(size) + noise_std * torch.randn(size, size))
            self.v_proj.weight.zero_()
            if self.input_norm is not None:
                self.input_norm.weight.fill_(1.0)

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """hidden, token_embedding ``[N, H]`` -> ``[N, H]``."""
        if self.input_norm is not None:
            hidden = self.input_norm(hidden)
        if self.token_scale is not None:
            token_embedding = token_embedding * self.token_scale
        n, size = hidden.shape
        split = (n, self.num_heads, size // self.num_heads)
        q = self.q_proj(self.norm(hidden)).view(split)
        k = self.k_proj(token_embedding).view(split)
        v = self.v_proj(token_embedding).view(split)
        gate = nn.functional.cosine_similarity(q, k, dim=-1, eps=1e-6)  # [N, heads]
        return hidden + (gate[..., None] * v).reshape(n, size)


class MLPRegressive(nn.Module):
    """Ablation: ``h_i = h_{i-1} + W2 SiLU(W1 [norm(h_{i-1}); e_{i-1}])``, W2 zero-initialised."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.up = nn.Linear(2 * hidden_size, hidden_size)
        self.down = nn.Linear(hidden_size, hidden_size)

    def reset_parameters(self, noise_std: float) -> None:
        with torch.no_grad():
            self.down.weight.zero_()
            self.down.bias.zero_()

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.norm(hidden), token_embedding], dim=-1)
        return hidden + self.down(nn.functional.silu(self.up(x)))


class ConcatRegressive(nn.Module):
    """EAGLE-style token path: ``h_i = FC([norm(h_{i-1}); e_{i-1}])`` (``token_path`` ``concat``).

    ``norm`` (``input_norm``) starts at ones and FC at ``[I, 0]``, so ``h_i = norm(h_{i-1})`` at the start:
    the same first logits as the other paths (``head_norm`` follows the heads).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.input_norm = RMSNorm(hidden_size, eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size)

    def reset_parameters(self, noise_std: float) -> None:
        size = self.fc.weight.shape[0]
        with torch.no_grad():
            self.input_norm.weight.fill_(1.0)
            self.fc.weight.zero_()
            self.fc.weight[:, :size].copy_(torch.eye(size))  # exact: no symmetry to break in one linear map
            self.fc.bias.zero_()

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.input_norm(hidden), token_embedding], dim=-1))


class Drafter(nn.Module):
    """Draft heads for one target.

    * ``augment``: the Augmenting Block, one extra decoder layer fed the input of
      the target's last layer (a trainable fork beside it). None for Medusa and
      ``clover-no-augment``; then ``h0`` is the target's last hidden state.
    * ``regressive``: Attention Decoder, MLP (ablation) or None.
    * ``heads``: K ResBlocks. ``head_norm``: a copy of the final norm; Clover
      applies it after the ResBlock (trainable), Medusa before it (frozen).
    """

    def __init__(self, config: DrafterConfig, target_config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, target_config.rms_norm_eps
        self.augment = DecoderLayer(target_config) if config.has_augmenting_block else None
        layers = config.feature_layers or []
        # multi-layer features (docs/drafter.md#multi-layer-features): [h_l1; h_l2; ...] -> the block's input
        self.feature_fuse = nn.Linear(len(layers) * hidden, hidden, bias=False) if layers else None
        if config.regressive == "attention":
            self.regressive = AttentionDecoder(hidden, config.num_attention_heads, eps, config.normalizes_state,
                                               config.token_embedding_scale == "learned")
        elif config.regressive == "concat":
            self.regressive = ConcatRegressive(hidden, eps)
        elif config.regressive == "mlp":
            self.regressive = MLPRegressive(hidden, eps)
        else:
            self.regressive = None
        self.heads = StackedResBlocks(config.num_heads, hidden)
        self.head_norm = RMSNorm(hidden, eps)
        if config.is_medusa:
            self.head_norm.requires_grad_(False)

    @property
    def is_medusa(self) -> bool:
        return self.config.is_medusa

    # capability (docs/engine-contract.md#version-2-draft_prefill): Clover-2 overrides it
    has_draft_prefill = False

    @classmethod
    def untrained(cls, target: LlamaTarget, method: str = "clover", num_heads: int = 3) -> "Drafter":
        """Heads of ``method`` sized for ``target`` with the paper's initialisation (:meth:`from_target`), in eval mode."""
        return cls.from_target(new_drafter_config(method, num_heads, target), target).eval()

    @classmethod
    def from_target(cls, config: DrafterConfig, target: LlamaTarget, seed: int = 0) -> "Drafter":
        """The paper's initialisation on top of ``target`` (the one factory of every method: ``clover2``
        config gives a :class:`Clover2Drafter`).

        The Augmenting Block is an exact copy of the target's last layer, the
        norms copy the final norm, ResBlocks are zero, the Attention Decoder is
        identity plus noise with Wv = 0. The target fingerprint is recorded.
        """
        check_compatible(config, target)
        config.target_fingerprint = config.target_fingerprint or target_fingerprint(target)
        torch.manual_seed(seed)
        if config.has_draft_prefill:
            return Clover2Drafter(config, target.config).to(target.lm_head.weight.dtype).init_from(target)
        drafter = Drafter(config, target.config).to(target.lm_head.weight.dtype)
        with torch.no_grad():
            if drafter.augment is not None:
                drafter.augment.load_state_dict(target.layers[-1].state_dict())
            if drafter.feature_fuse is not None:  # starts by passing the highest layer's input: the one-layer block
                size = config.hidden_size
                drafter.feature_fuse.weight.zero_()
                drafter.feature_fuse.weight[:, -size:].copy_(torch.eye(size))
            drafter.head_norm.weight.copy_(target.norm.weight)
            if drafter.regressive is not None:
                if hasattr(drafter.regressive, "norm"):
                    drafter.regressive.norm.weight.copy_(target.norm.weight)
                drafter.regressive.reset_parameters(config.init_noise_std)
        return drafter

    def augment_input(self, features: torch.Tensor) -> torch.Tensor:
        """The Augmenting Block's input ``[..., H]`` from the target's features: the last layer's input
        ``[..., H]``, or with ``feature_layers`` the inputs of those layers concatenated in their order
        ``[..., k*H]``, fused by a learned linear map (EAGLE-3's FC)."""
        return features if self.feature_fuse is None else self.feature_fuse(features)

    def embed(self, token: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Regressive embedding ``normalize(W_lm[token])``: token ``[N]`` -> ``[N, H]``; times sqrt(H) (RMS 1)
        for the token paths that mix it into a normalised state (``DrafterConfig.token_embedding_scale``)."""
        unit = nn.functional.normalize(lm_head_weight[token], dim=-1)
        return unit * self.config.hidden_size ** 0.5 if self.config.token_embedding_scale == "rms" else unit

    def step(self, hidden, token, head, lm_head_weight, output_weight=None):
        """One regressive draft step for N nodes.

        Args:
            hidden: ``[N, H]``, ``h_{i-1}`` (``h0`` for the root).
            token: int64 ``[N]``, the node's own token ``tok_{i-1}``.
            head: scalar index i-1 of the head to apply.
            lm_head_weight: the target's frozen LM head ``[V, H]`` (its rows are also the token embeddings).
            output_weight: the rows to score, ``[V', H]``: the LM head's rows of a draft vocabulary
                (docs/drafter.md#draft-vocabulary); default ``lm_head_weight``.
        Returns:
            next_hidden ``[N, H]`` (``h_i``, the hidden state the node's children
            continue from) and logits ``[N, V]`` (``[N, V']``) for the token i+1 places after
            the last accepted position.
        """
        next_hidden, _, logits = self.step_with_feature(hidden, token, head, lm_head_weight, output_weight)
        return next_hidden, logits

    def step_with_feature(self, hidden, token, head, lm_head_weight, output_weight=None):
        """:meth:`step` plus the head's feature ``[N, H]``: the ResBlock's output, which training
        regresses onto the target's last hidden state (Clover-2; training/train.py ``--regression-weight``).

        Clover's feature is pre-norm (its ``head_norm`` follows), like the target's last hidden state;
        Medusa's is post-norm (its frozen ``head_norm`` comes first), like ``norm(last hidden)``.
        """
        scored = lm_head_weight if output_weight is None else output_weight  # [V or V', H]
        if self.is_medusa:
            feature = self.heads(self.head_norm(hidden), head)
            return hidden, feature, feature @ scored.T
        next_hidden = hidden
        if self.regressive is not None:
            next_hidden = self.regressive(hidden, self.embed(token, lm_head_weight))
        feature = self.heads(next_hidden, head)
        return next_hidden, feature, self.head_norm(feature) @ scored.T


class CosineGatedBlock(nn.Module):
    """Clover-2's token mixer: ``h + concat_heads(cos(q_h, k_h) * v_h)`` with ``q = Wq norm(h) + bq``,
    ``k = Wk e + bk``, ``v = Wv e + bv`` (its ``ResAttentionBlock``; like :class:`AttentionDecoder` with biases
    and its initialisation: Wq = Wk = I + U(0, 0.01), Wv = U(0, 0.01), biases 0)."""

    def __init__(self, hidden_size: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads, self.eps = num_heads, eps
        self.norm = RMSNorm(hidden_size, eps)
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)

    def reset_parameters(self, noise: float) -> None:
        size = self.q_proj.weight.shape[0]
        with torch.no_grad():
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.uniform_(proj.weight, 0.0, noise)
                nn.init.zeros_(proj.bias)
            for proj in (self.q_proj, self.k_proj):
                proj.weight.add_(torch.eye(size))

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """hidden, token_embedding ``[..., H]`` -> ``[..., H]``."""
        split = (*hidden.shape[:-1], self.num_heads, hidden.shape[-1] // self.num_heads)
        q = self.q_proj(self.norm(hidden)).view(split)
        k = self.k_proj(token_embedding).view(split)
        v = self.v_proj(token_embedding).view(split)
        gate = nn.functional.cosine_similarity(q, k, dim=-1, eps=self.eps)  # [..., heads]
        return hidden + (gate[..., None] * v).reshape(hidden.shape)


class Clover2Drafter(nn.Module):
    """Clover-2 (arXiv 2408.00264; docs/drafter.md#clover-2).

    ``prefill`` runs once per decode step over the positions accepted in it: at
    position t it RMS-normalises the target's last hidden state (``input_norm``)
    and mixes the embedding of token t+1 into it (``token_mixer``), then ``block``
    (``block_layers`` decoder layers initialised from the target's last layer)
    runs causally with its own KV cache, then ``block_norm``. The state at the
    last accepted position is the tree root's. ``step`` is the per-node RNN:
    head 0 reads ``[root state; embedding of the root token]`` through
    ``first_head``; deeper heads mix the node's token into the state (``rnn``)
    and read ``[state; token embedding]`` through ``rnn_head``. Token embeddings
    are the frozen LM-head rows, as in the public code (a frozen copy of
    ``lm_head``), so the drafter adds no vocabulary-sized weights.

    Two deviations from the public code, both measured (docs/drafter.md#clover-2):
    the mixer reads the normalised state (the raw one drowns the token: 0.25 % of
    its norm on the demo target) and head 0 reads the root token's embedding as
    the deeper heads read theirs (head-1 agreement 0.079 against 0.041 after the
    same 25 steps).
    """

    has_draft_prefill = True
    augment = None  # no block inside the target pass: the target's h0 is its last hidden state
    is_medusa = False

    def __init__(self, config: DrafterConfig, target_config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, target_config.rms_norm_eps
        self.head_dim, self.rope_theta = target_config.head_dim, target_config.rope_theta
        self.input_norm = RMSNorm(hidden, eps)
        self.token_mixer = CosineGatedBlock(hidden, config.num_attention_heads, eps)
        self.block = nn.ModuleList(DecoderLayer(target_config) for _ in range(config.block_layers))
        self.block_norm = RMSNorm(hidden, eps)
        self.first_head = nn.Linear(2 * hidden, hidden)
        self.rnn = CosineGatedBlock(hidden, config.num_attention_heads, eps)
        self.rnn_head = nn.Linear(2 * hidden, hidden)
        self.head_norm = RMSNorm(hidden, eps)

    def init_from(self, target: LlamaTarget) -> "Clover2Drafter":
        """The public code's initialisation where the layers match (docs/drafter.md#clover-2): block layers
        copy the target's last layer, the mixers are identity plus U(0, 0.01) noise, ``first_head`` and
        ``rnn_head`` are ``[I, 0]`` + U(0, 0.01) (they start by passing the state through). ``input_norm``
        and ``block_norm`` start at ones, so the final norm's weights are applied once (by ``head_norm``)."""
        noise = self.config.init_noise_std
        with torch.no_grad():
            for layer in self.block:
                layer.load_state_dict(target.layers[-1].state_dict())
            for norm in (self.head_norm, self.token_mixer.norm, self.rnn.norm):
                norm.weight.copy_(target.norm.weight)
            self.block_norm.weight.fill_(1.0)
            self.input_norm.weight.fill_(1.0)
            self.token_mixer.reset_parameters(noise)
            self.rnn.reset_parameters(noise)
            size = self.config.hidden_size
            for linear in (self.first_head, self.rnn_head):
                nn.init.uniform_(linear.weight, 0.0, noise)
                nn.init.zeros_(linear.bias)
                linear.weight[:, :size].add_(torch.eye(size, dtype=linear.weight.dtype))
        return self

    @property
    def num_kv_layers(self) -> int:
        return len(self.block)

    def prefill(self, hidden, next_token, position_ids, past_lengths, packed_mask, k_caches, v_caches,
                lm_head_weight):
        """The token-aware Augmenting Block over T new positions per sequence.

        Args:
            hidden: ``[B, T, H]``, the target's last hidden state (before its final norm) at the positions
                (``input_norm`` normalises it).
            next_token: int64 ``[B, T]``, the token that follows each position.
            position_ids: int64 ``[B, T]``; past_lengths: int32 ``[B]``; packed_mask: int32 ``[B, T, ceil(T/32)]``.
            k_caches, v_caches: the block's cache, one ``[B, Hkv, S_max, D]`` per block layer (read only).
        Returns:
            state ``[B, T, H]`` (the root state of a tree grown after that position), and the new tokens'
            keys and values, one ``[B, Hkv, T, D]`` per block layer.
        """
        x = self.token_mixer(self.input_norm(hidden), lm_head_weight[next_token])
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta, x.dtype)
        present_keys, present_values = [], []
        for layer, k_cache, v_cache in zip(self.block, k_caches, v_caches):
            x, pk, pv = layer(x, cos, sin, past_lengths, packed_mask, k_cache, v_cache)
            present_keys.append(pk)
            present_values.append(pv)
        return self.block_norm(x), present_keys, present_values

    def step(self, hidden, token, head, lm_head_weight, output_weight=None):
        """One draft step, as :meth:`Drafter.step`: (next_hidden ``[N, H]``, logits ``[N, V]`` or ``[N, V']``)."""
        next_hidden, _, logits = self.step_with_feature(hidden, token, head, lm_head_weight, output_weight)
        return next_hidden, logits

    def step_with_feature(self, hidden, token, head, lm_head_weight, output_weight=None):
        """:meth:`step` plus the feature before ``head_norm`` (regressed onto the target's last hidden state).

        Head 0's state already mixed its token in (the prefill did), so ``rnn`` does not run for it; its
        ``first_head`` reads the token's embedding beside the state. A tensor ``head`` (the exported graph)
        computes both branches and selects, so one graph serves every depth.
        """
        embedding = lm_head_weight[token]  # [N, H]
        if isinstance(head, int) and head == 0:
            feature, next_hidden = self.first_head(torch.cat([hidden, embedding], dim=-1)), hidden
        else:
            next_hidden = self.rnn(hidden, embedding)
            feature = self.rnn_head(torch.cat([next_hidden, embedding], dim=-1))
            if not isinstance(head, int):
                first = head == 0
                feature = torch.where(first, self.first_head(torch.cat([hidden, embedding], dim=-1)), feature)
                next_hidden = torch.where(first, hidden, next_hidden)
        scored = lm_head_weight if output_weight is None else output_weight  # [V or V', H]: a draft vocabulary's rows
        return next_hidden, feature, self.head_norm(feature) @ scored.T


def calibrate_token_scale(drafter: nn.Module, h0: torch.Tensor) -> float | None:
    """Initialise a learned token scale (``token_path`` ``scaled``) to the median norm of root states ``h0``
    ``[N, H]``, so the unit-norm embedding enters at the state's own scale; returns it (None: no such scale)."""
    scale = getattr(getattr(drafter, "regressive", None), "token_scale", None)
    if scale is None:
        return None
    with torch.no_grad():
        scale.fill_(float(h0.float().norm(dim=-1).median()))
    return float(scale.detach())


def new_drafter_config(method: str, num_heads: int, target: LlamaTarget, **fields) -> DrafterConfig:
    """A drafter config sized for ``target``; Clover-2's mixers get the target's attention head count."""
    cfg = target.config
    if drafter_has_draft_prefill(method):
        fields.setdefault("num_attention_heads", cfg.num_heads)
    return DrafterConfig(method=method, num_heads=num_heads, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                         target_num_layers=cfg.num_layers, **fields)


def drafter_class(config: DrafterConfig) -> type[nn.Module]:
    return Clover2Drafter if config.has_draft_prefill else Drafter


def check_compatible(config: DrafterConfig, target: LlamaTarget, source: str = "drafter") -> None:
    """Raise :class:`ConfigError` when heads were made for another target."""
    tc = target.config
    problems = []
    if config.hidden_size != tc.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target's {tc.hidden_size}")
    if config.vocab_size != tc.vocab_size:
        problems.append(f"vocab size {config.vocab_size} != target's {tc.vocab_size}")
    if config.target_num_layers != tc.num_layers:
        problems.append(f"layer count {config.target_num_layers} != target's {tc.num_layers}")
    if not problems and config.target_fingerprint:
        actual = target_fingerprint(target)
        if config.target_fingerprint != actual:
            problems.append(f"target fingerprint {config.target_fingerprint} != this target's {actual}")
    if problems:
        raise ConfigError(f"{source} was trained for a different target: " + "; ".join(problems))


def draft_vocab_of(drafter: nn.Module) -> torch.Tensor | None:
    """The target token ids a drafter's heads score, int64 ``[V']`` (most frequent first), or None for the full
    vocabulary (docs/drafter.md#draft-vocabulary). Any drafter class: :func:`set_draft_vocab` sets it."""
    return getattr(drafter, "draft_vocab", None)


def set_draft_vocab(drafter: nn.Module, token_ids: torch.Tensor | None) -> None:
    """Let the heads score only ``token_ids`` (``[V']``, target ids; None: the full vocabulary).

    Only the draft step's proposals change; verification still uses the target's full LM head, so decoding
    stays lossless. ``config.draft_vocab_size`` follows (engines record it in ``engine.json``).
    """
    config = drafter.config
    if token_ids is not None:
        if "output_weight" not in inspect.signature(drafter.step).parameters:
            raise ConfigError(f"{config.method} heads cannot score a draft vocabulary yet (their step takes no "
                              "output_weight); use the full vocabulary (--draft-vocab 0)")
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if not len(token_ids) or int(token_ids.min()) < 0 or int(token_ids.max()) >= config.vocab_size:
            raise ConfigError(f"a draft vocabulary needs 1 to {config.vocab_size} ids in [0, {config.vocab_size})")
        if len(torch.unique(token_ids)) != len(token_ids):
            raise ConfigError("the draft vocabulary repeats token ids")
    drafter.register_buffer("draft_vocab", token_ids, persistent=False)  # not in model.safetensors
    config.draft_vocab_size = 0 if token_ids is None else len(token_ids)


def save_draft_vocab(directory: str | Path, token_ids: torch.Tensor, counts: torch.Tensor | None = None,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write ``draft_vocab.safetensors``: ``token_ids`` int64 ``[L]`` most frequent first (and their counts)."""
    from safetensors.torch import save_file

    tensors = {"token_ids": torch.as_tensor(token_ids, dtype=torch.long).contiguous()}
    if counts is not None:
        tensors["counts"] = torch.as_tensor(counts, dtype=torch.long).contiguous()
    path = Path(directory) / DRAFT_VOCAB_FILE
    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})
    return path


def read_draft_vocab(directory: str | Path, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids of ``directory``'s draft vocabulary, int64 ``[size]``."""
    from safetensors.torch import load_file

    path = Path(directory) / DRAFT_VOCAB_FILE
    if size < 1:
        raise ConfigError(f"a draft vocabulary needs at least one token, not {size}")
    if not path.exists():
        raise ConfigError(f"{directory}: a draft vocabulary of {size} tokens needs {DRAFT_VOCAB_FILE}; "
                          "write one with training/draft_vocab.py, or use the full vocabulary (--draft-vocab 0)")
    ranking = load_file(str(path))["token_ids"]
    if size > len(ranking):
        raise ConfigError(f"{path} ranks only {len(ranking)} tokens, fewer than the {size} asked for")
    return ranking[:size]


def save_drafter(drafter: Drafter, directory: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (optionally cast, e.g. fp16), and the draft vocabulary
    ``draft_vocab.safetensors`` when the heads have one."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    drafter.config.save(directory / CONFIG_FILE)
    state = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})  # one key: reproducible bytes
    if draft_vocab_of(drafter) is not None:
        save_draft_vocab(directory, draft_vocab_of(drafter))


def load_drafter(directory: str | Path, target: LlamaTarget, draft_vocab_size: int | None = None) -> Drafter:
    """Load heads saved by :func:`save_drafter`, checking they belong to ``target``.

    ``draft_vocab_size``: score only that many most frequent tokens of the heads' ``draft_vocab.safetensors``
    (0: the full vocabulary); default: ``config.json``'s ``draft_vocab_size``.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG_FILE).exists():
        raise ConfigError(f"{directory}: not a drafter directory (no {CONFIG_FILE})")
    try:
        config = DrafterConfig.load(directory / CONFIG_FILE)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ConfigError(f"{directory / CONFIG_FILE}: invalid drafter config ({exc})") from exc
    check_compatible(config, target, source=f"drafter {directory}")
    drafter = drafter_class(config)(config, target.config)
    dtype = target.lm_head.weight.dtype
    state = load_file(str(directory / WEIGHTS_FILE))
    try:
        drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    except RuntimeError as exc:
        raise ConfigError(f"{directory}: weights do not match config.json ({exc})") from exc
    drafter.to(dtype)
    drafter.requires_grad_(False)
    size = config.draft_vocab_size if draft_vocab_size is None else draft_vocab_size
    set_draft_vocab(drafter, read_draft_vocab(directory, size) if size else None)
    return drafter.eval()
