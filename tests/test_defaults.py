"""The default settings cannot lose speed and stay lossless (issue 14, docs/trees.md#adaptive-tree-budget).

An engine built with export/build_engine.py's default flags carries a cost model and int8 draft weights;
decoding on it with default settings picks each step's budget adaptively; the output still equals the
independent reference (transformers ``generate()``), on onnxruntime and on the torch path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from clover.adaptive import CostModel
from clover.backends import load_engine
from clover.backends.torch import TorchEngine
from clover.config import TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from tests.conftest import make_drafter, write_tiny_checkpoint
from tests.helpers import OracleEngine, hf_greedy, random_prompts

MAX_NEW = 16
REPO = Path(__file__).resolve().parent.parent


def _build_engine_script():
    spec = importlib.util.spec_from_file_location("build_engine_cli", REPO / "export" / "build_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def default_engine(tmp_path_factory):
    """(checkpoint, engine dir) built by ``export/build_engine.py`` with no flags but target and output."""
    root = tmp_path_factory.mktemp("defaults")
    checkpoint = write_tiny_checkpoint(root / "ckpt")
    engine_dir = root / "engine"
    assert _build_engine_script().main(["--target", str(checkpoint), "--output", str(engine_dir),
                                        "--max-seq", "128", "--max-batch", "4", "--max-tree", "8"]) == 0
    return checkpoint, engine_dir


def _decode(engine, method, prompts, tree=None, batch=4):
    decoder = SpeculativeDecoder(engine, method, tree, max_batch_size=batch)
    results = decoder.generate([GenerationRequest(p, MAX_NEW, stop_token_ids=()) for p in prompts])
    return decoder, [r.token_ids for r in results]


def test_an_engine_built_with_default_flags_carries_a_cost_model_and_int8_drafts(default_engine):
    engine = load_engine(default_engine[1])
    assert engine.cost_model is not None and engine.cost_model.target and engine.cost_model.draft
    assert engine.meta.draft_quantization is not None  # int8 draft weights are the onnxruntime fp32 default


def test_build_engine_flags_turn_the_defaults_off(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    assert _build_engine_script().main(["--target", str(checkpoint), "--output", str(tmp_path / "plain"),
                                        "--max-seq", "64", "--no-calibrate", "--no-draft-int8"]) == 0
    engine = load_engine(tmp_path / "plain")
    assert engine.cost_model is None and engine.meta.draft_quantization is None


@pytest.mark.parametrize("adaptive", [None, False], ids=["adaptive-default", "fixed-budget"])
def test_default_settings_are_lossless_on_onnxruntime(default_engine, adaptive):
    checkpoint, engine_dir = default_engine
    engine = load_engine(engine_dir)
    prompts = random_prompts(7, 5, engine.spec.vocab_size, 2, 12)
    tree = TreeConfig(budget=8) if adaptive is None else TreeConfig(budget=8, adaptive=adaptive)
    decoder, tokens = _decode(engine, engine.spec.default_method, prompts, tree)
    assert (decoder.adaptive is not None) == (adaptive is None)  # the default is adaptive on a calibrated engine
    assert tokens == hf_greedy(checkpoint, prompts, MAX_NEW)
    _, vanilla = _decode(engine, "vanilla", prompts)
    assert vanilla == tokens


def test_default_settings_are_lossless_on_the_torch_path(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    engine = TorchEngine.from_checkpoint(str(checkpoint), "untrained", "clover", max_seq_len=128)
    engine.calibrate_cost_model(max_tokens=20)
    prompts = random_prompts(8, 4, engine.spec.vocab_size, 2, 12)
    decoder, tokens = _decode(engine, "clover", prompts)  # default TreeConfig: adaptive with the measured model
    assert decoder.adaptive is not None and decoder.adaptive.cost is engine.cost_model
    assert tokens == hf_greedy(checkpoint, prompts, MAX_NEW)


def _default_budgets(engine, prompts, cost_model, max_new=40):
    """Budgets chosen while both sequences ran (a last step may have one), and the tokens."""
    # the cost model stands for the machine here (a roofline), so the decoder's own step times on this
    # tiny engine must not correct it
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=8), max_batch_size=2, cost_model=cost_model,
                                 step_timing=False)
    results = decoder.generate([GenerationRequest(p, max_new, stop_token_ids=()) for p in prompts])
    return [budget for batch, budget in decoder.adaptive.history if batch == 2], [r.token_ids for r in results]


def test_the_default_chooser_takes_vanilla_steps_with_useless_heads(tiny_target):
    """On a machine where verifying up to 16 tokens costs about one token (the paper's Figure 2), the default
    decoder keeps drafting with heads that always match (an oracle), and stops drafting, apart from its
    periodic probe, with heads that never match the target."""
    roofline = CostModel(target=[[1, 0.010], [16, 0.011], [256, 0.176]], draft=[[1, 0.001], [256, 0.002]])
    useless = TorchEngine(tiny_target, make_drafter(tiny_target, seed=5))
    prompts = random_prompts(9, 2, useless.spec.vocab_size, 2, 8)
    expected = hf_greedy(tiny_target, prompts, 40)
    oracle = OracleEngine(TorchEngine(tiny_target), prompts, expected)
    oracle_budgets, oracle_tokens = _default_budgets(oracle, prompts, roofline)
    useless_budgets, useless_tokens = _default_budgets(useless, prompts, roofline)
    assert oracle_tokens == useless_tokens == expected
    assert min(oracle_budgets) > 0, oracle_budgets
    # the acceptance average (decay 0.95 per sequence-step) falls from the prior to vanilla's break-even on this
    # nearly free verification within 2 x 12 sequence-steps; the periodic probe comes only after 64 vanilla steps
    assert useless_budgets[0] > 0 and all(b == 0 for b in useless_budgets[12:]), useless_budgets
