"""KVCache row bookkeeping and the decode loop's chunked prefill."""

from __future__ import annotations

import pytest
import torch

from clover.backends.torch import TorchEngine
from clover.config import TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.kv_cache import KVCache
from tests.conftest import make_drafter, make_target
from tests.helpers import hf_greedy, random_prompts


def _filled_cache(lengths: list[int]) -> KVCache:
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, max_seq_len=8, capacity=len(lengths))
    cache.add_rows(len(lengths))
    for row, length in enumerate(lengths):
        # the value encodes (row, position); positions past the length hold garbage (-1)
        cache._keys[:, row] = -1.0
        cache._keys[:, row, :, :length] = (100 * row + torch.arange(length, dtype=torch.float32))[None, None, :, None]
        cache._values[:, row, :, :length] = -cache._keys[:, row, :, :length]
        cache._lengths[row] = length
    return cache


@pytest.mark.parametrize("drop", [[0], [4], [1, 3], [0, 1, 2, 3, 4], [2, 0], []])
def test_remove_rows_keeps_each_live_row_prefix_and_reports_the_order(drop):
    lengths = [3, 8, 1, 5, 2]
    cache = _filled_cache(lengths)
    order = cache.remove_rows(drop)
    assert sorted(order) == [r for r in range(5) if r not in drop]
    assert cache.num_rows == len(order)
    for new_row, old_row in enumerate(order):
        length = lengths[old_row]
        assert int(cache.lengths[new_row]) == length
        expected = (100 * old_row + torch.arange(length, dtype=torch.float32))[None, None, :, None].expand(2, 1, -1, 2)
        assert torch.equal(cache._keys[:, new_row, :, :length], expected)
        assert torch.equal(cache._values[:, new_row, :, :length], -expected)


def test_remove_rows_moves_only_rows_past_the_live_count():
    cache = _filled_cache([3, 8, 1, 5, 2])
    assert cache.remove_rows([1]) == [0, 4, 2, 3]  # the last row fills the hole; the others stay put


@pytest.mark.parametrize("chunk_tokens", [1, 40, 4096])
def test_chunked_prefill_equals_transformers_greedy(chunk_tokens):
    """Many prompts of mixed lengths joining at once, prefilled in length-sorted chunks of any size, decode as
    transformers does (an independent reference: a target bug vanilla decoding shares does not hide here)."""
    target = make_target(seed=3)
    engine = TorchEngine(target, make_drafter(target, num_heads=2), max_seq_len=128)
    prompts = random_prompts(3, 9, target.config.vocab_size, 1, 30)
    decoder = SpeculativeDecoder(engine, "clover", TreeConfig(budget=4), max_batch_size=9,
                                 prefill_chunk_tokens=chunk_tokens)
    results = decoder.generate([GenerationRequest(p, max_new_tokens=10, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == hf_greedy(target, prompts, 10)


def test_prefill_chunks_are_length_sorted_and_bounded():
    target = make_target(seed=3)
    engine = TorchEngine(target, None, max_seq_len=128)
    decoder = SpeculativeDecoder(engine, "vanilla", max_batch_size=16, prefill_chunk_tokens=40)
    lengths = [30, 3, 12, 7, 20, 1, 9, 10]
    for n in lengths:
        decoder.submit(GenerationRequest(list(range(1, n + 1)), max_new_tokens=1))
    chunks = decoder._prefill_chunks(decoder._pending)
    flat = [len(s.request.prompt_ids) for chunk in chunks for s in chunk]
    assert flat == sorted(lengths)
    for chunk in chunks:
        widths = [len(s.request.prompt_ids) for s in chunk]
        assert len(chunk) == 1 or max(widths) * len(chunk) <= 40
