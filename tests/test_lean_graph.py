"""The lean onnxruntime target graph (``gqa`` attention, engine contract v3: docs/engine-contract.md#in-place-kv).

GroupQueryAttention writes the new tokens' K/V into the decode loop's cache itself; these tests hold that graph
to the torch reference, check where onnxruntime's op cannot run a step (the backend's routing), check the
in-place commit after acceptance against a plain prompt pass, and decode losslessly through it.
"""

import json

import onnx
import pytest
import torch

from clover.attention import causal_packed_mask
from clover.backends.onnxruntime import OnnxRuntimeEngine, _gqa_runs
from clover.backends.torch import TorchEngine
from clover.config import ConfigError, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.drafters import load_drafter, save_drafter
from clover.engine_dir import read_engine_meta
from clover.export.builder import build_engine
from clover.target import load_target
from tests.conftest import make_drafter, write_tiny_checkpoint
from tests.helpers import OracleEngine, assert_close_to_scale, hf_greedy, new_kv_of, random_prompts, vanilla_greedy
from tests.test_export import _random_step_inputs

quiet = dict(progress=lambda message: None)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per architecture: the checkpoint, its Clover heads and a default (gqa) engine; plus a standard-attention
    Llama engine (what engines were before contract v3)."""
    root = tmp_path_factory.mktemp("lean")
    out = {}
    for arch, overrides in [("llama", {}), ("qwen2", dict(model_type="qwen2", num_key_value_heads=1, seed=3))]:
        checkpoint = write_tiny_checkpoint(root / arch, **overrides)
        heads = root / f"{arch}-heads"
        save_drafter(make_drafter(load_target(checkpoint), method="clover", num_heads=3), heads)
        out[arch] = (checkpoint, heads, build_engine(root / f"{arch}-gqa", str(checkpoint), str(heads), max_seq=256,
                                                     **quiet))
    checkpoint, heads, _ = out["llama"]
    out["standard"] = build_engine(root / "llama-standard", str(checkpoint), str(heads), max_seq=256,
                                   attention="standard", **quiet)
    return out


def _torch_engine(checkpoint, heads):
    target = load_target(checkpoint)
    return TorchEngine(target, load_drafter(heads, target), max_seq_len=256)


def test_default_onnxruntime_engine_is_the_lean_in_place_graph(built):
    meta = read_engine_meta(built["llama"][2])
    assert meta.attention == "gqa" and meta.contract_version == 3
    assert meta.files["target_batched"] == "target_batched.onnx"
    graph = onnx.load(str(built["llama"][2] / "target.onnx"), load_external_data=False).graph
    ops = [node.op_type for node in graph.node]
    layers = meta.num_kv_layers  # the target's layers and the Augmenting Block
    assert ops.count("GroupQueryAttention") == layers
    # two norms per layer and the final norm, each fused with its residual add, but the first (no residual yet)
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * (layers - 1) + 1 + 1
    assert "Softmax" not in ops and "Transpose" not in ops  # no attention plumbing outside the fused op


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch, tokens, past", [(1, 1, (7,)), (1, 5, (9,)), (1, 37, (19,)), (3, 1, (0, 5, 19)),
                                                 (3, 5, (0, 5, 19)), (3, 37, (0, 5, 19)), (2, 6, (0, 0))])
def test_gqa_engine_matches_torch(built, arch, batch, tokens, past):
    """Tree steps (random ancestor masks, tree positions; two mask words at T = 37) with mixed past lengths: the
    in-place graph where onnxruntime's op runs them, the batched graph where it does not."""
    checkpoint, heads, engine_dir = built[arch]
    ort_engine, torch_engine = OnnxRuntimeEngine(engine_dir), _torch_engine(checkpoint, heads)
    inputs = _random_step_inputs(torch_engine.spec, seed=tokens + batch, batch=batch, tokens=tokens, past=past)
    expected = torch_engine.target(*inputs)
    k_cache, v_cache = [t.clone() for t in inputs[4]], [t.clone() for t in inputs[5]]
    actual = ort_engine.target(*inputs[:4], k_cache, v_cache)
    keys, values = new_kv_of(actual, inputs[2], k_cache, v_cache)
    pairs = [(actual.logits, expected.logits), (actual.h0, expected.h0),
             *zip(keys + values, expected.present_keys + expected.present_values)]
    for got, want in pairs:
        assert_close_to_scale(got, want)
    for before, after in zip(inputs[4] + inputs[5], k_cache + v_cache):  # the past itself is never written
        for b, p in enumerate(past):
            assert torch.equal(before[b, :, :p], after[b, :, :p])
    assert (actual.present_keys is None) == _gqa_runs(batch, tokens, inputs[2].numpy(), inputs[3].numpy())


