"""Multi-layer features (EAGLE-3; docs/drafter.md#multi-layer-features): the Augmenting Block reads a learned
fusion of several target layers' inputs. The ONNX target graphs (gqa, standard and plugin attention) compute the
torch target pass; decoding with such heads stays lossless on torch and onnxruntime (Triton: tests/test_serving.py);
heads saved before the option load unchanged."""

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
from clover.drafters import Drafter, load_drafter, save_drafter
from clover.target import load_target
from tests.conftest import make_drafter, make_target, write_tiny_checkpoint
from tests.helpers import OracleEngine, assert_close_to_scale, hf_greedy, new_kv_of, random_prompts

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
    # the shipped Clover heads read EAGLE-3's layers (docs/demo.md#shipped-heads), the Medusa baseline none
    assert DrafterConfig.load(ASSETS / "clover" / "config.json").feature_layers == resolve_feature_layers("eagle3", 30)
    assert DrafterConfig.load(ASSETS / "medusa" / "config.json").feature_layers is None


def test_config_checks():
    config = DrafterConfig(method="clover", num_heads=2, hidden_size=32, vocab_size=97, target_num_layers=30)
    assert resolve_feature_layers("eagle3", 30) == [2, 15, 29]
    assert resolve_feature_layers("1,4", 30) == [1, 4] and resolve_feature_layers(None, 30) is None
    for bad in ([29, 2], [3], [2, 30]):
        with pytest.raises(ConfigError, match="feature_layers"):
            dataclasses.replace(config, feature_layers=bad)
    with pytest.raises(ConfigError, match="Augmenting Block"):
        dataclasses.replace(config, method="medusa", feature_layers=[2, 29])


quiet = dict(progress=lambda message: None)


@pytest.fixture(scope="module")
def onnx_built(tmp_path_factory):
    """A 3-layer checkpoint, random heads reading the inputs of layers 0 and 2, and their engines with the default
    (gqa, in place) and the standard attention."""
    from clover.export.builder import build_engine

    root = tmp_path_factory.mktemp("multi-layer")
    checkpoint = write_tiny_checkpoint(root / "checkpoint", num_hidden_layers=3, seed=6)
    save_drafter(multi_layer_drafter(load_target(checkpoint), (0, 2), seed=8), root / "heads")
    engines = {attention: build_engine(root / attention, str(checkpoint), str(root / "heads"), max_seq=256,
                                       attention=attention, **quiet) for attention in ("gqa", "standard")}
    return checkpoint, root / "heads", engines


def _torch_engine(checkpoint, heads):
    target = load_target(checkpoint)
    return TorchEngine(target, load_drafter(heads, target), max_seq_len=256)


@pytest.mark.parametrize("attention", ["gqa", "standard"])
@pytest.mark.parametrize("batch, tokens, past", [(1, 1, (7,)), (1, 6, (9,)), (3, 37, (0, 5, 19))])
def test_onnx_target_pass_with_fused_features_matches_torch(onnx_built, attention, batch, tokens, past):
    """The engine's target graph captures the layers' inputs and fuses them before the Augmenting Block: logits,
    h0 and every layer's new K/V (the block's included) equal the torch target pass."""
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from tests.test_export import _random_step_inputs

    checkpoint, heads, engines = onnx_built
    reference = _torch_engine(checkpoint, heads)
    inputs = _random_step_inputs(reference.spec, seed=tokens, batch=batch, tokens=tokens, past=past)
    want = reference.target(*inputs)
    k_cache, v_cache = [t.clone() for t in inputs[4]], [t.clone() for t in inputs[5]]
    got = OnnxRuntimeEngine(engines[attention]).target(*inputs[:4], k_cache, v_cache)
    keys, values = new_kv_of(got, inputs[2], k_cache, v_cache)
    for actual, expected in [(got.logits, want.logits), (got.h0, want.h0),
                             *zip(keys + values, want.present_keys + want.present_values)]:
        assert_close_to_scale(actual, expected)
    one_layer = TorchEngine(load_target(checkpoint), _one_layer_copy(heads, checkpoint), max_seq_len=256)
    assert not torch.allclose(got.h0, one_layer.target(*inputs).h0, atol=1e-3)  # the fusion is in the graph


def _one_layer_copy(heads, checkpoint) -> Drafter:
    """The heads without their fusion: the Augmenting Block reads the last layer's input alone."""
    target = load_target(checkpoint)
    multi = load_drafter(heads, target)
    drafter = Drafter(dataclasses.replace(multi.config, feature_layers=None), target.config)
    state = {k: v for k, v in multi.state_dict().items() if not k.startswith("feature_fuse")}
    drafter.load_state_dict(state)
    return drafter.eval()


def test_plugin_graph_with_fused_features_computes_the_torch_target(onnx_built, tmp_path):
    """The --attention plugin graph (TensorRT's) by onnx's reference evaluator, as for one-layer heads."""
    from tests.test_export import assert_plugin_graph_computes_the_torch_target

    checkpoint, heads, _ = onnx_built
    assert_plugin_graph_computes_the_torch_target(checkpoint, heads, tmp_path / "plugin")


@pytest.mark.parametrize("attention", ["gqa", "standard"])
def test_onnxruntime_decoding_with_multi_layer_heads_is_lossless(onnx_built, attention):
    """Random heads (budgets 1 and 6, joins and a batch of 3) and the oracle through the engine's fused target
    pass: exactly transformers' greedy output; the oracle accepts every head's token at every step."""
    from clover.backends.onnxruntime import OnnxRuntimeEngine

    checkpoint, _, engines = onnx_built
    engine = OnnxRuntimeEngine(engines[attention])
    prompts = random_prompts(11, 3, engine.spec.vocab_size, 1, 16)
    expected = hf_greedy(checkpoint, prompts, MAX_NEW)
    for budget in (1, 6):
        results = _generate(engine, prompts, TreeConfig(budget=budget, proposer="none"))
        assert [r.token_ids for r in results] == expected
    oracle = OracleEngine(engine, prompts, expected)
    results = _generate(oracle, prompts, TreeConfig(budget=5, proposer="none"))
    assert [r.token_ids for r in results] == expected
    for r in results:
        assert r.stats.accepted_per_step[:-1] == [3] * (len(r.stats.accepted_per_step) - 1)
