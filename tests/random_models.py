"""Tiny random models (no downloads), shared by the tests and scripts/gpu_check.py.

A plain module, importable without pytest: the GPU check runs on machines where only torch, transformers and
onnxruntime may be installed (docs/status.md). ``tests/conftest.py`` re-exports these names.
"""

from __future__ import annotations

import torch

from clover.config import DrafterConfig, TargetConfig
from clover.drafters import Drafter
from clover.target import LlamaTarget


def tiny_target_config(**overrides) -> TargetConfig:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, rope_theta=10000.0, max_position_embeddings=512)
    base.update(overrides)
    return TargetConfig(**base)


def make_target(seed: int = 0, **overrides) -> LlamaTarget:
    torch.manual_seed(seed)
    target = LlamaTarget(tiny_target_config(**overrides))
    with torch.no_grad():
        for p in target.parameters():  # larger weights: peaked, tie-free logits
            p.normal_(0, 0.3)
        for layer in target.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        target.norm.weight.fill_(1.0)
    return target.eval().requires_grad_(False)


def make_drafter(target: LlamaTarget, method: str = "clover", num_heads: int = 3, seed: int = 1,
                 randomize: bool = True, token_path: str = "residual") -> Drafter:
    """A drafter on ``target``; ``randomize`` replaces the identity init by random weights (a useless drafter)."""
    cfg = target.config
    config = DrafterConfig(method=method, num_heads=num_heads, hidden_size=cfg.hidden_size,
                           vocab_size=cfg.vocab_size, target_num_layers=cfg.num_layers, num_attention_heads=2,
                           token_path=token_path)
    drafter = Drafter.from_target(config, target, seed=seed)
    if randomize:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "norm" not in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return drafter.eval().requires_grad_(False)
