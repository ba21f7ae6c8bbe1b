"""Clover-2 engines (engine contract v2): the ``draft_prefill`` graph, its engine directory, onnxruntime parity
with the torch callables, lossless decoding through onnxruntime, int8, calibration, and v1 engines still loading.

docs/engine-contract.md#draft_prefill-in-the-engine-directory; the torch-path tests of the decode loop are in
tests/test_lossless.py.
"""

from __future__ import annotations

import json
import math
import shutil

import onnx
import pytest
import torch

from clover.adaptive import CostModel, expected_throughput
from clover.attention import pack_mask
from clover.backends import load_engine
from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.backends.torch import TorchEngine
from clover.config import ConfigError, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.drafters import load_drafter, save_drafter, set_draft_vocab
from clover.engine_contract import DRAFT_INPUTS, DRAFT_PREFILL_INPUTS
from clover.export.builder import build_engine
from clover.export.tensorrt_build import draft_prefill_profile
from clover.target import load_target
from tests.conftest import make_drafter, write_tiny_checkpoint
from tests.helpers import Clover2OracleEngine, hf_greedy, random_prompts, vanilla_greedy

quiet = dict(progress=lambda message: None)
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("clover2-export")
    return {"llama": write_tiny_checkpoint(root / "llama"),
            "qwen2": write_tiny_checkpoint(root / "qwen2", model_type="qwen2", num_key_value_heads=1, seed=3)}


def _heads(checkpoint, directory, method: str = "clover2", seed: int = 1):
    """Random (useless) heads of ``method`` for the checkpoint, saved to ``directory``."""
    save_drafter(make_drafter(load_target(checkpoint), method=method, num_heads=3, seed=seed), directory)
    return directory


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    """A Clover-2 onnxruntime engine per architecture (Qwen2: q/k/v biases in the block, 4:1 GQA), and a
    Clover engine with standard attention beside the Llama one (contract v1)."""
    root = tmp_path_factory.mktemp("clover2-engines")
    built = {}
    for key in (("llama", "clover2"), ("qwen2", "clover2"), ("llama", "clover")):
        heads = _heads(checkpoints[key[0]], root / f"{key[0]}-{key[1]}-heads", key[1])
        attention = "standard" if key[1] == "clover" else None  # None: the default (gqa)
        built[key] = build_engine(root / f"{key[0]}-{key[1]}", str(checkpoints[key[0]]), str(heads), max_seq=256,
                                  attention=attention, **quiet)
    return built


def _torch_engine(checkpoint, engine_dir):
    target = load_target(checkpoint)
    return TorchEngine(target, load_drafter(engine_dir.parent / f"{engine_dir.name}-heads", target), max_seq_len=256)


def _random_prefill_inputs(spec, seed, batch=3, tokens=37, past=(0, 5, 19)):
    """T > 32 positions (two mask words) after mixed past lengths, a random ancestor-style mask, random caches."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, tokens, spec.hidden_size, generator=gen)
    next_token = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen)
    past_lengths = torch.tensor(past[:batch], dtype=torch.int32)
    position_ids = past_lengths[:, None].long() + torch.randint(0, 4, (batch, tokens), generator=gen)
    visible = (torch.rand(batch, tokens, tokens, generator=gen) > 0.5).tril() | torch.eye(tokens, dtype=torch.bool)
    shape = (batch, spec.num_kv_heads, 64, spec.head_dim)
    k_cache = [torch.randn(shape, generator=gen) for _ in range(spec.num_draft_kv_layers)]
    v_cache = [torch.randn(shape, generator=gen) for _ in range(spec.num_draft_kv_layers)]
    return hidden, next_token, position_ids, past_lengths, pack_mask(visible), k_cache, v_cache


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_onnxruntime_draft_callables_match_torch(checkpoints, engines, arch):
    ort_engine = OnnxRuntimeEngine(engines[(arch, "clover2")])
    torch_engine = _torch_engine(checkpoints[arch], engines[(arch, "clover2")])
    assert ort_engine.spec == torch_engine.spec and ort_engine.spec.num_draft_kv_layers == 2
    inputs = _random_prefill_inputs(torch_engine.spec, seed=len(arch))
    expected, actual = torch_engine.draft_prefill(*inputs), ort_engine.draft_prefill(*inputs)
    assert actual.state.shape == (3, 37, torch_engine.spec.hidden_size)
    torch.testing.assert_close(actual.state, expected.state, rtol=1e-4, atol=1e-4)
    assert len(actual.present_keys) == len(actual.present_values) == 2
    for a, e in zip(actual.present_keys + actual.present_values, expected.present_keys + expected.present_values):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(7, torch_engine.spec.hidden_size, generator=gen)
    token = torch.randint(0, torch_engine.spec.vocab_size, (7,), generator=gen)
    for head in range(3):  # head 0 reads [state; token embedding] through first_head; deeper heads run the RNN step
        want, got = torch_engine.draft_step(hidden, token, head), ort_engine.draft_step(hidden, token, head)
        torch.testing.assert_close(got.next_hidden, want.next_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.topk_ids, want.topk_ids)
    assert not torch.equal(ort_engine.draft_step(hidden, token, 0).topk_ids,
                           ort_engine.draft_step(hidden, token, 1).topk_ids)  # the two branches really differ


def test_draft_step_with_a_draft_vocabulary_matches_torch(checkpoints, tmp_path):
    """Clover-2's draft step scoring only a draft vocabulary (docs/drafter.md#draft-vocabulary): same proposals."""
    target = load_target(checkpoints["llama"])
    drafter = make_drafter(target, method="clover2", num_heads=3, seed=4)
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    set_draft_vocab(drafter, vocab)
    save_drafter(drafter, tmp_path / "heads")
    engine_dir = build_engine(tmp_path / "engine", str(checkpoints["llama"]), str(tmp_path / "heads"), max_seq=256,
                              **quiet)
    ort_engine = OnnxRuntimeEngine(engine_dir)
    torch_engine = TorchEngine(target, load_drafter(tmp_path / "heads", target), max_seq_len=256)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(5, target.config.hidden_size, generator=gen)
    token = torch.randint(0, target.config.vocab_size, (5,), generator=gen)
    for head in range(3):
        want, got = torch_engine.draft_step(hidden, token, head), ort_engine.draft_step(hidden, token, head)
        torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.topk_ids, want.topk_ids)
        assert set(got.topk_ids.flatten().tolist()) <= set(vocab.tolist())


