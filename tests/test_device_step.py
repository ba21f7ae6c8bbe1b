"""The decode step on the device (clover/device_step.py, clover/backends/device.py; docs/gpu-engine.md).

On this CPU the step runs eagerly, the same tensor ops a CUDA graph replays on a GPU. Its output is checked
against transformers ``generate()`` (tests/helpers.py::hf_greedy), an independent reference; its pieces against
the reference tree attention and a brute-force tree; that it never reads a value back to the host (what a CUDA
graph needs) by tracing it as one graph.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from clover.attention import InPlaceAttention, pack_mask, tree_attention
from clover.backends.device import DeviceEngine, kv_bucket
from clover.config import SamplingConfig, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.adaptive import CostModel, SourceCalibration
from clover.device_step import (GIVEN_ROWS, PADDING_SCORE, DeviceAccepted, DeviceCalibration, DeviceSampling,
                                DeviceTree, GivenCandidates, StepShape, accept_greedy, accept_sampled,
                                ancestor_masks, given_arrays, heads_run, matched_nodes, propose_tree, root_tree,
                                sample_rows, sampling_arrays, uniform_draws)
from clover.engine_contract import DraftResult
from clover.kv_cache import KVCache
from clover.suffix import SuffixProposal
from clover.tree import SOURCE_HEADS, SOURCE_SUFFIX, SUFFIX_MATCH_ROWS, suffix_calibration_row
from tests.conftest import make_drafter, make_target
from tests.helpers import DeviceOracleEngine, hf_greedy, random_prompts

MAX_NEW = 24


def _generate(engine, method, prompts, budget=4, batch_size=4, max_new=MAX_NEW, sampling=None, seeds=None):
    decoder = SpeculativeDecoder(engine, method, TreeConfig(budget=budget), max_batch_size=batch_size)
    assert decoder.device_stepper is not None, "the decoder did not take the device step"
    requests = [GenerationRequest(p, max_new_tokens=max_new, stop_token_ids=(),
                                  sampling=(sampling or {}).get(i, SamplingConfig()), seed=(seeds or {}).get(i, 0))
                for i, p in enumerate(prompts)]
    return decoder.generate(requests)


def _random_tree_masks(gen, batch, tokens):
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, tokens)] for _ in range(batch)]
    mask = torch.zeros(batch, tokens, tokens, dtype=torch.bool)
    for b, row in enumerate(parents):
        for i, parent in enumerate(row):
            if parent >= 0:
                mask[b, i] = mask[b, parent]
            mask[b, i, i] = True
    return mask


@pytest.mark.parametrize("seed", range(3))
def test_in_place_attention_equals_the_reference_and_writes_the_cache(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, tokens, q_heads, kv_heads, dim, size = 3, 6, 4, 2, 8, 40
    q = torch.randn(batch, tokens, q_heads, dim, generator=gen)
    k, v = (torch.randn(batch, tokens, kv_heads, dim, generator=gen) for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, kv_heads, size, dim, generator=gen) for _ in range(2))
    past = torch.tensor([0, 7, 20], dtype=torch.int32)
    mask = _random_tree_masks(gen, batch, tokens)
    want = tree_attention(q, k, v, k_cache, v_cache, past, pack_mask(mask))
    keys, values = k_cache.clone(), v_cache.clone()
    got = InPlaceAttention(past, mask, kv_bucket(27, size)).attend(q, k, v, keys, values)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for b, start in enumerate(past.tolist()):
        torch.testing.assert_close(keys[b, :, start: start + tokens], k[b].transpose(0, 1))
        torch.testing.assert_close(values[b, :, :start], v_cache[b, :, :start])  # the cache before: untouched


def test_a_kernel_with_the_reference_ops_signature_attends_as_sdpa_does():
    """The kernel path (the CUDA kernel's op on a GPU) reads the cache and the new tokens apart; with the reference
    op standing in for the kernel it must give SDPA's result, and write the cache the same way."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 5, 4, 8, generator=gen)
    k, v = (torch.randn(2, 5, 2, 8, generator=gen) for _ in range(2))
    cache = [torch.randn(2, 2, 32, 8, generator=gen) for _ in range(2)]
    mask = _random_tree_masks(gen, 2, 5)
    past = torch.tensor([3, 9])
    plain = InPlaceAttention(past, mask, 16)
    kernel = InPlaceAttention(past, mask, 16)
    kernel.use_kernel(tree_attention)
    written = [[c.clone() for c in cache] for _ in range(2)]
    torch.testing.assert_close(kernel.attend(q, k, v, *written[1]), plain.attend(q, k, v, *written[0]),
                               atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(*written))


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here: it would run")
def test_asking_for_cuda_without_a_gpu_is_one_clear_error(capsys):
    from clover.cli import main

    assert main(["generate", "--device", "cuda", "--prompt", "hi", "--max-new-tokens", "2", "--no-compare"]) != 0
    err = capsys.readouterr().err
    assert "torch sees no CUDA GPU" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_compiled_layers_decode_as_transformers_generate(tmp_path, monkeypatch):
    """torch.compile of the decoder layers (shape-generic) changes no token; its cache goes where it is told."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    target = make_target(seed=0)
    engine = DeviceEngine(target, make_drafter(target, num_heads=3, seed=10), max_seq_len=128, compile_layers=True)
    prompts = random_prompts(0, 2, target.config.vocab_size, 1, 24)
    results = _generate(engine, "clover", prompts, 4, batch_size=2, max_new=12)
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, 12)
    assert any((tmp_path / "inductor").iterdir())


def test_the_kernel_attention_needs_cuda():
    from clover.config import ConfigError

    target = make_target(seed=0)
    with pytest.raises(ConfigError, match="CUDA"):
        DeviceEngine(target, None, attention="kernel")
    with pytest.raises(ConfigError, match="auto, sdpa, kernel"):
        DeviceEngine(target, None, attention="flash")
    assert DeviceEngine(target, None).attention.kernel is None  # auto on a CPU: SDPA, no kernel to build


class _ScriptedTimer:
    """A stand-in for the attention timer: the kernel is "faster" for passes of at most ``kernel_up_to`` tokens.
    Counts the shapes it was asked to time."""

    def __init__(self, kernel_up_to: int) -> None:
        self.kernel_up_to, self.timed = kernel_up_to, []

    def __call__(self, run, repeats, device):
        attention = run.__defaults__[0]
        tokens = attention.write_index.shape[1]
        self.timed.append(tokens)
        fast = (attention.kernel is not None) == (tokens <= self.kernel_up_to)
        return 1.0 if fast else 2.0


def test_auto_attention_takes_the_faster_per_shape_and_times_each_shape_once():
    from clover.backends.attention_choice import TIMED_MAX_TOKENS, AttentionChoice

    timer = _ScriptedTimer(kernel_up_to=4)
    choice = AttentionChoice("auto", tree_attention, (4, 2, 8), torch.float32, torch.device("cpu"), timer=timer)
    assert choice.kernel_for(2, 3, 256) is tree_attention and choice.kernel_for(2, 9, 256) is None
    assert choice.kernel_for(2, 3, 256) is tree_attention and timer.timed == [3, 3, 9, 9]  # both ways, once per shape
    assert choice.kernel_for(1, TIMED_MAX_TOKENS + 1, 512) is None and len(timer.timed) == 4  # prompts: SDPA, untimed
    forced = AttentionChoice("kernel", tree_attention, (4, 2, 8), torch.float32, torch.device("cpu"), timer=timer)
    assert forced.kernel_for(1, TIMED_MAX_TOKENS + 1, 512) is tree_attention and len(timer.timed) == 4


def test_the_measured_attention_times_real_calls_of_both_ways(monkeypatch):
    """The real timer on this CPU, with the reference op standing in for the kernel: both ways run on a shape
    whose cache is filled to the attended length, and one is kept."""
    from clover.backends.attention_choice import AttentionChoice

    calls = []

    def kernel(q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale=None):
        calls.append(int(past_lengths.min()))
        return tree_attention(q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale)

    choice = AttentionChoice("auto", kernel, (4, 2, 8), torch.float32, torch.device("cpu"), repeats=3)
    choice.kernel_for(2, 5, 256)
    sdpa_seconds, kernel_seconds = choice.timings[(2, 5, 256)]
    assert sdpa_seconds > 0 and kernel_seconds > 0 and calls and set(calls) == {256 - 5}


def test_steps_that_switch_attention_by_shape_still_equal_transformers_generate():
    """Passes of up to 9 tokens (the trees of budget 8) attend by the kernel path (the reference op standing in),
    larger ones (the prompts) by SDPA: the tokens must not change, and both ways must have run."""
    from clover.backends.attention_choice import AttentionChoice

    target = make_target(seed=2)
    engine = DeviceEngine(target, make_drafter(target, num_heads=3, seed=12), max_seq_len=128)
    kernel_calls = []

    def kernel(*args):
        kernel_calls.append(args[0].shape[1])
        return tree_attention(*args)

    cfg = target.config
    engine.attention = AttentionChoice("auto", kernel, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                                       torch.float32, torch.device("cpu"), timer=_ScriptedTimer(kernel_up_to=9))
    prompts = random_prompts(2, 3, target.config.vocab_size, 10, 24)
    results = _generate(engine, "clover", prompts, 8, batch_size=3)
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, MAX_NEW)
    assert kernel_calls and max(kernel_calls) <= 9
    assert any(tokens > 9 for (_, tokens, _) in engine.attention.timings), "no pass went to SDPA"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [0, 1, 4, 16])
@pytest.mark.parametrize("batch", [1, 4])
def test_random_heads_on_the_device_step_equal_transformers_generate(seed, budget, batch):
    target = make_target(seed=seed)
    engine = DeviceEngine(target, make_drafter(target, num_heads=3, seed=seed + 10), max_seq_len=128)
    prompts = random_prompts(seed, batch, target.config.vocab_size, 1, 24)
    results = _generate(engine, "clover" if budget else "vanilla", prompts, budget)
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, MAX_NEW)


def test_medusa_heads_on_the_device_step_equal_transformers_generate():
    target = make_target(seed=4)
    engine = DeviceEngine(target, make_drafter(target, method="medusa", num_heads=3), max_seq_len=128)
    prompts = random_prompts(4, 3, target.config.vocab_size, 2, 16)
    assert [r.token_ids for r in _generate(engine, "medusa", prompts, 6)] == hf_greedy(target, prompts, MAX_NEW)


@pytest.mark.parametrize("batch", [1, 4])
def test_oracle_heads_on_the_device_step_accept_whole_paths(batch):
    target = make_target(seed=2)
    prompts = random_prompts(7, batch, target.config.vocab_size, 2, 20)
    expected = hf_greedy(target, prompts, MAX_NEW)
    engine = DeviceOracleEngine(target, prompts, expected, num_heads=3, top_k=4)
    results = _generate(engine, "clover", prompts, budget=8)
    assert [r.token_ids for r in results] == expected
    # every step accepts the three heads' tokens plus the bonus token: 23 tokens after the prefill in 6 steps
    assert [r.stats.num_steps for r in results] == [6] * batch


def test_rows_that_join_and_finish_at_different_steps_stay_exact():
    """Five requests through two rows: the cache compacts, and the root states must follow their rows, or the
    oracle heads would propose another sequence's continuation and steps would accept less."""
    target = make_target(seed=6)
    prompts = random_prompts(6, 5, target.config.vocab_size, 1, 20)
    lengths = [5, 17, 9, 24, 3]
    expected = hf_greedy(target, prompts, max(lengths))
    engine = DeviceOracleEngine(target, prompts, expected, num_heads=3, top_k=4)
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=8), max_batch_size=2)
    results = decoder.generate([GenerationRequest(p, max_new_tokens=n, stop_token_ids=())
                                for p, n in zip(prompts, lengths)])
    assert [r.token_ids for r in results] == [e[:n] for e, n in zip(expected, lengths)]
    assert [r.stats.num_steps for r in results] == [-(-(n - 1) // 4) for n in lengths]  # 4 tokens a step


def test_a_sampling_request_on_the_device_leaves_its_greedy_neighbours_exact():
    target = make_target(seed=3)
    engine = DeviceEngine(target, make_drafter(target, num_heads=3, seed=13), max_seq_len=128)
    prompts = random_prompts(3, 3, target.config.vocab_size, 1, 16)
    sampled = {1: SamplingConfig(temperature=0.8, top_k=20)}
    results = _generate(engine, "clover", prompts, 4, sampling=sampled)
    expected = hf_greedy(target, prompts, MAX_NEW)
    assert [results[0].token_ids, results[2].token_ids] == [expected[0], expected[2]]
    assert len(results[1].token_ids) == MAX_NEW and results[1].token_ids != expected[1]


def test_a_seeded_request_samples_the_same_tokens_alone_in_a_batch_and_as_vanilla():
    """Each output position draws its own uniform number from (seed, position): the tokens a seeded request
    samples depend on neither its neighbours, nor its tree, nor the step that reaches a position. Fails if the
    draws come from a shared generator or are numbered per step."""
    target = make_target(seed=3)
    engine = DeviceEngine(target, make_drafter(target, num_heads=3, seed=13), max_seq_len=128)
    prompts = random_prompts(3, 3, target.config.vocab_size, 1, 16)
    hot = SamplingConfig(temperature=1.0)
    batched = _generate(engine, "clover", prompts, 8, sampling={0: hot, 1: hot, 2: hot}, seeds={0: 5, 1: 7, 2: 2**40})
    alone = _generate(engine, "clover", prompts[1:2], 8, sampling={0: hot}, seeds={0: 7})
    vanilla = _generate(engine, "vanilla", prompts[1:2], 0, sampling={0: hot}, seeds={0: 7})
    other_seed = _generate(engine, "clover", prompts[1:2], 8, sampling={0: hot}, seeds={0: 8})
    assert batched[1].token_ids == alone[0].token_ids == vanilla[0].token_ids
    assert other_seed[0].token_ids != alone[0].token_ids
    assert batched[1].stats.num_steps < vanilla[0].stats.num_steps, "no draft token was accepted: a weak test"


def test_uniform_draws_are_uniform_and_differ_by_every_part_of_the_seed():
    from scipy.stats import chisquare

    rows = 50000
    floats, ints = sampling_arrays([SamplingConfig(temperature=1.0)] * rows, [3] * rows, list(range(rows)))
    base = DeviceSampling(*torch.from_numpy(floats), *torch.from_numpy(ints))
    draws = uniform_draws(base)
    assert ((draws >= 0) & (draws < 1)).all()
    assert chisquare(torch.histc(draws, bins=20, min=0, max=1).numpy()).pvalue > 1e-4
    assert torch.equal(uniform_draws(base, offset=1)[:-1], draws[1:])  # offset: the next output position
    for other_seed in (4, 3 + 2**32):  # the low and the high 32 bits both count
        _, ints = sampling_arrays([SamplingConfig()] * rows, [other_seed] * rows, list(range(rows)))
        other = uniform_draws(dataclasses.replace(base, seed_low=torch.from_numpy(ints[0]),
                                                  seed_high=torch.from_numpy(ints[1])))
        assert (other != draws).float().mean() > 0.99
        assert abs(float(torch.corrcoef(torch.stack([draws, other]))[0, 1])) < 0.02


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against ``probs`` (cells with probability 0 must be empty)."""
    from scipy.stats import chisquare

    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the distribution's support was drawn"
    expected = probs[support].double() * counts.sum()
    return float(chisquare(counts[support].double().numpy(), expected.numpy()).pvalue)


def _sampling(settings, seeds=None, generated=None) -> DeviceSampling:
    """Rows of ``settings``, each with its own seed (default: its row index; large ones use the high half)."""
    seeds = [row * 2**40 + row for row in range(len(settings))] if seeds is None else seeds
    floats, ints = sampling_arrays(settings, seeds, [0] * len(settings) if generated is None else generated)
    floats, ints = torch.from_numpy(floats), torch.from_numpy(ints)
    return DeviceSampling(floats[0], floats[1].to(torch.int64), floats[2], ints[0], ints[1], ints[2])


SETTINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3),
            SamplingConfig(temperature=1.3, top_p=0.8)]


@pytest.mark.parametrize("setting", SETTINGS, ids=["plain", "top-k", "top-p"])
def test_device_sampling_draws_from_the_targets_distribution(setting):
    from clover.verify import target_probs

    torch.manual_seed(0)
    draws = 20000
    logits = torch.tensor([2.0, 1.5, 0.3, -0.2, 1.1, -1.0])
    sampling = _sampling([setting] * draws)
    drawn = sample_rows(logits.expand(draws, -1), sampling)
    assert _chi_square_p(torch.bincount(drawn, minlength=6), target_probs(logits, setting)) > 1e-4


def test_tree_sampling_on_the_device_emits_the_targets_distribution_at_every_depth():
    """A root with three children (two of them with children): the first token must follow the root's
    distribution and the second the distribution of the child the first one went to, or the bonus token's."""
    from clover.device_step import DeviceTree, ancestor_masks
    from clover.verify import target_probs

    torch.manual_seed(1)
    draws, setting = 30000, SamplingConfig(temperature=1.0)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2]])
    tokens = torch.tensor([[9, 0, 1, 4, 2, 3, 0]])
    depths = torch.tensor([[0, 1, 1, 1, 2, 2, 2]])
    node_logits = torch.randn(7, 6)
    tree = DeviceTree(*(t.expand(draws, -1) for t in (tokens, depths, parents)),
                      ancestor_masks(parents, 2).expand(draws, -1, -1), 2)
    sampling = _sampling([setting] * draws)
    accepted = accept_sampled(node_logits.expand(draws, -1, -1), tree, sampling, 3)
    first, second = accepted.tokens[:, 0], accepted.tokens[:, 1]
    assert _chi_square_p(torch.bincount(first, minlength=6), target_probs(node_logits[0], setting)) > 1e-4
    for token, node in ((0, 1), (1, 2), (4, 3)):  # after token t the walk is at the child carrying it
        went = first == token
        assert (accepted.path[went, 1] == node).all() and (accepted.counts[went] >= 2).all()
        probs = target_probs(node_logits[node], setting)
        assert _chi_square_p(torch.bincount(second[went], minlength=6), probs) > 1e-4
    assert (accepted.counts[(first != 0) & (first != 1) & (first != 4)] == 1).all()  # a bonus token ends it


