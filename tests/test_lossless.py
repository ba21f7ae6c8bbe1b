"""Speculative greedy decoding equals vanilla greedy decoding, token for token.

The reference is transformers ``generate()`` on the same weights (tests/helpers.py::hf_greedy), independent
of clover's decode loop; clover's own vanilla decoding is checked against it too.
"""

from __future__ import annotations

import pytest
import torch

from clover.attention import causal_packed_mask
from clover.backends.torch import TorchEngine
from clover.config import ConfigError, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from tests.conftest import make_drafter, make_target
from tests.helpers import Clover2OracleEngine, OracleEngine, hf_greedy, random_prompts, vanilla_greedy

MAX_NEW = 24
ORACLES = {"clover": OracleEngine, "clover2": Clover2OracleEngine}  # oracle drafters by decoding method


def _generate(engine, method, prompts, tree=None, batch_size=8, max_new=MAX_NEW):
    decoder = SpeculativeDecoder(engine, method, tree, max_batch_size=batch_size)
    return decoder.generate([GenerationRequest(p, max_new_tokens=max_new, stop_token_ids=()) for p in prompts])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_heads", [1, 2, 3, 5])
@pytest.mark.parametrize("budget", [1, 4, 16])
@pytest.mark.parametrize("batch", [1, 3])
def test_random_clover_heads_equal_vanilla(seed, num_heads, budget, batch):
    target = make_target(seed=seed)
    engine = TorchEngine(target, make_drafter(target, num_heads=num_heads, seed=seed + 10), max_seq_len=128)
    prompts = random_prompts(seed, batch, target.config.vocab_size, 1, 24)
    expected = hf_greedy(target, prompts, MAX_NEW)
    assert vanilla_greedy(engine, prompts, MAX_NEW) == expected
    results = _generate(engine, "clover", prompts, TreeConfig(budget=budget))
    assert [r.token_ids for r in results] == expected
    # the trees were really speculative: some step had more than one node
    assert all(r.stats.depth_tried for r in results) or budget == 0


@pytest.mark.parametrize("method", ["medusa", "clover-mlp-regressive", "clover-no-regressive", "clover-no-augment"])
def test_other_drafters_equal_vanilla(method):
    target = make_target(seed=5)
    engine = TorchEngine(target, make_drafter(target, method=method, num_heads=3), max_seq_len=128)
    prompts = random_prompts(5, 3, target.config.vocab_size, 2, 16)
    expected = hf_greedy(target, prompts, MAX_NEW)
    assert vanilla_greedy(engine, prompts, MAX_NEW) == expected
    family = "medusa" if method == "medusa" else "clover"
    assert [r.token_ids for r in _generate(engine, family, prompts, TreeConfig(budget=6))] == expected


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("budget", [1, 4, 16])
@pytest.mark.parametrize("batch", [1, 3])
def test_random_clover2_heads_equal_vanilla(seed, budget, batch):
    """Clover-2 (engine contract v2: draft_prefill and its own draft cache), useless random heads."""
    target = make_target(seed=seed)
    engine = TorchEngine(target, make_drafter(target, method="clover2", num_heads=3, seed=seed + 10), max_seq_len=128)
    prompts = random_prompts(seed, batch, target.config.vocab_size, 1, 24)
    expected = hf_greedy(target, prompts, MAX_NEW)
    assert vanilla_greedy(engine, prompts, MAX_NEW) == expected
    results = _generate(engine, "clover2", prompts, TreeConfig(budget=budget))
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.depth_tried for r in results)


