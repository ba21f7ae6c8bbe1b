"""The decode step's small tensor operations on the host, through NumPy where the tensors are on the CPU.

A decode step does a few dozen small index operations between engine calls
(docs/trees.md#host-work-per-step). On CPU, torch runs some of them with its
intra-op thread pool, and on a machine whose cores are busy (onnxruntime's
threads, other processes) a parallel kernel waits for a descheduled thread:
``logits.argmax(-1)`` over ``[1, 5, 49152]`` took 8 ms with 2 threads against
0.03 ms in NumPy, and ``hidden.index_select(0, rows)`` over ``[128, 576]``
22 ms (measured 2026-12-02 on 2 busy cores, torch 2.13, NumPy 1.26). NumPy
runs them on the calling thread. Other devices and dtypes NumPy lacks
(bfloat16) keep the torch op.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool)


def _on_numpy(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in _NUMPY_DTYPES


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor as a NumPy array: a view of a CPU tensor, a copy of one on another device."""
    return tensor.detach().cpu().numpy()


def argmax_last(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[...]``: the index of the largest of ``logits [..., V]``, the first one on ties (as torch.argmax)."""
    if not _on_numpy(logits):
        return logits.argmax(-1)
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1), dtype=np.int64))


def take_rows(tensor: torch.Tensor, rows) -> torch.Tensor:
    """``tensor[rows]`` for ``tensor [N, ...]`` and int64 ``rows [M]`` (a NumPy array, a list or a tensor): a new
    ``[M, ...]`` tensor, as ``index_select(0, rows)``."""
    if not _on_numpy(tensor):
        return tensor.index_select(0, torch.as_tensor(np.asarray(rows), dtype=torch.long).to(tensor.device))
    return torch.from_numpy(tensor.detach().numpy().take(np.asarray(rows, dtype=np.int64), axis=0))


def cpu_tensor(data, dtype: type = np.int64) -> torch.Tensor:
    """``torch.tensor(data)`` for (nested) lists on the CPU, made through NumPy: ~1 us against torch's ~4 us."""
    return torch.from_numpy(np.array(data, dtype=dtype))