def _table_draft(logprob_table):
    """A draft step whose top-k log-probabilities depend only on (head, rank): ``logprob_table[head]``; token id
    = rank, next hidden = the input's. The tree's scores are then known in closed form."""
    def draft(hidden, token, head):
        k = len(logprob_table[head])
        logprobs = torch.tensor(logprob_table[head]).expand(len(token), k)
        return DraftResult(hidden.clone(), logprobs, torch.arange(k).expand(len(token), k))
    return draft


def test_the_tree_holds_the_best_paths_by_joint_log_probability():
    """With a frontier as wide as every path, the tree is the ``budget`` best rank paths of all depths (brute
    force over every path), parents before children."""
    table = [[-0.1, -0.9, -2.3], [-0.2, -0.5, -3.1], [-0.05, -1.7, -2.0]]
    budget, k = 10, 3
    shape = StepShape(batch=2, budget=budget, depth=3, top_k=k, width=k * k, kv_len=64)
    tree = propose_tree(_table_draft(table), torch.zeros(2, 4), torch.tensor([5, 6]), shape)
    paths = [p for d in range(1, 4) for p in itertools.product(range(k), repeat=d)]
    best = sorted(paths, key=lambda p: -sum(table[i][r] for i, r in enumerate(p)))[:budget]
    for b in range(2):
        parents, tokens = tree.parents[b].tolist(), tree.tokens[b].tolist()
        assert tokens[0] == [5, 6][b] and parents[0] == -1
        assert all(0 <= parents[i] < i for i in range(1, len(parents)))

        def path_of(node):
            return () if node == 0 else path_of(parents[node]) + (tokens[node],)
        assert sorted(path_of(n) for n in range(1, len(tokens))) == sorted(best)


