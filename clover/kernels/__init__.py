"""Clover's own kernels: the CUDA kernels of the GPU engine, as torch ops built on first use, and the exact int8
CPU target (``cpu_target.cpp``: :mod:`clover.kernels.cpu_target`, built by :mod:`clover.kernels.cpu_build`).

- ``tree_attention_kernel.h/.cu``: the TreeAttention kernel (no TensorRT; trt_plugins/OP_SPEC.md).
  ``trt_plugins/`` builds its TensorRT plugin from these same sources.
- ``tree_attention_ext.cpp``: its PyTorch binding; :mod:`clover.kernels.tree_attention` compiles it.

Importing this package compiles nothing and needs neither torch's CUDA build nor nvcc.
"""

from clover.kernels.tree_attention import SOURCES, load_extension

__all__ = ["SOURCES", "load_extension"]
