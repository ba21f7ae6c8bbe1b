"""Llama-family target model with an explicit KV cache.

Parameter names mirror Hugging Face's ``LlamaForCausalLM`` without the
``model.`` prefix, so :func:`hf_to_clover_name` is the whole weight mapping.
Attention goes through the :func:`clover.attention.tree_attention` reference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from clover.attention import InPlaceAttention, tree_attention
from clover.config import ConfigError, TargetConfig, read_json_file


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin ``[B, T, D]`` for positions ``[B, T]`` (Hugging Face's rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, H, D]``; cos/sin ``[B, T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, past_lengths, packed_mask, k_cache, v_cache):
        """x ``[B, T, H]`` -> (out ``[B, T, H]``, present_k, present_v ``[B, Hkv, T, D]``)."""
        batch, num_tokens, _ = x.shape
        q = self.q_proj(x).view(batch, num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(packed_mask, InPlaceAttention):  # the device engine's static cache (docs/gpu-engine.md)
            out = packed_mask.attend(q, k, v, k_cache, v_cache)
        else:
            out = tree_attention(q, k, v, k_cache, v_cache, past_lengths, packed_mask)
        out = self.o_proj(out.reshape(batch, num_tokens, self.num_heads * self.head_dim))
        return out, k.transpose(1, 2), v.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer. Also the Augmenting Block's architecture."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, past_lengths, packed_mask, k_cache, v_cache):
        """x ``[B, T, H]`` -> (x ``[B, T, H]``, present_k, present_v ``[B, Hkv, T, D]``)."""
        attn, present_k, present_v = self.self_attn(
            self.input_layernorm(x), cos, sin, past_lengths, packed_mask, k_cache, v_cache
        )
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present_k, present_v


@dataclasses.dataclass
class TargetOutput:
    """What one target pass produces.

    logits ``[B, T, V]``; last_layer_input and last_hidden ``[B, T, H]`` (the
    input and the output of the last layer, before the final norm);
    present_keys / present_values: one ``[B, Hkv, T, D]`` per layer.
    """

    logits: torch.Tensor
    last_layer_input: torch.Tensor
    last_hidden: torch.Tensor
    present_keys: list[torch.Tensor]
    present_values: list[torch.Tensor]
    layer_inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)  # forward's capture_layers, in order


class LlamaTarget(nn.Module):
    """The frozen target: embeddings, decoder layers, final norm, LM head."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def rope(self, position_ids: torch.Tensor):
        return rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, self.embed_tokens.weight.dtype)

    def forward(self, input_ids, position_ids, past_lengths, packed_mask, k_caches, v_caches,
                capture_layers: tuple[int, ...] | list[int] = ()) -> TargetOutput:
        """One pass over T new tokens per sequence.

        Args:
            input_ids, position_ids: int64 ``[B, T]``.
            past_lengths: int32 ``[B]``; packed_mask: int32 ``[B, T, ceil(T/32)]``.
            k_caches, v_caches: one ``[B, Hkv, S_max, D]`` per layer (read only).
            capture_layers: layers whose inputs ``[B, T, H]`` come back in ``layer_inputs`` (multi-layer features).
        """
        cos, sin = self.rope(position_ids)
        x = self.embed_tokens(input_ids)
        present_keys, present_values, inputs = [], [], {}
        last_input = x
        for i, layer in enumerate(self.layers):
            last_input = x
            if i in capture_layers:
                inputs[i] = x
            x, pk, pv = layer(x, cos, sin, past_lengths, packed_mask, k_caches[i], v_caches[i])
            present_keys.append(pk)
            present_values.append(pv)
        logits = self.lm_head(self.norm(x))
        return TargetOutput(logits, last_input, x, present_keys, present_values, [inputs[i] for i in capture_layers])


# ---------------------------------------------------------------------------
# Hugging Face checkpoint loading


def hf_to_clover_name(name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``layers.0.mlp.up_proj.weight``."""
    return name.removeprefix("model.")


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory}: no *.safetensors weights found (only safetensors checkpoints are supported)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(directory / name))
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise ConfigError(f"{directory / name}: cannot read safetensors file ({exc})") from exc
    return tensors


def load_target_config(directory: str | Path) -> TargetConfig:
    directory = Path(directory)
    hf = read_json_file(directory / "config.json",
                        f"{directory}: not a Hugging Face checkpoint directory (no config.json)")
    return TargetConfig.from_hf(hf)


def load_target(directory: str | Path, dtype: torch.dtype = torch.float32) -> LlamaTarget:
    """Load a Hugging Face Llama-family checkpoint (config.json + safetensors), frozen, in eval mode."""
    directory = Path(directory)
    cfg = load_target_config(directory)
    with torch.device("meta"):
        model = LlamaTarget(cfg)
    state = {hf_to_clover_name(k): v for k, v in _read_safetensors(directory).items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k: v.shape for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if "rotary_emb" not in k)
    if missing or unexpected:
        raise ConfigError(
            f"{directory}: checkpoint does not match its config.json: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ConfigError(f"{directory}: tensor {name} has shape {tuple(state[name].shape)}, config implies {tuple(shape)}")
    model.load_state_dict({k: state[k].to(dtype) for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()


def load_tokenizer(directory: str | Path):
    """The checkpoint's tokenizer (with its chat template) via transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def target_fingerprint(model: LlamaTarget) -> str:
    """A short hash of the target's shape and LM head, recorded in drafter configs.

    It is computed from fp16-rounded values of a few LM-head rows, so a target
    loaded in fp32 or fp16 has the same fingerprint.
    """
    cfg = model.config
    digest = hashlib.sha256()
    shape = [cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim]
    digest.update(json.dumps(shape).encode())
    rows = model.lm_head.weight.detach()[:: max(1, cfg.vocab_size // 16)][:16].cpu()  # one result on any device
    digest.update(rows.to(torch.float16).float().round(decimals=2).numpy().tobytes())
    return digest.hexdigest()[:16]