def test_given_candidates_join_the_tree_by_score_under_their_given_parents():
    """Suffix candidates (as given token ids, with their own scores) compete with the heads' for the budget:
    the tree holds the best paths of both sources (brute force), each given node under its given parent."""
    table = [[-0.1, -0.9, -2.3], [-0.2, -0.5, -3.1]]
    given = GivenCandidates(tokens=torch.tensor([[40, 41, 42]]), parents=torch.tensor([[-1, 0, 1]]),
                            depths=torch.tensor([[1, 2, 3]]), scores=torch.tensor([[-0.15, -0.3, -0.6]]))
    budget = 6
    shape = StepShape(batch=1, budget=budget, depth=2, top_k=3, width=3, kv_len=64, given=3, given_depth=3)
    tree = propose_tree(_table_draft(table), torch.zeros(1, 4), torch.tensor([5]), shape, given)
    head_paths = {p: sum(table[i][r] for i, r in enumerate(p))
                  for d in (1, 2) for p in itertools.product(range(3), repeat=d)}
    given_paths = {(40,): -0.15, (40, 41): -0.3, (40, 41, 42): -0.6}
    best = sorted({**head_paths, **given_paths}.items(), key=lambda item: -item[1])[:budget]
    parents, tokens = tree.parents[0].tolist(), tree.tokens[0].tolist()

    def path_of(node):
        return () if node == 0 else path_of(parents[node]) + (tokens[node],)
    assert sorted(path_of(n) for n in range(1, len(tokens))) == sorted(p for p, _ in best)
    assert tree.max_depth == 3


