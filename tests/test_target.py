"""The target against transformers, and checkpoint loading errors."""

import json

import pytest
import torch

from clover.attention import causal_packed_mask
from clover.config import ConfigError
from clover.target import load_target

transformers = pytest.importorskip("transformers")


def _save_hf(tmp_path, model_type, **kwargs):

    common = dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    common.update(kwargs)
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif model_type == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    return model


def _forward_full(target, ids):
    batch, length = ids.shape
    cfg = target.config
    empty = [torch.zeros(batch, cfg.num_kv_heads, 0, cfg.head_dim)] * cfg.num_layers
    return target(ids, torch.arange(length).expand(batch, -1), torch.zeros(batch, dtype=torch.int32),
                  causal_packed_mask(batch, length), empty, empty)


@pytest.mark.parametrize("model_type,kwargs", [
    ("llama", {}),
    ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
    ("qwen2", {}),
    ("mistral", {"num_key_value_heads": 3}),
])
def test_logits_match_transformers(tmp_path, model_type, kwargs):
    hf = _save_hf(tmp_path, model_type, **kwargs)
    target = load_target(tmp_path)
    if model_type == "qwen2":
        assert target.config.qkv_bias and not target.config.o_bias
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(_forward_full(target, ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_incremental_decoding_with_cache_matches_full_pass(tmp_path):
    _save_hf(tmp_path, "llama")
    target = load_target(tmp_path)
    cfg = target.config
    ids = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(2))
    full = _forward_full(target, ids).logits
    k_cache = [torch.zeros(1, cfg.num_kv_heads, 32, cfg.head_dim) for _ in range(cfg.num_layers)]
    v_cache = [torch.zeros_like(c) for c in k_cache]
    for pos in range(12):
        out = target(ids[:, pos : pos + 1], torch.tensor([[pos]]), torch.tensor([pos], dtype=torch.int32),
                     causal_packed_mask(1, 1), k_cache, v_cache)
        for layer in range(cfg.num_layers):
            k_cache[layer][:, :, pos] = out.present_keys[layer][:, :, 0]
            v_cache[layer][:, :, pos] = out.present_values[layer][:, :, 0]
        torch.testing.assert_close(out.logits[:, 0], full[:, pos], rtol=1e-5, atol=1e-5)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unsupported architecture model_type='gpt2'"):
        load_target(tmp_path)


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_target(tmp_path)


def test_missing_tensor_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_hf(tmp_path, "llama")
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="missing.*layers.1.mlp.up_proj.weight"):
        load_target(tmp_path)


def test_corrupt_weights_are_a_clear_error(tmp_path):
    _save_hf(tmp_path, "llama")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="cannot read safetensors"):
        load_target(tmp_path)


def test_wrong_shape_is_a_clear_error(tmp_path):
    _save_hf(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="has shape"):
        load_target(tmp_path)
