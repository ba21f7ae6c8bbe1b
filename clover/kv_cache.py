"""Explicit KV cache for a batch of sequences, owned by the decode loop.

Rows ``[0, num_rows)`` are the live sequences, so ``keys[i][:num_rows]`` is a
contiguous view any backend can read without a copy. A decode step writes
only the accepted tokens' K/V; finished rows are compacted away.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer ``[capacity, Hkv, S_max, D]`` keys and values plus int32 lengths."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, capacity: int = 1, device: str = "cpu") -> None:
        self.shape = (num_kv_heads, max_seq_len, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.num_rows = 0
        self._capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._lengths = torch.zeros(0, dtype=torch.int32)
        self._grow(max(1, capacity))

    @property
    def max_seq_len(self) -> int:
        return self.shape[1]

    def _grow(self, capacity: int) -> None:
        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.zeros(capacity, *self.shape, dtype=self.dtype, device=self.device)
            if old is not None:
                new[: self.num_rows] = old[: self.num_rows]
            return new

        had = bool(self.keys)
        self.keys = [grown(self.keys[i] if had else None) for i in range(self.num_layers)]
        self.values = [grown(self.values[i] if had else None) for i in range(self.num_layers)]
        lengths = torch.zeros(capacity, dtype=torch.int32)
        lengths[: self.num_rows] = self._lengths[: self.num_rows]
        self._lengths, self._capacity = lengths, capacity

    def add_rows(self, count: int) -> range:
        """Append ``count`` empty rows; returns their indices."""
        if self.num_rows + count > self._capacity:
            self._grow(max(self.num_rows + count, 2 * self._capacity))
        start = self.num_rows
        self._lengths[start : start + count] = 0
        self.num_rows += count
        return range(start, start + count)

    def remove_rows(self, rows: list[int]) -> None:
        """Drop finished rows, keeping the others in order at the front."""
        drop = set(rows)
        keep = torch.tensor([r for r in range(self.num_rows) if r not in drop], dtype=torch.long)
        keep_on_device = keep.to(self.device)
        for tensor in (*self.keys, *self.values):
            tensor[: len(keep)] = tensor[keep_on_device]
        self._lengths[: len(keep)] = self._lengths[keep].clone()
        self.num_rows = len(keep)

    @property
    def lengths(self) -> torch.Tensor:
        """int32 ``[num_rows]`` valid cached tokens per live row (a view)."""
        return self._lengths[: self.num_rows]

    def views(self, rows: slice | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Key and value views ``[n, Hkv, S_max, D]`` of the live rows (no copy)."""
        rows = rows or slice(0, self.num_rows)
        return [k[rows] for k in self.keys], [v[rows] for v in self.values]

    def commit(self, present_keys, present_values, source_index: torch.Tensor, counts: torch.Tensor,
               rows: slice | None = None) -> None:
        """Append accepted tokens' K/V to the cache.

        Args:
            present_keys, present_values: one ``[n, Hkv, T, D]`` per layer, the
                K/V of the T tokens just run for rows ``rows``.
            source_index: int64 ``[n, A]``, which of the T tokens to keep, in order.
            counts: int ``[n]``, how many of ``source_index[r]`` are valid.
        """
        rows = rows or slice(0, self.num_rows)
        row_ids = torch.arange(self._capacity)[rows]
        lengths = self._lengths[rows]
        width = source_index.shape[1]
        slot = torch.arange(width)
        valid = slot[None, :] < counts[:, None]  # [n, A]
        if int((lengths + counts.to(torch.int32)).max()) > self.max_seq_len:
            raise RuntimeError("KV cache overflow: a sequence is longer than max_seq_len")
        row_index = row_ids[:, None].expand(-1, width)[valid]  # [M]
        dest = (lengths[:, None].long() + slot[None, :])[valid]  # [M]
        src_rows = torch.arange(len(row_ids))[:, None].expand(-1, width)[valid]
        src_tokens = source_index[valid]
        if self.device != "cpu":
            row_index, dest, src_rows, src_tokens = (t.to(self.device) for t in (row_index, dest, src_rows, src_tokens))
        for cache, present in zip((*self.keys, *self.values), (*present_keys, *present_values)):
            # cache.permute: [cap, S, Hkv, D] view; present.permute: [n, T, Hkv, D]
            cache.permute(0, 2, 1, 3)[row_index, dest] = present.permute(0, 2, 1, 3)[src_rows, src_tokens].to(self.dtype)
        self._lengths[rows] += counts.to(torch.int32)