def test_a_path_both_sources_propose_is_one_node_scored_by_the_better_source():
    """As on the host (clover.tree's merge), a given candidate whose path the heads also drafted is one node: it
    carries both raw probabilities, scores by the larger, and the given children hang under it. So a budget of 7
    holds 7 distinct paths, the best by that score (brute force, each child cut below its parent); a row given
    only padding keeps the heads' best paths. Two nodes per shared path would leave fewer distinct paths."""
    table = [[-0.1, -0.9, -2.3], [-0.2, -0.5, -3.1]]
    given_paths = {(2,): -0.05, (2, 40): -0.3, (2, 40, 41): -0.6, (0,): -0.2, (0, 40): -0.25}
    given = GivenCandidates(tokens=torch.tensor([[2, 40, 41, 0, 40], [0] * 5]),
                            parents=torch.tensor([[-1, 0, 1, -1, 3], [-1] * 5]),
                            depths=torch.tensor([[1, 2, 3, 1, 2], [0] * 5]),
                            scores=torch.tensor([list(given_paths.values()), [PADDING_SCORE] * 5]))
    budget = 7
    shape = StepShape(batch=2, budget=budget, depth=2, top_k=3, width=3, kv_len=64, given=5, given_depth=3)
    tree = propose_tree(_table_draft(table), torch.zeros(2, 4), torch.tensor([5, 6]), shape, given)
    head_paths = {p: sum(table[i][r] for i, r in enumerate(p))
                  for d in (1, 2) for p in itertools.product(range(3), repeat=d)}

    def best_paths(scores):
        cut = {}
        for path in sorted(scores, key=len):  # parents first: each child just below its parent
            cut[path] = min(scores[path], cut[path[:-1]] - 1e-3) if len(path) > 1 else scores[path]
        return sorted(sorted(cut, key=lambda path: -cut[path])[:budget])

    merged = {p: max(head_paths.get(p, -np.inf), given_paths.get(p, -np.inf)) for p in {*head_paths, *given_paths}}
    for row, expected in ((0, best_paths(merged)), (1, best_paths(head_paths))):
        parents, tokens = tree.parents[row].tolist(), tree.tokens[row].tolist()

        def path_of(node):
            return () if node == 0 else path_of(parents[node]) + (tokens[node],)
        assert sorted(path_of(n) for n in range(1, len(tokens))) == expected
    nodes = {tuple(tree.tokens[0, :n + 1][tree.ancestors[0, n, :n + 1]].tolist()[1:]): n for n in range(1, budget + 1)}
    both = tree.lograw[0, nodes[(2,)]].tolist()
    assert both == pytest.approx([-2.3, -0.05])  # the heads' and the given raw log-probabilities, one node


