"""Engine backends. Each implements the two callables of :mod:`clover.engine_contract`.

:func:`load_engine` is the one place that picks a backend for an engine directory.
"""

from __future__ import annotations

from pathlib import Path

from clover.config import CHECKPOINT_DTYPES, ConfigError
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


def load_checkpoint_engine(target: str | Path | None = "demo", drafter: str | None = None, method: str = "clover",
                           max_seq_len: int = 2048, cache_dir: str | Path | None = None, device: str = "auto",
                           dtype: str = "auto"):
    """The engine of a Hugging Face checkpoint (no engine directory), where it runs best.

    ``device``: ``auto`` (a CUDA GPU when torch sees one, else the CPU), ``cpu`` or ``cuda``. On a GPU: the device
    engine, its steps replayed from CUDA graphs (docs/gpu-engine.md); on the CPU: the torch reference engine.
    ``dtype``: ``auto`` (bf16 on a GPU, fp32 on the CPU), ``fp32`` (token-exact with the reference: what
    docs/gpu-engine.md#precision measures bf16 against) or ``bf16``.
    """
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device {device!r}: choose auto, cpu or cuda")
    if dtype not in CHECKPOINT_DTYPES:
        raise ConfigError(f"dtype {dtype!r}: choose {', '.join(CHECKPOINT_DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda: torch sees no CUDA GPU here (a CPU build of torch, or no driver)")
    weights = torch.bfloat16 if dtype == "bf16" or (dtype == "auto" and device == "cuda") else torch.float32
    if device == "cpu":
        from clover.backends.torch import TorchEngine

        return TorchEngine.from_checkpoint(target, drafter, method, max_seq_len, cache_dir, dtype=weights)
    from clover.backends.device import DeviceEngine

    return DeviceEngine.from_checkpoint(target, drafter, method, max_seq_len, cache_dir, device="cuda", dtype=weights)
