"""The exact int8 CPU target (clover/kernels/cpu_target.cpp; docs/quantized-target.md#the-exact-int8-engine).

Its promise is bitwise: a token's logits are the same numbers whatever else its pass holds. So every test here
compares logits with ``np.array_equal``, never a tolerance: the token alone (T = 1, every token fed one at a
time from position 0, the chain) against the same token in a prompt chunk, at depths 1-4 of trees of 8 and 32
with siblings in between, in a batch of 4 with other sequences, after its tree's commit, and with past lengths
around every block boundary of the attention's reductions (blocks of 8 keys). Each op is also checked against
its reference (numpy for the matmuls, :func:`clover.attention.tree_attention` for attention), with tolerances:
those tests say what is computed, the bitwise ones that it never depends on the pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clover.attention import causal_packed_mask, pack_mask, tree_attention
from clover.kernels import cpu_target
from clover.kv_cache import KVCache
from clover.tree import ancestor_masks

pytestmark = pytest.mark.skipif(cpu_target.unavailable_reason() is not None,
                                reason=f"{cpu_target.unavailable_reason()}")

ATTENTION_BLOCK = 8  # keys per block of the softmax's max and sum (cpu_target.cpp: attend_row)


@pytest.fixture(scope="module")
def build_dir():
    from clover.demo import cache_root

    return str(cache_root() / "kernels")


def _int8_reference(x: np.ndarray) -> np.ndarray:
    """x quantised as the kernel does: per row, blocks of 32, symmetric, max|x| / 127, rounded to nearest."""
    blocks = x.reshape(x.shape[0], -1, 32)
    peak = np.abs(blocks).max(-1, keepdims=True)
    q = np.round(blocks * np.where(peak > 0, 127 / np.where(peak > 0, peak, 1), 0))
    return (q * (peak / 127)).reshape(x.shape)


def _paths_here() -> list[str]:
    """The kernel paths this CPU can run (each is tested on its own machine; docs/quantized-target.md)."""
    flags = cpu_target.cpu_flags()
    return [name for name, (needs, _) in cpu_target.KERNEL_PATHS.items() if all(f in flags for f in needs)]


PATHS = pytest.mark.parametrize("kernel", list(cpu_target.KERNEL_PATHS))


def _skip_unless_here(kernel: str) -> None:
    if kernel not in _paths_here():
        pytest.skip(f"this CPU cannot run the {kernel} path (it lacks {', '.join(cpu_target.KERNEL_PATHS[kernel][0])})")


@PATHS
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_linear_computes_int8_activations_times_the_stored_blocks(build_dir, fmt, kernel):
    """Columns 77 (no multiple of the 8-column groups: the padded group's lanes must not leak) and 7 rows."""
    from clover.export.target_weights import quantize_gguf

    _skip_unless_here(kernel)
    rng = np.random.default_rng(1)
    stored = quantize_gguf(rng.standard_normal((77, 96)).astype(np.float32), fmt)
    x = rng.standard_normal((7, 96)).astype(np.float32)
    expected = _int8_reference(x) @ stored.dequantize().T
    got = cpu_target.linear(build_dir, stored.data, fmt, 77, 96, x, kernel=kernel)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4 * np.abs(expected).max())


@PATHS
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_rows_linear_output_is_the_same_in_any_pass(build_dir, fmt, kernel):
    """Alone, first, last or in the middle of 2-33 rows (every row tile and remainder), over 61 columns (seven
    8-column groups and a part group): the same bits."""
    from clover.export.target_weights import quantize_gguf

    _skip_unless_here(kernel)
    rng = np.random.default_rng(2)
    stored = quantize_gguf(rng.standard_normal((61, 64)).astype(np.float32), fmt)
    row = rng.standard_normal((1, 64)).astype(np.float32)
    alone = cpu_target.linear(build_dir, stored.data, fmt, 61, 64, row, kernel=kernel)[0]
    for rows in range(2, 34):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        wheres = sorted({0, rows // 2, rows - 1})
        x[wheres] = row[0]
        out = cpu_target.linear(build_dir, stored.data, fmt, 61, 64, x, kernel=kernel)
        for where in wheres:
            assert np.array_equal(out[where], alone), (rows, where)


def test_every_kernel_path_here_computes_the_same_bits(build_dir):
    """The paths differ only in integer instructions (exact), so a matrix gives the same floats on each."""
    from clover.export.target_weights import quantize_gguf

    paths = _paths_here()
    if len(paths) < 2:
        pytest.skip(f"this CPU runs one kernel path only ({paths[0]})")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 128)).astype(np.float32)
    for fmt in ("q4_1", "q8_0"):
        stored = quantize_gguf(rng.standard_normal((45, 128)).astype(np.float32), fmt)
        outs = [cpu_target.linear(build_dir, stored.data, fmt, 45, 128, x, kernel=k) for k in paths]
        assert all(np.array_equal(outs[0], out) for out in outs[1:]), (fmt, paths)