def test_suffix_proposals_become_given_candidates_with_raw_scores_and_their_calibration_row():
    proposal = SuffixProposal(tokens=np.array([7, 8, 9]), parents=np.array([-1, 0, 0]), depths=np.array([1, 2, 2]),
                              counts=np.array([4, 4, 1]), total=4, match_length=3)
    arrays = given_arrays([proposal, None], width=4)
    assert arrays.shape == (GIVEN_ROWS, 2, 4)
    assert arrays[0, 0, :3].tolist() == [7, 8, 9] and arrays[1, 0, :3].tolist() == [0 - 1, 0, 0]
    assert arrays[3, 0, :3] == pytest.approx(np.log([1.0, 1.0, 0.25]))  # the raw shares: the tree calibrates
    assert (arrays[4, 0] == suffix_calibration_row(3)).all() and (arrays[4, 1] == 1).all()
    assert (arrays[3, 1] == PADDING_SCORE).all() and (arrays[1, 1] == -1).all()  # no proposal: padding


def test_a_child_always_scores_below_its_parent_even_where_its_depth_is_calibrated_higher():
    """The given path 40 → 41 → 42 has raw shares 0.5, 0.5, 0.5; a calibration whose suffix factor grows with depth
    (0.1 at depth 1, 1 at 2 and 3) would score the children above their parent, and a budget of 2 would then
    take 41 and 42 without 40. The pool cuts each child below its parent, so the tree is the path's first two."""
    given = GivenCandidates(tokens=torch.tensor([[40, 41, 42]]), parents=torch.tensor([[-1, 0, 1]]),
                            depths=torch.tensor([[1, 2, 3]]), scores=torch.log(torch.tensor([[0.5, 0.5, 0.5]])),
                            keys=torch.tensor([2]))
    shape = StepShape(batch=1, budget=2, depth=0, top_k=1, width=1, kv_len=64, given=3, given_depth=3)
    factors = torch.ones(1 + SUFFIX_MATCH_ROWS, 4)
    factors[2, 1] = 0.1
    tree = propose_tree(None, torch.zeros(1, 4), torch.tensor([5]), shape, given, torch.log(factors))
    assert tree.tokens.tolist() == [[5, 40, 41]] and tree.parents.tolist() == [[-1, 0, 1]]
    assert tree.keys.tolist() == [2] and tree.lograw[0, 1:, 0].isneginf().all()  # the given source's alone



