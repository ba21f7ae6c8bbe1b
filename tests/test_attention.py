import pytest
import torch

from clover.attention import causal_packed_mask, pack_mask, tree_attention, unpack_mask
from tests.helpers import naive_tree_attention


def test_packed_mask_golden_chain():
    chain = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    assert pack_mask(chain).tolist() == [[1], [3]]


def test_packed_mask_golden_two_words_and_bit_31():
    mask = torch.ones(40, 40, dtype=torch.bool).tril()
    packed = pack_mask(mask)
    assert packed.shape == (40, 2) and packed.dtype == torch.int32
    assert packed[0].tolist() == [1, 0]
    assert packed[30].tolist() == [2**31 - 1, 0]  # bits 0..30
    assert packed[31].tolist() == [-1, 0]  # bit 31 set: all 32 bits -> -1 as int32
    assert packed[32].tolist() == [-1, 1]
    assert packed[39].tolist() == [-1, 255]
    only_31 = torch.zeros(1, 33, dtype=torch.bool)
    only_31[0, 31] = True
    assert pack_mask(only_31).tolist() == [[-(2**31), 0]]
    only_32 = torch.zeros(1, 33, dtype=torch.bool)
    only_32[0, 32] = True
    assert pack_mask(only_32).tolist() == [[0, 1]]


def test_tree_mask_golden():
    # root 0; children 1, 2 of root; 3 child of 1
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert pack_mask(anc).flatten().tolist() == [1, 3, 5, 11]


@pytest.mark.parametrize("size", [1, 5, 31, 32, 33, 64, 70])
def test_pack_unpack_roundtrip(size):
    mask = torch.rand(3, size, size, generator=torch.Generator().manual_seed(size)) > 0.5
    packed = pack_mask(mask)
    assert packed.shape == (3, size, -(-size // 32))
    assert torch.equal(unpack_mask(packed, size), mask)


def test_causal_packed_mask():
    packed = causal_packed_mask(2, 3)
    assert packed.tolist() == [[[1], [3], [7]]] * 2


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("tokens", [1, 5, 35])
def test_tree_attention_matches_naive_loop(q_heads, kv_heads, tokens):
    gen = torch.Generator().manual_seed(tokens * 10 + q_heads)
    batch, dim, cache_len = 3, 8, 12
    q = torch.randn(batch, tokens, q_heads, dim, generator=gen)
    k = torch.randn(batch, tokens, kv_heads, dim, generator=gen)
    v = torch.randn(batch, tokens, kv_heads, dim, generator=gen)
    k_cache = torch.randn(batch, kv_heads, cache_len, dim, generator=gen)
    v_cache = torch.randn(batch, kv_heads, cache_len, dim, generator=gen)
    past = torch.tensor([0, 7, 12], dtype=torch.int32)
    visible = torch.rand(batch, tokens, tokens, generator=gen) > 0.5
    visible |= torch.eye(tokens, dtype=torch.bool)
    out = tree_attention(q, k, v, k_cache, v_cache, past, pack_mask(visible))
    expected = naive_tree_attention(q, k, v, k_cache, v_cache, past, visible)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_tree_attention_ignores_cache_beyond_past_length_and_empty_rows_are_zero():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 2, 4, generator=gen)
    k, v = torch.randn(2, 3, 2, 4, generator=gen), torch.randn(2, 3, 2, 4, generator=gen)
    k_cache, v_cache = torch.randn(2, 2, 10, 4, generator=gen), torch.randn(2, 2, 10, 4, generator=gen)
    past = torch.tensor([4, 0], dtype=torch.int32)
    mask = pack_mask(torch.eye(3, dtype=torch.bool).expand(2, 3, 3).clone())
    out = tree_attention(q, k, v, k_cache, v_cache, past, mask)
    k_cache[0, :, 4:] = 1e3
    v_cache[1] = -1e3
    torch.testing.assert_close(tree_attention(q, k, v, k_cache, v_cache, past, mask), out)
    empty = torch.zeros_like(mask)
    out_empty = tree_attention(q, k, v, k_cache, v_cache, past, empty)
    assert torch.equal(out_empty[1], torch.zeros_like(out_empty[1]))  # sees nothing at all
    assert torch.isfinite(out_empty).all()
