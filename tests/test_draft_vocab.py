"""Frequency-ranked draft vocabulary (FR-Spec; docs/drafter.md#draft-vocabulary): the draft step scores only V'
rows of the LM head, its ids stay target ids, decoding stays lossless, heads without a vocabulary are unchanged."""

import json

import onnx
import pytest
import torch

from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.backends.torch import DraftStep, TorchEngine
from clover.config import ConfigError, DrafterConfig, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.drafters import (DRAFT_VOCAB_FILE, draft_vocab_of, load_drafter, read_draft_vocab, save_draft_vocab,
                             save_drafter, set_draft_vocab)
from clover.export.builder import build_engine
from clover.target import load_target
from tests.conftest import make_drafter, make_target, write_tiny_checkpoint
from tests.helpers import hf_greedy, random_prompts
from training.draft_vocab import main as draft_vocab_main

METHODS = ["clover", "medusa", "clover-mlp-regressive", "clover-no-regressive", "clover-no-augment"]
TOP_K = 5
quiet = dict(progress=lambda message: None)


def _subset(vocab_size: int, size: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size]


def _step_inputs(hidden_size: int, vocab_size: int, nodes: int = 11, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(nodes, hidden_size, generator=gen), torch.randint(0, vocab_size, (nodes,), generator=gen)


@pytest.mark.parametrize("method", [*METHODS, "clover2"])
def test_subset_step_is_the_full_step_restricted_to_the_subset(method):
    target = make_target()
    drafter = make_drafter(target, method=method)
    hidden, token = _step_inputs(32, 97)
    subset = _subset(97, 40, seed=len(method))
    full_logits = [drafter.step(hidden, token, head, target.lm_head.weight)[1] for head in range(3)]  # [N, V]
    full_next = [drafter.step(hidden, token, head, target.lm_head.weight)[0] for head in range(3)]
    set_draft_vocab(drafter, subset)
    step = DraftStep(target, drafter, TOP_K)
    outside = torch.ones(97, dtype=torch.bool)
    outside[subset] = False
    for head in range(3):
        with torch.no_grad():
            got = step(hidden, token, head)
        # independent restriction: mask the full logits, renormalise over the subset, top-k over the full id space
        masked = torch.log_softmax(full_logits[head].float().masked_fill(outside, float("-inf")), dim=-1)
        want = torch.topk(masked, TOP_K, dim=-1)
        assert torch.isin(got.topk_ids, subset).all()
        assert torch.equal(got.topk_ids, want.indices)
        torch.testing.assert_close(got.topk_logprobs, want.values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.next_hidden, full_next[head], rtol=0, atol=0)  # only the scoring changes


def test_a_permuted_full_vocabulary_changes_nothing():
    target = make_target()
    drafter = make_drafter(target)
    hidden, token = _step_inputs(32, 97)
    with torch.no_grad():
        want = DraftStep(target, drafter, TOP_K)(hidden, token, 1)
        set_draft_vocab(drafter, _subset(97, 97, seed=9))  # every id, in another order
        got = DraftStep(target, drafter, TOP_K)(hidden, token, 1)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=1e-5, atol=1e-5)


def test_draft_vocab_checks():
    target = make_target()
    drafter = make_drafter(target)
    for bad in ([], [3, 3], [97], [-1]):
        with pytest.raises(ConfigError):
            set_draft_vocab(drafter, torch.tensor(bad, dtype=torch.long))
    set_draft_vocab(drafter, torch.arange(4))
    with pytest.raises(ConfigError, match="top 5"):
        DraftStep(target, drafter, TOP_K)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        DrafterConfig(method="clover", num_heads=1, hidden_size=32, vocab_size=97, target_num_layers=2,
                      draft_vocab_size=98)


def test_heads_without_a_vocabulary_load_and_run_unchanged(tmp_path):
    target = make_target()
    drafter = make_drafter(target)
    save_drafter(drafter, tmp_path / "heads")
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    del config["draft_vocab_size"]  # heads saved before draft vocabularies existed
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    assert not (tmp_path / "heads" / DRAFT_VOCAB_FILE).exists()
    loaded = load_drafter(tmp_path / "heads", target)
    assert draft_vocab_of(loaded) is None and loaded.config.draft_vocab_size == 0
    hidden, token = _step_inputs(32, 97)
    with torch.no_grad():
        want, got = DraftStep(target, drafter, TOP_K)(hidden, token, 2), DraftStep(target, loaded, TOP_K)(hidden, token, 2)
    assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_logprobs, want.topk_logprobs)
    with pytest.raises(ConfigError, match="training/draft_vocab.py"):
        load_drafter(tmp_path / "heads", target, draft_vocab_size=10)