def test_engine_directory_records_draft_prefill(engines):
    engine_dir = engines[("llama", "clover2")]
    meta = json.loads((engine_dir / "engine.json").read_text())
    assert meta["contract_version"] == 3 and meta["num_draft_kv_layers"] == 2  # gqa target, draft_prefill of v2
    assert meta["drafter_config"]["method"] == "clover2" and meta["num_kv_layers"] == 2  # no block in the target
    assert meta["files"]["draft_prefill"] == "draft_prefill.onnx" and (engine_dir / "draft_prefill.onnx").exists()
    table = meta["tensors"]["draft_prefill"]
    names = [t["name"] for t in table["inputs"]]
    assert names[:5] == list(DRAFT_PREFILL_INPUTS)
    assert names[5:] == ["draft_past_key_0", "draft_past_value_0", "draft_past_key_1", "draft_past_value_1"]
    assert [t["name"] for t in table["outputs"]] == ["state", "draft_present_key_0", "draft_present_value_0",
                                                     "draft_present_key_1", "draft_present_value_1"]
    assert table["inputs"][0]["shape"] == ["batch", "tokens", 64] and table["inputs"][5]["shape"] == ["batch", 2,
                                                                                                       "max_seq", 16]
    assert [t["name"] for t in meta["tensors"]["draft_step"]["inputs"]] == list(DRAFT_INPUTS)
    # an engine of another method: contract 1, no draft_prefill, no num_draft_kv_layers key
    other = json.loads((engines[("llama", "clover")] / "engine.json").read_text())
    assert other["contract_version"] == 1 and "num_draft_kv_layers" not in other
    assert "draft_prefill" not in other["files"] and "draft_prefill" not in other["tensors"]
    assert not (engines[("llama", "clover")] / "draft_prefill.onnx").exists()


@pytest.mark.parametrize("batch", [1, 3])
def test_clover2_engine_decodes_losslessly_through_onnxruntime(checkpoints, engines, batch):
    """Useless random heads: ONNX drafting proposes what torch drafting proposes, and output is greedy."""
    ort_engine = OnnxRuntimeEngine(engines[("llama", "clover2")])
    torch_engine = _torch_engine(checkpoints["llama"], engines[("llama", "clover2")])
    prompts = random_prompts(20 + batch, batch, ort_engine.spec.vocab_size, 2, 20)  # mixed lengths
    expected = hf_greedy(checkpoints["llama"], prompts, MAX_NEW)  # transformers generate(): independent of clover
    assert vanilla_greedy(ort_engine, prompts, MAX_NEW) == expected
    requests = [GenerationRequest(p, max_new_tokens=MAX_NEW, stop_token_ids=()) for p in prompts]
    results = SpeculativeDecoder(ort_engine, "clover2", TreeConfig(budget=6)).generate(requests)
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.depth_tried for r in results)
    on_torch = SpeculativeDecoder(torch_engine, "clover2", TreeConfig(budget=6)).generate(requests)
    assert [r.stats.accepted_per_step for r in results] == [r.stats.accepted_per_step for r in on_torch]


