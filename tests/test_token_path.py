"""Token paths of the regressive step (DrafterConfig.token_path, issue 28; docs/drafter.md#token-path).

Every path: a head's output depends on the token it is given; teacher-forced training equals the decode loop's
draft_step calls; decoding with random heads is lossless on torch and through onnxruntime; the exported draft step
computes the torch step. Heads saved before the field existed still load and decode as before.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.backends.torch import TorchEngine
from clover.config import TOKEN_PATHS, ConfigError, DrafterConfig, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.demo import SHIPPED_HEADS_DIR
from clover.drafters import calibrate_token_scale, load_drafter, save_drafter
from clover.export.builder import build_engine
from clover.target import load_target
from tests.conftest import make_drafter, make_target, write_tiny_checkpoint
from tests.helpers import hf_greedy, random_prompts
from training import batches as batches_mod
from training import forward as forward_mod
from training import train as train_mod
from training.hidden_cache import target_hidden_states

MAX_NEW = 20
NEW_PATHS = [p for p in TOKEN_PATHS if p != "residual"]


def _generate(engine, prompts, budget=6):
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=budget, adaptive=False, proposer="none"))
    return [r.token_ids for r in decoder.generate([GenerationRequest(p, max_new_tokens=MAX_NEW, stop_token_ids=())
                                                   for p in prompts])]


def _batch(target, ids: list[int], num_prompt: int) -> batches_mod.Batch:
    with torch.no_grad():
        last_input, last_hidden = target_hidden_states(target, torch.tensor([ids]))
    return batches_mod.Batch(last_input, last_hidden, torch.tensor([ids]), torch.arange(len(ids))[None] >= num_prompt,
                           torch.tensor([len(ids)]), [""])


def _root_states(target, drafter, seed: int = 0):
    """h0 at every answer root of a random conversation (the target's own scale), its roots and the drafter."""
    ids = random_prompts(seed, 1, target.config.vocab_size, 40, 40)[0]
    batch = _batch(target, ids, 8)
    roots = forward_mod.find_roots(batch, drafter.config.num_heads)
    with torch.no_grad():
        h0 = forward_mod.compute_h0(drafter, target, batch)[roots.b, roots.t]
    return h0, roots


def _token_sensitivity(drafter, target, h0, tokens, head) -> float:
    """Share of states whose top-1 changes when the given token is replaced by another one."""
    other = (tokens + 1 + torch.arange(len(tokens)) % 7) % target.config.vocab_size
    with torch.no_grad():
        _, a = drafter.step(h0, tokens, head, target.lm_head.weight)
        _, b = drafter.step(h0, other, head, target.lm_head.weight)
    return float((a.argmax(-1) != b.argmax(-1)).float().mean())


def _cut_token_path(drafter) -> None:
    """Scale the token's contribution to nothing (what the test must catch)."""
    reg = drafter.regressive
    with torch.no_grad():
        if drafter.config.regressive == "concat":
            reg.fc.weight[:, drafter.config.hidden_size:].zero_()
        else:
            reg.v_proj.weight.zero_()


@pytest.mark.parametrize("token_path", TOKEN_PATHS)
def test_a_heads_output_depends_on_its_given_token(token_path):
    target = make_target(seed=2)
    drafter = make_drafter(target, token_path=token_path, seed=3)  # trained-like: every weight non-zero
    h0, roots = _root_states(target, drafter)
    if token_path == "scaled":
        calibrate_token_scale(drafter, h0)
    if token_path == "residual":  # its unit-norm token needs a Wv at the stream's scale (random 0.2 drowns it)
        with torch.no_grad():
            drafter.regressive.v_proj.weight.mul_(h0.norm(dim=-1).median())
    h = h0
    for head in range(drafter.config.num_heads):
        assert _token_sensitivity(drafter, target, h, roots.tok_in[:, head], head) > 0.2, (token_path, head)
        with torch.no_grad():
            h, _ = drafter.step(h, roots.tok_in[:, head], head, target.lm_head.weight)
    _cut_token_path(drafter)
    assert _token_sensitivity(drafter, target, h0, roots.tok_in[:, 0], 0) == 0.0  # the measure sees a cut path


def test_the_token_paths_start_where_the_residual_path_starts():
    """At initialisation every path drafts the target's own next-token logits from h0 (equal starting points)."""
    target = make_target(seed=4)
    base = make_drafter(target, randomize=False)
    h0, roots = _root_states(target, base)
    _, want = base.step(h0, roots.tok_in[:, 0], 0, target.lm_head.weight)
    for token_path in NEW_PATHS:
        drafter = make_drafter(target, token_path=token_path, randomize=False)
        calibrate_token_scale(drafter, h0)
        _, got = drafter.step(h0, roots.tok_in[:, 0], 0, target.lm_head.weight)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), token_path
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("token_path", NEW_PATHS)
@pytest.mark.parametrize("batch", [1, 3])
def test_random_heads_of_every_token_path_equal_vanilla(token_path, batch):
    target = make_target(seed=7)
    engine = TorchEngine(target, make_drafter(target, token_path=token_path, seed=8), max_seq_len=128)
    prompts = random_prompts(7 + batch, batch, target.config.vocab_size, 2, 16)
    assert _generate(engine, prompts) == hf_greedy(target, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """An onnxruntime engine per new token path on a tiny llama checkpoint, with its torch twin."""
    root = tmp_path_factory.mktemp("token-path")
    checkpoint = write_tiny_checkpoint(root / "llama")
    target = load_target(checkpoint)
    built = {}
    for token_path in NEW_PATHS:
        heads = root / f"heads-{token_path}"
        save_drafter(make_drafter(target, token_path=token_path, seed=9), heads)
        engine_dir = build_engine(root / f"engine-{token_path}", str(checkpoint), str(heads), max_seq=128,
                                  progress=lambda message: None)
        built[token_path] = (OnnxRuntimeEngine(engine_dir),
                             TorchEngine(target, load_drafter(heads, target), max_seq_len=128), target)
    return built


@pytest.mark.parametrize("token_path", NEW_PATHS)
def test_exported_draft_step_computes_the_torch_step(engines, token_path):
    ort_engine, torch_engine, _ = engines[token_path]
    assert ort_engine.meta.drafter_config.token_path == token_path
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, torch_engine.spec.hidden_size, generator=gen) * 30  # a raw residual-stream scale
    token = torch.randint(0, torch_engine.spec.vocab_size, (7,), generator=gen)
    for head in range(3):
        want, got = torch_engine.draft_step(hidden, token, head), ort_engine.draft_step(hidden, token, head)
        torch.testing.assert_close(got.next_hidden, want.next_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.topk_ids, want.topk_ids)


