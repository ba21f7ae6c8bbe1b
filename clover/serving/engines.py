"""Load the engine a served model runs, from its model-config parameters."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from clover.config import ConfigError, TreeConfig

DEFAULT_ENGINE_SUBDIR = Path("engines") / "demo"


def default_engine_dir(repository_parent: str | Path | None = None) -> Path:
    """``$CLOVER_ENGINE_DIR``, else ``engines/demo`` in ``repository_parent`` (default: the current directory)."""
    env = os.environ.get("CLOVER_ENGINE_DIR")
    if env:
        return Path(env)
    return Path(repository_parent or ".") / DEFAULT_ENGINE_SUBDIR


def resolve_engine_dir(value: str, repository_parent: str | Path | None = None) -> Path:
    """The ``engine_dir`` parameter as a path: empty means :func:`default_engine_dir`; relative paths
    are taken from ``repository_parent`` (the directory that holds the model repository)."""
    if not value:
        return default_engine_dir(repository_parent)
    if value == "demo":
        return Path(value)
    path = Path(os.path.expanduser(value))
    if not path.is_absolute() and repository_parent is not None:
        path = Path(repository_parent) / path
    return path


@dataclasses.dataclass
class LoadedEngine:
    engine: object
    tokenizer: object
    method: str
    tree: TreeConfig
    max_batch: int
    description: str


def load_serving_engine(engine_dir: str | Path, backend: str = "auto", method: str = "auto",
                        max_batch: int = 0, tree_budget: int | None = None, threads: int = 0,
                        adaptive: bool = False) -> LoadedEngine:
    """Engine, tokenizer and decode settings for serving. Raises ConfigError naming the problem.

    ``adaptive`` picks each step's budget (up to ``tree_budget``) from the engine's cost model; an engine
    without one (built without ``--calibrate``) is refused here rather than at the first request."""
    from clover.target import load_tokenizer

    threads = threads or None
    engine_dir = Path(engine_dir)
    if method not in ("auto", "vanilla", "clover", "medusa"):
        raise ConfigError(f"model parameter method={method!r}: choose auto, clover, medusa or vanilla")
    tree = TreeConfig()
    limit_batch = 16
    if backend == "torch":
        from clover.cli import load_torch_engine

        chosen = "clover" if method == "auto" else method
        engine, tokenizer = load_torch_engine(str(engine_dir), None, chosen, 2048)
        description = f"torch engine on {engine_dir}"
    elif backend in ("auto", "onnxruntime", "tensorrt"):
        from clover.export.engine_dir import read_engine_meta

        if not engine_dir.is_dir():
            raise ConfigError(f"engine directory {engine_dir} does not exist; build it with "
                              f"python export/build_engine.py --output {engine_dir}")
        meta = read_engine_meta(engine_dir)
        built_for = meta.get("backend", "onnxruntime")
        if backend != "auto" and backend != built_for:
            raise ConfigError(f"{engine_dir} was built for {built_for}, not {backend}; rebuild it or set backend "
                              f"to {built_for}")
        if built_for == "tensorrt":
            from clover.backends.tensorrt import TensorRTEngine

            engine = TensorRTEngine(engine_dir)
        else:
            from clover.backends.onnxruntime import OnnxRuntimeEngine

            engine = OnnxRuntimeEngine(engine_dir, threads=threads)
        tokenizer = load_tokenizer(engine_dir)
        if meta.get("tree_defaults"):
            tree = TreeConfig.from_dict(meta["tree_defaults"])
        limit_batch = int(meta.get("limits", {}).get("max_batch", limit_batch))
        description = f"{built_for} engine {engine_dir}"
    else:
        raise ConfigError(f"model parameter backend={backend!r}: choose auto, onnxruntime, tensorrt or torch")

    family = engine.spec.drafter_method
    if method == "auto":
        method = "vanilla" if family is None else "medusa" if family == "medusa" else "clover"
    if tree_budget is not None:
        tree = dataclasses.replace(tree, budget=tree_budget)
    if adaptive:
        if method == "vanilla":
            raise ConfigError("adaptive=true needs draft heads; this model decodes vanilla")
        if getattr(engine, "cost_model", None) is None:
            raise ConfigError(f"adaptive=true needs a cost model in {engine_dir}; store one with "
                              f"python export/build_engine.py --output {engine_dir} --recalibrate "
                              "(or build with --calibrate)")
        tree = dataclasses.replace(tree, adaptive=True)
    max_batch = max_batch or limit_batch
    if max_batch < 1:
        raise ConfigError(f"model parameter max_batch must be >= 1, got {max_batch}")
    return LoadedEngine(engine, tokenizer, method, tree, max_batch, description)