def test_oracle_clover2_drafter_on_the_onnxruntime_target_with_joins(checkpoints, engines):
    """Every draft accepted, through the engine's ONNX target, with requests joining and leaving mid-run."""
    ort_engine = OnnxRuntimeEngine(engines[("llama", "clover2")])
    prompts = random_prompts(31, 4, ort_engine.spec.vocab_size, 2, 16)
    lengths = [MAX_NEW, 9, MAX_NEW, 14]
    expected = hf_greedy(checkpoints["llama"], prompts, MAX_NEW)
    oracle = Clover2OracleEngine(ort_engine, prompts, expected, num_heads=3)
    decoder = SpeculativeDecoder(oracle, "clover2", TreeConfig(budget=5), max_batch_size=2)
    results = decoder.generate([GenerationRequest(p, max_new_tokens=n, stop_token_ids=())
                                for p, n in zip(prompts, lengths)])
    assert [r.token_ids for r in results] == [e[:n] for e, n in zip(expected, lengths)]
    for r in results:  # every step but the last accepts all 3 draft tokens
        assert r.stats.accepted_per_step[:-1] == [3] * (len(r.stats.accepted_per_step) - 1)
    assert oracle.draft_prefill_calls > 0


def test_int8_quantizes_the_draft_step_only_and_stays_lossless(checkpoints, engines, tmp_path):
    fp32_dir = engines[("llama", "clover2")]
    heads = fp32_dir.parent / f"{fp32_dir.name}-heads"
    int8_dir = build_engine(tmp_path / "int8", str(checkpoints["llama"]), str(heads), max_seq=256, draft_int8=True,
                            **quiet)
    quantized = ("MatMulInteger", "DynamicQuantizeMatMul")
    step = onnx.load(str(int8_dir / "draft_step.onnx"), load_external_data=False).graph
    assert any(n.op_type in quantized for n in step.node)
    assert json.loads((int8_dir / "engine.json").read_text())["draft_quantization"]["quantized_matmuls"] >= 1
    for name in ("draft_prefill.onnx", "draft_prefill.onnx.data"):  # kept fp32: docs/engine-contract.md
        assert (int8_dir / name).read_bytes() == (fp32_dir / name).read_bytes()
    engine = OnnxRuntimeEngine(int8_dir)
    prompts = random_prompts(41, 3, engine.spec.vocab_size, 2, 20)
    results = SpeculativeDecoder(engine, "clover2", TreeConfig(budget=6)).generate(
        [GenerationRequest(p, max_new_tokens=MAX_NEW, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(checkpoints["llama"], prompts, MAX_NEW)


def test_calibration_measures_draft_prefill(checkpoints, engines, tmp_path):
    heads = engines[("llama", "clover2")].parent / "llama-clover2-heads"
    engine_dir = build_engine(tmp_path / "calibrated", str(checkpoints["llama"]), str(heads), max_seq=256,
                              calibrate=True, calibrate_max_tokens=4, **quiet)
    cost = load_engine(engine_dir).cost_model
    assert [n for n, _ in cost.draft_prefill] == [1, 2, 4] and all(s > 0 for _, s in cost.draft_prefill)
    clover_cost = load_engine(engines[("llama", "clover")]).cost_model
    assert clover_cost is None or clover_cost.draft_prefill == []
    # a step's time includes draft_prefill over the positions it accepts (vanilla steps too: the decode loop
    # keeps the draft cache in step), so a costly prefill lowers the expected tokens/s of every budget
    base = CostModel(target=[[1, 0.010], [64, 0.020]], draft=[[1, 0.001], [64, 0.002]])
    costly = CostModel(target=base.target, draft=base.draft, draft_prefill=[[1, 0.005], [64, 0.100]])
    assert base.draft_prefill_time(8) == 0 and costly.draft_prefill_time(8) > 0
    for budget, tokens in ((0, 1.0), (4, 2.5)):
        seconds = 2 * tokens / expected_throughput(2, budget, costly, tokens, 3)
        assert seconds == pytest.approx(2 * tokens / expected_throughput(2, budget, base, tokens, 3)
                                        + costly.draft_prefill_time(2 * tokens))
    assert CostModel.from_dict(costly.to_dict()).draft_prefill == costly.draft_prefill


def test_plugin_variant_uses_tree_attention_in_the_block(checkpoints, engines, tmp_path):
    heads = engines[("qwen2", "clover2")].parent / "qwen2-clover2-heads"
    engine_dir = build_engine(tmp_path / "plugin", str(checkpoints["qwen2"]), str(heads), attention="plugin", **quiet)
    path = engine_dir / "draft_prefill.onnx"
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "TreeAttention"]
    assert len(nodes) == 2 and all(n.domain == "clover" for n in nodes)  # one per block layer
    cache_inputs = {i.name for i in model.graph.input if i.name.startswith("draft_past_")}
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["num_q_heads"] == 4 and attrs["num_kv_heads"] == 1 and attrs["head_dim"] == 16
        assert math.isclose(attrs["scale"], 1 / math.sqrt(16), rel_tol=1e-6)
        assert node.input[3] in cache_inputs and node.input[4] in cache_inputs
        assert list(node.input[5:]) == ["past_lengths", "spec_decoding_packed_mask"]
    step = onnx.load(str(engine_dir / "draft_step.onnx"), load_external_data=False)
    assert not [n for n in step.graph.node if n.domain == "clover"]
    # the TensorRT optimization profile names every dynamic input of the graph, with its rank
    cfg = load_target(checkpoints["qwen2"]).config
    profile = draft_prefill_profile(4, 256, cfg.hidden_size, 2, cfg.num_kv_heads, cfg.head_dim)
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in model.graph.input}
    assert set(profile) == set(ranks)
    assert all(len(shape) == ranks[name] for name, shapes in profile.items() for shape in shapes)


def test_tensorrt_draft_prefill_matches_torch(checkpoints, engines, tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (no NVIDIA GPU here): the tensorrt backend's "
                                           "draft_prefill has not run; docs/status.md")
    if not torch.cuda.is_available():
        pytest.skip("the tensorrt backend needs a CUDA GPU")
    heads = engines[("llama", "clover2")].parent / "llama-clover2-heads"
    engine_dir = build_engine(tmp_path / "trt", str(checkpoints["llama"]), str(heads), backend="tensorrt",
                              max_batch=4, max_seq=256, **quiet)
    trt_engine = load_engine(engine_dir)
    torch_engine = _torch_engine(checkpoints["llama"], engines[("llama", "clover2")])
    inputs = _random_prefill_inputs(torch_engine.spec, seed=3)
    cuda_inputs = [*inputs[:5], [k.cuda() for k in inputs[5]], [v.cuda() for v in inputs[6]]]
    expected, actual = torch_engine.draft_prefill(*inputs), trt_engine.draft_prefill(*cuda_inputs)
    torch.testing.assert_close(actual.state, expected.state, rtol=1e-3, atol=1e-3)
    for a, e in zip(actual.present_keys + actual.present_values, expected.present_keys + expected.present_values):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-3, atol=1e-3)