@pytest.mark.parametrize("token_path", NEW_PATHS)
def test_decoding_through_onnxruntime_equals_vanilla(engines, token_path):
    ort_engine, _, target = engines[token_path]
    prompts = random_prompts(11, 3, target.config.vocab_size, 2, 16)
    assert _generate(ort_engine, prompts) == hf_greedy(target, prompts, MAX_NEW)


def test_heads_saved_before_token_paths_load_and_decode_unchanged(tmp_path):
    target = make_target(seed=12)
    drafter = make_drafter(target, seed=13)
    save_drafter(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["token_path"]  # a config.json written before the field existed
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_drafter(tmp_path, target)
    assert loaded.config.token_path == "residual"
    h0, roots = _root_states(target, loaded)
    for head in range(3):
        with torch.no_grad():
            want = drafter.step(h0, roots.tok_in[:, head], head, target.lm_head.weight)
            got = loaded.step(h0, roots.tok_in[:, head], head, target.lm_head.weight)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    prompts = random_prompts(12, 2, target.config.vocab_size, 2, 12)
    assert _generate(TorchEngine(target, loaded, max_seq_len=128), prompts) == hf_greedy(target, prompts, MAX_NEW)


@pytest.mark.parametrize("method", ["clover", "medusa"])
def test_the_shipped_heads_have_exactly_the_weights_of_their_token_path(method):
    from safetensors import safe_open

    from clover.config import TargetConfig
    from clover.drafters import drafter_class

    config = DrafterConfig.load(SHIPPED_HEADS_DIR / method / "config.json")
    # Clover: the concat path won the equal-data comparison (docs/results/heads-token-path); Medusa has none
    assert config.token_path == {"clover": "concat", "medusa": "residual"}[method]
    target_config = TargetConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=8,
                                 num_layers=config.target_num_layers, num_heads=9, num_kv_heads=3, head_dim=64)
    drafter = drafter_class(config)(config, target_config)
    with safe_open(str(SHIPPED_HEADS_DIR / method / "model.safetensors"), "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    if drafter.augment is not None:  # the tiny intermediate size above only shapes the MLP of the block
        expected = {k: v for k, v in expected.items() if ".mlp." not in k}
        stored = {k: v for k, v in stored.items() if ".mlp." not in k}
    assert stored == expected


def test_token_paths_need_the_attention_decoder():
    with pytest.raises(ConfigError, match="token path"):
        DrafterConfig(method="medusa", num_heads=3, hidden_size=32, vocab_size=97, target_num_layers=2,
                      token_path="normed")
    with pytest.raises(ConfigError, match="unknown token path"):
        DrafterConfig(method="clover", num_heads=3, hidden_size=32, vocab_size=97, target_num_layers=2,
                      token_path="sideways")


@pytest.mark.parametrize("token_path", NEW_PATHS)
def test_training_runs_each_token_path_and_saves_heads_that_decode(token_path, tmp_path):
    from training.hidden_cache import build_cache

    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    target = load_target(checkpoint)
    prompts = random_prompts(3, 6, target.config.vocab_size, 4, 8)
    answers = random_prompts(4, 6, target.config.vocab_size, 10, 16)
    records = [{"id": f"r{i}", "category": "chat", "prompt_ids": p, "response_ids": a}
               for i, (p, a) in enumerate(zip(prompts, answers))]
    cache = build_cache(records, target, tmp_path / "cache", batch_tokens=256, progress=False)
    cfg = train_mod.TrainConfig(method="clover", cache=str(cache), output=str(tmp_path / "run"), target=str(checkpoint),
                                num_heads=3, decoder_heads=2, batch_tokens=64, lr=3e-3, progress=False, device="cpu",
                                token_path=token_path, labels="soft")
    train_mod.train(cfg, target)
    heads = load_drafter(tmp_path / "run", target)
    assert heads.config.token_path == token_path
    if token_path == "scaled":  # calibrated to the data's root-state norm, not left at its placeholder 1
        assert float(heads.regressive.token_scale) > 2.0
    prompts = random_prompts(14, 2, target.config.vocab_size, 2, 12)
    assert _generate(TorchEngine(target, heads.float(), max_seq_len=128), prompts) == hf_greedy(target, prompts, MAX_NEW)


def test_topk_distillation_loss_is_the_soft_cross_entropy_over_the_targets_top_k():
    """HASS's top-K term: -sum over the target's K likeliest tokens of p log q; with K = V it is the soft CE."""
    gen = torch.Generator().manual_seed(0)
    logits, target_logits = torch.randn(5, 11, generator=gen), torch.randn(5, 11, generator=gen) * 3
    probs = torch.softmax(target_logits, -1)
    rows = forward_mod.DraftRows(None, torch.zeros(11, 4), None)
    labels = torch.zeros(5, dtype=torch.long)

    def loss(**spec):
        return float(forward_mod.head_loss(None, None, rows, None, logits, labels, None,
                                         forward_mod.LossSpec([1.0], "soft", **spec), probs))

    soft = loss()
    assert loss(topk_weight=1.0, topk_tokens=11) == pytest.approx(2 * soft, rel=1e-5)
    top = probs.topk(3, -1)
    manual = -(top.values * torch.log_softmax(logits, -1).gather(-1, top.indices)).sum()
    assert loss(topk_weight=0.5, topk_tokens=3) == pytest.approx(soft + 0.5 * float(manual), rel=1e-5)


def test_triton_model_serves_concat_heads_token_for_token(engines):
    """The Triton Python model on an engine whose heads use the EAGLE-style token path: streamed and whole
    answers are transformers' greedy decoding of the checkpoint (the oracle drafter of tests/helpers.py replaces
    the drafter whole, so the token path changes nothing it checks; random heads run the real path here)."""
    from clover.serving.triton_model import CloverTritonModel
    from tests.serving_support import Reference
    from tests.test_serving_unit import FakePbUtils, FakeRequest, _args, _text

    ort_engine = engines["concat"][0]
    reference = Reference(ort_engine.engine_dir, checkpoint=ort_engine.engine_dir.parent / "llama")
    model = CloverTritonModel(FakePbUtils, _args(ort_engine.engine_dir, threads="1", method="clover"))
    prompts = {"hello there": 20, "write a poem about the sea": 24, "1 2 3 4": 12}
    try:
        requests = {p: FakeRequest(text_input=_text(p), max_tokens=np.array([n], np.int32), stream=np.array([True]))
                    for p, n in prompts.items()}
        model.execute(list(requests.values()))
        for request in requests.values():
            assert request.sender.closed.wait(60)
    finally:
        model.finalize()
    for prompt, request in requests.items():
        outputs = [r.outputs for r in request.sender.responses]
        assert all(r.error is None for r in request.sender.responses)
        ids = [int(t) for o in outputs for t in o["output_ids"]]
        assert ids == reference(prompt, prompts[prompt]).token_ids, prompt


def test_recipe_curve_places_each_runs_agreement_at_its_tokens(tmp_path):
    from training.experiments.recipe_curve import main as recipe_curve

    for name, runs in {"small": {"a": [0.1, 0.05, 0.04], "b": [0.2, 0.1, 0.08]},
                       "large": {"a": [0.3, 0.15, 0.1], "b": [0.4, 0.2, 0.15]}}.items():
        report = {"runs": {run: {"teacher_forced": {"overall": {"agree1": agree}}} for run, agree in runs.items()}}
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    points = [f"{recipe}={tokens}:{tmp_path / name}.json:{recipe}" for recipe in ("a", "b")
              for tokens, name in (("330k", "large"), ("40k", "small"))]
    assert recipe_curve([arg for p in points for arg in ("--point", p)] + ["--output", str(tmp_path / "out")]) == 0
    rows = (tmp_path / "out" / "recipe_curve.md").read_text().splitlines()[2:]
    assert rows == ["| a | 40,000 | 0.100 | 0.050 | 0.040 |", "| a | 330,000 | 0.300 | 0.150 | 0.100 |",
                    "| b | 40,000 | 0.200 | 0.100 | 0.080 |", "| b | 330,000 | 0.400 | 0.200 | 0.150 |"]
    assert (tmp_path / "out" / "recipe_curve.png").stat().st_size > 5000
    with pytest.raises(SystemExit):
        recipe_curve(["--point", f"a=1k:{tmp_path / 'small'}.json:missing", "--output", str(tmp_path / "x")])
