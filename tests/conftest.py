"""Tiny random models built in the tests (no downloads)."""

from __future__ import annotations

import pytest
import torch

from clover.backends.torch import TorchEngine
from clover.config import DrafterConfig, TargetConfig
from clover.drafters import Drafter
from clover.target import LlamaTarget

pytest.register_assert_rewrite("tests.helpers")


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


@pytest.fixture(scope="session")
def tiny_target() -> LlamaTarget:
    return make_target()


@pytest.fixture(scope="session")
def tiny_engine(tiny_target) -> TorchEngine:
    return TorchEngine(tiny_target, make_drafter(tiny_target), max_seq_len=256)


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_checkpoint(path, model_type: str = "llama", seed: int = 0, **config_overrides):
    """A random tiny Hugging Face checkpoint with a byte-level tokenizer and a ChatML template.

    Vocabulary: the 256 byte symbols plus ``<|im_start|>`` and ``<|im_end|>`` (EOS).
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<|im_start|>"], vocab["<|im_end|>"] = len(vocab), len(vocab) + 1
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                                     bos_token="<|im_start|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    settings = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    eos_token_id=vocab["<|im_end|>"])
    settings.update(config_overrides)
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[model_type]
    torch.manual_seed(seed)
    model = model_class(config_class(**settings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path