def test_the_lm_head_gives_a_row_the_same_logits_in_any_pass(build_dir):
    """The demo's LM head (its tied Q8_0 embedding, 49,152 columns): a row alone and among 5, 9 and 33 rows."""
    from gguf import GGUFReader

    from clover.demo import find_demo_gguf

    head = next(t for t in GGUFReader(str(find_demo_gguf())).tensors if t.name == "token_embd.weight")
    assert head.tensor_type.name == "Q8_0"
    k, n = (int(s) for s in head.shape)  # GGUF lists the input size first
    rng = np.random.default_rng(4)
    row = rng.standard_normal((1, k)).astype(np.float32)
    alone = cpu_target.linear(build_dir, head.data, "q8_0", n, k, row)[0]
    for rows in (5, 9, 33):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x[rows // 2] = row[0]
        assert np.array_equal(cpu_target.linear(build_dir, head.data, "q8_0", n, k, x)[rows // 2], alone), rows


def _random_attention(rng, batch, tokens, past, heads=6, kv_heads=2, d=32, cache_len=48):
    q = torch.from_numpy(rng.standard_normal((batch, tokens, heads, d)).astype(np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((batch, tokens, kv_heads, d)).astype(np.float32)) for _ in range(2))
    caches = [torch.from_numpy(rng.standard_normal((batch, kv_heads, cache_len, d)).astype(np.float32))
              for _ in range(2)]
    return q, k, v, *caches, torch.tensor(past, dtype=torch.int32)


def test_tree_attention_keeps_the_tree_attention_contract(build_dir):
    """A tree per sequence (random parents) over different pasts: the reference op's numbers."""
    rng = np.random.default_rng(3)
    q, k, v, k_cache, v_cache, past = _random_attention(rng, 3, 9, [0, 17, 40])
    parents = np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, 9)] for _ in range(3)])
    mask = pack_mask(torch.from_numpy(ancestor_masks(parents)))
    expected = tree_attention(q, k, v, k_cache, v_cache, past, mask).numpy()
    got = cpu_target.tree_attention(build_dir, q, k, v, k_cache, v_cache, past, mask)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_row_that_sees_nothing_attends_to_zeros(build_dir):
    rng = np.random.default_rng(8)
    q, k, v, k_cache, v_cache, past = _random_attention(rng, 1, 2, [0])
    mask = torch.tensor([[[1], [0]]], dtype=torch.int32)  # row 1 sees neither the past (none) nor any token
    got = cpu_target.tree_attention(build_dir, q, k, v, k_cache, v_cache, past, mask)
    assert np.array_equal(got[0, 1], np.zeros_like(got[0, 1]))
    np.testing.assert_allclose(got, tree_attention(q, k, v, k_cache, v_cache, past, mask).numpy(), atol=1e-6)


def test_tree_attention_depends_only_on_the_keys_in_logical_order(build_dir):
    """A node at depth 3 with masked siblings before, between and after its ancestors, against the same query
    once its ancestors are committed behind the past: the same bits."""
    rng = np.random.default_rng(4)
    past = 13
    q, k, v, k_cache, v_cache, _ = _random_attention(rng, 1, 8, [past])
    parents = np.array([[-1, 0, 0, 2, 1, 4, 3, 4]])  # node 5's ancestors: 4, 1, 0 (siblings 2, 3, 6, 7 masked)
    mask = pack_mask(torch.from_numpy(ancestor_masks(parents)))
    in_tree = cpu_target.tree_attention(build_dir, q, k, v, k_cache, v_cache, torch.tensor([past]), mask)[0, 5]
    path = [0, 1, 4]
    committed_k, committed_v = k_cache.clone(), v_cache.clone()
    committed_k[0, :, past:past + 3], committed_v[0, :, past:past + 3] = k[0, path].transpose(0, 1), v[0, path].transpose(0, 1)
    alone = cpu_target.tree_attention(build_dir, q[:, 5:6], k[:, 5:6], v[:, 5:6], committed_k, committed_v,
                                      torch.tensor([past + 3]), torch.ones(1, 1, 1, dtype=torch.int32))[0, 0]
    assert np.array_equal(in_tree, alone)


# -- the demo target ----------------------------------------------------------------------------------------

MAX_SEQ = 160


