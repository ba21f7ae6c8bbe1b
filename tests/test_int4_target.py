"""``--target-weights int4``: MatMulNBits' own symmetric 4-bit blocks for every linear, as onnxruntime-genai's
model builder writes them (docs/quantized-target.md). An engine with int8 activations (the default) decodes, with
random and oracle heads, what its stored weights mean: the near-tie rule against transformers over the weights
dequantised, its activations quantized as the kernel does (tests/test_quantized_target.py), not its own vanilla."""

import numpy as np
import onnx
import pytest

from clover.config import TreeConfig
from clover.drafters import save_drafter
from clover.export.builder import build_engine
from clover.export.target_weights import quantize_int4_block, quantize_target
from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.target import load_target
from tests.conftest import make_drafter, write_tiny_checkpoint
from tests.helpers import OracleEngine, dequantised_target, random_prompts, vanilla_greedy
from tests.test_quantized_target import _assert_decodes_the_reference, _decode, _matmul_nbits_weight

MAX_NEW = 24


def test_int4_blocks_round_to_the_nearest_level_and_keep_each_blocks_peak():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((6, 64)).astype(np.float32)
    weight[0, :32] = 0.0  # an all-zero block
    stored = quantize_int4_block(weight)
    assert stored.format == "int4_block" and stored.data.shape == (6, 2, 16) and stored.scale.shape == (6, 2)
    back = stored.dequantize()
    blocks, restored = weight.reshape(6, 2, 32), back.reshape(6, 2, 32)
    peaks = np.abs(blocks).argmax(-1)
    assert np.array_equal(np.take_along_axis(restored, peaks[..., None], -1),
                          np.take_along_axis(blocks, peaks[..., None], -1))  # the peak maps to -8 exactly
    step = np.abs(stored.scale)[..., None]
    error = np.abs(restored - blocks)
    inside = np.abs(blocks) <= 7.5 * step  # levels reach 8 steps on the peak's side, 7 on the other
    assert np.all((error <= step / 2 + 1e-6) | ~inside)  # rounded to the nearest level
    assert np.all(error <= step + 1e-6)  # a value beyond the last level on the far side is clipped to it
    assert not back[0, :32].any()


def test_matmul_nbits_applies_exactly_the_int4_weights(tmp_path):
    stored = quantize_int4_block(np.random.default_rng(2).standard_normal((40, 96)).astype(np.float32))
    assert np.array_equal(_matmul_nbits_weight(stored, "fp32", tmp_path), stored.dequantize())


@pytest.fixture(scope="module")
def int4_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    checkpoint = write_tiny_checkpoint(root / "tied", tie_word_embeddings=True, seed=4)
    target = load_target(checkpoint)
    save_drafter(make_drafter(target, method="clover", num_heads=3), root / "heads")
    return build_engine(root / "engine", str(checkpoint), str(root / "heads"), max_seq=256, target_weights="int4",
                        **dict(progress=lambda message: None)), checkpoint


def test_int4_engine_is_one_matmul_nbits_per_linear_lm_head_included(int4_engine):
    engine_dir, checkpoint = int4_engine
    engine = OnnxRuntimeEngine(engine_dir)
    quantization = engine.meta.target_quantization
    assert quantization["weights"] == "int4" and quantization["compute"] == "int8"  # int8 compute by default
    assert quantization["formats"] == ["int4_block"] and quantization["lm_head"] == "int4_block"
    ops = [n.op_type for n in onnx.load(str(engine_dir / "target.onnx"), load_external_data=False).graph.node]
    layers = load_target(checkpoint).config.num_layers
    assert ops.count("MatMulNBits") == 4 * layers + 1  # qkv, o, gate/up, down per layer, and the LM head
    assert "ReduceSum" not in ops  # no Q4_1 offset terms
    assert len(quantize_target(load_target(checkpoint), "int4")) == 7 * layers + 1


@pytest.mark.parametrize("batch", [1, 3])
def test_int4_engine_decodes_the_dequantised_reference_with_random_and_oracle_heads(int4_engine, batch):
    engine_dir, checkpoint = int4_engine
    engine = OnnxRuntimeEngine(engine_dir)
    assert engine.meta.target_quantization["compute"] == "int8"
    stored = quantize_target(load_target(checkpoint), "int4")  # what the build stored (deterministic)
    # the engine keeps the tied embedding's Gather table in fp32 (only the LM head is int4: docs/quantized-target.md),
    # so the reference's embedding stays fp32 too; its LM head is the stored int4 one, through the int8-compute hook
    linears = {name: weight for name, weight in stored.items() if name != "lm_head.weight"}
    reference = (dequantised_target(checkpoint, linears), stored)
    prompts = random_prompts(30 + batch, batch, engine.spec.vocab_size, 2, 16)
    tree = TreeConfig(budget=6, adaptive=False, proposer="suffix")
    oracle = OracleEngine(engine, prompts, vanilla_greedy(engine, prompts, MAX_NEW), num_heads=3)
    _assert_decodes_the_reference(engine, *reference, "int8", prompts,
                                  {"random heads": _decode(engine, "clover", prompts, tree),
                                   "oracle heads": _decode(oracle, "clover", prompts, tree)})
