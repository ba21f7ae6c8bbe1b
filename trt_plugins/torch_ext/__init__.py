"""PyTorch CUDA extension around the TreeAttention kernel (GPU tests only).

``load_extension()`` JIT-compiles ``tree_attention_ext.cpp`` together with
``trt_plugins/tree_attention_kernel.cu`` via ``torch.utils.cpp_extension.load``
(needs a CUDA build of torch and nvcc); nothing is compiled at import time.
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = HERE.parent
EXTENSION_NAME = "clover_tree_attention_ext"

_extension = None


def load_extension(verbose: bool = False, build_directory: str | None = None):
    """Build (once, cached by torch) and import the extension module.

    Returns:
        A module with ``tree_attention(q, k, v, k_cache, v_cache, past_lengths,
        packed_mask, scale=0.0)`` (scale <= 0 means ``1/sqrt(D)``) and
        ``num_splits(...)`` with the same tensor arguments.
    """
    global _extension
    if _extension is not None:
        return _extension
    from torch.utils.cpp_extension import load

    if build_directory is not None:
        os.makedirs(build_directory, exist_ok=True)
    _extension = load(
        name=EXTENSION_NAME,
        sources=[str(HERE / "tree_attention_ext.cpp"), str(PLUGIN_DIR / "tree_attention_kernel.cu")],
        extra_include_paths=[str(PLUGIN_DIR)],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
        build_directory=build_directory,
        verbose=verbose,
    )
    return _extension


def tree_attention(q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale: float | None = None):
    """Run the CUDA kernel; same arguments as :func:`clover.attention.tree_attention`.

    All tensors must be contiguous CUDA tensors; past_lengths and packed_mask int32.
    """
    ext = load_extension()
    return ext.tree_attention(q, k, v, k_cache, v_cache, past_lengths, packed_mask, 0.0 if scale is None else scale)
