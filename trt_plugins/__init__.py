"""Clover's TensorRT plugin (IPluginV3 around the CUDA kernel of clover/kernels/) and its Python helpers.

Only :mod:`trt_plugins.loader` and :mod:`trt_plugins.tiling_model` are Python;
neither imports TensorRT or needs a GPU.
"""

from trt_plugins.loader import PluginLibraryNotFoundError, find_plugin_library, load_plugin_library

__all__ = ["PluginLibraryNotFoundError", "find_plugin_library", "load_plugin_library"]