def test_vocabulary_round_trips_with_the_heads(tmp_path):
    target = make_target()
    drafter = make_drafter(target)
    ranking = _subset(97, 60, seed=4)
    save_drafter(drafter, tmp_path / "heads")
    save_draft_vocab(tmp_path / "heads", ranking)
    config = DrafterConfig.load(tmp_path / "heads" / "config.json")
    config.draft_vocab_size = 30
    config.save(tmp_path / "heads" / "config.json")
    assert torch.equal(draft_vocab_of(load_drafter(tmp_path / "heads", target)), ranking[:30])
    assert torch.equal(draft_vocab_of(load_drafter(tmp_path / "heads", target, draft_vocab_size=60)), ranking)
    assert draft_vocab_of(load_drafter(tmp_path / "heads", target, draft_vocab_size=0)) is None
    with pytest.raises(ConfigError, match="ranks only 60"):
        load_drafter(tmp_path / "heads", target, draft_vocab_size=61)
    resaved = load_drafter(tmp_path / "heads", target)
    save_drafter(resaved, tmp_path / "again")  # the active vocabulary travels with the heads
    assert torch.equal(draft_vocab_of(load_drafter(tmp_path / "again", target)), ranking[:30])


# -- engines ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("vocab") / "llama")


def _heads_with_vocab(checkpoint, directory, method, size=48, ranked=80, seed=0):
    """Random heads of ``method`` with a ranking of ``ranked`` ids, ``size`` of them used by default."""
    target = load_target(checkpoint)
    drafter = make_drafter(target, method=method, seed=seed + 1)
    save_drafter(drafter, directory)
    save_draft_vocab(directory, _subset(target.config.vocab_size, ranked, seed=seed))
    config = DrafterConfig.load(directory / "config.json")
    config.draft_vocab_size = size
    config.save(directory / "config.json")
    return directory


