"""ONNX engines: parity with torch, lossless decoding through onnxruntime, plugin graphs, atomic builds."""

import hashlib
import json
import math

import onnx
import pytest
import torch

from clover.attention import pack_mask
from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.backends.torch import TorchEngine
from clover.cli import main as clover_main
from clover.config import ConfigError, TreeConfig
from clover.engine_contract import DRAFT_INPUTS, TARGET_INPUTS
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.drafters import load_drafter, save_drafter
from clover.export.builder import build_engine
from clover.target import load_target
from tests.conftest import make_drafter, write_tiny_checkpoint
from tests.helpers import (assert_argmax_up_to_its_error, assert_close_to_scale, full_pass_logits,
                           hf_greedy, hf_next_logits, logit_error, new_kv_of, random_prompts, vanilla_greedy)

METHODS = ["clover", "medusa", "clover-mlp-regressive", "clover-no-regressive", "clover-no-augment"]
quiet = dict(progress=lambda message: None)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    llama = write_tiny_checkpoint(root / "llama")
    qwen = write_tiny_checkpoint(root / "qwen2", model_type="qwen2", num_key_value_heads=1, seed=3)
    return {"llama": llama, "qwen2": qwen}


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    """One ONNX engine per drafter method (llama), plus a Qwen2 (q/k/v bias, 4:1 GQA) Clover engine."""
    root = tmp_path_factory.mktemp("engines")
    built = {}
    for arch, method in [("llama", m) for m in METHODS] + [("qwen2", "clover")]:
        target = load_target(checkpoints[arch])
        heads_dir = root / f"{arch}-{method}-heads"
        save_drafter(make_drafter(target, method=method, num_heads=3), heads_dir)
        built[(arch, method)] = build_engine(root / f"{arch}-{method}", str(checkpoints[arch]), str(heads_dir),
                                             max_seq=256, **quiet)
    return built


def _torch_engine(checkpoint, engine_dir):
    target = load_target(checkpoint)
    return TorchEngine(target, load_drafter(engine_dir.parent / f"{engine_dir.name}-heads", target), max_seq_len=256)


