"""TreeAttention reference op and the packed-mask format (docs/engine-contract.md#treeattention and #packed-mask).

This module is the single definition of the tree-attention semantics. The ONNX
export, the CUDA kernel in ``clover/kernels/`` and every test compare against
:func:`tree_attention`.

Packed mask (TensorRT-LLM's ``spec_decoding_packed_mask``): int32 ``[B, T, W]``
with ``W = ceil(T / 32)``. Bit ``j % 32`` of word ``j // 32`` in row ``i`` is set
when in-flight token ``i`` may attend to in-flight token ``j`` (LSB first).
"""

from __future__ import annotations

import math

import numpy as np
import torch

BITS_PER_WORD = 32


def num_mask_words(num_tokens: int) -> int:
    """Words per packed-mask row for ``num_tokens`` in-flight tokens."""
    return max(1, math.ceil(num_tokens / BITS_PER_WORD))


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask into int32 words.

    Args:
        mask: bool ``[..., T, T]``; ``mask[..., i, j]`` lets token i see token j.
    Returns:
        int32 ``[..., T, ceil(T/32)]``. Bit 31 set gives a negative int32
        (two's complement), exactly as TensorRT-LLM stores it.
    """
    *lead, rows, cols = mask.shape
    words = num_mask_words(cols)
    if mask.device.type == "cpu":  # NumPy: ~10 us, against ~200 us for the torch ops below (a per-step cost)
        padded = np.zeros((*lead, rows, words * BITS_PER_WORD), dtype=bool)
        padded[..., :cols] = mask.numpy()
        packed = np.packbits(padded, axis=-1, bitorder="little")  # [..., T, 4 * words] bytes, LSB first
        return torch.from_numpy(packed.view("<i4").astype(np.int32, copy=False))  # little-endian words
    padded = torch.zeros(*lead, rows, words * BITS_PER_WORD, dtype=torch.int64, device=mask.device)
    padded[..., :cols] = mask.to(torch.int64)
    bit_values = torch.bitwise_left_shift(
        torch.ones(BITS_PER_WORD, dtype=torch.int64, device=mask.device),
        torch.arange(BITS_PER_WORD, device=mask.device),
    )
    unsigned = (padded.view(*lead, rows, words, BITS_PER_WORD) * bit_values).sum(-1)
    signed = torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned)
    return signed.to(torch.int32)


def unpack_mask(packed: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`.

    Args:
        packed: int32 ``[..., T, W]``.
        num_tokens: T, the number of columns to unpack.
    Returns:
        bool ``[..., T, num_tokens]``.
    """
    columns = torch.arange(num_tokens, device=packed.device)
    words = packed.to(torch.int64)[..., columns // BITS_PER_WORD]  # [..., T, num_tokens]
    return torch.bitwise_and(torch.bitwise_right_shift(words, columns % BITS_PER_WORD), 1).bool()


def causal_packed_mask(batch: int, num_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Causal packed mask int32 ``[batch, T, ceil(T/32)]`` for a prompt chunk."""
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()
    return pack_mask(causal).unsqueeze(0).expand(batch, -1, -1).contiguous()


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    past_lengths: torch.Tensor,
    packed_mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference tree attention over a KV cache plus T in-flight tokens.

    Token t of sequence b attends to cache positions ``[0, past_lengths[b])`` and
    to the in-flight tokens whose bit is set in row t of its packed mask.
    Grouped-query attention maps query head h to KV head ``h // (Hq // Hkv)``.

    Args:
        q: ``[B, T, Hq, D]`` queries of the in-flight tokens (RoPE applied).
        k, v: ``[B, T, Hkv, D]`` keys/values of the in-flight tokens.
        k_cache, v_cache: ``[B, Hkv, S, D]``; only ``[:, :, :past_lengths[b]]``
            is read. S may be any size >= max(past_lengths).
        past_lengths: int ``[B]`` valid cached tokens per sequence.
        packed_mask: int32 ``[B, T, ceil(T/32)]``.
        scale: softmax scale, default ``1/sqrt(D)``.
    Returns:
        ``[B, T, Hq, D]`` in the dtype of ``q``. Softmax runs in fp32.
    """
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    past_used = int(past_lengths.max()) if batch else 0

    keys = torch.cat([k_cache[:, :, :past_used], k.transpose(1, 2)], dim=2)  # [B, Hkv, P+T, D]
    values = torch.cat([v_cache[:, :, :past_used], v.transpose(1, 2)], dim=2)
    keys = keys.repeat_interleave(group, dim=1).float()  # [B, Hq, P+T, D]
    values = values.repeat_interleave(group, dim=1).float()

    cache_visible = torch.arange(past_used, device=q.device)[None, :] < past_lengths[:, None].to(q.device)
    tree_visible = unpack_mask(packed_mask, num_tokens)  # [B, T, T]
    visible = torch.cat([cache_visible[:, None, :].expand(-1, num_tokens, -1), tree_visible], dim=-1)

    scores = torch.einsum("bthd,bhsd->bhts", q.float(), keys) * scale  # [B, Hq, T, P+T]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A row that sees nothing (only a padded row with an empty mask) gives zeros, not NaN.
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("bhts,bhsd->bthd", probs, values)
    return out.to(q.dtype)


class InPlaceAttention:
    """How a pass on a static device cache attends (docs/gpu-engine.md#attention): the in-flight tokens' K/V are
    written into the cache at ``write_index``, then every query attends to the first ``kv_len`` cache positions
    through ``visible``. Passed in place of the packed mask (``Attention.forward`` dispatches on it), so the
    target, the Augmenting Block and a CUDA graph share one forward. Only tensor ops with static shapes: no value
    leaves the device, so a pass can be captured in a CUDA graph.

    Same semantics as :func:`tree_attention`: token t sees cache positions ``[0, past)`` and the in-flight tokens
    whose bit is set in its tree row (``tests/test_device_step.py`` compares the two).
    """

    def __init__(self, past_lengths: torch.Tensor, tree_visible: torch.Tensor, kv_len: int) -> None:
        """past_lengths int ``[B]`` on the cache's device; tree_visible bool ``[B, T, T]`` (a token's ancestors and
        itself); kv_len: cache positions read, at least ``max(past) + T`` (the caller's bucket)."""
        batch, num_tokens, _ = tree_visible.shape
        past = past_lengths.to(torch.int64)
        self.write_index = past[:, None] + torch.arange(num_tokens, device=past.device)  # [B, T]
        offset = torch.arange(kv_len, device=past.device)[None, :] - past[:, None]  # [B, kv]: position - past
        in_flight = (offset >= 0) & (offset < num_tokens)
        column = offset.clamp(0, num_tokens - 1)[:, None, :].expand(batch, num_tokens, kv_len)
        tree = tree_visible.gather(2, column) & in_flight[:, None, :]
        self.visible = ((offset < 0)[:, None, :] | tree)[:, None]  # [B, 1, T, kv]
        self.kv_len = kv_len
        self.past_lengths, self.tree_visible = past_lengths, tree_visible
        self.kernel = None  # an op with tree_attention's signature (the CUDA kernel), else SDPA
        self.packed_mask = None

    def use_kernel(self, kernel) -> None:
        """Attend with ``kernel`` (``tree_attention``'s signature, e.g. the TreeAttention CUDA kernel's torch op)
        instead of SDPA: it reads the cache up to each row's length and the new tokens from their own tensors."""
        self.kernel = kernel
        self.packed_mask = pack_mask(self.tree_visible)
        self.past_lengths = self.past_lengths.to(torch.int32)

    def attend(self, q, k, v, k_cache, v_cache, scale: float | None = None) -> torch.Tensor:
        """q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]``, caches ``[B, Hkv, S, D]`` (written) -> ``[B, T, Hq, D]``."""
        self.write(k, v, k_cache, v_cache)
        return self.read(q, k, v, k_cache, v_cache, scale)

    def write(self, k, v, k_cache, v_cache) -> None:
        """The in-flight tokens' K/V into the caches at ``write_index``."""
        batch, num_tokens, num_kv_heads, head_dim = k.shape
        index = self.write_index[:, None, :, None].expand(batch, num_kv_heads, num_tokens, head_dim)
        k_cache.scatter_(2, index, k.transpose(1, 2).to(k_cache.dtype))
        v_cache.scatter_(2, index, v.transpose(1, 2).to(v_cache.dtype))

    def read(self, q, k, v, k_cache, v_cache, scale: float | None = None) -> torch.Tensor:
        """The attention output once :meth:`write` has run: by the kernel where one is set, else SDPA."""
        if self.kernel is not None:
            return self.kernel(q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache, self.past_lengths,
                               self.packed_mask, scale)
        keys, values = k_cache[:, :, : self.kv_len], v_cache[:, :, : self.kv_len]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=self.visible, scale=scale,
            enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
