"""``target_native.safetensors``: the exact int8 CPU target's weights (docs/quantized-target.md#the-exact-int8-engine).

What :class:`clover.kernels.cpu_target.NativeTarget` reads, written at build time from the stored Q4_1 / Q8_0
blocks (:mod:`clover.export.target_weights`: the demo GGUF's own bytes), unchanged: q/k/v and gate/up rows
concatenated per layer (a block runs along the input, so rows move whole), the tied embedding as the LM head's
Q8_0 blocks, fp32 norms and rotary tables. The Augmenting Block and the feature fuse, which only shape
proposals, are quantised to Q8_0 by the ``gguf`` package. Every matrix is stored in the kernel's repacked layout
(:func:`clover.kernels.cpu_target.repack`: the same blocks, 8 columns interleaved), the embedding in GGUF rows
(a token reads one row). The shape of the model and the layout's version go in the file's metadata; a file of
another layout version is refused with the command that rebuilds it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from clover.config import ConfigError
from clover.export.target_weights import StoredWeight, concat_rows, quantize_gguf
from clover.kernels.cpu_target import LAYOUT_VERSION, repack

FILE = "target_native.safetensors"
FORMATS = ("q4_1", "q8_0")


def native_target_supported(cfg, weights: dict[str, StoredWeight] | None, drafter=None) -> str | None:
    """None where the native target can hold this model, else why not (one line)."""
    if weights is None or any(w.format not in FORMATS for w in weights.values()):  # {}: not read yet
        return "the exact int8 target reads Q4_1 / Q8_0 blocks (--target-weights q4)"
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        return "the exact int8 target has no linear biases"
    if cfg.head_dim % 16 or cfg.head_dim > 256:
        return f"the exact int8 target takes head sizes that are multiples of 16 up to 256 (this one: {cfg.head_dim})"
    if drafter is not None and drafter.config.has_draft_prefill:
        return "the exact int8 target runs Clover and Medusa heads (not Clover-2's draft prefill)"
    return None


def _stored(block: StoredWeight) -> np.ndarray:
    return np.ascontiguousarray(block.data, np.uint8)


def _packed(block: StoredWeight) -> np.ndarray:
    return repack(block.data, block.format, *block.shape)


def _q8(module_weight) -> StoredWeight:
    return quantize_gguf(module_weight.detach().float().numpy(), "q8_0")


def _layer_tensors(prefix: str, linears: dict[str, StoredWeight], layer) -> dict[str, np.ndarray]:
    """One decoder layer: ``linears`` by clover name (``self_attn.q_proj`` ...), norms from ``layer``."""
    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    return {f"{prefix}.qkv": _packed(concat_rows([linears[n] for n in attn])),
            f"{prefix}.o": _packed(linears["self_attn.o_proj"]),
            f"{prefix}.gate_up": _packed(concat_rows([linears["mlp.gate_proj"], linears["mlp.up_proj"]])),
            f"{prefix}.down": _packed(linears["mlp.down_proj"]),
            f"{prefix}.attn_norm": layer.input_layernorm.weight.detach().float().numpy(),
            f"{prefix}.mlp_norm": layer.post_attention_layernorm.weight.detach().float().numpy()}


def _rope_tables(cfg, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin ``[max_positions, D/2]`` computed as the torch target does (:func:`clover.target.rope_cos_sin`)."""
    import torch

    from clover.target import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(max_positions)[None], cfg.head_dim, cfg.rope_theta, torch.float32)
    half = cfg.head_dim // 2
    return cos[0, :, :half].numpy().copy(), sin[0, :, :half].numpy().copy()


def native_tensors(model, drafter, weights: dict[str, StoredWeight], max_positions: int):
    """(tensors, config) of the native target of ``model`` (+ ``drafter``'s Augmenting Block)."""
    cfg = model.config
    reason = native_target_supported(cfg, weights, drafter)
    if reason:
        raise ConfigError(reason)
    tensors, formats = {}, {}
    for i, layer in enumerate(model.layers):
        linears = {name.split(f"layers.{i}.", 1)[1].removesuffix(".weight"): w
                   for name, w in weights.items() if name.startswith(f"layers.{i}.")}
        tensors.update(_layer_tensors(f"layers.{i}", linears, layer))
        formats[f"layers.{i}"] = _single_format([linears[n] for n in linears])
    lm_head = weights["lm_head.weight"]
    tensors["lm_head"], formats["lm_head"] = _packed(lm_head), lm_head.format
    tied_q8 = cfg.tie_word_embeddings and lm_head.format == "q8_0"
    tensors["embedding"] = _stored(lm_head) if tied_q8 else _stored(_q8(model.embed_tokens.weight))
    tensors["final_norm"] = model.norm.weight.detach().float().numpy()
    tensors["rope_cos"], tensors["rope_sin"] = _rope_tables(cfg, max_positions)
    augment = drafter.augment if drafter is not None else None
    feature_layers = []
    if augment is not None:
        linears = {name: _q8(module.weight) for name, module in augment.named_modules()
                   if name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        tensors.update(_layer_tensors("augment", linears, augment))
        formats["augment"] = "q8_0"
        if drafter.feature_fuse is not None:
            tensors["feature_fuse"] = _packed(_q8(drafter.feature_fuse.weight))
            feature_layers = list(drafter.config.feature_layers)
    config = {**{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                              "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps")},
              "augment": augment is not None, "feature_layers": feature_layers, "formats": formats,
              "layout_version": LAYOUT_VERSION}
    return tensors, config


def _single_format(linears: list[StoredWeight]) -> str:
    formats = {w.format for w in linears}
    if len(formats) != 1:
        raise ConfigError(f"a layer's linears must share one block format for the exact int8 target, not {formats}")
    return formats.pop()


def write_native_target(directory: Path, model, drafter, weights: dict[str, StoredWeight], max_positions: int) -> dict:
    """Write :data:`FILE` into ``directory``; returns its config (also in the file's metadata)."""
    from safetensors.numpy import save_file

    tensors, config = native_tensors(model, drafter, weights, max_positions)
    save_file(tensors, str(Path(directory) / FILE), metadata={"config": json.dumps(config)})
    return config


def native_config(path: Path) -> dict:
    """The config in a :data:`FILE`'s metadata (no tensors read); ``layout_version`` 1 where it predates them."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return {"layout_version": 1, **json.loads(f.metadata()["config"])}


def read_native_target(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, config) of a :data:`FILE`; ConfigError (one line, with the rebuild) for another layout version."""
    from safetensors.numpy import load_file

    config = native_config(path)
    version = config["layout_version"]
    if version != LAYOUT_VERSION:
        raise ConfigError(f"{path}: the exact int8 target's weights are in layout {version}, this Clover reads "
                          f"layout {LAYOUT_VERSION}; rebuild the engine (clover build --output "
                          f"{Path(path).parent} ... with the options it was built with)")
    return load_file(str(path)), config