def _random_step_inputs(spec, seed, batch=3, tokens=37, past=(0, 5, 19)):
    """A tree step: random tokens, a random ancestor-style mask (T > 32: two mask words), random caches."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen)
    offsets = torch.randint(0, 4, (batch, tokens), generator=gen)
    past_lengths = torch.tensor(past[:batch], dtype=torch.int32)
    visible = (torch.rand(batch, tokens, tokens, generator=gen) > 0.5).tril() | torch.eye(tokens, dtype=torch.bool)
    shape = (batch, spec.num_kv_heads, 64, spec.head_dim)
    k_cache = [torch.randn(shape, generator=gen) for _ in range(spec.num_kv_layers)]
    v_cache = [torch.randn(shape, generator=gen) for _ in range(spec.num_kv_layers)]
    return input_ids, past_lengths[:, None].long() + offsets, past_lengths, pack_mask(visible), k_cache, v_cache


@pytest.mark.parametrize("key", [("llama", m) for m in METHODS] + [("qwen2", "clover")])
def test_onnxruntime_matches_torch(checkpoints, engines, key):
    ort_engine = OnnxRuntimeEngine(engines[key])
    torch_engine = _torch_engine(checkpoints[key[0]], engines[key])
    assert ort_engine.spec == torch_engine.spec
    inputs = _random_step_inputs(torch_engine.spec, seed=len(key[1]))
    expected, actual = torch_engine.target(*inputs), ort_engine.target(*inputs)
    keys, values = new_kv_of(actual, *inputs[2:3], *inputs[4:])
    for a, e in [(actual.logits, expected.logits), (actual.h0, expected.h0),
                 *zip(keys + values, expected.present_keys + expected.present_values)]:
        assert_close_to_scale(a, e)
    hidden = torch.randn(7, torch_engine.spec.hidden_size, generator=torch.Generator().manual_seed(1))
    token = torch.randint(0, torch_engine.spec.vocab_size, (7,), generator=torch.Generator().manual_seed(2))
    for head in range(3):
        want, got = torch_engine.draft_step(hidden, token, head), ort_engine.draft_step(hidden, token, head)
        torch.testing.assert_close(got.next_hidden, want.next_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.topk_ids, want.topk_ids)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("key", [("llama", "clover"), ("llama", "medusa"), ("qwen2", "clover")])
def test_speculative_decoding_through_onnxruntime_equals_torch_vanilla(checkpoints, engines, batch, key):
    arch, method = key
    ort_engine = OnnxRuntimeEngine(engines[key])
    torch_engine = _torch_engine(checkpoints[arch], engines[key])
    prompts = random_prompts(batch, batch, ort_engine.spec.vocab_size, 2, 20)
    expected = hf_greedy(checkpoints[arch], prompts, 24)  # transformers generate(): independent of clover
    assert vanilla_greedy(torch_engine, prompts, 24) == expected
    assert vanilla_greedy(ort_engine, prompts, 24) == expected
    results = SpeculativeDecoder(ort_engine, method, TreeConfig(budget=6)).generate(
        [GenerationRequest(p, max_new_tokens=24, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == expected
    assert sum(sum(r.stats.depth_tried) for r in results) > 0


@pytest.mark.parametrize("method", ["clover", "suffix"])
def test_suffix_candidates_through_onnxruntime_equal_vanilla(checkpoints, engines, method):
    """The suffix index's candidates merged into the heads' trees (and alone) on an onnxruntime engine, batch 3,
    prompts that repeat themselves so the index proposes from the first step."""
    ort_engine = OnnxRuntimeEngine(engines[("llama", "clover")])
    prompts = [p * 3 for p in random_prompts(31, 3, ort_engine.spec.vocab_size, 2, 8)]
    expected = hf_greedy(checkpoints["llama"], prompts, 24)
    decoder = SpeculativeDecoder(ort_engine, method, TreeConfig(budget=6, proposer="suffix"))
    results = decoder.generate([GenerationRequest(p, max_new_tokens=24, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == expected
    assert decoder.source_counts["suffix"][0] > 0  # candidates were merged into the trees


def test_cli_generate_with_engine_equals_torch(checkpoints, engines, tmp_path, capsys):
    engine_dir = engines[("llama", "clover")]
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": 1, "prompt": "hello"}) + "\n" + json.dumps({"id": 2, "prompt": "sea"}) + "\n")
    outputs = {}
    for name, source in [("engine", ["--engine", str(engine_dir)]),
                         ("torch", ["--target", str(checkpoints["llama"]), "--method", "vanilla"])]:
        out = tmp_path / f"{name}.jsonl"
        assert clover_main(["generate", *source, "--prompts-file", str(prompts), "--output", str(out),
                            "--max-new-tokens", "16"]) == 0
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in outputs["engine"]] == [r["token_ids"] for r in outputs["torch"]]
    assert [r["text"] for r in outputs["engine"]] == [r["text"] for r in outputs["torch"]]
    # the independent reference: the chat template through transformers, generate() up to EOS
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoints["llama"]))
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_dict=False) for text in ("hello", "sea")]
    expected = hf_greedy(checkpoints["llama"], prompt_ids, 16, stop_token_ids=(tokenizer.eos_token_id,))
    assert [r["token_ids"] for r in outputs["engine"]] == expected


def test_engine_json_is_self_describing(engines):
    meta = json.loads((engines[("llama", "clover")] / "engine.json").read_text())
    assert meta["contract_version"] == 3 and meta["dtype"] == "fp32" and meta["attention"] == "gqa"
    assert meta["files"]["target_batched"] == "target_batched.onnx"
    assert meta["tensors"]["target_batched"]["inputs"] == meta["tensors"]["target"]["inputs"]
    assert meta["drafter_config"]["method"] == "clover" and meta["num_kv_layers"] == 3
    heads_file = engines[("llama", "clover")].parent / "llama-clover-heads" / "model.safetensors"
    assert meta["source"]["drafter_sha256"] == hashlib.sha256(heads_file.read_bytes()).hexdigest()
    names = [t["name"] for t in meta["tensors"]["target"]["inputs"]]
    assert names[:4] == ["input_ids", "position_ids", "past_lengths", "spec_decoding_packed_mask"] == list(TARGET_INPUTS)
    assert names[4:] == ["past_key_0", "past_value_0", "past_key_1", "past_value_1", "past_key_2", "past_value_2"]
    outputs = [t["name"] for t in meta["tensors"]["target"]["outputs"]]
    assert outputs[:2] == ["logits", "h0"] and outputs[2] == "present_key_0"
    assert [t["name"] for t in meta["tensors"]["draft_step"]["outputs"]] == ["next_hidden", "topk_logprobs", "topk_ids"]
    assert [t["name"] for t in meta["tensors"]["draft_step"]["inputs"]] == list(DRAFT_INPUTS)
    model = onnx.load(str(engines[("llama", "clover")] / "target.onnx"), load_external_data=False)
    assert model.opset_import[0].version >= 17
    dims = [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "tokens"]
    assert (engines[("llama", "clover")] / "tokenizer.json").exists()


def test_plugin_variant_graph(checkpoints, tmp_path):
    engine_dir = build_engine(tmp_path / "plugin", str(checkpoints["qwen2"]), None, attention="plugin", **quiet)
    path = engine_dir / "target.onnx"
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "TreeAttention"]
    assert len(nodes) == 3  # two target layers + the Augmenting Block
    assert all(n.domain == "clover" for n in nodes)
    assert ("clover", 1) in [(o.domain, o.version) for o in model.opset_import]
    cache_inputs = {i.name for i in model.graph.input if i.name.startswith("past_")}
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["num_q_heads"] == 4 and attrs["num_kv_heads"] == 1 and attrs["head_dim"] == 16
        assert math.isclose(attrs["scale"], 1 / math.sqrt(16), rel_tol=1e-6)
        assert attrs["plugin_namespace"] == b"clover" and attrs["plugin_version"] == b"1"
        assert len(node.input) == 7 and len(node.output) == 1
        assert node.input[3] in cache_inputs and node.input[4] in cache_inputs
        assert list(node.input[5:]) == ["past_lengths", "spec_decoding_packed_mask"]
    with pytest.raises(ConfigError, match="plugin"):
        OnnxRuntimeEngine(engine_dir)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_plugin_variant_graph_computes_the_torch_target(checkpoints, arch, tmp_path):
    """The --attention plugin graph (what TensorRT builds) run by onnx's reference evaluator, its TreeAttention
    nodes by the reference op clover.attention.tree_attention: the same logits and h0 as the torch engine, for
    mixed past lengths and a random tree mask. Everything but the plugin kernel is so checked without TensorRT."""
    save_drafter(make_drafter(load_target(checkpoints[arch]), method="clover", num_heads=3), tmp_path / "heads")
    assert_plugin_graph_computes_the_torch_target(checkpoints[arch], tmp_path / "heads", tmp_path / "plugin")


def assert_plugin_graph_computes_the_torch_target(checkpoint, heads, engine_path) -> None:
    """Build ``heads`` over ``checkpoint`` with ``--attention plugin`` into ``engine_path`` and hold its target
    graph, run by onnx's reference evaluator, to the torch engine (3 sequences, 37 tokens, pasts 0/5/19)."""
    import numpy as np
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    from clover.attention import tree_attention

    class TreeAttention(OpRun):
        op_domain = "clover"

        def _run(self, q, k, v, past_k, past_v, lengths, mask, **attrs):
            inputs = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v, past_k, past_v, lengths, mask)]
            return (tree_attention(*inputs, scale=self.scale).numpy(),)

    target = load_target(checkpoint)
    engine_dir = build_engine(engine_path, str(checkpoint), str(heads), attention="plugin", max_seq=256, **quiet)
    torch_engine = TorchEngine(target, load_drafter(heads, target), max_seq_len=256)
    spec, gen = torch_engine.spec, torch.Generator().manual_seed(0)
    batch, tokens, past = 3, 37, torch.tensor([0, 5, 19], dtype=torch.int32)
    ids = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen)
    positions = past[:, None].long() + torch.randint(0, 4, (batch, tokens), generator=gen)
    visible = (torch.rand(batch, tokens, tokens, generator=gen) > 0.5).tril() | torch.eye(tokens, dtype=torch.bool)
    shape = (batch, spec.num_kv_heads, 64, spec.head_dim)
    k_cache = [torch.randn(shape, generator=gen) for _ in range(spec.num_kv_layers)]
    v_cache = [torch.randn(shape, generator=gen) for _ in range(spec.num_kv_layers)]
    want = torch_engine.target(ids, positions, past, pack_mask(visible), k_cache, v_cache)
    feeds = {"input_ids": ids.numpy(), "position_ids": positions.numpy(), "past_lengths": past.numpy(),
             "spec_decoding_packed_mask": pack_mask(visible).numpy()}
    for i in range(spec.num_kv_layers):
        feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = k_cache[i].numpy(), v_cache[i].numpy()
    model = onnx.load(str(engine_dir / "target.onnx"))
    logits, h0 = ReferenceEvaluator(model, new_ops=[TreeAttention]).run(["logits", "h0"], feeds)
    assert_close_to_scale(torch.from_numpy(logits), want.logits)
    assert_close_to_scale(torch.from_numpy(h0), want.h0)


