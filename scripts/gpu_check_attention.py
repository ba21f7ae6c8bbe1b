"""The three ways scripts/gpu_check.py runs the target's attention, all with the signature of the reference op
:func:`clover.attention.tree_attention` (docs/engine-contract.md#treeattention):

- ``reference``: that op itself (fp32 scores over cache + tree; what the torch backend runs);
- ``kernel``: the TreeAttention CUDA kernel (clover/kernels), what the TensorRT plugin launches;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask over the
  cache and the tree, the plain-torch way to attend over a tree.

:func:`use_attention` swaps one in for the target's (and the Augmenting Block's) attention.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from unittest import mock

import torch

import clover.target
from clover.attention import tree_attention, unpack_mask

GPU_CHECKS = Path(__file__).resolve().parents[1] / "trt_plugins" / "tests" / "gpu_checks.py"


def gpu_checks_module():
    """trt_plugins/tests/gpu_checks.py, loaded from its file once (a script folder, not a package)."""
    if "gpu_checks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_checks", GPU_CHECKS)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_checks"] = module  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["gpu_checks"]


sdpa_gqa = gpu_checks_module().sdpa_gqa


@contextlib.contextmanager
def use_attention(attend):
    """Run every ``clover.target`` attention layer through ``attend`` inside the block."""
    with mock.patch.object(clover.target, "tree_attention", attend):
        yield


def kernel_attention(ext):
    """The kernel as a drop-in for the reference op (``ext``: clover.kernels.load_extension())."""

    def attend(q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale=None):
        tensors = (t.contiguous() for t in (q, k, v, k_cache, v_cache, past_lengths, packed_mask))
        return ext.tree_attention(*tensors, 0.0 if scale is None else scale)

    return attend


class SdpaAttention:
    """SDPA over ``cat(cache, tree)`` keys with a ``[B, 1, T, S + T]`` boolean mask.

    The mask is built once per target pass and reused by every layer (all layers get the same
    ``past_lengths`` and ``packed_mask`` tensors), as an engine would. Every cache slot is attended to
    under the mask, so give it a cache of exactly ``max(past_lengths)`` slots to compare its cost with
    the kernel's; a row that sees nothing gives NaN here (the reference gives zeros).
    """

    def __init__(self) -> None:
        self._memo: tuple | None = None  # (past_lengths, packed_mask, slots, mask): tensors held, not ids

    def mask(self, past_lengths: torch.Tensor, packed_mask: torch.Tensor, slots: int) -> torch.Tensor:
        memo = self._memo
        if memo is not None and memo[0] is past_lengths and memo[1] is packed_mask and memo[2] == slots:
            return memo[3]
        tokens = packed_mask.shape[1]
        cache = torch.arange(slots, device=packed_mask.device)[None, :] < past_lengths[:, None]  # [B, S]
        tree = unpack_mask(packed_mask, tokens)  # [B, T, T]
        mask = torch.cat([cache[:, None, :].expand(-1, tokens, -1), tree], dim=-1)[:, None]
        self._memo = (past_lengths, packed_mask, slots, mask)
        return mask

    def __call__(self, q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale=None):
        if scale is not None:
            raise ValueError("the SDPA stand-in uses SDPA's default scale 1/sqrt(D) only")
        keys = torch.cat([k_cache, k.transpose(1, 2)], dim=2)  # [B, Hkv, S + T, D]
        values = torch.cat([v_cache, v.transpose(1, 2)], dim=2)
        mask = self.mask(past_lengths.to(q.device), packed_mask, k_cache.shape[2])
        return sdpa_gqa(q.transpose(1, 2), keys, values, mask).transpose(1, 2)


def attention_variants(kernel_ext=None) -> dict:
    """name -> drop-in attention; ``kernel`` only when the extension is given."""
    variants = {"reference": tree_attention, "sdpa": SdpaAttention()}
    if kernel_ext is not None:
        variants = {"kernel": kernel_attention(kernel_ext), **variants}
    return variants
