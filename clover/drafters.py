"""Draft heads: Clover, the Medusa baseline and the ablations (docs/drafter.md#medusa-baseline-and-ablations).

The shared, frozen LM head is never owned by a drafter: it is passed in as
``lm_head_weight [V, H]``. Head MLPs are stored stacked (``[K, H, H]``) so a
draft step can pick its head with a tensor index (this keeps the ONNX graph a
single graph for every depth).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from clover.config import ConfigError, DrafterConfig, TargetConfig
from clover.target import DecoderLayer, LlamaTarget, RMSNorm, target_fingerprint

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


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
    """

    def __init__(self, hidden_size: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm = RMSNorm(hidden_size, eps)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def reset_parameters(self, noise_std: float) -> None:
        size = self.q_proj.weight.shape[0]
        with torch.no_grad():
            for proj in (self.q_proj, self.k_proj):
                proj.weight.copy_(torch.eye(size) + noise_std * torch.randn(size, size))
            self.v_proj.weight.zero_()

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """hidden, token_embedding ``[N, H]`` -> ``[N, H]``."""
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
        if config.regressive == "attention":
            self.regressive = AttentionDecoder(hidden, config.num_attention_heads, eps)
        elif config.regressive == "mlp":
            self.regressive = MLPRegressive(hidden, eps)
        else:
            self.regressive = None
        self.heads = StackedResBlocks(config.num_heads, hidden)
        self.head_norm = RMSNorm(hidden, eps)
        if config.method == "medusa":
            self.head_norm.requires_grad_(False)

    @property
    def is_medusa(self) -> bool:
        return self.config.method == "medusa"

    @classmethod
    def untrained(cls, target: LlamaTarget, method: str = "clover", num_heads: int = 3) -> "Drafter":
        """Heads of ``method`` sized for ``target`` with the paper's initialisation (:meth:`from_target`), in eval mode."""
        cfg = target.config
        config = DrafterConfig(method=method, num_heads=num_heads, hidden_size=cfg.hidden_size,
                               vocab_size=cfg.vocab_size, target_num_layers=cfg.num_layers)
        return cls.from_target(config, target).eval()

    @classmethod
    def from_target(cls, config: DrafterConfig, target: LlamaTarget, seed: int = 0) -> "Drafter":
        """The paper's initialisation on top of ``target``.

        The Augmenting Block is an exact copy of the target's last layer, the
        norms copy the final norm, ResBlocks are zero, the Attention Decoder is
        identity plus noise with Wv = 0. The target fingerprint is recorded.
        """
        check_compatible(config, target)
        config.target_fingerprint = config.target_fingerprint or target_fingerprint(target)
        torch.manual_seed(seed)
        drafter = cls(config, target.config).to(target.lm_head.weight.dtype)
        with torch.no_grad():
            if drafter.augment is not None:
                drafter.augment.load_state_dict(target.layers[-1].state_dict())
            drafter.head_norm.weight.copy_(target.norm.weight)
            if drafter.regressive is not None:
                drafter.regressive.norm.weight.copy_(target.norm.weight)
                drafter.regressive.reset_parameters(config.init_noise_std)
        return drafter

    def embed(self, token: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Regressive embedding ``normalize(W_lm[token])``: token ``[N]`` -> ``[N, H]``."""
        return nn.functional.normalize(lm_head_weight[token], dim=-1)

    def step(self, hidden, token, head, lm_head_weight):
        """One regressive draft step for N nodes.

        Args:
            hidden: ``[N, H]``, ``h_{i-1}`` (``h0`` for the root).
            token: int64 ``[N]``, the node's own token ``tok_{i-1}``.
            head: scalar index i-1 of the head to apply.
            lm_head_weight: the target's frozen LM head ``[V, H]``.
        Returns:
            next_hidden ``[N, H]`` (``h_i``, the hidden state the node's children
            continue from) and logits ``[N, V]`` for the token i+1 places after
            the last accepted position.
        """
        next_hidden, _, logits = self.step_with_feature(hidden, token, head, lm_head_weight)
        return next_hidden, logits

    def step_with_feature(self, hidden, token, head, lm_head_weight):
        """:meth:`step` plus the head's feature ``[N, H]``: the ResBlock's output, which training
        regresses onto the target's last hidden state (Clover-2; training/train.py ``--regression-weight``).

        Clover's feature is pre-norm (its ``head_norm`` follows), like the target's last hidden state;
        Medusa's is post-norm (its frozen ``head_norm`` comes first), like ``norm(last hidden)``.
        """
        if self.is_medusa:
            feature = self.heads(self.head_norm(hidden), head)
            return hidden, feature, feature @ lm_head_weight.T
        next_hidden = hidden
        if self.regressive is not None:
            next_hidden = self.regressive(hidden, self.embed(token, lm_head_weight))
        feature = self.heads(next_hidden, head)
        return next_hidden, feature, self.head_norm(feature) @ lm_head_weight.T


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


def save_drafter(drafter: Drafter, directory: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (optionally cast, e.g. fp16)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    drafter.config.save(directory / CONFIG_FILE)
    state = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})  # one key: reproducible bytes


def load_drafter(directory: str | Path, target: LlamaTarget) -> Drafter:
    """Load heads saved by :func:`save_drafter`, checking they belong to ``target``."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG_FILE).exists():
        raise ConfigError(f"{directory}: not a drafter directory (no {CONFIG_FILE})")
    try:
        config = DrafterConfig.load(directory / CONFIG_FILE)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ConfigError(f"{directory / CONFIG_FILE}: invalid drafter config ({exc})") from exc
    check_compatible(config, target, source=f"drafter {directory}")
    drafter = Drafter(config, target.config)
    dtype = target.lm_head.weight.dtype
    state = load_file(str(directory / WEIGHTS_FILE))
    try:
        drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    except RuntimeError as exc:
        raise ConfigError(f"{directory}: weights do not match config.json ({exc})") from exc
    drafter.to(dtype)
    drafter.requires_grad_(False)
    return drafter.eval()