def test_failed_build_leaves_nothing_behind(checkpoints, tmp_path, monkeypatch):
    import clover.export.onnx_graph as onnx_graph

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure half-way")

    monkeypatch.setattr(onnx_graph, "export_draft_step", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        build_engine(tmp_path / "engine", str(checkpoints["llama"]), None, **quiet)
    assert list(tmp_path.iterdir()) == []  # neither the engine nor its temporary directory


def test_build_errors_are_clear(checkpoints, tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="unsupported architecture"):
        build_engine(tmp_path / "e1", str(tmp_path / "gpt2"), None, **quiet)
    other = load_target(checkpoints["qwen2"])
    save_drafter(make_drafter(other), tmp_path / "qwen-heads")
    with pytest.raises(ConfigError, match="different target"):
        build_engine(tmp_path / "e2", str(checkpoints["llama"]), str(tmp_path / "qwen-heads"), **quiet)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="cannot write"):
        build_engine(tmp_path / "a-file" / "engine", str(checkpoints["llama"]), None, **quiet)
    build_engine(tmp_path / "e3", str(checkpoints["llama"]), "none", **quiet)
    with pytest.raises(ConfigError, match="already exists"):
        build_engine(tmp_path / "e3", str(checkpoints["llama"]), "none", **quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "e3", "gpt2", "qwen-heads"]
    with pytest.raises(ConfigError, match="not an engine directory"):
        OnnxRuntimeEngine(tmp_path / "gpt2")


