"""Explicit KV cache for a batch of sequences, owned by the decode loop.

Rows ``[0, num_rows)`` are the live sequences, so ``keys[i][:num_rows]`` is a
contiguous view any backend can read without a copy. A decode step writes
only the accepted tokens' K/V; finished rows are compacted away.
"""

from __future__ import annotations

import numpy as np
import torch


class KVCache:
    """Keys and values ``[layers, capacity, Hkv, S_max, D]`` plus int32 lengths.

    One tensor per kind (not per layer) so a commit or a compaction is one
    indexing op for all layers; ``keys[i]`` / ``values[i]`` are per-layer views.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, capacity: int = 1, device: str = "cpu") -> None:
        self.shape = (num_kv_heads, max_seq_len, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.num_rows = 0
        self._capacity = 0
        self._keys = self._values = None
        self._views: tuple = (None, (), ())  # (rows, key views, value views) of the last views() call
        self._lengths = torch.zeros(0, dtype=torch.int32)
        self._grow(max(1, capacity))

    @property
    def max_seq_len(self) -> int:
        return self.shape[1]

    @property
    def keys(self) -> list[torch.Tensor]:
        return list(self._keys.unbind(0))

    @property
    def values(self) -> list[torch.Tensor]:
        return list(self._values.unbind(0))

    def _grow(self, capacity: int) -> None:
        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.zeros(self.num_layers, capacity, *self.shape, dtype=self.dtype, device=self.device)
            if old is not None:
                new[:, : self.num_rows] = old[:, : self.num_rows]
            return new

        self._keys, self._values = grown(self._keys), grown(self._values)
        self._views = (None, (), ())  # views of the old tensors
        lengths = torch.zeros(capacity, dtype=torch.int32)
        lengths[: self.num_rows] = self._lengths[: self.num_rows]
        # the lengths also as a NumPy array over the same memory: the decode step reads and adds to them with NumPy
        # calls (~1 us) rather than torch ops (5-10 us on CPU: docs/trees.md#host-work-per-step)
        self._lengths, self._lengths_array, self._capacity = lengths, lengths.numpy(), capacity

    def add_rows(self, count: int) -> range:
        """Append ``count`` empty rows; returns their indices."""
        if self.num_rows + count > self._capacity:
            self._grow(max(self.num_rows + count, 2 * self._capacity))
        start = self.num_rows
        self._lengths_array[start : start + count] = 0
        self.num_rows += count
        return range(start, start + count)

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop finished rows; the last live rows move into the holes.

        Only the moved rows' valid prefixes are copied (a full compaction of a
        ``[L, 32, Hkv, 1024, D]`` cache costs more than a decode step).

        Returns:
            ``order``: ``order[j]`` is the old index of the row now at ``j``.
        """
        drop = set(rows)
        order = list(range(self.num_rows))
        live = self.num_rows - len(drop)
        movers = [r for r in range(live, self.num_rows) if r not in drop]
        holes = [r for r in sorted(drop) if r < live]
        for hole, mover in zip(holes, movers):
            length = int(self._lengths[mover])
            for tensor in (self._keys, self._values):
                tensor[:, hole, :, :length] = tensor[:, mover, :, :length]
            self._lengths[hole] = self._lengths[mover]
            order[hole] = mover
        self.num_rows = live
        return order[:live]

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value tensors ``[layers, capacity, Hkv, S_max, D]``: what a step on the device writes in
        place (:mod:`clover.device_step`). A new pair after the cache grows (:meth:`reserve`)."""
        return self._keys, self._values

    @property
    def capacity(self) -> int:
        return self._capacity

    def reserve(self, capacity: int) -> None:
        """Room for ``capacity`` rows without growing later (a CUDA graph keeps reading the same tensors)."""
        if capacity > self._capacity:
            self._grow(capacity)

    def advance(self, counts) -> None:
        """The live rows gained ``counts[r]`` tokens whose K/V the engine already committed in place, on the device."""
        ends = self._lengths_array[: self.num_rows] + np.asarray(counts, dtype=np.int32)
        if self.num_rows and int(ends.max()) > self.max_seq_len:
            raise RuntimeError("KV cache overflow: a sequence is longer than max_seq_len")
        self._lengths_array[: self.num_rows] = ends

    @property
    def lengths(self) -> torch.Tensor:
        """int32 ``[num_rows]`` valid cached tokens per live row (a view)."""
        return self._lengths[: self.num_rows]

    @property
    def lengths_array(self) -> np.ndarray:
        """:attr:`lengths` as a NumPy view (the lengths are on the CPU whatever the cache's device)."""
        return self._lengths_array[: self.num_rows]

    def views(self, rows: slice | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer key and value views ``[n, Hkv, S_max, D]`` of the live rows (contiguous, no copy).

        The same view tensors come back while the rows and the storage stay the same, so a backend may keep
        what it derives from them (the onnxruntime backend keeps its feeds: docs/trees.md#host-work-per-step).
        """
        rows = rows or slice(0, self.num_rows)
        key = (rows.start, rows.stop, rows.step)
        if self._views[0] != key:
            self._views = (key, self._keys[:, rows].unbind(0), self._values[:, rows].unbind(0))
        return list(self._views[1]), list(self._views[2])

    def commit(self, present_keys, present_values, source_index: torch.Tensor, counts: torch.Tensor,
               rows: slice | None = None) -> None:
        """Append accepted tokens' K/V to the cache.

        Args:
            present_keys, present_values: one ``[n, Hkv, T, D]`` per layer, the
                K/V of the T tokens just run for rows ``rows``; None when the engine wrote them into the
                cache itself, at each row's ``[length, length + T)`` (engine contract v3,
                docs/engine-contract.md#in-place-kv): the kept ones then move down within the row.
            source_index: int64 ``[n, A]``, which of the T tokens to keep, in order.
            counts: int ``[n]``, how many of ``source_index[r]`` are valid.
        """
        rows = rows or slice(0, self.num_rows)
        first_row = rows.start or 0
        lengths = self._lengths_array[rows]
        counts_list, starts = [int(c) for c in counts.tolist()], lengths.tolist()
        ends = [start + count for start, count in zip(starts, counts_list)]
        if max(ends, default=0) > self.max_seq_len:
            raise RuntimeError("KV cache overflow: a sequence is longer than max_seq_len")
        if present_keys is None:  # the engine wrote the T new tokens at [start, start + T) of each row itself
            self._move_in_place(source_index, first_row, starts, counts_list)
        else:
            write = self._write_rows_numpy if self._numpy_writes else self._write_rows_torch
            for cache, presents in ((self._keys, present_keys), (self._values, present_values)):
                write(cache, presents, source_index, first_row, starts, counts_list)
        lengths[:] = ends

    def _move_in_place(self, source_index: torch.Tensor, first_row: int, starts: list[int], counts: list[int]) -> None:
        """Row i keeps its new tokens ``source_index[i, :counts[i]]`` (written at ``starts[i] + index``) at
        ``starts[i]...``: a gather (a copy) then one slice write per row for all layers; rows whose kept tokens
        already sit in order (a prompt, a chain's accepted prefix) move nothing."""
        source = source_index.detach().cpu().numpy()
        for i, (start, count) in enumerate(zip(starts, counts)):
            kept = source[i, :count]
            if not count or np.array_equal(kept, np.arange(count)):
                continue
            if kept.min() < 0 or start + kept.max() >= self.max_seq_len:
                raise IndexError(f"source_index {kept.tolist()} outside the tokens written after position {start}")
            index = torch.from_numpy(kept + start).to(self.device)
            for cache in (self._keys, self._values):
                row = cache[:, first_row + i]  # [L, Hkv, S_max, D]
                row[:, :, start : start + count] = row.index_select(2, index)
    @property
    def _numpy_writes(self) -> bool:
        return self.device == "cpu" and self.dtype in (torch.float32, torch.float16, torch.float64)

    @staticmethod
    def _write_rows_numpy(cache: torch.Tensor, presents, source_index: torch.Tensor, first_row: int,
                          starts: list[int], counts: list[int]) -> None:
        """Row i's ``counts[i]`` tokens ``source_index[i]`` of ``presents`` (one ``[n, Hkv, T, D]`` per layer) to
        positions ``starts[i]...`` of cache row ``first_row + i``: one NumPy take per row for all layers, straight
        into the cache (a NumPy call costs ~1 us, a torch op 5-10 us on CPU: docs/trees.md#host-work-per-step)."""
        new = torch.stack(presents).detach().numpy()  # [L, n, Hkv, T, D]: small, only this step's tokens
        source = source_index.detach().cpu().numpy()
        used = [row[:count] for row, count in zip(source.tolist(), counts) if count]  # what the rows keep
        if used and (min(map(min, used)) < 0 or max(map(max, used)) >= new.shape[3]):
            raise IndexError(f"source_index outside the {new.shape[3]} tokens just run")
        target = cache.numpy()
        for i, (start, count) in enumerate(zip(starts, counts)):
            if count:  # mode="clip" writes into the cache view unbuffered; the indices were checked above
                np.take(new[:, i], source[i, :count], axis=2, out=target[:, first_row + i, :, start : start + count],
                        mode="clip")

    @staticmethod
    def _write_rows_torch(cache: torch.Tensor, presents, source_index: torch.Tensor, first_row: int,
                          starts: list[int], counts: list[int]) -> None:
        """:meth:`_write_rows_numpy` for caches NumPy cannot hold (GPU, bfloat16)."""
        new = torch.stack(presents)  # [L, n, Hkv, T, D]: small, only this step's tokens
        source_index = source_index.to(cache.device)
        for i, (start, count) in enumerate(zip(starts, counts)):
            if count:  # one slice copy per row for all layers
                # index_select, not new[:, i, :, index]: torch's advanced indexing takes ~10 ms here on CPU
                # (measured 2026-12-01, torch 2.13), index_select ~10 us
                cache[:, first_row + i, :, start : start + count] = new[:, i].index_select(2, source_index[i, :count])
