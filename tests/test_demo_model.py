"""The real embedded SmolLM2-135M-Instruct (slow: converts the GGUF once, then decodes on CPU).

Each decoding of the prompts runs once for the module (the ``runs`` fixture): vanilla decoding, which
every test checks against the reference, and the untrained heads' decoding, which is both a lossless
check and the baseline of the shipped heads. The reference model is loaded once too
(tests/helpers.py caches it and its greedy outputs).
"""

import pytest
import torch

from clover.attention import causal_packed_mask
from clover.backends.torch import TorchEngine
from clover.config import TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.drafters import Drafter
from tests.helpers import NEAR_TIE, greedy_deviations, hf_greedy, hf_model, hf_next_logits

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Give me three tips for sleeping better."]
NEW_TOKENS = 48
# The reference is transformers generate() on the same checkpoint (tests/helpers.py::hf_greedy).


@pytest.fixture(scope="module")
def demo():
    from clover.demo import DemoModelMissing, demo_checkpoint
    from clover.target import load_target, load_tokenizer

    try:
        path = demo_checkpoint()
    except DemoModelMissing as exc:
        pytest.skip(str(exc))
    return path, load_target(path), load_tokenizer(path)


class Runs:
    """The chat-templated PROMPTS on the demo target and their decodings, each computed once."""

    def __init__(self, demo) -> None:
        _, self.target, tokenizer = demo
        self.prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                      return_dict=False) for p in PROMPTS]
        self.requests = [GenerationRequest(p, max_new_tokens=NEW_TOKENS, stop_token_ids=()) for p in self.prompts]
        self._engines: dict = {}
        self._results: dict = {}

    def decode(self, engine, method: str) -> list:
        if method == "vanilla":
            return SpeculativeDecoder(engine, "vanilla").generate(self.requests)
        return SpeculativeDecoder(engine, method, TreeConfig(budget=4)).generate(self.requests)

    def untrained_engine(self, method: str, num_heads: int) -> TorchEngine:
        """An engine with heads initialised from the target (deterministic: Drafter.from_target's seed)."""
        if (method, num_heads) not in self._engines:
            drafter = Drafter.untrained(self.target, method, num_heads)
            self._engines[method, num_heads] = TorchEngine(self.target, drafter, max_seq_len=512)
        return self._engines[method, num_heads]

    def _once(self, key: tuple, method: str, engine_key: tuple) -> list:
        if key not in self._results:
            self._results[key] = self.decode(self.untrained_engine(*engine_key), method)
        return self._results[key]

    @property
    def vanilla(self) -> list:
        """Vanilla decoding on an engine that has (untrained Clover) heads, as a server's method=vanilla."""
        return self._once(("vanilla",), "vanilla", ("clover", 3))

    def untrained(self, method: str, num_heads: int) -> list:
        return self._once(("untrained", method, num_heads), method, (method, num_heads))


@pytest.fixture(scope="module")
def runs(demo) -> Runs:
    return Runs(demo)


def _full_pass_logits(target, ids):
    cfg = target.config
    empty = [torch.zeros(1, cfg.num_kv_heads, 0, cfg.head_dim)] * cfg.num_layers
    with torch.inference_mode():
        return target(torch.tensor([ids]), torch.arange(len(ids))[None], torch.zeros(1, dtype=torch.int32),
                      causal_packed_mask(1, len(ids)), empty, empty).logits[0]


def test_demo_logits_match_transformers(demo):
    path, target, tokenizer = demo
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                        return_dict=False)
    hf = hf_model(path)  # AutoModelForCausalLM.from_pretrained(path) in fp32, eval mode; loaded once
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_full_pass_logits(target, ids), expected, rtol=1e-4, atol=1e-3)


def test_untrained_clover_equals_vanilla_greedy_on_chat_prompts(demo, runs):
    _assert_equal_but_near_ties(demo[0], runs.prompts, runs.vanilla, runs.untrained("clover", 3))


def _assert_equal_but_near_ties(path, prompts, vanilla, speculative):
    """Both outputs against transformers greedy decoding, over the full sequence.

    Where an output differs from the reference, each of its tokens is judged on its own prefix by the
    reference's logits (teacher forcing, so the tokens after a divergence are checked too): a token that is not
    the reference's argmax must be within NEAR_TIE of its top logit. Divergences are reported.
    """
    reference = hf_greedy(path, prompts, NEW_TOKENS)
    diverged = []
    for index, (prompt, ref, v, c) in enumerate(zip(prompts, reference, vanilla, speculative)):
        for name, result in (("vanilla", v), ("speculative", c)):
            assert len(result.token_ids) == NEW_TOKENS
            if result.token_ids == ref:
                continue
            first = next(i for i, (a, b) in enumerate(zip(result.token_ids, ref)) if a != b)
            logits = hf_next_logits(path, prompt, ref[: first + 1])[first]  # the shared prefix: one position
            gap = float(logits[ref[first]] - logits[result.token_ids[first]])
            assert abs(gap) < NEAR_TIE, f"{name}: divergence at token {first} is not a near-tie (gap {gap:.4g})"
            deviations = greedy_deviations(path, prompt, result.token_ids)
            for position, deficit, gap in deviations:
                assert deficit < NEAR_TIE, (f"{name}: token {position} is not the reference's argmax and not a "
                                            f"near-tie (logit deficit {deficit:.4g}, top-2 gap {gap:.4g})")
            diverged.append((name, index, first, deviations))
    print(f"divergences from transformers greedy (all near-ties): {diverged or 'none'}")
    assert len({index for _, index, _, _ in diverged}) < len(prompts)
    assert sum(c.stats.num_steps for c in speculative) > 0


@pytest.mark.parametrize("method", ["clover", "medusa"])
def test_shipped_heads_are_small_fp16_for_this_target_and_lossless(demo, runs, method):
    from safetensors import safe_open

    from clover.demo import SHIPPED_HEADS_DIR, shipped_heads
    from clover.drafters import load_drafter

    checkpoint, target, _ = demo
    path = shipped_heads(method)
    assert path is not None, f"{SHIPPED_HEADS_DIR / method} is missing"
    weights = sorted(SHIPPED_HEADS_DIR.glob("*/*.safetensors"))
    assert weights and sum(f.stat().st_size for f in weights) <= 25 * 2**20
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.float16"}
    assert (path / "README.md").is_file()  # the model card
    drafter = load_drafter(path, target)  # checks the target fingerprint
    assert drafter.config.method == method
    fast = runs.decode(TorchEngine(target, drafter.float().eval(), max_seq_len=512), method)
    _assert_equal_but_near_ties(checkpoint, runs.prompts, runs.vanilla, fast)

    def accepted_per_step(results):
        return sum(sum(r.stats.accepted_per_step) for r in results) / sum(r.stats.num_steps for r in results)

    # the training is what makes them speculate: heads initialised from the target accept far fewer tokens
    baseline = runs.untrained(method, drafter.config.num_heads)
    trained_rate, untrained_rate = accepted_per_step(fast), accepted_per_step(baseline)
    print(f"{method}: accepted per step, trained {trained_rate:.3f}, untrained {untrained_rate:.3f}")
    assert trained_rate > 0.1 and trained_rate > 2 * untrained_rate, (trained_rate, untrained_rate)