def test_gqa_routing_follows_what_onnxruntime_computes(built):
    """Why the backend routes: onnxruntime 1.32's GroupQueryAttention ignores the tree bias when no sequence has a
    past, and refuses trees of several sequences after a past. If a new onnxruntime lifts either, this fails
    and the routing (``_gqa_runs``) can take more steps in place."""
    checkpoint, heads, engine_dir = built["llama"]
    engine, reference = OnnxRuntimeEngine(engine_dir), _torch_engine(checkpoint, heads)
    tree_no_past = _random_step_inputs(reference.spec, seed=4, batch=1, tokens=6, past=(0,))
    assert not _gqa_runs(1, 6, tree_no_past[2].numpy(), tree_no_past[3].numpy())
    forced = engine._target_in_place(engine._binding_for(*tree_no_past[4:]), _feeds(tree_no_past))
    assert not torch.allclose(forced.logits, reference.target(*tree_no_past).logits, atol=1e-3)
    trees_after_past = _random_step_inputs(reference.spec, seed=5, batch=2, tokens=4, past=(3, 8))
    with pytest.raises(Exception, match="batch_size must be 1"):
        engine._target_in_place(engine._binding_for(*trees_after_past[4:]), _feeds(trees_after_past))
    prompt = (trees_after_past[0], torch.arange(4).expand(2, -1).contiguous(), torch.zeros(2, dtype=torch.int32),
              causal_packed_mask(2, 4))
    assert _gqa_runs(2, 4, prompt[2].numpy(), prompt[3].numpy())  # prompts of several sequences run in place


def _feeds(inputs) -> dict:
    ids, positions, past, mask = inputs[:4]
    return {"input_ids": ids.numpy(), "position_ids": positions.numpy(), "past_lengths": past.numpy(),
            "spec_decoding_packed_mask": mask.numpy()}


def test_a_step_past_the_cache_buffer_is_never_written_in_place(built):
    """The op writes wherever the lengths point: a step that does not fit the buffer runs the batched graph
    and returns its K/V (the decode loop's commit then refuses it as an overflow), the cache untouched."""
    engine = OnnxRuntimeEngine(built["llama"][2])
    spec = engine.spec
    cache = [torch.zeros(1, spec.num_kv_heads, 8, spec.head_dim) for _ in range(spec.num_kv_layers)]
    result = engine.target(torch.zeros(1, 4, dtype=torch.long), torch.arange(6, 10)[None],
                           torch.tensor([6], dtype=torch.int32), causal_packed_mask(1, 4), cache, cache)
    assert result.present_keys is not None and result.present_keys[0].shape[2] == 4
    assert all(not c.any() for c in cache)


def test_one_tensor_for_keys_and_values_is_never_written_in_place(built):
    """A caller that passes one tensor as both caches (as contract v1 allowed for read-only caches) gets the new
    tokens' K/V back: written in place, the values would overwrite the keys the op then reads."""
    checkpoint, heads, engine_dir = built["llama"]
    engine, reference = OnnxRuntimeEngine(engine_dir), _torch_engine(checkpoint, heads)
    inputs = _random_step_inputs(reference.spec, seed=9, batch=1, tokens=3, past=(5,))
    shared = [k.clone() for k in inputs[4]]
    result = engine.target(*inputs[:4], shared, shared)
    assert result.present_keys is not None
    assert_close_to_scale(result.logits, reference.target(*inputs[:4], shared, shared).logits)