@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("batch", [1, 3])
def test_heads_and_suffix_candidates_on_the_device_equal_transformers_generate(seed, batch):
    target = make_target(seed=seed)
    engine = DeviceEngine(target, make_drafter(target, num_heads=3, seed=seed + 10), max_seq_len=128)
    prompts = random_prompts(seed, batch, target.config.vocab_size, 1, 24)
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=8, proposer="suffix"), max_batch_size=4)
    assert decoder.device_stepper is not None and decoder.suffix_on
    results = decoder.generate([GenerationRequest(p, max_new_tokens=48, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, 48)


@pytest.mark.parametrize("max_step_tokens", [None, 24])
def test_concurrent_served_requests_on_the_device_engine_equal_their_solo_greedy_decoding(tmp_path, max_step_tokens):
    """The serving loop (the in-flight batcher that Triton's model and the OpenAI endpoint drive) on the device
    engine of a checkpoint: requests from threads, joining a running batch (with a step cap: one or two prompts a
    step, the device's prompt passes of one or two rows), each equal to generate() alone."""
    import threading

    from clover.serving.batcher import InflightBatcher
    from tests.conftest import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path / "tiny", seed=4)
    engine = DeviceEngine.from_checkpoint(checkpoint, None, "clover", max_seq_len=256)
    prompts = random_prompts(9, 6, engine.spec.vocab_size, 2, 20)
    lengths = [6 + 4 * i for i in range(len(prompts))]
    outputs = {i: [] for i in range(len(prompts))}
    finished = [threading.Event() for _ in prompts]

    def collect(i):
        def on_update(update):
            outputs[i].extend(update.token_ids)
            if update.finished:
                finished[i].set()
        return on_update

    decoder = lambda: SpeculativeDecoder(engine, "clover", TreeConfig(budget=4), max_batch_size=4,  # noqa: E731
                                         max_step_tokens=max_step_tokens)
    with InflightBatcher(decoder) as batcher:
        threads = [threading.Thread(target=batcher.submit, args=(
            GenerationRequest(p, max_new_tokens=n, stop_token_ids=()), collect(i)))
            for i, (p, n) in enumerate(zip(prompts, lengths))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(event.wait(120) for event in finished)
    expected = hf_greedy(checkpoint, prompts, max(lengths))
    assert [outputs[i] for i in range(len(prompts))] == [e[:n] for e, n in zip(expected, lengths)]


def test_greedy_acceptance_takes_the_longest_matching_path():
    # root 0 -> 1 (token 7) -> 3 (token 9); root -> 2 (token 8) -> 4 (token 4)
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    tokens = torch.tensor([[1, 7, 8, 9, 4]])
    depths = torch.tensor([[0, 1, 1, 2, 2]])
    from clover.device_step import DeviceTree, ancestor_masks
    tree = DeviceTree(tokens, depths, parents, ancestor_masks(parents, 2), 2)
    argmax = [8, 2, 4, 0, 6]  # after the root: 8 (node 2), after node 2: 4 (node 4), after node 4: 6 (bonus)
    logits = torch.nn.functional.one_hot(torch.tensor([argmax]), 10).float()
    accepted = accept_greedy(logits, tree, 3)
    assert accepted.counts.tolist() == [3]
    assert accepted.path.tolist() == [[0, 2, 4]]
    assert accepted.tokens.tolist() == [[8, 4, 6]]


def test_the_whole_step_traces_as_one_graph_and_a_host_read_would_break_it():
    """A CUDA graph can hold the step only if no value leaves the device: torch.compile's tracer with
    fullgraph=True refuses any such read. The same check fails for a draft that reads a value back."""
    target = make_target(seed=0)
    engine = DeviceEngine(target, make_drafter(target, num_heads=3, seed=10), max_seq_len=128)
    spec = engine.spec
    cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, capacity=4)
    cache.add_rows(4)
    stepper = engine.device_stepper(cache, 4)
    stepper.lengths[:4] = torch.tensor([3, 5, 7, 2])
    shape = StepShape(batch=4, budget=8, depth=3, top_k=8, width=8, kv_len=128)
    sampled = StepShape(batch=4, budget=8, depth=3, top_k=8, width=8, kv_len=128, given=6, given_depth=4,
                        sampling=True)
    merged = dataclasses.replace(sampled, sampling=False)  # greedy, the calibration scoring and learning
    for each in (shape, sampled, merged):
        with torch.inference_mode():
            stepper._eager(each)  # allocates the candidates' buffers on first use, outside the trace
        torch._dynamo.reset()
        with torch.inference_mode():
            out = torch.compile(lambda: stepper._eager(each), backend="eager", fullgraph=True)()
        assert out.shape == (4, each.path_width + 3)
    assert not np.allclose(stepper.calibration_factors()[0], 1.0), "the traced steps did not update the calibration"

    inner = engine.device_draft
    engine.device_draft = lambda hidden, token, head: inner(hidden, token, head) if int(token.max()) >= 0 else None
    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)graph break|data-dependent|item|unsupported"):
        with torch.inference_mode():
            torch.compile(lambda: stepper._eager(shape), backend="eager", fullgraph=True)()


