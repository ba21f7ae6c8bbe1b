"""Engine backends. Each implements the two callables of :mod:`clover.engine_contract`.

:func:`load_engine` is the one place that picks a backend for an engine directory.
"""

from __future__ import annotations

from pathlib import Path

from clover.config import ConfigError
from clover.engine_dir import BACKENDS, read_engine_meta


def load_engine(engine_dir: str | Path, backend: str = "auto", threads: int | None = None):
    """The engine of a built engine directory, on the backend it was built for.

    ``backend``: ``auto`` (what ``engine.json`` names) or one of :data:`~clover.engine_dir.BACKENDS`, which
    must match it. ``threads``: onnxruntime intra-op threads (default: onnxruntime's choice).
    """
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise ConfigError(f"engine directory {engine_dir} does not exist; build it with "
                          f"clover build --output {engine_dir}")
    if backend not in ("auto", *BACKENDS):
        raise ConfigError(f"backend {backend!r}: choose auto, {' or '.join(BACKENDS)}")
    meta = read_engine_meta(engine_dir)
    if backend not in ("auto", meta.backend):
        raise ConfigError(f"{engine_dir} was built for {meta.backend}, not {backend}; rebuild it or use "
                          f"backend {meta.backend}")
    if meta.backend == "tensorrt":
        from clover.backends.tensorrt import TensorRTEngine  # import-guarded: needs TensorRT and CUDA

        return TensorRTEngine(engine_dir, meta)
    from clover.backends.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(engine_dir, threads=threads, meta=meta)