@pytest.fixture(scope="module")
def demo(build_dir):
    """The demo target's native engine (no heads: h0 is not what is judged here) and its chain of T = 1 logits."""
    from clover.demo import demo_checkpoint, find_demo_gguf
    from clover.export.native_target import native_tensors
    from clover.export.target_weights import read_gguf_target
    from clover.target import load_target

    model = load_target(demo_checkpoint())
    tensors, config = native_tensors(model, None, read_gguf_target(find_demo_gguf(), model.config), MAX_SEQ)
    target = cpu_target.NativeTarget(tensors, config, build_dir, threads=2)
    tokens = np.random.default_rng(5).integers(0, config["vocab_size"], 48)
    cache = _cache(config, 1)
    chain = [_pass(target, cache, [[t]], [[i]], [i], causal_packed_mask(1, 1))[0, 0] for i, t in enumerate(tokens)]
    return target, tokens, np.stack(chain)


def _cache(config, rows: int) -> KVCache:
    cache = KVCache(config["num_layers"], config["num_kv_heads"], config["head_dim"], MAX_SEQ, capacity=rows)
    cache.add_rows(rows)
    return cache


def _pass(target, cache: KVCache, ids, positions, past, mask) -> np.ndarray:
    """One pass over ``ids`` [B, T] at rows 0..B-1 of ``cache``; lengths advance by T (each row's tokens stay at
    past + t, as a prompt's do)."""
    k, v = cache.views()
    ids, positions = np.asarray(ids, np.int64), np.asarray(positions, np.int64)
    logits, _ = target.forward(ids, positions, np.asarray(past, np.int32), np.asarray(mask, np.int32), k, v)
    return logits


def _prefill(target, cache: KVCache, rows_tokens: list) -> None:
    """Each row's prefix as one causal chunk (rows right-padded to the longest), committed."""
    width = max(len(t) for t in rows_tokens)
    ids = np.zeros((len(rows_tokens), width), np.int64)
    for i, tokens in enumerate(rows_tokens):
        ids[i, :len(tokens)] = tokens
    _pass(target, cache, ids, np.tile(np.arange(width), (len(rows_tokens), 1)), [0] * len(rows_tokens),
          causal_packed_mask(len(rows_tokens), width))
    lengths = [len(t) for t in rows_tokens]
    cache.commit(None, None, torch.arange(width).expand(len(rows_tokens), -1), torch.tensor(lengths))