@pytest.fixture(scope="module")
def vocab_engines(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-engines")
    built = {}
    for method in METHODS:
        heads = _heads_with_vocab(checkpoint, root / f"{method}-heads", method, seed=len(method))
        built[method] = build_engine(root / method, str(checkpoint), str(heads), max_seq=256, draft_top_k=TOP_K,
                                     **quiet)
    return built


def _torch_engine(checkpoint, engine_dir):
    target = load_target(checkpoint)
    heads = load_drafter(engine_dir.parent / f"{engine_dir.name}-heads", target)
    return TorchEngine(target, heads, max_seq_len=256, draft_top_k=TOP_K)


@pytest.mark.parametrize("method", METHODS)
def test_onnx_draft_step_with_a_vocabulary_matches_torch(checkpoint, vocab_engines, method):
    ort_engine, torch_engine = OnnxRuntimeEngine(vocab_engines[method]), _torch_engine(checkpoint, vocab_engines[method])
    assert ort_engine.meta.drafter_config.draft_vocab_size == 48  # engine.json records V'
    vocab = draft_vocab_of(torch_engine.draft.drafter)
    hidden, token = _step_inputs(ort_engine.spec.hidden_size, ort_engine.spec.vocab_size, nodes=7, seed=1)
    for head in range(3):
        want, got = torch_engine.draft_step(hidden, token, head), ort_engine.draft_step(hidden, token, head)
        torch.testing.assert_close(got.next_hidden, want.next_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.topk_ids, want.topk_ids) and torch.isin(got.topk_ids, vocab).all()
    weights = {t.name: list(t.dims) for t in onnx.load(str(vocab_engines[method] / "draft_step.onnx")).graph.initializer}
    assert weights["draft_lm_head.weight"] == [ort_engine.spec.hidden_size, 48] and weights["draft_vocab"] == [48]
    assert ("lm_head.weight" in weights) == (method not in ("medusa", "clover-no-regressive"))


@pytest.mark.parametrize("method", ["clover", "medusa"])
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_decoding_with_a_vocabulary_equals_transformers_greedy(checkpoint, vocab_engines, method, backend):
    engine_dir = vocab_engines[method]
    engine = OnnxRuntimeEngine(engine_dir) if backend == "onnxruntime" else _torch_engine(checkpoint, engine_dir)
    prompts = random_prompts(7, 3, engine.spec.vocab_size, 2, 20)
    for batch in (1, 3):
        results = SpeculativeDecoder(engine, method, TreeConfig(budget=6, adaptive=False),
                                     max_batch_size=batch).generate(
            [GenerationRequest(p, max_new_tokens=24, stop_token_ids=()) for p in prompts])
        assert [r.token_ids for r in results] == hf_greedy(checkpoint, prompts, 24)
        assert all(r.stats.depth_tried for r in results)  # the trees were really speculative


def test_int8_draft_step_quantizes_only_the_vocabulary_rows(checkpoint, vocab_engines, tmp_path):
    heads = vocab_engines["clover"].parent / "clover-heads"
    engine_dir = build_engine(tmp_path / "int8", str(checkpoint), str(heads), max_seq=256, draft_top_k=TOP_K,
                              draft_int8=True, **quiet)
    graph = onnx.load(str(engine_dir / "draft_step.onnx")).graph
    weights = {t.name: list(t.dims) for t in graph.initializer}
    assert weights["draft_lm_head.weight_quantized"] == [load_target(checkpoint).config.hidden_size, 48]
    assert not any("lm_head.weight.transposed" in name for name in weights)  # no full-vocabulary MatMul
    engine = OnnxRuntimeEngine(engine_dir)
    prompts = random_prompts(8, 3, engine.spec.vocab_size, 2, 20)
    results = SpeculativeDecoder(engine, "clover", TreeConfig(budget=6, adaptive=False)).generate(
        [GenerationRequest(p, max_new_tokens=24, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(checkpoint, prompts, 24)


def test_build_option_picks_a_prefix_of_the_ranking(checkpoint, vocab_engines, tmp_path):
    heads = vocab_engines["clover"].parent / "clover-heads"
    ranking = draft_vocab_of(load_drafter(heads, load_target(checkpoint), draft_vocab_size=80))
    engine_dir = build_engine(tmp_path / "v20", str(checkpoint), str(heads), max_seq=256, draft_vocab=20,
                              calibrate=False, **quiet)
    assert json.loads((engine_dir / "engine.json").read_text())["drafter_config"]["draft_vocab_size"] == 20
    engine = OnnxRuntimeEngine(engine_dir)
    ids = engine.draft_step(*_step_inputs(engine.spec.hidden_size, 97, nodes=9), 0).topk_ids
    assert torch.isin(ids, ranking[:20]).all()
    full = build_engine(tmp_path / "v0", str(checkpoint), str(heads), max_seq=256, draft_vocab=0, **quiet)
    names = {t.name for t in onnx.load(str(full / "draft_step.onnx"), load_external_data=False).graph.initializer}
    assert "draft_vocab" not in names
    assert OnnxRuntimeEngine(full).meta.drafter_config.draft_vocab_size == 0
    for kwargs, message in [(dict(draft_vocab=81), "ranks only 80"), (dict(draft_vocab=4), "top 8"),
                            (dict(draft_vocab=-1), ">= 0")]:
        with pytest.raises(ConfigError, match=message):
            build_engine(tmp_path / "bad", str(checkpoint), str(heads), **kwargs, **quiet)
    with pytest.raises(ConfigError, match="draft_vocab.py"):
        build_engine(tmp_path / "bad", str(checkpoint), "untrained", draft_vocab=20, **quiet)
    assert not (tmp_path / "bad").exists()


# -- the tool ----------------------------------------------------------------------------------------------------


def test_tool_ranks_answer_tokens_by_frequency(checkpoint, tmp_path, capsys):
    target = load_target(checkpoint)
    save_drafter(make_drafter(target), tmp_path / "heads")
    records = [{"prompt_ids": [90, 90, 90, 90], "response_ids": [5, 7, 7, 9, 9, 9]},
               {"prompt_ids": [91], "response_ids": [9, 7, 4]}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(json.dumps({"response_ids": [9, 9, 7, 50]}) + "\n")
    assert draft_vocab_main(["--data", str(data), "--heads", str(tmp_path / "heads"), "--size", "2", "--keep", "4",
                             "--eval", str(held_out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens_counted"] == 9 and report["distinct_tokens"] == 4
    assert report["eval_coverage"]["2"] == pytest.approx(3 / 4)  # 9, 9, 7 of 9, 9, 7, 50
    heads = load_drafter(tmp_path / "heads", target)
    assert heads.config.draft_vocab_size == 2 and draft_vocab_of(heads).tolist() == [9, 7]
    assert draft_vocab_of(load_drafter(tmp_path / "heads", target, draft_vocab_size=4)).tolist() == [9, 7, 4, 5]
    # prompts counted too, and records without ids tokenised with the target's tokenizer (byte-level here)
    text = tmp_path / "prompts.jsonl"
    text.write_text(json.dumps({"messages": [{"role": "user", "content": "zz"},
                                             {"role": "assistant", "content": "zzzzz"}]}) + "\n")
    assert draft_vocab_main(["--data", str(data), "--data", str(text), "--heads", str(tmp_path / "heads"),
                             "--size", "3", "--count-prompts", "--target", str(checkpoint)]) == 0
    z = _token_id(checkpoint, "z")
    assert draft_vocab_of(load_drafter(tmp_path / "heads", target)).tolist() == [z, 9, 90]  # 7, 4 and 4 counts
    assert draft_vocab_main(["--data", str(tmp_path / "missing.jsonl"), "--heads", str(tmp_path / "heads"),
                             "--size", "2"]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    # before any heads exist: a plain directory, read back as train.py --draft-vocab reads it
    assert draft_vocab_main(["--data", str(data), "--output", str(tmp_path / "vocab"), "--size", "2",
                             "--target", str(checkpoint)]) == 0
    assert read_draft_vocab(tmp_path / "vocab", 2).tolist() == [9, 7]
    assert not (tmp_path / "vocab" / "config.json").exists()


def _token_id(checkpoint, text: str) -> int:
    from clover.target import load_tokenizer

    (token,) = load_tokenizer(checkpoint).encode(text, add_special_tokens=False)
    return token


def test_a_demo_engine_without_the_shipped_vocabulary_is_rebuilt(tmp_path):
    """``clover serve --demo`` / ``clover generate`` rebuild engines/demo when its draft vocabulary is not the
    shipped heads' default (an engine built before the vocabulary shipped), or its heads' weights are not the
    shipped ones (heads updated since the build)."""
    from clover.adaptive import CostModel
    from clover.demo import resolve_drafter
    from clover.engine_dir import EngineLimits, EngineMeta
    from clover.export.builder import DEMO_TARGET_COMPUTE, DEMO_TARGET_WEIGHTS, demo_engine_is_current, heads_digest
    from tests.conftest import tiny_target_config

    heads = resolve_drafter(None, "demo")
    if heads is None:
        pytest.skip("this install ships no demo heads")
    shipped = DrafterConfig.load(f"{heads}/config.json")
    cases = [(shipped.draft_vocab_size, heads_digest(heads), True),
             (0 if shipped.draft_vocab_size else 16, heads_digest(heads), False),
             (shipped.draft_vocab_size, "0" * 64, False),  # built from earlier heads at the same path
             (shipped.draft_vocab_size, None, False)]  # built before engines recorded the heads' digest
    for size, digest, current in cases:
        drafter_config = DrafterConfig.from_dict({**shipped.to_dict(), "draft_vocab_size": size})
        EngineMeta(backend="onnxruntime", dtype="fp32", attention="gqa", files={}, tensors={}, num_kv_layers=3,
                   limits=EngineLimits(1, 1, 64), target_config=tiny_target_config(), drafter_config=drafter_config,
                   source={"drafter": heads, "drafter_sha256": digest}, cost_model=CostModel(target=[[1, 0.1]]),
                   target_quantization={"weights": DEMO_TARGET_WEIGHTS, "compute": DEMO_TARGET_COMPUTE}).write(tmp_path)
        assert demo_engine_is_current(tmp_path) == current
