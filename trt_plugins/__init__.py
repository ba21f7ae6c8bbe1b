"""Clover's TensorRT plugin sources (CUDA kernel, IPluginV3) and their Python helpers.

Only :mod:`trt_plugins.loader` and :mod:`trt_plugins.tiling_model` are Python;
neither imports TensorRT or needs a GPU.
"""

from trt_plugins.loader import PluginLibraryNotFoundError, find_plugin_library, load_plugin_library

__all__ = ["PluginLibraryNotFoundError", "find_plugin_library", "load_plugin_library"]
