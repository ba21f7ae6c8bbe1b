"""Find and load the Clover TensorRT plugin library (``libclover_trt_plugins.so``).

Search order: the ``path`` argument, then the ``CLOVER_TRT_PLUGIN_LIB``
environment variable, then ``trt_plugins/build/libclover_trt_plugins.so``.
Loading registers the ``TreeAttention`` plugin creator (version ``"1"``,
namespace ``"clover"``) with TensorRT's global plugin registry. Import
``tensorrt`` before calling this, so that the library binds to the same
``libnvinfer`` as the Python bindings.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

ENV_VAR = "CLOVER_TRT_PLUGIN_LIB"
LIBRARY_NAME = "libclover_trt_plugins.so"
PLUGIN_NAME = "TreeAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "clover"
BUILD_HINT = (
    "build it with: cmake -S trt_plugins -B trt_plugins/build -DTRT_ROOT=... && cmake --build trt_plugins/build"
)


class PluginLibraryNotFoundError(FileNotFoundError):
    """The plugin library is not built (or not where it was said to be)."""


def default_library_path() -> Path:
    """``trt_plugins/build/libclover_trt_plugins.so`` next to this file."""
    return Path(__file__).resolve().parent / "build" / LIBRARY_NAME


def find_plugin_library(path: str | os.PathLike | None = None) -> Path:
    """Return the path of the plugin library, or raise :class:`PluginLibraryNotFoundError`."""
    if path is not None:
        candidate, origin = Path(path), "the path argument"
    elif os.environ.get(ENV_VAR):
        candidate, origin = Path(os.environ[ENV_VAR]), f"${ENV_VAR}"
    else:
        candidate, origin = default_library_path(), "the default build location"
    if not candidate.is_file():
        raise PluginLibraryNotFoundError(
            f"Clover TensorRT plugin library not found at {candidate} (from {origin}); {BUILD_HINT}"
        )
    return candidate


def load_plugin_library(path: str | os.PathLike | None = None, register: bool = True) -> ctypes.CDLL:
    """Load the plugin library with ctypes and register its plugin creators.

    Args:
        path: explicit library path; default: ``$CLOVER_TRT_PLUGIN_LIB``, then
            ``trt_plugins/build/libclover_trt_plugins.so``.
        register: call the library's ``cloverRegisterTrtPlugins()``, which adds
            the ``TreeAttention`` creator to TensorRT's global plugin registry
            (idempotent). Pass False if you instead hand the file to
            ``trt.get_plugin_registry().load_library(path)`` or to
            ``trtexec --dynamicPlugins``; do not do both.
    Returns:
        The loaded ``ctypes.CDLL`` (keep a reference while TensorRT runs).
    Raises:
        PluginLibraryNotFoundError: nothing is built where we looked.
        OSError: the library exists but cannot be loaded (e.g. no libnvinfer).
        RuntimeError: registration with TensorRT failed.
    """
    library = find_plugin_library(path)
    try:
        handle = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        raise OSError(
            f"could not load {library}: {error}. It needs TensorRT (libnvinfer) and the CUDA runtime on the "
            f"library path; rebuild against this machine's TensorRT if needed; {BUILD_HINT}"
        ) from error
    if register:
        register_fn = handle.cloverRegisterTrtPlugins
        register_fn.restype = ctypes.c_bool
        register_fn.argtypes = []
        if not register_fn():
            raise RuntimeError(
                f"{library}: registering plugin {PLUGIN_NAMESPACE}::{PLUGIN_NAME} v{PLUGIN_VERSION} with TensorRT failed"
            )
    return handle