@pytest.mark.parametrize("batch", [1, 2])
def test_in_place_commit_after_acceptance_equals_a_prompt_pass(built, batch):
    """After speculative steps (random and oracle heads), each row's cache holds what a plain prompt pass over
    its tokens writes (the torch reference), for the in-place (batch 1) and the batched graph's steps."""
    checkpoint, heads, engine_dir = built["llama"]
    engine, reference = OnnxRuntimeEngine(engine_dir), _torch_engine(checkpoint, heads)
    prompts = random_prompts(10 + batch, batch, engine.spec.vocab_size, 4, 10)
    expected = hf_greedy(checkpoint, prompts, 12)
    for drafting in (engine, OracleEngine(engine, prompts, expected, num_heads=3)):
        decoder = SpeculativeDecoder(drafting, "clover", TreeConfig(budget=5))
        ids = [decoder.submit(GenerationRequest(p, max_new_tokens=1000, stop_token_ids=())) for p in prompts]
        while min(len(decoder.result(i).token_ids) for i in ids) < 12:
            decoder.step()
        for i, seq_id in enumerate(ids):
            assert decoder.result(seq_id).token_ids[:12] == expected[i]
            row = [s.seq_id for s in decoder._running].index(seq_id)
            tokens = prompts[i] + decoder.result(seq_id).token_ids
            length = int(decoder.cache.lengths[row])
            assert length == len(tokens) - 1
            fresh = _prompt_pass_kv(reference, tokens[:length])
            for layer in range(engine.spec.num_kv_layers):
                torch.testing.assert_close(decoder.cache.keys[layer][row, :, :length], fresh[0][layer][0],
                                           rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(decoder.cache.values[layer][row, :, :length], fresh[1][layer][0],
                                           rtol=1e-4, atol=1e-4)
        accepted = [n for seq in decoder._running for n in seq.stats.accepted_per_step]
        if drafting is not engine:
            assert max(accepted) >= 2, "the oracle's trees were not accepted: the in-place move was not exercised"


def _prompt_pass_kv(engine, tokens: list[int]):
    spec = engine.spec
    empty = [torch.zeros(1, spec.num_kv_heads, 0, spec.head_dim) for _ in range(spec.num_kv_layers)]
    out = engine.target(torch.tensor([tokens]), torch.arange(len(tokens))[None], torch.zeros(1, dtype=torch.int32),
                        causal_packed_mask(1, len(tokens)), empty, empty)
    return out.present_keys, out.present_values


@pytest.mark.parametrize("batch", [1, 3])
def test_lossless_through_the_gqa_engine_with_joins_and_suffix(built, batch):
    """Random and oracle heads, suffix candidates on, a small max batch so requests join mid-run: every output
    equals transformers' greedy ``generate()``."""
    checkpoint, _, engine_dir = built["llama"]
    engine = OnnxRuntimeEngine(engine_dir)
    prompts = [p * 2 for p in random_prompts(20 + batch, 2 * batch, engine.spec.vocab_size, 2, 12)]
    expected = hf_greedy(checkpoint, prompts, 20)
    assert vanilla_greedy(engine, prompts, 20) == expected
    for drafting in (engine, OracleEngine(engine, prompts, expected, num_heads=3)):
        decoder = SpeculativeDecoder(drafting, "clover", TreeConfig(budget=6, proposer="suffix"), max_batch_size=batch)
        results = decoder.generate([GenerationRequest(p, max_new_tokens=20, stop_token_ids=()) for p in prompts])
        assert [r.token_ids for r in results] == expected


def test_standard_engines_of_contract_v1_still_load_and_decode(built):
    checkpoint, _, _ = built["llama"]
    meta = read_engine_meta(built["standard"])
    assert meta.attention == "standard" and meta.contract_version == 1
    engine = OnnxRuntimeEngine(built["standard"])
    prompts = random_prompts(5, 2, engine.spec.vocab_size, 2, 10)
    results = SpeculativeDecoder(engine, "clover", TreeConfig(budget=4)).generate(
        [GenerationRequest(p, max_new_tokens=12, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(checkpoint, prompts, 12)


def test_gqa_engine_without_its_batched_graph_is_refused_with_the_rebuild_command(built, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in built["llama"][2].iterdir():
        if not path.name.startswith("target_batched"):
            (broken / path.name).symlink_to(path)
    data = json.loads((built["llama"][2] / "engine.json").read_text())
    del data["files"]["target_batched"]
    (broken / "engine.json").unlink()
    (broken / "engine.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="rebuild"):
        OnnxRuntimeEngine(broken)


def test_contract_v3_engine_json_is_refused_by_a_version_2_reader(built, tmp_path, monkeypatch):
    """An engine that writes its cache in place says contract 3, so a Clover that reads only 1-2 refuses it
    instead of decoding with a cache it never fills."""
    import clover.engine_dir as engine_dir

    monkeypatch.setattr(engine_dir, "SUPPORTED_CONTRACT_VERSIONS", (1, 2))
    with pytest.raises(ConfigError, match="rebuild the engine with"):
        read_engine_meta(built["llama"][2])
