"""Multi-layer features (EAGLE-3; docs/drafter.md#multi-layer-features): the Augmenting Block reads a learned
fusion of several target layers' inputs. Decoding with such heads stays lossless on the torch backend, heads
saved before the option load unchanged, and the ONNX engine build refuses them until its graph captures them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from clover.attention import causal_packed_mask
from clover.backends.torch import TorchEngine
from clover.config import ConfigError, DrafterConfig, TreeConfig, resolve_feature_layers
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.drafters import Drafter, check_onnx_exportable, load_drafter, save_drafter
from tests.conftest import make_drafter, make_target
from tests.helpers import OracleEngine, hf_greedy, random_prompts

MAX_NEW = 20
ASSETS = Path(__file__).resolve().parents[1] / "clover" / "assets" / "smollm2-135m-instruct"


def multi_layer_drafter(target, layers=(0, 1), seed: int = 1, method: str = "clover") -> Drafter:
    """Random (useless) heads of ``method`` whose Augmenting Block reads the inputs of ``layers``, fused by a
    random map: every weight differs from the one-layer initialisation."""
    base = make_drafter(target, method=method, seed=seed)
    drafter = Drafter(dataclasses.replace(base.config, feature_layers=list(layers)), target.config)
    missing = drafter.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert missing == ["feature_fuse.weight"]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fuse = drafter.feature_fuse.weight
        fuse.copy_(torch.randn(fuse.shape, generator=gen) * fuse.shape[1] ** -0.5)
    return drafter.eval().requires_grad_(False)


def _generate(engine, prompts, tree):
    decoder = SpeculativeDecoder(engine, "clover", tree, max_batch_size=8)
    return decoder.generate([GenerationRequest(p, max_new_tokens=MAX_NEW, stop_token_ids=()) for p in prompts])


@pytest.mark.parametrize("method", ["clover", "clover-mlp-regressive"])
@pytest.mark.parametrize("budget", [1, 6])
def test_random_multi_layer_heads_equal_vanilla(method, budget):
    target = make_target(seed=3, num_layers=3)
    engine = TorchEngine(target, multi_layer_drafter(target, (0, 1, 2), seed=5, method=method), max_seq_len=128)
    prompts = random_prompts(3, 3, target.config.vocab_size, 1, 16)
    results = _generate(engine, prompts, TreeConfig(budget=budget, proposer="none"))
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, MAX_NEW)
    assert all(r.stats.depth_tried for r in results)


def test_oracle_heads_over_a_multi_layer_target_pass_accept_everything():
    """The oracle proposes the true continuation through a target pass that runs the fused Augmenting Block
    and its KV layer (kept and compacted like any other): every step accepts all heads' tokens."""
    target = make_target(seed=7)
    prompts = random_prompts(8, 3, target.config.vocab_size, 3, 12)
    expected = hf_greedy(target, prompts, MAX_NEW)
    oracle = OracleEngine(TorchEngine(target, multi_layer_drafter(target), max_seq_len=128), prompts, expected)
    results = _generate(oracle, prompts, TreeConfig(budget=5, proposer="none"))
    assert [r.token_ids for r in results] == expected
    for r in results:
        assert r.stats.accepted_per_step[:-1] == [3] * (len(r.stats.accepted_per_step) - 1)


def test_fused_features_change_h0_and_start_as_the_one_layer_block():
    """The target pass feeds the fused layer inputs to the block: random fusion changes h0; the initialisation
    (identity on the highest layer) gives exactly the one-layer heads' h0."""
    target = make_target(seed=2, num_layers=3)
    ids = torch.tensor([[5, 9, 11, 3, 40]])
    caches = [torch.zeros(1, target.config.num_kv_heads, 0, target.config.head_dim)] * 4

    def h0(drafter):
        step = TorchEngine(target, drafter, max_seq_len=64)
        return step.target(ids, torch.arange(5)[None], torch.zeros(1, dtype=torch.int32), causal_packed_mask(1, 5),
                           caches, caches).h0

    config = DrafterConfig(method="clover", num_heads=2, hidden_size=32, vocab_size=97, target_num_layers=3,
                           num_attention_heads=2)
    one_layer = Drafter.from_target(config, target)
    fresh = Drafter.from_target(dataclasses.replace(config, feature_layers=[0, 2]), target)
    torch.testing.assert_close(h0(fresh), h0(one_layer), rtol=0, atol=0)
    assert not torch.allclose(h0(multi_layer_drafter(target, (0, 2))), h0(one_layer))


def test_multi_layer_heads_round_trip_and_old_heads_directories_load(tmp_path):
    target = make_target(seed=4)
    heads = multi_layer_drafter(target)
    save_drafter(heads, tmp_path / "multi")
    loaded = load_drafter(tmp_path / "multi", target)
    assert loaded.config.feature_layers == [0, 1]
    torch.testing.assert_close(loaded.feature_fuse.weight, heads.feature_fuse.weight)

    save_drafter(make_drafter(target), tmp_path / "old")  # a heads directory from before the option
    config_path = tmp_path / "old" / "config.json"
    config = json.loads(config_path.read_text())
    del config["feature_layers"]
    config_path.write_text(json.dumps(config))
    old = load_drafter(tmp_path / "old", target)
    assert old.config.feature_layers is None and old.feature_fuse is None
    for shipped in ("clover", "medusa"):  # the shipped heads' config.json predates it
        assert DrafterConfig.load(ASSETS / shipped / "config.json").feature_layers is None


def test_engine_build_refusal_and_config_checks():
    config = DrafterConfig(method="clover", num_heads=2, hidden_size=32, vocab_size=97, target_num_layers=30)
    check_onnx_exportable(config)  # one-layer heads export
    with pytest.raises(ConfigError, match="multi-layer features.*torch backend"):
        check_onnx_exportable(dataclasses.replace(config, feature_layers=[2, 15, 29]))
    assert resolve_feature_layers("eagle3", 30) == [2, 15, 29]
    assert resolve_feature_layers("1,4", 30) == [1, 4] and resolve_feature_layers(None, 30) is None
    for bad in ([29, 2], [3], [2, 30]):
        with pytest.raises(ConfigError, match="feature_layers"):
            dataclasses.replace(config, feature_layers=bad)
    with pytest.raises(ConfigError, match="Augmenting Block"):
        dataclasses.replace(config, method="medusa", feature_layers=[2, 29])


def test_build_engine_refuses_multi_layer_heads_before_writing_anything(tmp_path):
    from clover.export.builder import build_engine
    from clover.target import load_target
    from tests.conftest import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    save_drafter(multi_layer_drafter(load_target(checkpoint)), tmp_path / "heads")
    with pytest.raises(ConfigError, match="multi-layer features"):
        build_engine(tmp_path / "engine", str(checkpoint), str(tmp_path / "heads"), progress=lambda m: None)
    assert not (tmp_path / "engine").exists()
