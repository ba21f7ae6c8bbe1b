"""The onnxruntime backend keeps its KV-cache feeds across calls: never stale, never keeping a cache alive."""

from __future__ import annotations

import gc

import pytest
import torch

from clover.attention import pack_mask
from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.drafters import save_drafter
from clover.export.builder import build_engine
from clover.kv_cache import KVCache
from clover.target import load_target
from tests.conftest import make_drafter, write_tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("feeds")
    checkpoint = write_tiny_checkpoint(root / "llama")
    save_drafter(make_drafter(load_target(checkpoint), num_heads=2), root / "heads")
    return OnnxRuntimeEngine(build_engine(root / "engine", str(checkpoint), str(root / "heads"), max_seq=64,
                                          progress=lambda message: None))


def _step(spec, batch: int = 2, tokens: int = 3):
    """Step inputs: ``tokens`` new tokens after 10 cached ones per sequence, causal among themselves."""
    past = torch.full((batch,), 10, dtype=torch.int32)
    ids = torch.arange(batch * tokens).reshape(batch, tokens) % spec.vocab_size
    mask = pack_mask(torch.ones(batch, tokens, tokens, dtype=torch.bool).tril())
    return ids, past[:, None].long() + torch.arange(tokens), past, mask


def _filled_cache(spec, batch: int, seed: int) -> KVCache:
    cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, capacity=batch)
    cache.add_rows(batch)
    gen = torch.Generator().manual_seed(seed)
    cache._keys.copy_(torch.randn(cache._keys.shape, generator=gen))
    cache._values.copy_(torch.randn(cache._values.shape, generator=gen))
    return cache


def test_kept_feeds_read_the_cache_as_it_is_now(engine):
    spec = engine.spec
    cache = _filled_cache(spec, 2, seed=0)
    first = engine.target(*_step(spec), *cache.views())
    assert engine.run_seconds > 0
    cache._keys.mul_(-1.0)  # the same views (KVCache.views hands them out again), new contents
    again = engine.target(*_step(spec), *cache.views())
    fresh = engine.target(*_step(spec), [k.clone() for k in cache.views()[0]], [v.clone() for v in cache.views()[1]])
    assert not torch.equal(again.logits, first.logits)
    assert torch.equal(again.logits, fresh.logits)
    assert all(torch.equal(a, b) for a, b in zip(again.present_keys, fresh.present_keys))


def test_kept_feeds_do_not_keep_a_finished_cache_alive(engine):
    """The feeds hold no reference to the cache's memory: once the caller drops its views, nothing does."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        pytest.skip("this torch has no torch._C._storage_Use_Count")
    spec = engine.spec
    cache = torch.randn(spec.num_kv_layers, 2, spec.num_kv_heads, 32, spec.head_dim)
    references = lambda: use_count(cache.untyped_storage()._cdata)  # noqa: E731
    alone = references()
    keys, values = list(cache.unbind(0)), list((-cache).unbind(0))
    engine.target(*_step(spec), keys, values)
    assert references() > alone
    del keys, values
    gc.collect()
    assert references() == alone
    other = torch.randn(spec.num_kv_layers, 1, spec.num_kv_heads, 32, spec.head_dim)  # new views: new feeds
    result = engine.target(*_step(spec, batch=1), list(other.unbind(0)), list(other.unbind(0)))
    fresh = other.clone()  # one tensor for keys and values again: the same (not in-place) path of a gqa engine
    expected = engine.target(*_step(spec, batch=1), list(fresh.unbind(0)), list(fresh.unbind(0)))
    assert torch.equal(result.logits, expected.logits)


def test_empty_and_repeated_caches(engine):
    """A prompt pass on an empty cache (the same zero-size tensor for every layer) is not kept and works."""
    spec = engine.spec
    empty = [torch.zeros(1, spec.num_kv_heads, 0, spec.head_dim)] * spec.num_kv_layers
    ids = torch.tensor([[1, 2, 3]])
    result = engine.target(ids, torch.arange(3)[None], torch.zeros(1, dtype=torch.int32),
                           pack_mask(torch.ones(1, 3, 3, dtype=torch.bool).tril()), empty, empty)
    assert result.logits.shape == (1, 3, spec.vocab_size) and torch.isfinite(result.logits).all()