def _fresh_draft_prefill(engine, tokens: list[int], length: int):
    """The draft cache and states of ``length`` positions of ``tokens`` run from scratch: one target pass
    for h0, then one ``draft_prefill`` with the token after each position. Returns (state [L, H], keys,
    values one [Hkv, L, D] per draft layer)."""
    spec = engine.spec
    empty = [torch.zeros(1, spec.num_kv_heads, 0, spec.head_dim) for _ in range(spec.num_kv_layers)]
    positions, no_past = torch.arange(length)[None], torch.zeros(1, dtype=torch.int32)
    mask = causal_packed_mask(1, length)
    h0 = engine.target(torch.tensor([tokens[:length]]), positions, no_past, mask, empty, empty).h0
    empty = empty[: spec.num_draft_kv_layers]
    out = engine.draft_prefill(h0, torch.tensor([tokens[1: length + 1]]), positions, no_past, mask, empty, empty)
    return out.state[0], [k[0] for k in out.present_keys], [v[0] for v in out.present_values]


def _assert_draft_cache_fresh(decoder, engine, prompts_by_id) -> None:
    """Each live row's draft cache (and root state) equals a from-scratch ``draft_prefill`` of its tokens."""
    assert torch.equal(decoder.draft_cache.lengths, decoder.cache.lengths)
    for row, seq in enumerate(decoder._running):
        tokens = prompts_by_id[seq.seq_id] + seq.generated
        length = int(decoder.cache.lengths[row])
        assert length == len(tokens) - 1  # the root token follows the last cached position
        state, keys, values = _fresh_draft_prefill(engine, tokens, length)
        for layer in range(engine.spec.num_draft_kv_layers):
            torch.testing.assert_close(decoder.draft_cache.keys[layer][row, :, :length], keys[layer], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(decoder.draft_cache.values[layer][row, :, :length], values[layer],
                                       rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(seq.root_hidden, state[length - 1], rtol=1e-4, atol=1e-5)


def test_clover2_draft_cache_equals_fresh_draft_prefill_after_acceptance_and_compaction():
    target = make_target(seed=13)
    engine = TorchEngine(target, make_drafter(target, method="clover2", num_heads=3, seed=3), max_seq_len=128)
    prompts = random_prompts(13, 3, target.config.vocab_size, 2, 12)
    decoder = SpeculativeDecoder(engine, "clover2", TreeConfig(budget=16))
    ids = [decoder.submit(GenerationRequest(p, max_new_tokens=n, stop_token_ids=()))
           for p, n in zip(prompts, [40, 8, 40])]
    prompts_by_id = dict(zip(ids, prompts))
    for _ in range(3):
        decoder.step()
    assert decoder.num_running == 3
    _assert_draft_cache_fresh(decoder, engine, prompts_by_id)
    while ids[1] in [s.seq_id for s in decoder._running]:  # the short request leaves: its row is compacted away
        decoder.step()
    for _ in range(3):
        decoder.step()
    assert decoder.num_running == 2
    _assert_draft_cache_fresh(decoder, engine, prompts_by_id)
    accepted = [n for seq in decoder._running for n in seq.stats.accepted_per_step]
    assert max(accepted) >= 1, "no step accepted a draft token: the multi-position draft_prefill was not exercised"
    expected = hf_greedy(target, prompts, 40)
    for seq in decoder._running:
        assert seq.generated == expected[ids.index(seq.seq_id)][: len(seq.generated)]


def test_static_tree_equals_vanilla():
    target = make_target(seed=6)
    engine = TorchEngine(target, make_drafter(target, method="medusa", num_heads=3), max_seq_len=128)
    prompts = random_prompts(6, 3, target.config.vocab_size, 2, 16)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    results = _generate(engine, "medusa", prompts, TreeConfig(static_choices=choices))
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, MAX_NEW)
    assert max(r.stats.depth_tried[2] for r in results) > 0


@pytest.mark.parametrize("num_heads", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["clover", "clover2"])
def test_oracle_drafter_accepts_everything(num_heads, batch, method):
    target = make_target(seed=7)
    inner = TorchEngine(target, None, max_seq_len=128)
    prompts = random_prompts(7 + batch, batch, target.config.vocab_size, 3, 12)
    expected = hf_greedy(target, prompts, MAX_NEW)
    assert vanilla_greedy(inner, prompts, MAX_NEW) == expected
    oracle = ORACLES[method](inner, prompts, expected, num_heads=num_heads)
    results = _generate(oracle, method, prompts, TreeConfig(budget=num_heads + 2))
    assert [r.token_ids for r in results] == expected
    for r in results:
        # every step but the last accepts all K draft tokens: K+1 tokens per step
        assert r.stats.accepted_per_step[:-1] == [num_heads] * (len(r.stats.accepted_per_step) - 1)
        assert r.stats.num_steps == -(-(MAX_NEW - 1) // (num_heads + 1))


@pytest.mark.parametrize("method", ["clover", "clover2"])
def test_batched_equals_solo_with_mixed_lengths_and_joins(method):
    """A small max batch forces requests to join while others run and to leave as they finish."""
    target = make_target(seed=8)
    engine = TorchEngine(target, make_drafter(target, method=method, num_heads=3), max_seq_len=128)
    prompts = random_prompts(8, 7, target.config.vocab_size, 1, 30)
    lengths = [5, 30, 12, 1, 20, 8, 17]
    decoder = SpeculativeDecoder(engine, method, TreeConfig(budget=4), max_batch_size=3)
    results = decoder.generate([GenerationRequest(p, max_new_tokens=n, stop_token_ids=())
                                for p, n in zip(prompts, lengths)])
    for prompt, n, r in zip(prompts, lengths, results):
        assert r.token_ids == hf_greedy(target, [prompt], n)[0]
        assert len(r.token_ids) == n and r.finish_reason == "length"


def test_per_sequence_stop_on_eos():
    target = make_target(seed=9)
    engine = TorchEngine(target, make_drafter(target, num_heads=3), max_seq_len=128)
    prompts = random_prompts(9, 3, target.config.vocab_size, 2, 10)
    reference = hf_greedy(target, prompts, 30)
    # choose, per sequence, a token that first appears at a different place as its EOS
    eos = reference[0][10]
    results = SpeculativeDecoder(engine, "clover", TreeConfig(budget=4)).generate(
        [GenerationRequest(p, max_new_tokens=30, stop_token_ids=(eos,)) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, 30, stop_token_ids=(eos,))
    for ref, r in zip(reference, results):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert r.token_ids == ref[:cut]
        assert r.finish_reason == ("stop" if eos in ref else "length")


def test_kv_cache_equals_vanilla_cache_after_acceptance():
    target = make_target(seed=10)
    engine = TorchEngine(target, make_drafter(target, num_heads=3), max_seq_len=128)
    prompts = random_prompts(10, 2, target.config.vocab_size, 4, 10)
    expected = hf_greedy(target, prompts, 12)
    oracle = OracleEngine(engine, prompts, expected, num_heads=3)
    for eng in (engine, oracle):  # random heads (few accepted) and oracle heads (all accepted)
        decoder = SpeculativeDecoder(eng, "clover", TreeConfig(budget=5))
        ids = [decoder.submit(GenerationRequest(p, max_new_tokens=1000, stop_token_ids=())) for p in prompts]
        while min(len(decoder.result(i).token_ids) for i in ids) < 12:
            decoder.step()
        vanilla = SpeculativeDecoder(engine, "vanilla")
        for i, seq_id in enumerate(ids):
            tokens = prompts[i] + decoder.result(seq_id).token_ids
            assert decoder.result(seq_id).token_ids[:12] == expected[i]
            # cache rows follow the live sequences, not the submission order (prefill sorts by length)
            row = [s.seq_id for s in decoder._running].index(seq_id)
            length = int(decoder.cache.lengths[row])
            assert length == len(tokens) - 1  # the newest token's K/V is written by the next step
            vanilla.submit(GenerationRequest(tokens[:length], max_new_tokens=1, stop_token_ids=()))
            vanilla._prefill(vanilla._pending)  # cache rows of a plain prompt pass over the same tokens
            vanilla._pending = []
            v_row = vanilla.cache.num_rows - 1
            for layer in range(engine.spec.num_kv_layers):
                for spec_cache, ref_cache in ((decoder.cache.keys, vanilla.cache.keys),
                                              (decoder.cache.values, vanilla.cache.values)):
                    torch.testing.assert_close(spec_cache[layer][row, :, :length], ref_cache[layer][v_row, :, :length],
                                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["clover", "clover2"])
def test_cancel_leaves_batch_and_others_unchanged(method):
    target = make_target(seed=11)
    engine = TorchEngine(target, make_drafter(target, method=method, num_heads=2), max_seq_len=128)
    prompts = random_prompts(11, 3, target.config.vocab_size, 2, 10)
    expected = hf_greedy(target, prompts, 20)
    decoder = SpeculativeDecoder(engine, method, TreeConfig(budget=4))
    ids = [decoder.submit(GenerationRequest(p, max_new_tokens=20, stop_token_ids=())) for p in prompts]
    tokens = {i: [] for i in ids}
    finished = {}

    def run_step():
        events = decoder.step()
        for e in events:
            tokens[e.seq_id] += e.new_token_ids
            if e.finished:
                finished[e.seq_id] = e.finish_reason
        return events

    run_step()
    run_step()
    decoder.cancel(ids[1])
    events = run_step()
    assert any(e.seq_id == ids[1] and e.finish_reason == "cancelled" for e in events)
    assert decoder.num_running == 2
    while decoder.has_work:
        run_step()
    assert finished == {ids[0]: "length", ids[1]: "cancelled", ids[2]: "length"}
    # the cancelled sequence stopped early; the others are exactly their solo vanilla output
    assert tokens[ids[0]] == expected[0] and tokens[ids[2]] == expected[2]
    assert tokens[ids[1]] == expected[1][: len(tokens[ids[1]])] and len(tokens[ids[1]]) < 20


def test_max_seq_len_ends_sequence_with_length():
    target = make_target(seed=12)
    engine = TorchEngine(target, make_drafter(target, num_heads=3), max_seq_len=40)
    prompt = random_prompts(12, 1, target.config.vocab_size, 20, 20)[0]
    result = SpeculativeDecoder(engine, "clover", TreeConfig(budget=4)).generate(
        [GenerationRequest(prompt, max_new_tokens=100, stop_token_ids=())])[0]
    assert result.finish_reason == "length"
    assert len(prompt) + len(result.token_ids) <= 40
    assert result.token_ids == hf_greedy(target, [prompt], len(result.token_ids))[0]


def test_step_events_carry_each_decode_steps_counts():
    target = make_target(seed=13)
    engine = TorchEngine(target, make_drafter(target, num_heads=3), max_seq_len=128)
    prompts = random_prompts(13, 3, target.config.vocab_size, 2, 10)
    events = []
    results = SpeculativeDecoder(engine, "clover", TreeConfig(budget=4)).generate(
        [GenerationRequest(p, max_new_tokens=20, stop_token_ids=(), request_id=i) for i, p in enumerate(prompts)],
        on_event=events.append)
    for i, result in enumerate(results):
        decode_events = [e for e in events if e.request_id == i and e.decode_step]
        assert [e.accepted_draft_tokens for e in decode_events] == result.stats.accepted_per_step
        assert sum(e.draft_tokens for e in decode_events) == result.stats.num_draft_tokens > 0
        assert len(decode_events) == result.stats.num_steps
    first_events = {e.request_id: e for e in reversed(events)}  # each request's first event: its prompt pass
    assert not any(e.decode_step or e.draft_tokens for e in first_events.values())


# -- model-free candidates (docs/trees.md#model-free-candidates) -------------------------------------------------

def _repetitive_prompts(seed: int, count: int, vocab: int) -> list[list[int]]:
    """Prompts that repeat a random phrase, so the suffix index has something to propose from the start."""
    phrases = random_prompts(seed, count, vocab, 3, 8)
    return [phrase * (2 + i % 2) for i, phrase in enumerate(phrases)]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["clover", "medusa", "clover2"])
def test_suffix_candidates_with_random_heads_equal_vanilla(batch, method):
    target = make_target(seed=21, vocab_size=8)  # a small vocabulary: the greedy text soon repeats itself
    engine = TorchEngine(target, make_drafter(target, method=method, num_heads=3, seed=22), max_seq_len=160)
    prompts = _repetitive_prompts(21, batch, 8)
    expected = hf_greedy(target, prompts, 48)
    counts = {}
    for proposer in ("suffix", "none"):
        decoder = SpeculativeDecoder(engine, method, TreeConfig(budget=6, proposer=proposer))
        results = decoder.generate([GenerationRequest(p, max_new_tokens=48, stop_token_ids=()) for p in prompts])
        assert [r.token_ids for r in results] == expected
        counts[proposer] = decoder.source_counts
    # the suffix candidates were merged and some accepted; without the proposer no tree was merged
    assert counts["suffix"]["suffix"][1] >= 4 * batch and counts["suffix"]["heads"][0] > 0
    assert counts["none"] == {"heads": [0, 0], "suffix": [0, 0]}


@pytest.mark.parametrize("batch", [1, 3])
def test_suffix_alone_on_an_engine_without_heads_equals_vanilla(batch):
    target = make_target(seed=23, vocab_size=8)
    engine = TorchEngine(target, None, max_seq_len=160)
    prompts = _repetitive_prompts(23, batch, 8)
    expected = hf_greedy(target, prompts, 48)
    results = _generate(engine, "suffix", prompts, TreeConfig(budget=8), max_new=48)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_steps for r in results) < 0.8 * sum(len(r.token_ids) - 1 for r in results)


def test_suffix_candidates_with_oracle_heads_equal_vanilla_and_keep_the_oracle_path():
    target = make_target(seed=24, vocab_size=24)
    inner = TorchEngine(target, None, max_seq_len=160)
    prompts = _repetitive_prompts(24, 3, 24)
    expected = hf_greedy(target, prompts, MAX_NEW)
    oracle = OracleEngine(inner, prompts, expected, num_heads=3)
    results = _generate(oracle, "clover", prompts, TreeConfig(budget=8, proposer="suffix"))
    assert [r.token_ids for r in results] == expected
    for r in results:  # the oracle's path (probability 1) always fits the shared budget of 8 nodes
        assert min(r.stats.accepted_per_step[:-1]) >= 3


@pytest.mark.parametrize("method", ["clover", "suffix"])
def test_suffix_candidates_with_mixed_lengths_and_joins_equal_vanilla(method):
    target = make_target(seed=25, vocab_size=24)
    engine = TorchEngine(target, make_drafter(target, num_heads=3) if method == "clover" else None, max_seq_len=160)
    prompts = _repetitive_prompts(25, 7, 24)
    lengths = [5, 40, 12, 1, 30, 8, 17]
    decoder = SpeculativeDecoder(engine, method, TreeConfig(budget=6, proposer="suffix"), max_batch_size=3)
    results = decoder.generate([GenerationRequest(p, max_new_tokens=n, stop_token_ids=())
                                for p, n in zip(prompts, lengths)])
    for prompt, n, r in zip(prompts, lengths, results):
        assert r.token_ids == hf_greedy(target, [prompt], n)[0]


def test_method_suffix_refuses_a_tree_without_suffix_candidates():
    engine = TorchEngine(make_target(seed=1), None, max_seq_len=64)
    with pytest.raises(ConfigError, match="suffix proposer"):
        SpeculativeDecoder(engine, "suffix", TreeConfig(proposer="none"))