def test_contract_v1_engine_directories_still_load(checkpoints, engines, tmp_path):
    """An engine.json as Clover wrote it before contract v2 (no num_draft_kv_layers, drafter config without the
    fields added since) loads, and decodes greedy; inconsistent versions are refused."""
    engine_dir = shutil.copytree(engines[("llama", "clover")], tmp_path / "v1")
    meta = json.loads((engine_dir / "engine.json").read_text())
    for key in ("block_layers", "draft_vocab_size"):
        meta["drafter_config"].pop(key, None)
    meta.pop("num_draft_kv_layers", None)
    meta["contract_version"] = 1
    (engine_dir / "engine.json").write_text(json.dumps(meta))
    engine = load_engine(engine_dir)
    assert engine.spec.num_draft_kv_layers == 0 and engine.meta.contract_version == 1
    prompts = random_prompts(51, 2, engine.spec.vocab_size, 2, 12)
    results = SpeculativeDecoder(engine, "clover", TreeConfig(budget=4)).generate(
        [GenerationRequest(p, max_new_tokens=12, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(checkpoints["llama"], prompts, 12)
    with pytest.raises(RuntimeError, match="no draft_prefill"):
        engine.draft_prefill(*_random_prefill_inputs(engine.spec, seed=1))
    with pytest.raises(ConfigError, match="does not match"):
        SpeculativeDecoder(engine, "clover2")
    for version, draft_layers in ((1, 2), (4, 0), (None, 0)):
        broken = dict(meta, contract_version=version, num_draft_kv_layers=draft_layers)
        (engine_dir / "engine.json").write_text(json.dumps(broken))
        with pytest.raises(ConfigError, match="contract version"):
            load_engine(engine_dir)
