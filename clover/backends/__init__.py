"""Engine backends. Each implements the two callables of :mod:`clover.engine`."""

from pathlib import Path


def load_engine(engine_dir: str | Path, threads: int | None = None):
    """The engine of a built engine directory, on the backend it was built for."""
    from clover.export.engine_dir import read_engine_meta

    meta = read_engine_meta(engine_dir)
    if meta["backend"] == "tensorrt":
        from clover.backends.tensorrt import TensorRTEngine

        return TensorRTEngine(engine_dir)
    from clover.backends.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(engine_dir, threads=threads)