def _tree_with_path(rng, size: int, path_tokens, vocab: int):
    """A tree of ``size`` nodes whose nodes 0, a, b, c, d (depths 0-4, siblings and other branches interleaved
    between them in slot order) carry ``path_tokens``; returns tokens, parents, depths and the path's slots."""
    path_slots = [0, 2, max(4, size // 3), max(5, size // 2 + 1), size - 1]
    parents = np.zeros(size, np.int64)
    parents[0] = -1
    for depth, slot in enumerate(path_slots[1:], start=1):
        parents[slot] = path_slots[depth - 1]
    for slot in range(1, size):
        if slot not in path_slots:
            parents[slot] = int(rng.integers(0, slot))  # any earlier node: siblings and other branches
    depths = np.zeros(size, np.int64)
    for slot in range(1, size):
        depths[slot] = depths[parents[slot]] + 1
    tokens = rng.integers(0, vocab, size)
    tokens[path_slots] = path_tokens
    return tokens, parents, depths, path_slots


def _tree_pass_rows(target, cache, trees, pasts):
    """One pass over one tree per row (padded to the largest with masked copies of node 0's token)."""
    width = max(len(t[0]) for t in trees)
    ids, positions = np.zeros((len(trees), width), np.int64), np.zeros((len(trees), width), np.int64)
    parents = np.full((len(trees), width), -1)
    for i, ((tokens, tree_parents, depths, _), past) in enumerate(zip(trees, pasts)):
        ids[i, :len(tokens)], positions[i, :len(tokens)] = tokens, past + depths
        positions[i, len(tokens):] = past
        parents[i, :len(tokens)] = tree_parents
    mask = pack_mask(torch.from_numpy(ancestor_masks(parents)))
    return _pass(target, cache, ids, positions, pasts, mask)


def test_a_prompt_chunk_computes_each_token_as_the_chain_does(demo):
    target, tokens, chain = demo
    cache = _cache(target.config, 1)
    logits = _pass(target, cache, [tokens[:40]], [np.arange(40)], [0], causal_packed_mask(1, 40))[0]
    assert all(np.array_equal(logits[i], chain[i]) for i in range(40))


@pytest.mark.parametrize("size", [8, 32])
def test_tree_nodes_at_depths_1_to_4_compute_as_the_chain_does(demo, size):
    target, tokens, chain = demo
    rng = np.random.default_rng(size)
    past = 11
    cache = _cache(target.config, 1)
    _prefill(target, cache, [tokens[:past]])
    tree = _tree_with_path(rng, size, tokens[past:past + 5], target.config["vocab_size"])
    logits = _tree_pass_rows(target, cache, [tree], [past])[0]
    for depth, slot in enumerate(tree[3]):
        assert np.array_equal(logits[slot], chain[past + depth]), f"depth {depth}, slot {slot}"


def test_a_sequence_in_a_batch_of_4_computes_as_alone(demo):
    """Row 2 of 4; the other rows hold other sequences, other pasts and trees of other sizes."""
    target, tokens, chain = demo
    rng = np.random.default_rng(6)
    vocab = target.config["vocab_size"]
    pasts = [5, 23, 11, 30]
    prefixes = [rng.integers(0, vocab, p) for p in pasts]
    prefixes[2] = tokens[:11]
    cache = _cache(target.config, 4)
    _prefill(target, cache, prefixes)
    trees = [_tree_with_path(rng, size, rng.integers(0, vocab, 5), vocab) for size in (8, 32, 8, 12)]
    trees[2] = _tree_with_path(rng, 12, tokens[11:16], vocab)
    logits = _tree_pass_rows(target, cache, trees, pasts)[2]
    for depth, slot in enumerate(trees[2][3]):
        assert np.array_equal(logits[slot], chain[11 + depth]), f"depth {depth}"


def test_tokens_after_the_commit_compute_as_the_chain_does(demo):
    """The tree's path committed (its K/V moved down behind the past), then the next token alone and a second
    tree over the committed path: the chain's bits."""
    target, tokens, chain = demo
    rng = np.random.default_rng(7)
    past = 9
    cache = _cache(target.config, 1)
    _prefill(target, cache, [tokens[:past]])
    tree = _tree_with_path(rng, 16, tokens[past:past + 5], target.config["vocab_size"])
    _tree_pass_rows(target, cache, [tree], [past])
    cache.commit(None, None, torch.tensor([tree[3]]), torch.tensor([5]))
    past += 5
    after = _pass(target, cache, [[tokens[past]]], [[past]], [past], causal_packed_mask(1, 1))[0, 0]
    assert np.array_equal(after, chain[past])
    cache.commit(None, None, torch.tensor([[0]]), torch.tensor([1]))
    past += 1
    tree = _tree_with_path(rng, 8, tokens[past:past + 5], target.config["vocab_size"])
    logits = _tree_pass_rows(target, cache, [tree], [past])[0]
    assert all(np.array_equal(logits[slot], chain[past + d]) for d, slot in enumerate(tree[3]))


@pytest.mark.parametrize("past", [b + offset for b in (ATTENTION_BLOCK, 2 * ATTENTION_BLOCK, 4 * ATTENTION_BLOCK)
                                  for offset in (-3, -1, 0, 1)])
def test_past_lengths_around_the_attention_blocks(demo, past):
    """Trees of 8 after pasts just under, at and over multiples of the attention's block of keys: a path node's
    keys (past + depth) cross the boundary at each depth in turn."""
    target, tokens, chain = demo
    cache = _cache(target.config, 1)
    _prefill(target, cache, [tokens[:past]])
    tree = _tree_with_path(np.random.default_rng(past), 8, tokens[past:past + 5], target.config["vocab_size"])
    logits = _tree_pass_rows(target, cache, [tree], [past])[0]
    for depth, slot in enumerate(tree[3]):
        assert np.array_equal(logits[slot], chain[past + depth]), f"past {past}, depth {depth}"


def test_the_logits_are_the_int8_models(demo):
    """What is computed, not only that it is invariant: on real text, the logits against the fp32 demo target's
    within int8's error (int8 activations move this model's logits by up to about 2: docs/quantized-target.md;
    a kernel that is wrong, a RoPE, mask or block-format bug, errs by whole logits), and the same argmax at
    nearly every position (int8 engines agree with the fp32 one at 97.7% of MT-bench positions; a wrong kernel
    at few). Each op's own reference: the tests above."""
    from clover.demo import demo_checkpoint
    from clover.target import load_target, load_tokenizer

    target, _, _ = demo
    model = load_target(demo_checkpoint())
    text = ("The quick brown fox jumps over the lazy dog. Speculative decoding makes a language model faster by "
            "letting small heads guess several tokens, which the model then checks in one pass.")
    ids = load_tokenizer(demo_checkpoint())(text)["input_ids"]
    n, cfg = len(ids), target.config
    cache = _cache(cfg, 1)
    native = _pass(target, cache, [ids], [np.arange(n)], [0], causal_packed_mask(1, n))[0]
    zeros = [torch.zeros(1, cfg["num_kv_heads"], n, cfg["head_dim"])] * cfg["num_layers"]
    with torch.inference_mode():
        fp32 = model(torch.tensor([ids]), torch.arange(n)[None], torch.zeros(1, dtype=torch.int32),
                     causal_packed_mask(1, n), zeros, zeros).logits[0].numpy()
    error_band = 3.0
    assert np.abs(native - fp32).max() < error_band
    assert (native.argmax(-1) == fp32.argmax(-1)).mean() >= 0.85
