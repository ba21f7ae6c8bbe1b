"""Tiny random models built in the tests (no downloads)."""

from __future__ import annotations

import pytest
import torch

from clover.backends.torch import TorchEngine
from clover.target import LlamaTarget

pytest.register_assert_rewrite("tests.helpers")
from tests.random_models import make_drafter, make_target, tiny_target_config  # noqa: E402,F401  (re-exported)


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
    # head size 16: onnxruntime's GroupQueryAttention (the default engine graph) takes multiples of 16 only
    settings = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
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
