"""The independent greedy reference (tests/helpers.py::hf_greedy): transformers, not clover's decode loop.

These tests check the reference itself: that the tiny checkpoints the tests build load in transformers as
the architecture they claim, with the same logits as clover's target, and that ``hf_greedy`` is plain
greedy decoding (an argmax loop over full forward passes gives the same tokens).
"""

from __future__ import annotations

import pytest
import torch

from clover.attention import causal_packed_mask
from clover.target import load_target
from tests.conftest import make_target, write_tiny_checkpoint
from tests.helpers import greedy_deviations, hf_greedy, hf_model, random_prompts

transformers = pytest.importorskip("transformers")


def _clover_logits(target, ids: list[int]) -> torch.Tensor:
    cfg = target.config
    empty = [torch.zeros(1, cfg.num_kv_heads, 0, cfg.head_dim)] * cfg.num_layers
    with torch.inference_mode():
        return target(torch.tensor([ids]), torch.arange(len(ids))[None], torch.zeros(1, dtype=torch.int32),
                      causal_packed_mask(1, len(ids)), empty, empty).logits[0]


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("model_type,overrides,cls", [
    ("llama", {}, "LlamaForCausalLM"),
    ("qwen2", {"num_key_value_heads": 1, "seed": 3}, "Qwen2ForCausalLM"),
    # the reference follows the checkpoint's config: tied embeddings, another RoPE base, another norm epsilon
    ("llama", {"tie_word_embeddings": True, "rms_norm_eps": 1e-5,
               "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, "LlamaForCausalLM"),
])
def test_tiny_checkpoints_load_in_transformers_with_clover_logits(tmp_path, model_type, overrides, cls):
    overrides = dict(overrides)
    seed = overrides.pop("seed", 0)
    path = write_tiny_checkpoint(tmp_path / "ckpt", model_type=model_type, seed=seed, **overrides)
    model = hf_model(path)
    assert type(model).__name__ == cls
    target = load_target(path)
    for key, value in overrides.items():
        if key == "tie_word_embeddings":
            assert target.config.tie_word_embeddings is value and model.config.tie_word_embeddings is value
    ids = random_prompts(seed, 1, target.config.vocab_size, 30, 30)[0]
    torch.testing.assert_close(_clover_logits(target, ids), _hf_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_in_memory_targets_convert_with_the_same_logits():
    target = make_target(seed=4)
    model = hf_model(target)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.rms_norm_eps == target.config.rms_norm_eps
    ids = random_prompts(4, 1, target.config.vocab_size, 25, 25)[0]
    torch.testing.assert_close(_clover_logits(target, ids), _hf_logits(model, ids), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the cache follows the weights, not the object
        target.lm_head.weight.mul_(0.5)
    assert hf_model(target) is not model
    torch.testing.assert_close(_clover_logits(target, ids), _hf_logits(hf_model(target), ids), rtol=1e-5, atol=1e-5)


def test_hf_greedy_is_an_argmax_loop_and_ignores_eos(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    model = hf_model(path)
    eos = model.config.eos_token_id
    prompts = random_prompts(2, 3, model.config.vocab_size, 1, 12) + [[eos]]
    got = hf_greedy(path, prompts, 16)
    for prompt, tokens in zip(prompts, got):
        ids = list(prompt)
        for _ in range(16):  # no KV cache: one full pass per token
            ids.append(int(_hf_logits(model, ids)[-1].argmax()))
        assert tokens == ids[len(prompt):]
        assert greedy_deviations(path, prompt, tokens) == []
    # EOS never stops generate(); stop tokens are cut by hf_greedy, kept as clover keeps them
    stop = got[0][5]
    cut = hf_greedy(path, prompts[:1], 16, stop_token_ids=(stop,))[0]
    assert cut == got[0][: got[0].index(stop) + 1]
    assert hf_greedy(path, prompts[:1], 4) == [got[0][:4]]
    # a wrong token is reported with its logit deficit
    wrong = list(got[0])
    logits = _hf_logits(model, prompts[0] + wrong[:3])[-1]
    wrong[3] = int(logits.argsort()[-2])
    (position, deficit, gap), *_ = greedy_deviations(path, prompts[0], wrong)
    assert position == 3 and deficit == pytest.approx(gap) and deficit > 0