def test_vanilla_only_engine(checkpoints, tmp_path):
    engine_dir = build_engine(tmp_path / "vanilla", str(checkpoints["llama"]), "none", **quiet)
    engine = OnnxRuntimeEngine(engine_dir)
    assert engine.spec.num_draft_heads == 0 and not (engine_dir / "draft_step.onnx").exists()
    with pytest.raises(ConfigError, match="needs draft heads"):
        SpeculativeDecoder(engine, "clover")
    prompts = random_prompts(4, 2, engine.spec.vocab_size, 2, 10)
    torch_engine = TorchEngine(load_target(checkpoints["llama"]), None)
    out = SpeculativeDecoder(engine, "vanilla").generate([GenerationRequest(p, 12, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in out] == vanilla_greedy(torch_engine, prompts, 12)
    assert [r.token_ids for r in out] == hf_greedy(checkpoints["llama"], prompts, 12)


def test_tensorrt_backend_says_clearly_when_missing(checkpoints, tmp_path):
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="TensorRT is not installed"):
            build_engine(tmp_path / "trt", str(checkpoints["llama"]), None, backend="tensorrt", **quiet)
        assert not (tmp_path / "trt").exists()
    else:
        pytest.skip("tensorrt is installed: the GPU check script covers it")


# fp16 greedy prefers a token t over the fp32 argmax a only where z16[t] >= z16[a], so z32[a] - z32[t] is at most
# twice the fp16 engine's logit error |z16 - z32|: that measured error, not a constant tuned to one run, bounds the
# near-ties the rule allows (tests/helpers.py::assert_argmax_up_to_its_error, docs/testing.md). fp16 keeps 11
# significant bits; the error itself must stay fp16-sized, under FP16_ERROR_CAP of the logit scale (64 ulps;
# measured up to 1.3 % on prompt seeds 0-9): an engine that is wrong (RoPE, cache, mask) errs by whole logits.
FP16_ERROR_CAP = 2.0**-5


@pytest.fixture(scope="module")
def fp16_engine(checkpoints, tmp_path_factory):
    engine = OnnxRuntimeEngine(build_engine(tmp_path_factory.mktemp("fp16") / "fp16", str(checkpoints["llama"]),
                                            None, dtype="fp16", **quiet))
    assert engine.spec.dtype == torch.float16
    return engine


@pytest.mark.parametrize("prompt_seed", range(10))
def test_fp16_engine_decodes_the_fp32_reference_up_to_fp16_near_ties(checkpoints, fp16_engine, prompt_seed):
    """Vanilla and Clover decoding on an fp16 engine against transformers fp32 logits, by the near-tie rule.

    Every emitted token is judged on its own prefix (teacher forcing, so decoding is checked past a divergence):
    it must be the fp32 reference's argmax, or within twice the engine's fp16 logit error (measured on that path)
    of the reference's top logit; and that error stays fp16-sized (FP16_ERROR_CAP). No count of exact outputs:
    a prompt seed whose outputs deviate only at real near-ties passes (issue 48: seed 0 has 4 of 8 inexact).
    """
    checkpoint, engine = checkpoints["llama"], fp16_engine
    prompts = random_prompts(prompt_seed, 4, engine.spec.vocab_size, 2, 10)
    requests = [GenerationRequest(p, 24, stop_token_ids=()) for p in prompts]
    vanilla = SpeculativeDecoder(engine, "vanilla").generate(requests)
    clover = SpeculativeDecoder(engine, "clover").generate(requests)
    assert sum(sum(r.stats.depth_tried) for r in clover) > 0
    flips = []
    for name, results in (("vanilla", vanilla), ("clover", clover)):
        for index, (prompt, result) in enumerate(zip(prompts, results)):
            tokens = result.token_ids
            assert len(tokens) == 24
            reference = hf_next_logits(checkpoint, prompt, tokens)
            error = logit_error(full_pass_logits(engine, prompt, tokens), reference)
            deviations = assert_argmax_up_to_its_error(error, reference, tokens, FP16_ERROR_CAP,
                                                       f"fp16 {name} prompt {index}")
            flips += [(name, index, position, round(deficit, 4)) for position, deficit, _ in deviations]
    print(f"fp16 near-tie flips against the fp32 reference (decoder, prompt, position, deficit): {flips}")


@pytest.mark.parametrize("method", ["clover", "medusa"])
def test_int8_draft_step_is_lossless_and_close_to_fp32(checkpoints, engines, tmp_path, method):
    fp32_dir = engines[("llama", method)]
    heads = fp32_dir.parent / f"{fp32_dir.name}-heads"
    int8_dir = build_engine(tmp_path / "int8", str(checkpoints["llama"]), str(heads), max_seq=256, draft_int8=True,
                            **quiet)
    graph = onnx.load(str(int8_dir / "draft_step.onnx"), load_external_data=False).graph
    assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in graph.node)
    assert json.loads((int8_dir / "engine.json").read_text())["draft_quantization"]["quantized_matmuls"] >= 1
    fp32, int8 = OnnxRuntimeEngine(fp32_dir), OnnxRuntimeEngine(int8_dir)
    inputs = _random_step_inputs(fp32.spec, seed=5)
    assert torch.equal(int8.target(*inputs).logits, fp32.target(*inputs).logits)  # the target is untouched
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(64, fp32.spec.hidden_size, generator=gen)
    token = torch.randint(0, fp32.spec.vocab_size, (64,), generator=gen)
    want, got = fp32.draft_step(hidden, token, 1), int8.draft_step(hidden, token, 1)
    assert float((got.next_hidden - want.next_hidden).norm() / want.next_hidden.norm()) < 0.02
    assert (got.topk_ids[:, 0] == want.topk_ids[:, 0]).float().mean() >= 0.8  # measured 0.92-0.94 on these seeds
    prompts = random_prompts(6, 3, int8.spec.vocab_size, 2, 20)
    results = SpeculativeDecoder(int8, method, TreeConfig(budget=6)).generate(
        [GenerationRequest(p, max_new_tokens=24, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(checkpoints["llama"], prompts, 24)
    with pytest.raises(ConfigError, match="onnxruntime fp32"):
        build_engine(tmp_path / "fp16", str(checkpoints["llama"]), str(heads), dtype="fp16", draft_int8=True, **quiet)