def test_calibration_times_every_step_shape_into_a_cost_model():
    target = make_target(seed=0)
    engine = DeviceEngine(target, make_drafter(target, num_heads=3, seed=10), max_seq_len=128)
    spec = engine.spec
    cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, capacity=4)
    stepper = engine.device_stepper(cache, 4, max_budget=8)
    model = stepper.calibrate(depth=3, top_k=8, repeats=1)
    assert [x for x, _ in model.target] == [1, 2, 4, 5, 9]  # vanilla at batch 1, 2, 4; batch 1 at budgets 4, 8
    assert [x for x, _ in model.target_batched] == [2 * 5, 2 * 9, 4 * 5, 4 * 9]  # trees of 2 and 4 rows
    assert all(a[1] <= b[1] for a, b in zip(model.target, model.target[1:]))  # fitted non-decreasing
    assert model.draft == [] and model.step_time(1, 8, 1.0, 3) == pytest.approx(model.target_time(9))


def test_root_trees_are_one_node():
    tree = root_tree(torch.tensor([3, 4]))
    assert tree.tokens.tolist() == [[3], [4]] and tree.parents.tolist() == [[-1], [-1]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (docs/status.md)")
def test_cuda_graph_steps_equal_generate_and_never_synchronise():
    target = make_target(seed=1)
    drafter = make_drafter(target, num_heads=3, seed=11)
    prompts = random_prompts(1, 4, target.config.vocab_size, 1, 24)
    expected = hf_greedy(target, prompts, MAX_NEW)
    engine = DeviceEngine(target.cuda(), drafter.cuda(), max_seq_len=128)
    assert engine.cuda_graphs
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=8, adaptive=False), max_batch_size=4)
    assert [r.token_ids for r in decoder.generate([GenerationRequest(p, max_new_tokens=MAX_NEW, stop_token_ids=())
                                                   for p in prompts])] == expected
    stepper = decoder.device_stepper
    assert stepper.graphs, "no step ran from a CUDA graph"
    shape = stepper.shape(4, 8, 3, 8)
    stepper._run(shape)  # captured here if this shape was not
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        stepper._run(shape)  # the step without its one device-to-host copy
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _host_tree(gen, size, max_depth):
    """One sequence's merged tree as the host holds it: parents, depths, bits (1 heads, 2 suffix, 3 both), raw
    ``[T, 2]``. The heads' nodes form a tree of their own (a heads' node's parent is the root or a heads' node)."""
    parents, depths, bits = [-1], [0], [0]
    raw = np.zeros((size, 2))
    for node in range(1, size):
        parent = int(gen.integers(0, node))
        while depths[parent] > max_depth:  # one level past the calibration's last depth: it is clipped there
            parent = parents[parent]
        parents.append(parent)
        depths.append(depths[parent] + 1)
        bits.append(int(gen.choice([1, 2, 3])) if parent == 0 or bits[parent] & SOURCE_HEADS else SOURCE_SUFFIX)
        raw[node] = gen.uniform(0.05, 1.0, 2) * [(bits[-1] >> column) & 1 for column in (0, 1)]
    return np.array(parents), np.array(depths), np.array(bits, dtype=np.uint8), raw


def _device_tree(host_trees, keys, width, padding_rows):
    """The host's trees as the device step holds them: one node per host node (a path both sources proposed is
    one node with both raw probabilities), rows padded to ``width`` nodes with depth-0 padding; then
    ``padding_rows`` random rows that are not live. Tokens: 100 + host node."""
    fields = {name: [] for name in ("tokens", "parents", "depths", "raw")}
    for parents, depths, _, raw in host_trees:
        nodes = [(100 + n, parents[n], depths[n], raw[n].tolist()) for n in range(len(parents))]
        nodes += [(0, 0, 0, [0.0, 0.0])] * (width - len(nodes))
        for name, column in zip(fields, zip(*nodes)):
            fields[name].append(list(column))
    for _ in range(padding_rows):  # a batch's padding row: anything, never counted
        for name, column in zip(fields, ([7] * width, [-1] + [0] * (width - 1), [0] + [1] * (width - 1),
                                         [[1.0, 0.0]] + [[0.5, 0.5]] * (width - 1))):
            fields[name].append(column)
    parents = torch.tensor(fields["parents"])
    parents[:, 0] = -1
    lograw = torch.log(torch.tensor(fields["raw"], dtype=torch.float32))
    return DeviceTree(torch.tensor(fields["tokens"]), torch.tensor(fields["depths"]), parents,
                      ancestor_masks(parents, width), width, lograw, torch.tensor(keys + [1] * padding_rows))


