"""The TreeAttention kernel's torch op: the GPU engine's attention (docs/gpu-engine.md#attention).

``load_extension()`` JIT-compiles ``tree_attention_ext.cpp`` together with
``tree_attention_kernel.cu`` (both beside this file, shipped in the wheel) via
``torch.utils.cpp_extension.load`` (needs a CUDA build of torch and nvcc; without
ninja, through setuptools instead); nothing is compiled at import time. The
TensorRT plugin in ``trt_plugins/`` wraps the same kernel sources.
"""

from __future__ import annotations

import os
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent  # the sources and tree_attention_kernel.h
EXTENSION_NAME = "clover_tree_attention_ext"
SOURCES = [str(KERNEL_DIR / "tree_attention_ext.cpp"), str(KERNEL_DIR / "tree_attention_kernel.cu")]
CXX_FLAGS = ["-O3", "-std=c++17"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]

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
    from torch.utils.cpp_extension import is_ninja_available, load

    if build_directory is not None:
        os.makedirs(build_directory, exist_ok=True)
    if not is_ninja_available():  # torch's JIT loader needs ninja; a GPU host may lack it and have no internet
        _extension = _build_with_setuptools(build_directory or "/tmp/clover_tree_attention_ext_setuptools", verbose)
        return _extension
    _extension = load(
        name=EXTENSION_NAME,
        sources=SOURCES,
        extra_include_paths=[str(KERNEL_DIR)],
        extra_cflags=CXX_FLAGS,
        extra_cuda_cflags=NVCC_FLAGS,
        build_directory=build_directory,
        verbose=verbose,
    )
    return _extension


def _build_with_setuptools(build_directory: str, verbose: bool):
    """The same extension built without ninja: torch's ``BuildExtension(use_ninja=False)`` through setuptools
    (a dependency of torch), then imported from ``build_directory``. Slower (one source at a time)."""
    import importlib.util

    import setuptools
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.makedirs(build_directory, exist_ok=True)
    extension = CUDAExtension(EXTENSION_NAME, SOURCES, include_dirs=[str(KERNEL_DIR)],
                              extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS})
    setuptools.setup(name=EXTENSION_NAME, ext_modules=[extension],
                     cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
                     script_args=["build_ext", "--build-lib", build_directory,
                                  "--build-temp", os.path.join(build_directory, "temp"), *([] if verbose else ["-q"])])
    library = next(Path(build_directory).glob(f"{EXTENSION_NAME}*.so"))
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree_attention(q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale: float | None = None):
    """Run the CUDA kernel; same arguments as :func:`clover.attention.tree_attention`.

    All tensors must be contiguous CUDA tensors; past_lengths and packed_mask int32.
    """
    ext = load_extension()
    return ext.tree_attention(q, k, v, k_cache, v_cache, past_lengths, packed_mask, 0.0 if scale is None else scale)
