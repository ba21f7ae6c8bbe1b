import dataclasses
import types

import pytest
import torch

from clover.backends.torch import TargetStep, TorchEngine
from clover.config import ConfigError, DrafterConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.drafters import Drafter, load_drafter, save_drafter
from clover.attention import causal_packed_mask
from tests.conftest import make_drafter, make_target


def _config(target, method="clover", heads=3):
    cfg = target.config
    return DrafterConfig(method=method, num_heads=heads, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                         target_num_layers=cfg.num_layers, num_attention_heads=2)


def _prompt_pass(step, ids):
    batch, length = ids.shape
    n = step.num_kv_layers
    empty = [torch.zeros(batch, step.target.config.num_kv_heads, 0, step.target.config.head_dim)] * n
    return step(ids, torch.arange(length).expand(batch, -1), torch.zeros(batch, dtype=torch.int32),
                causal_packed_mask(batch, length), empty, empty)


def test_augmenting_block_fork_is_a_true_warm_start():
    target = make_target()
    drafter = Drafter.from_target(_config(target), target)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_fork = _prompt_pass(TargetStep(target, drafter), ids)
        plain = _prompt_pass(TargetStep(target, None), ids)
    assert len(with_fork.present_keys) == target.config.num_layers + 1
    torch.testing.assert_close(with_fork.h0, plain.h0, rtol=0, atol=0)
    torch.testing.assert_close(with_fork.logits, plain.logits, rtol=0, atol=0)


def test_initial_draft_step_is_identity_then_lm_head():
    target = make_target()
    drafter = Drafter.from_target(_config(target), target)
    hidden = torch.randn(5, 32)
    token = torch.tensor([1, 2, 3, 4, 5])
    with torch.no_grad():
        next_hidden, logits = drafter.step(hidden, token, 1, target.lm_head.weight)
        torch.testing.assert_close(next_hidden, hidden)  # Wv = 0
        torch.testing.assert_close(logits, target.lm_head(target.norm(hidden)))  # ResBlocks are zero


def test_regressive_embedding_is_row_normalised_lm_head():
    target = make_target()
    drafter = Drafter.from_target(_config(target), target)
    emb = drafter.embed(torch.tensor([3, 7]), target.lm_head.weight)
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(2))
    torch.testing.assert_close(emb[0] * target.lm_head.weight[3].norm(), target.lm_head.weight[3])


def test_query_and_key_receive_gradients():
    """The cosine gate depends on q and k, so they learn (a softmax over one key would not)."""
    target = make_target()
    drafter = Drafter.from_target(_config(target), target).train()
    opt = torch.optim.SGD([p for p in drafter.parameters() if p.requires_grad], lr=0.1)
    hidden, token, labels = torch.randn(16, 32), torch.randint(0, 97, (16,)), torch.randint(0, 97, (16,))
    grads = []
    for _ in range(2):
        opt.zero_grad()
        _, logits = drafter.step(hidden, token, 0, target.lm_head.weight)
        torch.nn.functional.cross_entropy(logits, labels).backward()
        grads.append((drafter.regressive.q_proj.weight.grad.abs().sum(), drafter.regressive.k_proj.weight.grad.abs().sum(),
                      drafter.regressive.v_proj.weight.grad.abs().sum()))
        opt.step()
    assert grads[0][2] > 0  # Wv learns first (it starts at zero)
    assert grads[1][0] > 0 and grads[1][1] > 0


@pytest.mark.parametrize("method", ["clover", "clover2", "medusa", "clover-mlp-regressive", "clover-no-regressive",
                                    "clover-no-augment"])
def test_save_load_roundtrip(tmp_path, method):
    target = make_target()
    drafter = make_drafter(target, method=method)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, target)
    assert loaded.config == drafter.config
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    hidden, token = torch.randn(3, 32), torch.tensor([1, 2, 3])
    torch.testing.assert_close(loaded.step(hidden, token, 2, target.lm_head.weight),
                               drafter.step(hidden, token, 2, target.lm_head.weight))


def test_fp16_save_loads_into_fp32_target(tmp_path):
    target = make_target()
    drafter = make_drafter(target)
    save_drafter(drafter, tmp_path, dtype=torch.float16)
    loaded = load_drafter(tmp_path, target)
    assert loaded.heads.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.heads.weight, drafter.heads.weight, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 48, "num_heads": 6, "num_kv_heads": 2}, "hidden size 32 != target's 48"),
    ({"vocab_size": 120}, "vocab size 97 != target's 120"),
    ({"num_layers": 3}, "layer count 2 != target's 3"),
    ({}, "target fingerprint"),  # same shapes, other weights
])
def test_heads_for_another_target_fail_clearly(tmp_path, change, message):
    target = make_target(seed=0)
    save_drafter(make_drafter(target), tmp_path)
    other = make_target(seed=1, **change)
    with pytest.raises(ConfigError, match=message):
        load_drafter(tmp_path, other)


def test_unknown_method_and_broken_config(tmp_path):
    target = make_target()
    with pytest.raises(ConfigError, match="unknown drafter method"):
        _config(target, method="eagle")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid drafter config"):
        load_drafter(tmp_path, target)


def test_method_must_match_drafter_family():
    target = make_target()
    engine = TorchEngine(target, make_drafter(target, method="medusa"))
    with pytest.raises(ConfigError, match="does not match"):
        SpeculativeDecoder(engine, "clover")
    with pytest.raises(ConfigError, match="needs draft heads"):
        SpeculativeDecoder(TorchEngine(target, None), "medusa")
    out = SpeculativeDecoder(engine, "medusa").generate([GenerationRequest([1, 2, 3], max_new_tokens=4)])
    assert len(out[0].token_ids) <= 4
    clover2 = TorchEngine(target, make_drafter(target, method="clover2"))
    assert clover2.spec.default_method == "clover2" and clover2.spec.num_draft_kv_layers == 2
    for engine, method in ((clover2, "clover"), (TorchEngine(target, make_drafter(target)), "clover2")):
        with pytest.raises(ConfigError, match="does not match"):
            SpeculativeDecoder(engine, method)
    # an engine that claims Clover-2 heads but has no draft_prefill (contract v1) is refused up front
    v1 = dataclasses.replace(clover2.spec, num_draft_kv_layers=0)
    with pytest.raises(ConfigError, match="draft_prefill"):
        SpeculativeDecoder(types.SimpleNamespace(spec=v1), "clover2")
    assert SpeculativeDecoder(clover2, "vanilla").draft_cache is None  # vanilla on Clover-2 heads: no draft cache