def test_device_calibration_learns_as_the_hosts_source_calibration():
    """The host's SourceCalibration is the reference: the same random merged trees, sources and accepted paths,
    several steps, the same factors; each path both sources proposed counts for both, and the heads' accepted
    run is what the host's proposer tells the budget chooser. A padding row (length 0) is never counted."""
    gen = np.random.default_rng(0)
    max_depth, batch, size = 3, 3, 12
    host = SourceCalibration(max_depth)
    device = DeviceCalibration.of(SourceCalibration(max_depth))
    assert np.allclose(device.log_factors().exp().numpy(), host.factors())
    for _ in range(6):
        trees = [_host_tree(gen, size, max_depth) for _ in range(batch)]
        keys = gen.integers(1, SUFFIX_MATCH_ROWS + 1, batch)
        ends = [int(gen.integers(0, size)) for _ in range(batch)]  # each accepted path's deepest node
        paths = []
        for (parents, *_), end in zip(trees, ends):
            path = [end]
            while path[-1] > 0:
                path.append(int(parents[path[-1]]))
            paths.append(path[::-1])  # root first
        on_path = np.zeros((batch, size), dtype=bool)
        for b, path in enumerate(paths):
            on_path[b, path[1:]] = True
        host.observe(np.stack([t[1] for t in trees]), np.stack([t[2] for t in trees]),
                     np.stack([t[3] for t in trees]), keys, on_path)

        tree = _device_tree(trees, keys.tolist(), 2 * size, padding_rows=1)
        width = max_depth + 3
        accepted_tokens = torch.tensor([[100 + n for n in path[1:]] + [-5] * (width - len(path) + 1)
                                        for path in paths] + [[7] * width])
        accepted = DeviceAccepted(None, accepted_tokens, torch.tensor([len(p) for p in paths] + [3]), None)
        matched = matched_nodes(tree, accepted)
        device.observe(tree, matched, torch.tensor([True] * batch + [False]))
        assert np.allclose((device.accepted / device.predicted).numpy(), host.factors(), rtol=1e-5)
        by_heads = [(t[2] & SOURCE_HEADS).astype(bool) for t in trees]
        host_runs = [next((j for j, node in enumerate(path[1:]) if not by_heads[b][node]), len(path) - 1)
                     for b, path in enumerate(paths)]
        assert heads_run(tree, accepted, matched)[:batch].tolist() == host_runs
    assert not np.allclose(host.factors(), SourceCalibration(max_depth).factors())  # it moved off the priors


@pytest.mark.parametrize("suffix_factor, expected", [(3.0, [5, 40, 41]), (0.05, [5, 0, 1])])
def test_calibrated_scores_choose_between_the_heads_and_the_suffix(suffix_factor, expected):
    """The heads propose tokens 0, 1 with raw probabilities 0.9, 0.8 at depth 1; the suffix the path 40 → 41 with
    0.5, 0.5. Raw, the heads' pair wins a budget of 2. With the heads' row measured at 0.2 and the suffix row at 3
    (its candidates accepted well above their raw shares), the suffix path wins; at 0.05 the heads keep it."""
    table = [[np.log(0.9), np.log(0.8), np.log(0.01)]]
    given = GivenCandidates(tokens=torch.tensor([[40, 41]]), parents=torch.tensor([[-1, 0]]),
                            depths=torch.tensor([[1, 2]]), scores=torch.log(torch.tensor([[0.5, 0.5]])),
                            keys=torch.tensor([3]))
    shape = StepShape(batch=1, budget=2, depth=1, top_k=3, width=3, kv_len=64, given=2, given_depth=2)
    raw = propose_tree(_table_draft(table), torch.zeros(1, 4), torch.tensor([5]), shape, given)
    assert raw.tokens.tolist() == [[5, 0, 1]]
    calibration = DeviceCalibration.of(SourceCalibration(2))
    calibration.accepted[0] = 0.2 * calibration.predicted[0]
    calibration.accepted[3] = suffix_factor * calibration.predicted[3]
    tree = propose_tree(_table_draft(table), torch.zeros(1, 4), torch.tensor([5]), shape, given,
                        calibration.log_factors())
    assert tree.tokens.tolist() == [expected]


def test_a_calibration_moved_off_its_priors_keeps_the_device_step_exact():
    """Repetitive prompts, so the suffix proposes and is measured: the device calibration moves during the run
    (and the run starts from a skewed one that lets the suffix's candidates crowd out the heads'), and the
    tokens still equal transformers' generate(). The budget chooser learns, on steps with suffix candidates, the
    heads' accepted run the step emits (below the accepted count where the suffix's nodes were accepted)."""
    target = make_target(seed=3)
    engine = DeviceEngine(target, make_drafter(target, num_heads=3, seed=13), max_seq_len=160)
    prompts = [(p * 4)[:40] for p in random_prompts(3, 2, target.config.vocab_size, 5, 8)]
    flat = CostModel(target=[[1, 0.010], [256, 0.0102]], draft=[[1, 0.0005], [256, 0.0006]])
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=8, proposer="suffix"), max_batch_size=4,
                                 cost_model=flat, step_timing=False)
    stepper, chooser = decoder.device_stepper, decoder.adaptive
    stepper.calibration.accepted[1:] *= 4.0  # the suffix's rows: candidates 4x likelier than their priors
    start = stepper.calibration_factors().copy()
    emitted, observed = [], []
    inner_step, inner_observe = stepper.step, chooser.observe
    stepper.step = lambda shape, *args: emitted.append((shape, inner_step(shape, *args))) or emitted[-1][1]
    chooser.observe = lambda budget, accepted: observed.append(list(accepted)) or inner_observe(budget, accepted)
    results = decoder.generate([GenerationRequest(p, max_new_tokens=48, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, 48)
    moved = np.abs(stepper.calibration_factors() - start)
    assert moved[1:].max() > 0.05 and moved[0].max() > 0.0  # both sources measured
    assert len(observed) == len(emitted)
    suffix_won = 0
    for (shape, rows), heads in zip(emitted, observed):
        counts = rows[:, shape.path_width]
        assert heads == (rows[:, shape.path_width + 2] if shape.given else counts - 1).tolist()
        assert all(0 <= h <= c - 1 for h, c in zip(heads, counts))
        suffix_won += sum(h < c - 1 for h, c in zip(heads, counts))
    assert suffix_won > 0, "no step accepted a suffix candidate past the heads' run"
